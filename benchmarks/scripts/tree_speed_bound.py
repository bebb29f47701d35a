"""How fast trees could be against chains on this machine, from measured acceptance and measured prices alone.

    python benchmarks/scripts/tree_speed_bound.py budget.json ~/.cache/flashdraft/costs/<key>.json [--context 256]

`budget.json` is tree_budget.py's (τ of a chain and a tree of each node count, every step verifying exactly that
many nodes); the price list is the cost model measure.py caches for a target, precision and machine (the one the
bench used: its `summary` is printed). A step that verifies n draft nodes costs a draft pass plus a verify of n + 1
tokens (padded as the engine pads it: `--buckets`), so n nodes decode at τ(n) · t_verify(1) / (t_draft +
t_verify(n + 1)) plain steps' worth of tokens per plain step. The table gives each set's best n for chains and for
trees and the ratio of the two rates: an upper bound on what trees gain over chains at fixed sizes, because a
tree's own host work (its candidates, mask and walk) is priced at zero. The policy adapts n per step, which helps chains and trees alike.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flashdraft.engine.costs import CostModel
from flashdraft.engine.kv_cache import VERIFY_BUCKETS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("budget", type=Path)
    ap.add_argument("costs", type=Path)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument(
        "--buckets",
        default=",".join(map(str, VERIFY_BUCKETS)),
        help="the verify lengths a static cache pads to (the engine's, compiled or on a GPU); 'none': eager",
    )
    args = ap.parse_args()
    record = json.loads(args.budget.read_text())
    costs = CostModel.from_dict(json.loads(args.costs.read_text()))
    plain = float(costs.verify_s(1, args.context))
    draft = costs.draft_s(args.context)
    print(
        f"{costs.summary(args.context)}; {costs.key.get('machine', '?')}, {costs.key.get('threads', '?')} threads"
    )
    buckets = [] if args.buckets == "none" else [int(b) for b in args.buckets.split(",")]

    def rate(tau: float, nodes: int) -> float:
        tokens = next((b for b in buckets if b >= nodes + 1), nodes + 1)
        return tau * plain / (draft + float(costs.verify_s(tokens, args.context)))

    print(
        "| set | chain: best n, τ, rate × plain | tree: best n, τ, rate × plain | tree / chain: τ, rate "
        "| τ, tree of n / chain of m ≤ n nodes |"
    )
    print("|---|---|---|---|---|")
    for name, taus in record["sets"].items():
        best = {}
        for kind in ("chain", "tree"):
            runs = [(int(k.split()[1]), tau) for k, tau in taus.items() if k.startswith(kind)]
            best[kind] = max(((n, tau, rate(tau, n)) for n, tau in runs), key=lambda r: r[2])
        (cn, ct, cr), (tn, tt, tr) = best["chain"], best["tree"]
        chains = sorted(int(k.split()[1]) for k in taus if k.startswith("chain"))
        equal = []  # each tree against the longest chain no longer than it
        for n in sorted(int(k.split()[1]) for k in taus if k.startswith("tree")):
            if shorter := [c for c in chains if c <= n]:
                equal.append(f"{n}/{shorter[-1]}: {taus[f'tree {n}'] / taus[f'chain {shorter[-1]}']:.2f}")
        print(
            f"| {name} | {cn}, {ct:.2f}, {cr:.2f}× | {tn}, {tt:.2f}, {tr:.2f}× | {tt / ct:.2f}×, "
            f"{max(tr, 1.0) / max(cr, 1.0):.2f}× | {', '.join(equal)} |"
        )
    print(
        "rate × plain: tokens per plain step's time (plain decoding 1.00); tree / chain rate: each the better of itself "
        "and plain decoding (the policy takes plain steps where drafting does not pay)"
    )


if __name__ == "__main__":
    main()
