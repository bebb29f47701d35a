"""How many proposed tokens to verify: expected tokens per second from acceptance estimates and a cost model.

Verifying n proposals yields E(n) = 1 + sum_{k<=n} prod_{j<=k} p_j tokens (the target's own token always comes),
where p_j = P(proposal j accepted | proposals before it accepted). A step costs t_propose + t_verify(n + 1).
`best_verify_length` picks the n in 0..N with the most tokens per second. The p_j come from `AcceptanceTable`s
learned online from the steps already verified (calibration.py: the drafter's keyed by confidence and depth).
`BatchPolicy` makes a batch's choices each step from them (batched_dflash.py's proposer asks it): one verify length
for the batch, the rate speculating must beat, and when to skip the draft pass and probe again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

MAX_SKIP_STEPS, BATCH_MAX_SKIP_STEPS = 32, 128  # one row, several rows
# When drafting does not pay, a probe loses time against a plain step (its draft pass, mostly: for 16 rows it costs
# more than their plain step): probes come rarely enough that they lose at most this share of the steps between.
# One row's pass is cheap and its text turns predictable again often; several rows' passes cost 2-3 plain steps
# (16 rows of SmolLM2-135M on a 2-core Xeon: about 30 ms against 10), and at 16 rows probes every 30 steps cost
# 8 % of the time, where drafting never paid (benchmarks/README.md, 2026-12-06).
PROBE_SHARE = 0.1
BATCH_PROBE_SHARE = 0.03
# Several rows speculate only where they are expected to beat plain steps by this factor (one row: by any margin).
# A batch's speculation is chosen on the rows' most hopeful estimates, and at 8 rows a verify of 2 tokens each costs
# about 1.5 plain steps: served at 8 requests at once, single drafts accepted 43 % of the time (the policy expected
# over half) made DFlash 0.82x plain decoding (w8a16, a 2-core Emerald Rapids Xeon, benchmarks/README.md).
BATCH_MARGIN = 1.1


class AcceptanceTable:
    """P(accepted | key) for a few discrete keys, as Beta posteriors updated from verified steps.

    `prior[k]` is the initial guess for key k, worth `prior_weight` observations.
    """

    def __init__(self, prior: Sequence[float], prior_weight: float = 2.0) -> None:
        self.hits = torch.tensor([p * prior_weight for p in prior], dtype=torch.float64)
        self.trials = torch.full((len(prior),), float(prior_weight), dtype=torch.float64)
        self._runs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.hits)

    def p(self, keys: torch.Tensor) -> torch.Tensor:
        return (self.hits[keys] / self.trials[keys]).float()

    def run(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, expected tokens) of n proposals keyed start, start + 1, .. (a lookup match, forced text): kept until
        the table learns something, as a batch asks for them for every row at every step."""
        run = self._runs.get((start, n))
        if run is None:
            keys = torch.arange(start, start + n)
            run = self._runs[start, n] = (keys, expected_tokens(self.p(keys)))
        return run

    def record(self, tried: torch.Tensor, hits: torch.Tensor) -> None:
        """The proposals with keys `tried` were tested (their parent was accepted), those with keys `hits` accepted."""
        self._runs.clear()
        self.trials.index_add_(0, tried, torch.ones(len(tried), dtype=torch.float64))
        self.hits.index_add_(0, hits, torch.ones(len(hits), dtype=torch.float64))

    def update(self, keys: torch.Tensor, num_verified: int, num_accepted: int) -> None:
        """Slots 0..num_verified-1 were verified in order: slot j was a trial iff every slot before it was accepted,
        and a hit iff j < num_accepted."""
        self.record(keys[: min(num_verified, num_accepted + 1)], keys[: min(num_verified, num_accepted)])


def confidence_prior(bins: int = 20, groups: int = 1) -> list[float]:
    """The prior of a drafter table keyed by confidence bin (`groups` ranges of `bins` keys, each its own): the
    drafter calibrated (p = confidence)."""
    return [(i + 0.5) / bins for i in range(bins)] * groups


def confidence_keys(confidence: torch.Tensor, bins: int) -> torch.Tensor:
    return (confidence.float() * bins).long().clamp_(0, bins - 1)


def expected_tokens(p: torch.Tensor) -> torch.Tensor:
    """[n + 1]: expected tokens emitted when verifying the first 0, 1, .., n proposals."""
    survive = torch.cumprod(p.float(), 0)
    return torch.cat([torch.ones(1), 1.0 + torch.cumsum(survive, 0)])


def best_verify_length(p: torch.Tensor, step_s: torch.Tensor) -> tuple[int, float]:
    """(n, tokens/s) maximising expected tokens per second; `step_s[n]` = cost of a step verifying n proposals."""
    rates = expected_tokens(p)[: len(step_s)] / step_s
    n = int(torch.argmax(rates))
    return n, float(rates[n])


def extended(expected: torch.Tensor, more: int) -> torch.Tensor:
    """An upper bound on the expected tokens `expected` [k + 1] (by proposals verified) would reach with `more`
    further proposals: each accepted with the chance the last one had of being reached and accepted."""
    last = expected[-1] - expected[-2] if len(expected) > 1 else expected.new_zeros(())
    return torch.cat([expected, expected[-1] + last * torch.arange(1, more + 1)])


