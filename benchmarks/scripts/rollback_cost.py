"""What the exact rollback of recurrent state costs per decode step, on tiny random hybrid targets.

For each family: the verify forward of a block of n tokens with and without the recording the rollback needs
(snapshots, or the stepwise mixer loop), and `keep` (restore + replay of the accepted tokens, or the restore of a
kept per-position state) for a row that keeps k of the n tokens. Replay and stepwise are timed on the same model
where both apply (stepwise is forced on a model whose mixers can continue from a state). Medians over repeats.

    python benchmarks/scripts/rollback_cost.py --block 8 --keep 3 --repeats 21
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import hybrid_model  # noqa: E402
from flashdraft import Target  # noqa: E402
from flashdraft.engine.measure import cpu_name  # noqa: E402


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


@torch.no_grad()
def measure(arch: str, stepwise: bool | None, block: int, keep: int, repeats: int, context: int) -> dict:
    """Medians (ms) of: a plain verify forward, the same forward recorded for the rollback, and `keep`."""
    target = Target(hybrid_model(arch))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 90, (1, context), generator=gen)
    ids = torch.randint(3, 90, (1, block), generator=gen)
    base = target.new_cache()
    target.forward(prompt, base)
    target.rollback_mode()  # the probe that picks replay or stepwise
    if stepwise is not None:
        target.recurrent.stepwise = stepwise
    plain, recorded, kept = [], [], []
    for i in range(repeats + 1):  # the first round warms up
        cache = copy.deepcopy(base)
        t_plain = _timed(lambda c=cache: target.model(input_ids=ids, past_key_values=c, use_cache=True))
        cache = copy.deepcopy(base)
        t_rec = _timed(lambda c=cache: target.forward(ids, c))
        t_keep = _timed(lambda c=cache: target.keep(c, [keep]))
        if i:
            plain.append(t_plain)
            recorded.append(t_rec)
            kept.append(t_keep)
    return {
        "family": arch,
        "mode": "stepwise" if target.recurrent.stepwise else "replay",
        "verify_ms": statistics.median(plain),
        "verify_recorded_ms": statistics.median(recorded),
        "keep_ms": statistics.median(kept),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runs = [
        ("qwen3_5", None),
        ("qwen3_5", True),
        ("qwen3_next", None),
        ("jamba", None),
        ("falcon_h1", None),
        ("falcon_h1", True),
        ("mamba2", None),
        ("lfm2", None),
    ]
    print(
        f"{cpu_name()}, {args.threads} thread(s), torch {torch.__version__}; block {args.block}, keep {args.keep}, "
        f"context {args.context}; medians of {args.repeats}"
    )
    print("| family | rollback | verify forward | same, recorded | keep k | rollback cost per step |")
    print("|---|---|---|---|---|---|")
    for arch, stepwise in runs:
        r = measure(arch, stepwise, args.block, args.keep, args.repeats, args.context)
        cost = r["verify_recorded_ms"] - r["verify_ms"] + r["keep_ms"]
        print(
            f"| {r['family']} | {r['mode']} | {r['verify_ms']:.2f} ms | {r['verify_recorded_ms']:.2f} ms | "
            f"{r['keep_ms']:.2f} ms | {cost:+.2f} ms ({100 * cost / r['verify_ms']:+.0f} % of the verify) |"
        )


if __name__ == "__main__":
    main()
