"""The learning curve of a drafter: τ on held-out prompts against what training has seen.

    python benchmarks/scripts/learning_curve.py runs/train/next/eval_log.jsonl [more logs, in order] \
        --prior-sequences 7800 --bars gsm8k=4,humaneval=2.5,mt-bench=2 --png drafters/learning-curve.png

Reads the `eval_log.jsonl` that `flashdraft train --eval-every N` writes (several logs are chained: a run continued
with `--init-from` counts on from the previous one; `--prior-sequences` adds what the first run's `--init-from`
drafter had already seen), prints a markdown table and writes a PNG (τ per dataset against sequences seen).

With `--bars`, it also fits τ = a + b·ln(sequences seen) per dataset by least squares over the points after the
first and says how many sequences (and hours at the measured rate) each bar would take if the trend held: a rough
extrapolation from a noisy curve, printed as such.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def load_points(logs: list[Path], prior_sequences: int) -> list[dict]:
    points, offset = [], {"sequences": prior_sequences, "supervised_tokens": 0, "train_wall_s": 0.0}
    for i, log in enumerate(logs):
        entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        if i > 0 and entries and entries[0]["sequences"] == 0:
            entries = entries[1:]  # a continued run's step 0 is the previous run's last point
        for e in entries:
            points.append({**e, **{k: e[k] + offset[k] for k in offset}, "run": i})
        if entries:
            offset = {k: points[-1][k] for k in offset}
    return points


def log_fit(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least squares y = a + b ln x; None when there is too little to fit."""
    pts = [(math.log(x), y) for x, y in zip(xs, ys, strict=True) if x > 0 and y is not None]
    if len(pts) < 3:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    var = sum((p[0] - mx) ** 2 for p in pts)
    if var == 0:
        return None
    b = sum((p[0] - mx) * (p[1] - my) for p in pts) / var
    return my - b * mx, b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--prior-sequences", type=int, default=0,
                    help="sequences the first run's --init-from drafter had already been trained on")  # fmt: skip
    ap.add_argument("--bars", default="", help="dataset=τ,... to extrapolate to, e.g. gsm8k=4,humaneval=2.5")
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--labels", default="", help="a name per log for the PNG, separated by semicolons")
    args = ap.parse_args()
    points = load_points(args.logs, args.prior_sequences)
    names = sorted({k for p in points for k in p["tau"]})
    print("| sequences seen | supervised tokens (this run) | training hours (this run) | "
          + " | ".join(f"τ {n}" for n in names) + " |")  # fmt: skip
    print("|---|---|---|" + "---|" * len(names))
    for p in points:
        taus = " | ".join(f"{p['tau'].get(n, float('nan')):.2f}" for n in names)
        print(
            f"| {p['sequences']} | {p['supervised_tokens'] / 1e6:.2f}M | {p['train_wall_s'] / 3600:.2f} | {taus} |"
        )
    if args.bars:
        trained = [p for p in points if p["train_wall_s"] > 0]
        per_seq_s = (
            (trained[-1]["train_wall_s"] - points[0]["train_wall_s"])
            / max(1, trained[-1]["sequences"] - points[0]["sequences"])
            if trained
            else float("nan")
        )
        print(f"\nExtrapolation, τ = a + b·ln(sequences), fitted on {len(points) - 1} points after the first "
              f"(training at {per_seq_s:.2f} s per sequence here):")  # fmt: skip
        for bar in args.bars.split(","):
            name, target = bar.split("=")
            fit = log_fit([p["sequences"] for p in points[1:]], [p["tau"].get(name) for p in points[1:]])
            if fit is None:
                print(f"- {name}: too few points to fit")
                continue
            a, b = fit
            seen = [p["sequences"] for p in points[1:] if p["sequences"] > 0]
            if max(seen) < 3 * min(seen):
                print(f"- {name}: τ = {a:.2f} + {b:.3f}·ln(n), but the points span less than a factor 3 in "
                      f"sequences ({min(seen)}-{max(seen)}): too narrow to extrapolate")  # fmt: skip
                continue
            if b <= 0:
                print(f"- {name}: τ = {a:.2f} + {b:.3f}·ln(n): not rising over this range, no estimate")
                continue
            need = math.exp((float(target) - a) / b)
            print(f"- {name}: τ = {a:.2f} + {b:.3f}·ln(n); τ {target} at about {need:,.0f} sequences seen "
                  f"(≈ {need * per_seq_s / 3600:,.0f} hours of this machine at this rate)")  # fmt: skip
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        labels = [x.strip() for x in args.labels.split(";") if x.strip()] or [str(log) for log in args.logs]
        markers = "os^Dv"
        runs = sorted({p["run"] for p in points})
        for j, n in enumerate(names):
            ax.plot(
                [p["sequences"] for p in points], [p["tau"].get(n) for p in points], color=f"C{j}", label=n
            )
            for i in runs:
                run = [p for p in points if p["run"] == i]
                ax.plot([p["sequences"] for p in run], [p["tau"].get(n) for p in run], linestyle="none",
                        marker=markers[i % len(markers)], color=f"C{j}")  # fmt: skip
        for i in runs:
            ax.plot([], [], linestyle="none", marker=markers[i % len(markers)], color="gray",
                    label=labels[i] if i < len(labels) else str(i))  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("training sequences seen (log scale)")
        ax.set_ylabel("τ (T=0, fixed block)")
        ax.set_title("drafter learning curve")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
