"""What a tree step costs against a chain step that verifies as many tokens: fixed shapes, no policy, one row.

    python benchmarks/scripts/tree_step_cost.py [--quantize w8a16] [--nodes 3,4,7] [--rounds 3]

For each n, a chain of n drafts (`block_size=n + 1`) and a tree of n nodes over the drafter's whole block
(`block_size=B, tree=n`) decode the same GSM8K prompts, interleaved round by round; every output is checked equal to
plain decoding. Both verify n + 1 tokens a step after one draft pass, so the difference of their decode time per
step is what a tree adds on the host (its candidates, mask and walk, the accepted path's columns). Prints ms per step
(decode time over steps, prefills left out; median over rounds) and τ.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from flashdraft import DFlashDraftModel, generate, generate_ar, load_target
from flashdraft.compiled import compile_verify
from flashdraft.datasets import load_bench_dataset
from flashdraft.measure import cpu_name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="drafters/smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantize", default="w8a16")
    ap.add_argument("--nodes", default="3,4,7")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=args.dtype, device="cpu", quantize=args.quantize, compiled=True)
    if note := compile_verify(target):
        print(f"note: {note}")
    draft = DFlashDraftModel.from_pretrained(args.draft, dtype=target.dtype).eval()
    block = draft.config.block_size
    data = load_bench_dataset("gsm8k", max_samples=args.prompts, seed=0)
    prompts = [target.encode_prompt(c.user_turns[0]) for c in data.conversations]
    plain = [generate_ar(target, ids, args.max_new_tokens).new_tokens for ids in prompts]
    shapes = [(kind, int(n)) for n in args.nodes.split(",") for kind in ("chain", "tree")]
    runs: dict[tuple[str, int], list[tuple[float, float]]] = {s: [] for s in shapes}
    for _ in range(args.rounds + 1):  # the first round makes the graphs, untimed
        for kind, n in shapes:
            spec = dict(block_size=n + 1) if kind == "chain" else dict(block_size=block, tree=n)
            seconds = steps = emitted = 0.0
            for ids, ref in zip(prompts, plain, strict=True):
                res = generate(target, draft, ids, args.max_new_tokens, **spec)
                seconds += res.decode_s
                if res.new_tokens != ref:
                    raise SystemExit(f"{kind} {n}: the output differs from plain decoding")
                steps += res.num_steps
                emitted += sum(res.acceptance_lengths)
            runs[kind, n].append((1e3 * seconds / steps, emitted / steps))
    print(
        f"{cpu_name()}, {args.threads} threads, torch {torch.__version__}; {args.target} {args.dtype} "
        f"{args.quantize or ''} compiled; {args.prompts} GSM8K prompts, {args.max_new_tokens} tokens, median of "
        f"{args.rounds} rounds"
    )
    print("| nodes | chain ms/step (τ) | tree ms/step (τ) | tree - chain ms | tree / chain: τ, tok/s |")
    print("|---|---|---|---|---|")
    for n in sorted({n for _, n in shapes}):
        (cm, ct), (tm, tt) = (
            (statistics.median(r[0] for r in runs[k, n]), runs[k, n][-1][1]) for k in ("chain", "tree")
        )
        print(
            f"| {n} | {cm:.2f} ({ct:.2f}) | {tm:.2f} ({tt:.2f}) | {tm - cm:+.2f} | {tt / ct:.2f}×, "
            f"{(tt / tm) / (ct / cm):.2f}× |"
        )


if __name__ == "__main__":
    main()
