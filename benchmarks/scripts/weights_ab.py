"""Eager CPU targets with different weights side by side in one process: fp32 (oneDNN's packed layers, the default),
fp32-mkl (torch's own linear, MKL), `--quantize fp16` (fbgemm's fp16 GEMM, fp32 activations), `--quantize int8` (bf16
activations) and bf16; plain decoding and DFlash on each, in turn.

    python benchmarks/scripts/weights_ab.py --batch 1 --prompts 6 --targets fp32,fp16,int8
    python benchmarks/scripts/weights_ab.py --batch 16 --prompts 16 --targets fp32-mkl,fp32

Each target gets its own price list (measured once per machine, then cached). Prints tokens/s and whether every
output equals plain decoding of the same target (lossless means that: each is a model of its own).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from flashdraft import DFlashDraftModel, load_target
from flashdraft.prompts.benchmarks import load_bench_dataset
from flashdraft.generate import generate_batch
from flashdraft.engine.measure import cpu_name, load_or_measure_costs

TARGETS = {
    "fp32": {"dtype": "float32"},
    "fp32-mkl": {"dtype": "float32", "pack_linears": False},
    "fp16": {"quantize": "fp16"},
    "int8": {"quantize": "int8"},
    "bf16": {"dtype": "bfloat16"},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="drafters/smollm2-135m-instruct")
    ap.add_argument("--targets", default="fp32,fp16", help=f"comma-separated, of {', '.join(TARGETS)}")
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    draft = DFlashDraftModel.from_pretrained(args.draft).eval()
    sides = {}
    for name in args.targets.split(","):
        target = load_target(args.target, device="cpu", **TARGETS[name])
        costs = load_or_measure_costs(target, draft)
        print(f"{name}: {costs.summary()}", flush=True)
        sides[name] = (target, costs)
    print(f"machine: {cpu_name()}, {args.threads} threads, torch {torch.__version__}")
    data = load_bench_dataset(args.dataset, max_samples=args.prompts, seed=0)
    encode = next(iter(sides.values()))[0].encode_prompt
    prompts = [encode(c.user_turns[0])[0].tolist() for c in data.conversations][: args.prompts]
    totals: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    outputs = {}
    for start in range(0, len(prompts), args.batch):
        batch = prompts[start : start + args.batch]
        for name, (target, costs) in sides.items():
            for method, drafter in (("plain", None), ("dflash", draft)):
                t0 = time.perf_counter()
                out = generate_batch(target, drafter, batch, args.max_new_tokens, costs=costs)
                totals[(name, method)][1] += time.perf_counter() - t0
                totals[(name, method)][0] += sum(o.num_new_tokens for o in out)
                outputs[(name, method, start)] = [o.new_tokens for o in out]
    starts = range(0, len(prompts), args.batch)
    for (name, method), (tokens, seconds) in totals.items():
        own = sum(
            a == b for s in starts for a, b in zip(outputs[(name, method, s)], outputs[(name, "plain", s)])
        )
        print(f"| {name} | {method} | {tokens / seconds:.1f} tok/s | equal to its own plain {own}/{len(prompts)} |")


if __name__ == "__main__":
    main()
