"""How many drafts to verify on MLX: the cost-aware policy of the torch engine (engine/policy.py), on host floats.

prices      seconds of a target verify of n tokens (measured at n = 1, 2, 4, 8, 16, interpolated) and of a draft
            pass, timed on this MLX device when the pipeline loads (`measure_prices`)
acceptance  P(draft accepted | its confidence bin), Beta posteriors learned from the steps verified so far,
            starting from a calibrated drafter (p = confidence)
choice      verifying n drafts yields E(n) = 1 + sum_k prod_{j<=k} p_j tokens for draft_s + verify_s(n + 1)
            seconds; the n with the most tokens per second wins, a plain step (no draft pass) included. When the
            draft pass does not pay, the next ones are skipped, 1, 2, 4 .. 32 steps, then probed again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..engine.lookup import LOOKUP_MAX_NGRAM, LOOKUP_MAX_TOKENS

BINS = 20
MAX_SKIP = 32
LENGTHS = (1, 2, 4, 8, 16)


@dataclass
class Prices:
    """Seconds of a verify of n tokens (at `lengths`) and of one draft pass."""

    lengths: list[int]
    verify_s: list[float]
    draft_s: float

    def verify(self, n: int) -> float:
        return float(np.interp(n, self.lengths, self.verify_s))

    def summary(self) -> str:
        plain = self.verify_s[0]
        rel = ", ".join(f"{n}: {s / plain:.2f}" for n, s in zip(self.lengths, self.verify_s, strict=True))
        return f"MLX prices: plain step {plain * 1e3:.1f} ms, draft pass {self.draft_s / plain:.2f} steps, verify {rel}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "lengths": self.lengths,
            "verify_s": self.verify_s,
            "draft_s": self.draft_s,
            "summary": self.summary(),
        }


def measure_prices(target: Any, drafter: Any, context: int = 128, repeats: int = 3) -> Prices:
    """Time the target's verify at each length and one draft pass after `context` tokens (best of `repeats`)."""
    import mlx.core as mx

    from .drafter import DraftContext

    block = drafter.block_size
    lengths = [n for n in LENGTHS if n <= block] or [1]
    cache = target.make_cache()
    logits, features = target.forward(list(range(1, context + 1)), cache)
    ctx = DraftContext()
    ctx.append(drafter.context_kv(features, 0))
    mx.eval(logits, ctx.keys, ctx.values)
    verify = []
    for n in lengths:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            out, feats = target.forward([1] * n, cache)
            mx.eval(out, feats)
            best = min(best, time.perf_counter() - t0)
            for layer in cache:
                layer.trim(n)
        verify.append(best)
    draft = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        drafter.draft(target, ctx, 1, context, confidences=True)  # the pass the policy pays for
        draft = min(draft, time.perf_counter() - t0)
    return Prices(lengths, verify, draft)


@dataclass
class VerifyPolicy:
    """One request's choices: draft or not this step, and how many of the drafts to verify."""

    prices: Prices
    max_drafts: int
    hits: np.ndarray = field(default_factory=lambda: (np.arange(BINS) + 0.5) / BINS * 2.0)
    trials: np.ndarray = field(default_factory=lambda: np.full(BINS, 2.0))
    skip_next: int = 0  # plain steps left before the next probe
    backoff: int = 1
    draft_rate: float = 0.0  # tokens/s the last draft pass promised (0 while drafting does not pay)
    lookup_hits: np.ndarray = field(
        default_factory=lambda: np.full((LOOKUP_MAX_NGRAM + 1, LOOKUP_MAX_TOKENS), 1.0)
    )
    lookup_trials: np.ndarray = field(
        default_factory=lambda: np.full((LOOKUP_MAX_NGRAM + 1, LOOKUP_MAX_TOKENS), 2.0)
    )

    def _best(self, p: np.ndarray, draft_s: float) -> tuple[int, float]:
        expected = np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(p))])
        cost = np.array([draft_s + self.prices.verify(n + 1) for n in range(len(expected))])
        rates = expected / cost
        n = int(np.argmax(rates))
        return n, float(rates[n])

    def lookup_length(self, ngram: int, count: int) -> int:
        """How many of `count` prompt-lookup proposals (from an n-gram match) to verify; 0: draft instead."""
        p = self.lookup_hits[ngram, :count] / self.lookup_trials[ngram, :count]
        n, rate = self._best(p[: self.max_drafts], 0.0)
        bar = self.draft_rate if self.draft_rate > 0 else 1.0 / self.prices.verify(1)
        return n if rate > bar else 0

    def observe_lookup(self, ngram: int, verified: int, accepted: int) -> None:
        for j in range(min(verified, accepted + 1)):
            self.lookup_trials[ngram, j] += 1
            self.lookup_hits[ngram, j] += j < accepted

    def draft_now(self) -> bool:
        if self.skip_next > 0:
            self.skip_next -= 1
            return False
        return True

    def choose(self, confidences: list[float]) -> int:
        """How many of the drafts (by their confidences) to verify: 0 is a plain step."""
        keys = np.minimum((np.asarray(confidences[: self.max_drafts]) * BINS).astype(int), BINS - 1)
        n, rate = self._best(self.hits[keys] / self.trials[keys], self.prices.draft_s)
        if rate <= 1.0 / self.prices.verify(1):  # drafting does not pay now: plain steps, then a probe
            self.skip_next, self.backoff = self.backoff, min(2 * self.backoff, MAX_SKIP)
            self.draft_rate = 0.0
        else:
            self.backoff, self.draft_rate = 1, rate
        return n

    def observe(self, confidences: list[float], verified: int, accepted: int) -> None:
        """Drafts 0..accepted-1 were accepted; draft `accepted` (if verified) was the first rejected."""
        for j in range(min(verified, accepted + 1)):
            key = min(int(confidences[j] * BINS), BINS - 1)
            self.trials[key] += 1
            self.hits[key] += j < accepted
