"""Batched decoding on a real model: plain batches vs DFlash with the cost-aware policy (chains, draft trees) vs a
fixed verify length, all rows joining at once (a burst of requests on a server).

    python benchmarks/scripts/batch_policies.py --target smollm2-135m-instruct --draft drafters/smollm2-135m-instruct
    python benchmarks/scripts/batch_policies.py --dtype bfloat16 --quantize int8 --compile --batch-sizes 8,16 \\
        --max-new-tokens 64 --methods plain,dflash,tree --rounds 2

Prints one markdown table (tokens/s of the whole batch, its decode part apart from the rows' prefills, and each
method over plain at the same batch size; the steps by what they verified), all measured in one run on a quiet
machine, the methods interleaved round by round. Outputs are checked equal to plain decoding row by row.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from flashdraft import DFlashDraftModel, load_target
from flashdraft.engine.compiled import compile_verify
from flashdraft.prompts.benchmarks import load_bench_dataset
from flashdraft.generate import generate_batch
from flashdraft.engine.measure import cpu_name, load_or_measure_costs

METHODS = {
    "plain": dict(draft=False),
    "dflash": dict(draft=True),
    "tree": dict(draft=True, tree="auto"),
    "fixed": dict(draft=True, block_size=16),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="drafters/smollm2-135m-instruct")
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--batch-sizes", default="1,4,8")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--methods", default="plain,dflash,fixed", help=f"of {', '.join(METHODS)}")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantize", default=None)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(
        args.target, dtype=args.dtype, device="cpu", quantize=args.quantize, compiled=args.compile
    )
    if args.compile and (note := compile_verify(target)):
        print(f"note: {note}")
    draft = DFlashDraftModel.from_pretrained(args.draft, dtype=target.dtype).eval()
    costs = load_or_measure_costs(target, draft)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    methods = args.methods.split(",")
    data = load_bench_dataset(args.dataset, max_samples=max(sizes), seed=0)
    prompts = [target.encode_prompt(c.user_turns[0])[0].tolist() for c in data.conversations][: max(sizes)]

    def decode(method: str, batch: list, new_tokens: int):
        kw = dict(METHODS[method])
        return generate_batch(
            target, draft if kw.pop("draft") else None, batch, new_tokens, costs=costs, **kw
        )

    runs = collections.defaultdict(list)  # (batch, method) -> [(tok/s, decode tok/s, tau, equal, sources)]
    for _ in range(args.rounds):
        for b in sizes:
            batch, reference = prompts[:b], None
            for method in methods:
                decode(method, batch[:2], 8)  # its graphs and shapes made, untimed
                t0 = time.perf_counter()
                out = decode(method, batch, args.max_new_tokens)
                seconds = time.perf_counter() - t0
                tokens = sum(o.num_new_tokens for o in out)
                if reference is None:
                    reference = [o.new_tokens for o in out]
                decode_s = seconds - sum(o.prefill_s for o in out)  # prefills run one row at a time
                steps = collections.Counter()
                for o in out:
                    steps.update((o.proposer_stats or {}).get("steps_by_source", {}))
                tau = sum(sum(o.acceptance_lengths) for o in out) / max(1, sum(o.num_steps for o in out))
                same = sum(o.new_tokens == r for o, r in zip(out, reference, strict=True))
                runs[b, method].append((tokens / seconds, tokens / decode_s, tau, same, steps))
    print(
        f"machine: {cpu_name()}, {args.threads} threads, torch {torch.__version__}; {args.target} "
        f"{args.dtype}{' ' + args.quantize if args.quantize else ''}{' compiled' if args.compile else ''}; "
        f"{args.dataset}, {args.max_new_tokens} new tokens per prompt, median of {args.rounds} round(s)"
    )
    print(
        "| batch | method | tok/s | decode tok/s | over plain (decode) | tau | equal | row-steps by source |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for b in sizes:
        base = statistics.median(r[1] for r in runs[b, methods[0]])
        for method in methods:
            r = runs[b, method]
            rate, dec = statistics.median(x[0] for x in r), statistics.median(x[1] for x in r)
            steps = sum((x[4] for x in r), collections.Counter())
            print(
                f"| {b} | {method} | {rate:.1f} | {dec:.1f} | {dec / base:.2f}x | {r[-1][2]:.2f} | "
                f"{min(x[3] for x in r)}/{b} | {dict(steps) or '-'} |"
            )


if __name__ == "__main__":
    main()
