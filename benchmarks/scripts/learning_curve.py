"""The learning curve of a drafter: τ on held-out prompts against what training has seen.

    python benchmarks/scripts/learning_curve.py runs/train/next/eval_log.jsonl [more logs, in order] \
        --png drafters/learning-curve.png

Reads the `eval_log.jsonl` that `flashdraft train --eval-every N` writes (several logs are chained: a run continued
with `--init-from` counts on from the previous one), prints a markdown table and writes a PNG (τ per dataset against
supervised training tokens).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--png", type=Path, default=None)
    args = ap.parse_args()
    points, offset = [], {"sequences": 0, "supervised_tokens": 0, "train_wall_s": 0.0}
    for log in args.logs:
        entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        for e in entries:
            points.append({**e, **{k: e[k] + offset[k] for k in offset}})
        if entries:
            offset = {k: points[-1][k] for k in offset}
    names = sorted({k for p in points for k in p["tau"]})
    print(
        "| sequences seen | supervised tokens | training hours | "
        + " | ".join(f"τ {n}" for n in names)
        + " |"
    )
    print("|---|---|---|" + "---|" * len(names))
    for p in points:
        taus = " | ".join(f"{p['tau'].get(n, float('nan')):.2f}" for n in names)
        print(
            f"| {p['sequences']} | {p['supervised_tokens'] / 1e6:.2f}M | {p['train_wall_s'] / 3600:.2f} | {taus} |"
        )
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        for n in names:
            ax.plot([p["supervised_tokens"] / 1e6 for p in points], [p["tau"].get(n) for p in points],
                    marker="o", label=n)  # fmt: skip
        ax.set_xlabel("supervised training tokens (millions)")
        ax.set_ylabel("τ (T=0, fixed block)")
        ax.set_title("drafter learning curve")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
