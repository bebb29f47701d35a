"""Accepted length against node budget: draft trees vs chains from the same drafter, every step verifying the same
number of draft nodes (fixed blocks: no policy, so τ measures the proposals alone).

    python benchmarks/scripts/tree_budget.py --target smollm2-135m-instruct --draft drafters/smollm2-135m-instruct \
        --out benchmarks/smollm2-135m-instruct-trees

A chain of N nodes is the drafter's block of N + 1 (N <= B - 1); a tree of N nodes is the best-first tree over the
drafter's full block (tree.py). Writes budget.json (τ per set, method and budget; every output checked equal to plain
decoding) and budget.png. τ does not depend on timing, so this can run beside other work.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from flashdraft import DFlashDraftModel, generate, generate_ar, load_target
from flashdraft.prompts.benchmarks import load_bench_dataset
from flashdraft.engine.measure import cpu_name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="drafters/smollm2-135m-instruct")
    ap.add_argument("--datasets", default="gsm8k,humaneval,mt-bench")
    ap.add_argument("--max-samples", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--chains", default="1,2,3,4,6,8,12,15")
    ap.add_argument("--trees", default="2,4,6,8,12,16,24,32,48")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype="float32", device="cpu")
    draft = DFlashDraftModel.from_pretrained(args.draft).eval()
    block = draft.config.block_size
    runs = [("chain", int(n)) for n in args.chains.split(",") if int(n) < block]
    runs += [("tree", int(n)) for n in args.trees.split(",")]
    record: dict = {"target": args.target, "draft": args.draft, "cpu": cpu_name(), "sets": {}}
    for name in args.datasets.split(","):
        data = load_bench_dataset(name, max_samples=args.max_samples, seed=0)
        prompts = [target.encode_prompt(c.user_turns[0]) for c in data.conversations]
        plain = [generate_ar(target, ids, args.max_new_tokens).new_tokens for ids in prompts]
        taus = {}
        for kind, nodes in runs:
            emitted = steps = 0
            for ids, ref in zip(prompts, plain, strict=True):
                spec = dict(block_size=nodes + 1) if kind == "chain" else dict(block_size=block, tree=nodes)
                res = generate(target, draft, ids, args.max_new_tokens, **spec)
                if res.new_tokens != ref:
                    raise SystemExit(f"{name} {kind} {nodes}: the output differs from plain decoding")
                emitted += sum(res.acceptance_lengths)
                steps += len(res.acceptance_lengths)
            taus[f"{kind} {nodes}"] = emitted / steps
            print(f"{name:10s} {kind:5s} {nodes:3d} nodes: tau {emitted / steps:.2f}", flush=True)
        record["sets"][data.name] = taus
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "budget.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(record, args.out / "budget.png")


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, (name, taus) in enumerate(record["sets"].items()):
        for kind, style in (("chain", "--"), ("tree", "-")):
            points = sorted((int(k.split()[1]), v) for k, v in taus.items() if k.startswith(kind))
            ax.plot(
                [n for n, _ in points],
                [t for _, t in points],
                style,
                marker="o",
                color=f"C{i}",
                label=f"{name} {kind}",
            )
    ax.set_xlabel("draft nodes verified per step")
    ax.set_ylabel("τ (tokens per target forward)")
    ax.set_xscale("log", base=2)
    ax.set_title(f"{record['target']}: trees vs chains, same drafter")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
