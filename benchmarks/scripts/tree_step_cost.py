"""What a tree step costs against a chain step that verifies as many tokens: fixed shapes, no policy, one row.

    python benchmarks/scripts/tree_step_cost.py [--quantize w8a16] [--nodes 3,4,7] [--rounds 3] [--parts]

For each n, a chain of n drafts (`block_size=n + 1`) and a tree of n nodes over the drafter's whole block
(`block_size=B, tree=n`) decode the same GSM8K prompts, interleaved round by round; every output is checked equal to
plain decoding. Both verify n + 1 tokens a step after one draft pass, so the difference of their decode time per
step is what a tree adds on the host (its candidates, mask and walk, the accepted path's columns). Prints ms per step
(decode time over steps, prefills left out; median over rounds) and τ. `--parts`: where the difference goes, the
engine's, the proposer's and tree.py's functions timed inclusively (ms per step, median over rounds; the timers add
a little to both).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

import torch

from flashdraft import DFlashDraftModel, generate, generate_ar, load_target
from flashdraft.engine.compiled import compile_verify
from flashdraft.prompts.benchmarks import load_bench_dataset
from flashdraft.engine.measure import cpu_name


def time_parts() -> tuple[collections.Counter, collections.Counter]:
    """Wraps the functions a tree step adds to or changes; returns the timers' (seconds, calls) by name."""
    import flashdraft.engine.batched_dflash as B
    import flashdraft.engine.compiled as C
    import flashdraft.engine.decoder as E
    import flashdraft.engine.tree as T

    sys.path.insert(0, str(Path(__file__).parent))
    from call_timers import calls, spent, time_methods, timed

    time_methods(
        [
            (E.BatchDecoder, ["step", "forward_block", "_block", "_compact", "_gather_block", "_check_tree"]),
            (
                B.BatchedDFlashProposer,
                ["propose", "draft_rows", "_tree_for", "accept", "observe", "_compact"],
            ),
        ]
    )
    C.VerifyForward.__call__ = timed("VerifyForward.__call__", C.VerifyForward.__call__)
    for name in ("grow_tree", "slot_candidates", "accepted_path", "ancestor_mask"):
        wrapped = timed(name, getattr(T, name))
        for module in (T, B, E):  # where it is called from
            if hasattr(module, name):
                setattr(module, name, wrapped)
    return spent, calls


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
    ap.add_argument("--parts", action="store_true", help="also time the step's parts")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spent, calls = time_parts() if args.parts else (collections.Counter(), collections.Counter())
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
    parts: dict[tuple[str, int], dict[str, list[float]]] = {s: collections.defaultdict(list) for s in shapes}
    for first in [True] + [False] * args.rounds:  # the first round makes the graphs, untimed
        for kind, n in shapes:
            spec = dict(block_size=n + 1) if kind == "chain" else dict(block_size=block, tree=n)
            seconds = steps = emitted = 0.0
            spent.clear()
            calls.clear()
            for ids, ref in zip(prompts, plain, strict=True):
                res = generate(target, draft, ids, args.max_new_tokens, **spec)
                seconds += res.decode_s
                if res.new_tokens != ref:
                    raise SystemExit(f"{kind} {n}: the output differs from plain decoding")
                steps += res.num_steps
                emitted += sum(res.acceptance_lengths)
            if first:
                continue
            runs[kind, n].append((1e3 * seconds / steps, emitted / steps))
            for name, part_s in spent.items():
                parts[kind, n][name].append(1e3 * part_s / steps)
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
    for n in sorted({n for _, n in shapes}) if args.parts else []:
        chain, tree = parts["chain", n], parts["tree", n]
        print(f"\n{n} nodes, ms per step: | part | chain | tree | tree - chain |\n|---|---|---|---|")
        for name in sorted(set(chain) | set(tree), key=lambda k: -statistics.median(tree.get(k, [0.0]))):
            c, t = (statistics.median(part.get(name, [0.0])) for part in (chain, tree))
            print(f"| {name} | {c:.3f} | {t:.3f} | {t - c:+.3f} |")


if __name__ == "__main__":
    main()
