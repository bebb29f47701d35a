"""Eager fp32 on a CPU: the target's linear layers through MKL (torch's nn.Linear) against oneDNN's packed layers
(packed_linear.py), plain decoding and DFlash, in one process.

    python benchmarks/scripts/packed_linear_ab.py --batch 1 --prompts 6
    python benchmarks/scripts/packed_linear_ab.py --batch 16 --prompts 16

Both targets are loaded side by side and each gets its own price list (measured once per machine, then cached);
each batch of prompts runs plain and DFlash on both, in turn. Prints tokens/s and whether every output equals
plain decoding of the MKL target and of its own.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from flashdraft import DFlashDraftModel, load_target
from flashdraft.datasets import load_bench_dataset
from flashdraft.generate import generate_batch
from flashdraft.measure import cpu_name, load_or_measure_costs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="drafters/smollm2-135m-instruct")
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    draft = DFlashDraftModel.from_pretrained(args.draft).eval()
    sides = {}
    for name, pack in (("mkl", False), ("onednn", True)):
        target = load_target(args.target, dtype="float32", device="cpu", pack_linears=pack)
        costs = load_or_measure_costs(target, draft)
        print(f"{name}: {costs.summary()}", flush=True)
        sides[name] = (target, costs)
    print(f"machine: {cpu_name()}, {args.threads} threads, torch {torch.__version__}")
    data = load_bench_dataset(args.dataset, max_samples=args.prompts, seed=0)
    encode = sides["mkl"][0].encode_prompt
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
        mkl = sum(
            a == b for s in starts for a, b in zip(outputs[(name, method, s)], outputs[("mkl", "plain", s)])
        )
        own = sum(
            a == b for s in starts for a, b in zip(outputs[(name, method, s)], outputs[(name, "plain", s)])
        )
        print(
            f"| {name} | {method} | {tokens / seconds:.1f} tok/s | equal to MKL plain {mkl}/{len(prompts)}, "
            f"to its own plain {own}/{len(prompts)} |"
        )


if __name__ == "__main__":
    main()
