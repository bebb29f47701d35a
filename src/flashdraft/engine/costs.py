"""What the hardware charges: seconds for a target verify of n tokens and for a draft pass (the price list).

Verifying n tokens does not cost n one-token steps (the weights are read once), nor a constant (small-row GEMMs,
attention over the context). `CostModel` interpolates measured times in n and is linear in the context; the policy
(policy.py, proposers.py) reads prices from it and nothing else; `ObservedCosts` corrects them by the step times the
engine observes. How the prices are measured, and cached per machine, is measure.py.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class CostModel:
    """t_verify(n, c) = base[n] + slope[n] * c, t_draft(c) = draft_base + draft_slope * c (seconds); a batched
    draft pass of b rows costs t_draft(c) + (b - 1) * draft_row_s."""

    lengths: list[int]  # measured verify lengths, ascending, starting at 1
    verify_base: list[float]
    verify_slope: list[float]
    draft_base: float = 0.0
    draft_slope: float = 0.0
    draft_row_s: float = 0.0
    # the drafter's LM head per slot and row: a draft pass whose head covers k fewer slots (the lazy head,
    # batched_dflash.py) costs k x this less
    draft_slot_s: float = 0.0
    draft_dtype: str = "float32"  # the precision the drafter and its head run in (the faster one measured)
    head_s: dict[str, float] = field(default_factory=dict)  # draft-head time per dtype, for the record
    measured_s: float = 0.0
    key: dict[str, Any] = field(default_factory=dict)
    # every context of the measurement timed (False: its time budget ran out first, measure.measure_costs)
    complete: bool = True

    def verify_s(self, n: int | torch.Tensor, context: int) -> torch.Tensor:
        """Seconds for a target forward over n tokens after `context` cached ones (n may be a tensor)."""
        # Priced as measured: a longer verify can really cost less than a shorter one (on the 2-core AMD EPYC of
        # benchmarks/README.md, 5-8 tokens verify faster than 2-4, in every session: the CPU's GEMM kernels differ
        # by row count), and pricing a smoothed curve made the policy verify 8 where 5 was cheaper (1.51x vs
        # 1.86x). Timing noise must never price a verify at or below zero. In Python floats: the policy asks
        # several times a step, and the same in tensor ops took 55 us a call.
        ys = [max(b + s * context, 1e-6) for b, s in zip(self.verify_base, self.verify_slope, strict=True)]
        counts = n.tolist() if isinstance(n, torch.Tensor) else n
        if isinstance(counts, list):
            return torch.tensor([_interp(float(x), self.lengths, ys) for x in counts], dtype=torch.float32)
        return torch.tensor(_interp(float(counts), self.lengths, ys), dtype=torch.float32)

    def step_s(self, max_proposals: int, context: int, propose_s: float) -> torch.Tensor:
        """[max_proposals + 1]: seconds of a step that verifies 0..max_proposals proposals after paying propose_s."""
        return propose_s + self.verify_s(torch.arange(1, max_proposals + 2), context)

    def draft_s(self, context: int) -> float:
        return self.draft_base + self.draft_slope * context

    def draft_batch_s(self, rows: int, context: int, skipped_slots: int = 0) -> float:
        """One draft pass over `rows` rows (batched decoding), each after about `context` tokens, its LM head over
        all slots but `skipped_slots`."""
        full = self.draft_s(context) + max(0, rows - 1) * self.draft_row_s
        return max(full - skipped_slots * max(1, rows) * self.draft_slot_s, 0.25 * full)

    def summary(self, context: int = 256) -> str:
        plain = float(self.verify_s(1, context))
        ratios = ", ".join(f"{n}: {float(self.verify_s(n, context)) / plain:.2f}" for n in self.lengths[1:])
        return (
            f"cost model @ {context} tokens of context: plain step {plain * 1e3:.1f} ms, draft pass "
            f"{self.draft_s(context) * 1e3:.1f} ms ({self.draft_dtype}; its head {self.draft_slot_s * 1e3:.2f} ms a "
            f"slot), verify t(n)/t(1) = {ratios}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class ObservedCosts:
    """The cost model corrected online by the times observed (measured / predicted, EMA), for batches of 2+ rows
    only: a batched forward with ragged masks and a padded draft context costs what the single-row measurements
    cannot say. One row is the shape the cost model measured; correcting it only fed timing noise into the choice
    (at one row it measured 1.18x over plain against 1.36x without, in one run: benchmarks/README.md).

    One ratio per row count, which every verify of that many rows updates (plain steps included), so a busy spell
    and its end reach all verify lengths at once. A batched verify's cost does not follow rows x tokens as one
    row's does (16 rows of 2 tokens measured about 1.27x further above the cost model's price than 16 rows of 1, on
    the 2-core AMD EPYC), so each (rows, tokens per row) shape keeps its own factor over its row count's ratio: the
    level follows every verify, the shape only the verifies of that shape. The draft pass is priced relative to
    the verify (its ratio over the verify ratio of the moment). `online=False` prices by the cost model alone (one
    written by hand)."""

    def __init__(self, costs: CostModel, online: bool = True) -> None:
        self.costs = costs
        self.online = online
        self.by_rows: dict[int, float] = {}
        self.by_shape: dict[tuple[int, int], float] = {}  # over by_rows
        self.draft_ratio: float | None = None  # (measured / predicted draft pass) / verify ratio

    def ratio(self, rows: int) -> float:
        """Measured / predicted verify time at this many rows (the nearest row count measured so far; 1 for one
        row, the measured shape)."""
        if rows == 1 or not self.by_rows:
            return 1.0
        return self.by_rows[min(self.by_rows, key=lambda r: abs(r - rows))]

    def ratios(self, rows: int, tokens_per_row: torch.Tensor) -> torch.Tensor:
        """Measured / predicted verify time of `rows` rows of each of these token counts (the row count's ratio
        times each shape's own factor, where that shape has been measured)."""
        if rows == 1:
            return torch.ones(len(tokens_per_row))
        level = self.ratio(rows)
        return torch.tensor([level * self.by_shape.get((rows, int(t)), 1.0) for t in tokens_per_row])

    def verify_s(self, rows: int, tokens_per_row: torch.Tensor, context: int) -> torch.Tensor:
        """Seconds for a verify of `rows` rows of each of these token counts."""
        return self.costs.verify_s(rows * tokens_per_row, context) * self.ratios(rows, tokens_per_row)

    def verify_timed(self, rows: int, tokens_per_row: int, context: int, seconds: float) -> None:
        if not self.online or rows == 1:
            return
        ratio = seconds / max(float(self.costs.verify_s(rows * tokens_per_row, context)), 1e-9)
        old = self.by_rows.get(rows)
        if old is not None:
            key, shape = (rows, tokens_per_row), ratio / old
            self.by_shape[key] = _ema(self.by_shape[key], shape) if key in self.by_shape else shape
        self.by_rows[rows] = ratio if old is None else _ema(old, ratio)

    def draft_s(self, rows: int, context: int, skipped_slots: int, measured_s: float) -> float:
        """The price of a draft pass of `rows` rows (`CostModel.draft_batch_s`) that took `measured_s`, which
        corrects it first (the first measurement counts at once, as for the verify)."""
        predicted = self.costs.draft_batch_s(rows, context, skipped_slots)
        if rows == 1:
            return predicted
        if self.online:
            ratio = measured_s / max(predicted, 1e-9) / self.ratio(rows)
            self.draft_ratio = ratio if self.draft_ratio is None else _ema(self.draft_ratio, ratio)
        return predicted * (self.draft_ratio or 1.0) * self.ratio(rows)


def _ema(old: float, new: float, keep: float = 0.8) -> float:
    return keep * old + (1.0 - keep) * new


def _interp(x: float, xs: list[int], ys: list[float]) -> float:
    """Piecewise-linear interpolation; past the last measured length, linear extrapolation that never falls
    below the last measurement (a noisy last segment must not make longer verifies look cheaper)."""
    x = max(x, xs[0])
    i = min(max(bisect.bisect_right(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(y, ys[-1]) if x > xs[-1] else y
