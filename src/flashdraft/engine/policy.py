"""How many proposed tokens to verify: expected tokens per second from acceptance estimates and a cost model.

Verifying n proposals yields E(n) = 1 + sum_{k<=n} prod_{j<=k} p_j tokens (the target's own token always comes),
where p_j = P(proposal j accepted | proposals before it accepted). A step costs t_propose + t_verify(n + 1).
`best_verify_length` picks the n in 0..N with the most tokens per second. The p_j come from `AcceptanceTable`s
learned online from the steps already verified (calibration.py: the drafter's keyed by confidence and depth).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
