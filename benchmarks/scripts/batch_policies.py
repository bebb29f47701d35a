"""Batched decoding on a real model: plain batches vs DFlash with the cost-aware policy vs a fixed verify length.

    python benchmarks/scripts/batch_policies.py --target smollm2-135m-instruct --draft drafters/smollm2-135m-instruct

Prints one markdown table (tokens/s of the whole batch, and each method over plain at the same batch size), all
measured in one run on a quiet machine. Outputs are checked equal to plain decoding row by row.
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--batch-sizes", default="1,4,8")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype="float32", device="cpu")
    draft = DFlashDraftModel.from_pretrained(args.draft).eval()
    costs = load_or_measure_costs(target, draft)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    data = load_bench_dataset(args.dataset, max_samples=max(sizes), seed=0)
    prompts = [target.encode_prompt(c.user_turns[0])[0].tolist() for c in data.conversations][: max(sizes)]
    methods = {
        "plain": dict(draft=None),
        "dflash auto": dict(draft=draft),
        "dflash fixed B=16": dict(draft=draft, block_size=16),
    }
    print(
        f"machine: {cpu_name()}, {args.threads} threads, torch {torch.__version__}; {args.dataset}, "
        f"{args.max_new_tokens} new tokens per prompt"
    )
    print("| batch | " + " | ".join(methods) + " |")
    print("|---|" + "---|" * len(methods))
    for b in sizes:
        batch = prompts[:b]
        cells, base, reference = [], None, None
        for kw in methods.values():
            generate_batch(
                target,
                kw["draft"],
                batch[:1],
                8,
                costs=costs,
                **{k: v for k, v in kw.items() if k != "draft"},
            )
            t0 = time.perf_counter()
            out = generate_batch(
                target,
                kw["draft"],
                batch,
                args.max_new_tokens,
                costs=costs,
                **{k: v for k, v in kw.items() if k != "draft"},
            )
            dt = time.perf_counter() - t0
            tokens = sum(o.num_new_tokens for o in out)
            if reference is None:
                reference = [o.new_tokens for o in out]
            same = sum(o.new_tokens == r for o, r in zip(out, reference, strict=True))
            rate = tokens / dt
            base = base or rate
            tau = sum(sum(o.acceptance_lengths) for o in out) / max(1, sum(o.num_steps for o in out))
            cells.append(f"{rate:.1f} tok/s ({rate / base:.2f}x, tau {tau:.2f}, {same}/{b} equal)")
        print(f"| {b} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
