"""Target-side sampling and block verification.

Why verification is lossless at any temperature: the drafter proposes greedily, so its proposal distribution q is
one-hot on the draft token x. Speculative sampling then accepts x with probability min(1, p(x)/q(x)) = p(x) and,
on rejection, samples from the residual max(p - q, 0) = p with x removed, renormalised. The emitted token is
therefore distributed exactly as p, the target's (temperature/top-k/top-p processed) distribution. Temperature,
top-k and top-p are applied to the target only; they never touch the draft.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class SamplingError(ValueError):
    """Invalid sampling parameters."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        t, p, k = self.temperature, self.top_p, self.top_k
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise SamplingError(f"temperature must be a finite number >= 0, got {t!r}")
        if not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1], got {p!r}")
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0 disables it), got {k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, then top-k, then top-p (the order transformers uses). [.., V] float32."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        remove_sorted = mass_before >= params.top_p
        remove_sorted[..., 0] = False
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits.softmax(-1)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from a [V] logit vector."""
    if params.greedy:
        return int(logits.argmax(-1))
    probs = target_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_block(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, list[int]]:
    """Accept the longest valid prefix of `draft_tokens` and add one token of the target's own.

    logits:       [n + 1, V] target logits at the anchor and the n draft positions
    draft_tokens: [n] proposed tokens (greedy draft: a one-hot proposal)
    Returns (number of accepted drafts a, emitted tokens = draft_tokens[:a] + [bonus]).
    """
    n = draft_tokens.shape[0]
    if params.greedy:
        target_tokens = logits.argmax(-1)
        matches = (target_tokens[:n] == draft_tokens).int()
        a = int(matches.cumprod(0).sum())
        return a, target_tokens[: a + 1].tolist()

    probs = target_probs(logits, params)
    if n:
        p_draft = probs[torch.arange(n, device=probs.device), draft_tokens]
        u = torch.rand(n, generator=generator, device=probs.device)
        a = int((u < p_draft).int().cumprod(0).sum())
    else:
        a = 0
    if a < n:
        residual = probs[a].clone()
        residual[draft_tokens[a]] = 0.0
        total = residual.sum()
        # total == 0 would mean p(x) == 1, in which case x is always accepted; keep the guard for rounding.
        bonus = (
            int(torch.multinomial(residual / total, 1, generator=generator))
            if total > 0
            else int(draft_tokens[a])
        )
    else:
        bonus = int(torch.multinomial(probs[n], 1, generator=generator))
    return a, [*draft_tokens[:a].tolist(), bonus]