class BatchPolicy:
    """The cost-aware choices of a batch's step (engine/batched_dflash.py's proposer makes the proposals, this decides
    what they are worth): the expected tokens per second of each shared verify length under the price list
    (`batch_rate`), the rate speculating must beat (`bar`: plain steps, by a margin for several rows), and whether
    this step runs the draft pass (`draft_now`) or skips it for 1, 2, 4, .. steps between probes (`drafted`,
    `skipped`)."""

    def __init__(self, prices: Any) -> None:
        self.prices = prices  # costs.ObservedCosts (None: a fixed block, never asked)
        self.padded_lengths: list[int] | None = None  # set by the decoder (BatchProposer.padded_lengths)
        self.draft_rate: float | None = None  # the batch's expected tokens/s when drafting (EMA)
        self.skip_steps = 0
        self.skip_left = 0
        self.skip_rows = 0  # the rows of the batch that chose to skip

    def padded(self, tokens_per_row: torch.Tensor) -> torch.Tensor:
        """The verify lengths that really run for these proposed ones (their buckets)."""
        if self.padded_lengths is None:
            return tokens_per_row
        table = torch.tensor(self.padded_lengths)
        return table[(tokens_per_row - 1).clamp(max=len(table) - 1)]

    def batch_rate(
        self,
        expectations: list[torch.Tensor],
        propose_s: float,
        context: int,
        max_n: int,
        paid_against: float | None = None,
    ) -> tuple[int, float]:
        """(shared number of proposals n, expected batch tokens/s) over n = 0..max_n; `expectations[i][k]`: row i's
        expected tokens when k of its proposals are verified (`expected_tokens`, `DraftTree.expected_tokens`).

        The n of the most tokens per second, proposing included; with `paid_against` (tokens/s), the proposals are
        paid for already and the steps after this one decode at that rate: the n whose verify gives the most tokens
        beyond what that rate gives in the same time (0: the anchor alone, a plain step). Where drafting itself
        beats that rate the two choose alike (the best ratio E(n) / (t_propose + t_verify(n)) also maximises
        E(n) - ratio * t_verify(n)); where it does not, a verify of 16 rows x 4 tokens that the draft pass seemed to
        justify costs more than the tokens it adds."""
        b = len(expectations)
        expected = [0.0] * (max_n + 1)  # in Python floats: a few short lists, twice a step
        for e in expectations:
            values = e.tolist()
            last = len(values) - 1
            for k in range(max_n + 1):
                expected[k] += values[min(k, last)]
        tokens_per_row = self.padded(torch.arange(1, max_n + 2))
        seconds = self.prices.verify_s(b, tokens_per_row, context).tolist()
        rates = [e / (propose_s + s) for e, s in zip(expected, seconds, strict=True)]
        if paid_against is None:
            n = max(range(max_n + 1), key=rates.__getitem__)  # the first best, as torch.argmax
        else:
            gains = [e - paid_against * s for e, s in zip(expected, seconds, strict=True)]
            n = max(range(max_n + 1), key=gains.__getitem__)
        return n, rates[n]

    def plain_rate(self, b: int, context: int) -> float:
        """Tokens per second of plain steps for `b` rows at this context."""
        plain = self.padded(torch.ones(1, dtype=torch.long))
        return b / float(self.prices.verify_s(b, plain, context))

    @staticmethod
    def bar(b: int, plain_rate: float) -> float:
        """The rate speculating must beat: plain steps' (several rows: by BATCH_MARGIN)."""
        return plain_rate * (BATCH_MARGIN if b > 1 else 1.0)

    def draft_now(self, b: int, bar: float, free_rate: float, first_pass: bool) -> bool:
        """Whether this step runs the draft pass: when its expected rate beats this step's free proposals, and always
        once the skipped steps are over (the rate that made it skip is stale then: a probe measures it again, or
        lookup would keep it off forever), and on a `first_pass` (its graphs made before a later answer needs them)."""
        probe = self.draft_rate is None or self.draft_rate <= bar
        # half the rows or fewer since skipping was chosen: drafting may pay again, probe now
        if self.skip_left and 2 * b <= self.skip_rows:
            self.skip_left = 0
        return first_pass or self.skip_left == 0 and (probe or self.draft_rate >= free_rate)

    def skipped(self) -> None:
        """A step that ran no draft pass."""
        self.skip_left = max(0, self.skip_left - 1)

    def drafted(self, rate: float, bar: float, b: int, draft_s: float, plain_rate: float) -> None:
        """A step that drafted, expected to give `rate` tokens/s: the steps to skip before the next probe, if any."""
        self.draft_rate = rate if self.draft_rate is None else 0.5 * self.draft_rate + 0.5 * rate
        # Skipping compares with plain steps only: a lookup match is this step's luck, taken whenever it wins, not a
        # reason to stop drafting.
        if self.draft_rate > bar:
            self.skip_steps = self.skip_left = 0
        else:  # drafting does not pay for this batch right now: lookup or plain steps, then probe again
            plain_s = b / plain_rate
            lost_s = (1.0 - self.draft_rate / plain_rate) * (draft_s + plain_s)  # a probe's, about
            share, most = PROBE_SHARE, MAX_SKIP_STEPS
            # several rows: the loss is the draft pass at least (the verify after it wins back only what estimates
            # that failed promise)
            if b > 1:
                lost_s, share, most = max(draft_s, lost_s), BATCH_PROBE_SHARE, BATCH_MAX_SKIP_STEPS
            amortized = math.ceil(lost_s / (share * plain_s))
            self.skip_steps = min(most, max(1, 2 * self.skip_steps, amortized))
            self.skip_left = self.skip_steps
            self.skip_rows = b
