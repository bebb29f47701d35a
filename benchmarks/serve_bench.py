"""Serving benchmark: `flashdraft serve` with and without a drafter, at several concurrency levels, and a soak.

    python benchmarks/serve_bench.py --target smollm2-135m-instruct --draft drafters/smollm2-135m-instruct \
        --out benchmarks/serve-smollm2-135m-instruct --readme benchmarks/README.md

For each server (plain decoding, then DFlash) it starts `flashdraft serve` in its own process, runs
`flashdraft bench --backend openai` (the same code: `flashdraft.bench.run_server_bench`) at each concurrency
level, and stops the server with SIGTERM. Then the soak: `--soak-requests` streamed requests at concurrency
`--soak-concurrency` against the DFlash server, a share of whose clients disconnect mid-stream; it counts failures
and samples the server's resident memory (`process_resident_memory_bytes` on /metrics) as it goes. The tables go
to `<out>/serving.md`, the numbers to `<out>/serving.json`, and the block between the `flashdraft-serve` markers of
`--readme` is rewritten from them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from flashdraft.bench import ServerBenchConfig, machine_info, parse_prometheus, run_server_bench
from flashdraft.bench.config import BenchError
from flashdraft.bench.llamacpp import find_server
from flashdraft.prompts.benchmarks import load_bench_dataset

START, END = "<!-- flashdraft-serve:start -->", "<!-- flashdraft-serve:end -->"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flashdraft_command(args: argparse.Namespace, port: int, draft: str | None, tree: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "flashdraft", "serve", "--target", args.target, "--port", str(port),
           "--threads", str(args.threads), "--max-batch-size", str(args.max_batch_size), "--max-queue", "256"]  # fmt: skip
    if draft:
        cmd += ["--draft", draft]
    if tree:
        cmd += ["--tree", tree]
    return cmd + shlex.split(args.server_args)


def llamacpp_command(args: argparse.Namespace, port: int) -> list[str]:
    """llama.cpp's llama-server on the same weights (a GGUF): one slot per request of the highest level, each slot
    the context a request needs, the same threads, its own chat template (`--jinja`), no speculation."""
    slots = max(int(x) for x in args.concurrency.split(","))
    cmd = [str(find_server(args.llamacpp)), "-m", str(args.llamacpp_model), "--host", "127.0.0.1", "--port", str(port),
           "--parallel", str(slots), "-c", str(slots * args.llamacpp_slot_context), "-t", str(args.threads),
           "-tb", str(args.threads), "--jinja", "--no-webui", "--spec-type", "none"]  # fmt: skip
    return cmd + shlex.split(args.llamacpp_args)


class Server:
    """A server in a child process (`flashdraft serve`, or llama-server), up until `stop()` (SIGTERM)."""

    def __init__(
        self,
        args: argparse.Namespace,
        draft: str | None,
        log: Path,
        tree: str | None = None,
        llamacpp: bool = False,
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        if llamacpp:
            cmd = llamacpp_command(args, self.port)
            self.command = " ".join(cmd)
        else:
            cmd = flashdraft_command(args, self.port, draft, tree)
            self.command = " ".join(cmd[2:])
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + args.start_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited early; see {log}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.5)
        raise RuntimeError(f"the server did not come up in {args.start_timeout} s")

    def rss_mib(self) -> float:
        metrics = parse_prometheus(httpx.get(f"{self.base}/metrics", timeout=30).text)
        return sum(metrics.get("process_resident_memory_bytes", {}).values()) / 2**20

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=120)
        self.log.close()
        return code


async def soak(
    server: Server, model: str, prompts: list[str], n: int, concurrency: int, leave_share: float, seed: int
):
    """n streamed chat requests, `concurrency` at a time; a `leave_share` of clients leave after their first text."""
    rng = random.Random(seed)
    plan = [(rng.choice(prompts), rng.randint(16, 64), rng.random() < leave_share) for _ in range(n)]
    sem = asyncio.Semaphore(concurrency)
    done = {"ok": 0, "left": 0, "failed": 0}
    failures: list[str] = []
    rss: list[tuple[int, float]] = [(0, server.rss_mib())]

    async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int, leave: bool) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0, "stream": True}  # fmt: skip
        async with sem:
            try:
                async with client.stream("POST", f"{server.base}/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                    finished = False
                    async for line in r.aiter_lines():
                        if leave and '"content": "' in line and '"content": ""' not in line:
                            done["left"] += 1
                            return  # closing the stream here is the client going away
                        if line == "data: [DONE]":
                            finished = True
                    if not finished:
                        raise RuntimeError("the stream ended without [DONE]")
                done["ok"] += 1
            except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                done["failed"] += 1
                failures.append(f"{type(e).__name__}: {e}"[:200])
            finished_requests = sum(done.values())
            if finished_requests % 50 == 0:
                rss.append((finished_requests, await asyncio.to_thread(server.rss_mib)))

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        await asyncio.gather(*(one(client, *p) for p in plan))
    wall = time.perf_counter() - t0
    rss.append((n, server.rss_mib()))
    return {"requests": n, "concurrency": concurrency, "wall_s": wall, **done, "failures": failures[:10],
            "rss_mib": rss}  # fmt: skip


def level_rows(name: str, result: dict[str, Any]) -> list[str]:
    rows = []
    for lv in result["levels"]:
        spec = lv.get("vllm") or {}
        tau = spec.get("tau")
        ttft, tpot, lat = lv.get("ttft_s") or {}, lv.get("tpot_s") or {}, lv.get("latency_s") or {}
        rows.append(
            f"| {name} | {lv['concurrency']} | {lv['ok']}/{lv['requests']} | {lv['output_tokens_per_s']:.1f} | "
            f"{(ttft.get('p50') or 0) * 1e3:.0f} / {(ttft.get('p90') or 0) * 1e3:.0f} | "
            f"{(tpot.get('p50') or 0) * 1e3:.0f} / {(tpot.get('p90') or 0) * 1e3:.0f} | "
            f"{(lat.get('p50') or 0):.1f} / {(lat.get('p99') or 0):.1f} | {f'{tau:.2f}' if tau else '–'} |"
        )
    return rows


def render(results: dict[str, Any], out_rel: str) -> str:
    plain, dflash, s = results["plain"], results["dflash"], results["settings"]
    m = results["machine"]
    lines = [START, "<!-- written by benchmarks/serve_bench.py; do not edit by hand: rerun it -->", "",
             f"Command: `{results['command']}`", "",
             f"Machine: {m.get('cpu')}, {s['threads']} torch threads, torch {m.get('torch')}, transformers "
             f"{m.get('transformers')}; run {results['finished']}. Servers: `flashdraft serve --max-batch-size "
             f"{s['max_batch_size']}` (continuous batching), {s['dataset']} ({s['max_samples']} prompts per level), "
             f"{s['max_new_tokens']} new tokens, T=0, streamed.", "",
             "| server | concurrency | ok | output tok/s | TTFT p50 / p90 ms | TPOT p50 / p90 ms | latency p50 / p99 s "
             "| τ (/metrics) |", "|---|---|---|---|---|---|---|---|",
             *level_rows("plain", plain), *level_rows("dflash", dflash),
             *(level_rows("dflash --tree", results["tree"]) if "tree" in results else []),
             *(level_rows("llama.cpp", results["llamacpp"]) if "llamacpp" in results else []), ""]  # fmt: skip
    pairs = [("dflash", "plain", "DFlash over plain"), ("tree", "plain", "DFlash with draft trees over plain")]
    pairs += [(n, "llamacpp", f"{label} over llama.cpp's llama-server")
              for n, label in (("plain", "plain"), ("dflash", "DFlash"), ("tree", "DFlash with draft trees"))]  # fmt: skip
    for name, base, label in pairs:
        if name not in results or base not in results:
            continue
        ratios = []
        for a, b in zip(results[base]["levels"], results[name]["levels"], strict=True):
            ratios.append(f"{a['concurrency']}: {b['output_tokens_per_s'] / a['output_tokens_per_s']:.2f}x")
        lines += [f"{label}, output tokens/s by concurrency: {', '.join(ratios)}.", ""]
    if "llamacpp" in results:
        lines += [f"llama.cpp: `{results['llamacpp']['server_command']}`.", ""]
    sk = results.get("soak")
    if sk is None:
        return "\n".join([*lines, f"Raw numbers: [{out_rel}/serving.json]({out_rel}/serving.json).", "", END])
    rss = sk["rss_mib"]
    after_warm = next((r for k, r in rss if k >= 100), rss[0][1])
    lines += [
        f"Soak (DFlash server): {sk['requests']} streamed requests at concurrency {sk['concurrency']}, 16-64 new "
        f"tokens each, {sk['left']} clients left mid-stream on purpose: **{sk['failed']} failures**, {sk['ok']} "
        f"completed, in {sk['wall_s']:.0f} s. Server RSS (MiB) by finished requests: "
        + ", ".join(f"{k}: {r:.0f}" for k, r in rss)
        + f" (after the first 100: {after_warm:.0f} → end {rss[-1][1]:.0f}, {rss[-1][1] - after_warm:+.0f} MiB).",
        "",
        f"Raw numbers: [{out_rel}/serving.json]({out_rel}/serving.json).",
        "",
        END,
    ]
    return "\n".join(lines)


def run_soak(args: argparse.Namespace, results: dict[str, Any], prompts: list[str]) -> None:
    """The soak against the DFlash server: streamed requests, some clients leaving mid-stream."""
    server = Server(args, args.draft, args.out / "server-soak.log")
    try:
        results["soak"] = asyncio.run(
            soak(
                server,
                args.target,
                prompts,
                args.soak_requests,
                args.soak_concurrency,
                args.soak_leave_share,
                0,
            )
        )
    finally:
        results["soak"]["exit_code"] = server.stop()
    print("soak:", {k: v for k, v in results["soak"].items() if k != "failures"}, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="drafters/smollm2-135m-instruct")
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--max-samples", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--soak-requests", type=int, default=500)
    ap.add_argument("--soak-concurrency", type=int, default=32)
    ap.add_argument("--soak-leave-share", type=float, default=0.1)
    ap.add_argument(
        "--server-args", default="", help="more `flashdraft serve` options for every server, e.g. '--quantize int8 --compile'"
    )
    ap.add_argument("--start-timeout", type=int, default=300, help="seconds a server may take to start (compiling: more)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/serve"))
    ap.add_argument("--readme", type=Path, default=None)
    ap.add_argument(
        "--tree", default=None, help="also serve the drafter with --tree (draft trees), e.g. auto"
    )
    ap.add_argument(
        "--llamacpp", default=None, help="also serve with llama.cpp: its llama-server (a file or its directory)"
    )
    ap.add_argument("--llamacpp-model", default=None, help="the target's weights as a GGUF, for --llamacpp")
    ap.add_argument("--llamacpp-args", default="", help="more llama-server options, e.g. '--no-repack'")
    ap.add_argument("--llamacpp-slot-context", type=int, default=2048, help="llama-server context per slot")
    args = ap.parse_args()
    if args.llamacpp is not None:
        try:
            find_server(args.llamacpp)
        except BenchError as e:
            ap.error(str(e))
        if not args.llamacpp_model or not Path(args.llamacpp_model).is_file():
            ap.error(f"--llamacpp needs --llamacpp-model FILE, the target as a GGUF (got {args.llamacpp_model!r})")
    args.out.mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in args.concurrency.split(",")]
    results: dict[str, Any] = {
        "command": "python benchmarks/serve_bench.py " + " ".join(sys.argv[1:]),
        "settings": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "levels": levels,
        },
        "machine": machine_info(),
    }
    servers = [("plain", None, None), ("dflash", args.draft, None)]
    if args.tree:
        servers.append(("tree", args.draft, args.tree))
    if args.llamacpp:
        servers.append(("llamacpp", None, None))
    for name, draft, tree in servers:
        server = Server(args, draft, args.out / f"server-{name}.log", tree, llamacpp=name == "llamacpp")
        try:
            cfg = ServerBenchConfig(base_url=server.base, datasets=[args.dataset], concurrency=levels,
                                    max_samples=args.max_samples, max_new_tokens=args.max_new_tokens,
                                    out_dir=args.out / name, plots=False, show_progress=False)  # fmt: skip
            results[name] = run_server_bench(cfg)
            results[name]["server_command"] = server.command
            print(f"{name}: " + ", ".join(f"{lv['concurrency']}: {lv['output_tokens_per_s']:.1f} tok/s"
                                          for lv in results[name]["levels"]), flush=True)  # fmt: skip
        finally:
            results[name]["exit_code"] = server.stop()
    prompts = [
        c.user_turns[0] for c in load_bench_dataset(args.dataset, max_samples=200, seed=1).conversations
    ]
    if args.soak_requests > 0:
        run_soak(args, results, prompts)
    results["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    (args.out / "serving.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    readme_dir = (args.readme or args.out / "x").parent
    try:
        rel = args.out.resolve().relative_to(readme_dir.resolve()).as_posix()
    except ValueError:
        rel = args.out.as_posix()
    block = render(results, rel)
    (args.out / "serving.md").write_text(block + "\n")
    if args.readme:
        text = args.readme.read_text() if args.readme.exists() else ""
        if START in text and END in text:
            head, rest = text.split(START, 1)
            text = head + block + rest.split(END, 1)[1]
        else:
            text = text.rstrip("\n") + "\n\n" + block + "\n"
        args.readme.write_text(text)
    print(block)


if __name__ == "__main__":
    main()
