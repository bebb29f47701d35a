"""The GPU playbook (drafters/device/playbook.py) dry-run on the CPU with a tiny model: every part runs, what comes
back is what the agenda needs in at most 8 files, and a second start resumes instead of starting over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from conftest import tiny_model

ROOT = Path(__file__).resolve().parents[1]
PLAYBOOK = ROOT / "drafters" / "device" / "playbook.py"


@pytest.mark.slow  # the whole agenda in small: ~1.5 minutes on 2 cores
def test_playbook_dry_run_brings_back_everything_and_resumes(tmp_path):
    from test_data import make_tokenizer

    target = tmp_path / "target"
    tiny_model("llama", layers=3).save_pretrained(target)
    make_tokenizer().save_pretrained(target)
    draft = tmp_path / "draft"
    env = {**os.environ, "DRY": "1", "PLAYBOOK_DIR": str(tmp_path / "w"), "TARGET": str(target),
           "DRAFT": str(draft), "OUT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1",
           "FLASHDRAFT_COMPILE": '{"backend": "eager"}'}  # the compiled parts traced whole, kernels eager  # fmt: skip
    cli = [sys.executable, "-m", "flashdraft"]
    subprocess.run([*cli, "init-draft", "--target", str(target), "--out", str(draft), "--num-layers", "1",
                    "--block-size", "4"], check=True, env=env, capture_output=True)  # fmt: skip
    (tmp_path / "out").mkdir()

    def playbook(*args: str) -> str:
        done = subprocess.run([sys.executable, str(PLAYBOOK), *args], env=env, capture_output=True, text=True,
                              timeout=900, cwd=ROOT)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    playbook("start", "600")
    report = playbook("status", "800")
    w = tmp_path / "w"
    assert (w / "pipeline.done").exists(), report
    for part in ("bench", "profile", "compiled-profile", "compiled-bench", "sharded", "regenerate", "eval"):
        assert (w / "done" / part).exists(), (part, report)
    back = sorted((tmp_path / "out").iterdir())
    assert 1 <= len(back) <= 8 and all(p.stat().st_size < 16 * 2**20 for p in back), back
    with open(tmp_path / "results.tgz", "wb") as f:
        for piece in back:
            f.write(piece.read_bytes())
    with tarfile.open(tmp_path / "results.tgz") as tar:
        names = set(tar.getnames())
    for name in ("bench/results.json", "profile.json", "bench-compiled/results.json", "profile-compiled.json",
                 "sharded.json", "train-modes.json", "gsm8k-t07.npz", "run/model.safetensors",
                 "run/train_log.jsonl", "eval-new.json", "eval-shipped.json"):  # fmt: skip
        assert name in names, (name, sorted(names))
    # the sharded path at world size 1 takes the steps the whole target takes
    sharded = json.loads((w / "sharded.json").read_text())
    assert sharded["whole"]["exit"] == sharded["sharded"]["exit"] == 0
    assert len(sharded["whole"]["losses"]) == len(sharded["sharded"]["losses"]) > 0
    assert sharded["sharded"]["losses"] == pytest.approx(sharded["whole"]["losses"], rel=1e-4)
    profile = json.loads((w / "profile.json").read_text())
    assert 0 <= profile["generate"]["outside_forward_share"] < 1
    compiled = json.loads((w / "bench-compiled" / "results.json").read_text())
    assert compiled["settings"]["compile_verify"] and compiled["equality"]["mismatches"] == 0
    assert json.loads((w / "profile-compiled.json").read_text())["compile_verify"]

    steps = len((w / "run" / "train_log.jsonl").read_text().splitlines())
    playbook("start", "400")  # a later half hour: finished parts are skipped, training resumes
    playbook("status", "600")
    log = (w / "pipeline.log").read_text().split("pipeline finished")[-2]
    assert "flashdraft bench" not in log and "profile_decode" not in log
    assert "resumed from" in (w / "train.log").read_text()
    assert len((w / "run" / "train_log.jsonl").read_text().splitlines()) > steps


def test_check_leaves_the_suite_running_apart_and_stop_tests_ends_it(tmp_path):
    """`check` returns at once, even to a caller that reads its output to the end (a device call's `| tail`): the
    suite it starts holds none of that output. `stop-tests` ends the whole suite and lists what failed so far."""
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "test_suite.py").write_text(
        "import time\n\ndef test_fails():\n    assert False\n\ndef test_slow():\n    time.sleep(120)\n"
    )
    env = {**os.environ, "DRY": "1", "PLAYBOOK_DIR": str(tmp_path / "w"), "PLAYBOOK_REPO": str(repo),
           "SUITE_ARGS": "tests/test_suite.py"}  # fmt: skip
    w = tmp_path / "w"
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(PLAYBOOK), "check"], env=env, capture_output=True, text=True,
                          timeout=100, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert time.monotonic() - start < 60 and not (w / "cuda-tests.done").exists()
    pgid = int((w / "cuda-tests.pid").read_text())
    for _ in range(60):  # the first test has failed once its line is in the log
        if "FAILED" in ((w / "cuda-tests.log").read_text() if (w / "cuda-tests.log").exists() else ""):
            break
        time.sleep(1)
    stopped = subprocess.run([sys.executable, str(PLAYBOOK), "stop-tests"], env=env, capture_output=True,
                             text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert "test_suite.py::test_fails" in stopped.stdout and "1 failed so far" in stopped.stdout
    assert (w / "cuda-tests.done").exists()
    assert not running_in_group(pgid)


def running_in_group(pgid: int) -> list[int]:
    """The processes of process group `pgid` still running: zombies left unreaped (where nothing reaps orphans, as
    in a CI container) do not count."""
    running = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue
        if int(group) == pgid and state != "Z":
            running.append(int(stat.parent.name))
    return running
