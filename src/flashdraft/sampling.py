"""Target-side sampling and block verification.

Sampling: the token at output position i is the inverse-CDF draw of the target's (temperature/top-k/top-p
processed) distribution at the uniform u_i = U(seed, i), one uniform per absolute position. Verification samples
the target's token at every position of the block with those same uniforms and accepts the longest prefix of drafts
equal to the target's samples, plus the target's sample after it.

Why this is lossless, and more: the emitted token at every position is the target's own sample there, drawn with a
uniform that depends only on (seed, position), given a prefix that is the output itself. So the output is exactly
what plain sampling with the same seed produces, token for token, whatever was proposed; a proposal only decides how
many positions one target forward settles. A draft x is accepted with probability p(x), as in speculative sampling
with a one-hot (greedy) proposal. Temperature, top-k and top-p are applied to the target only; they never touch the
draft.

Sampled drafts (`draft_sampling="pq"`, `verify_block_pq`): the drafter samples x_k from its own processed
distribution q_k, and the target accepts x_k when u_k q_k(x_k) < p_k(x_k), else draws from norm(max(0, p_k - q_k))
and stops; after n accepted drafts it draws from p_n (speculative sampling, Leviathan et al. / Chen et al.). The
output is an exact sample of the target's distribution, but not the one plain sampling with the same seed gives.
A deterministic proposal (prompt lookup, a greedy draft) is the one-hot q of its token.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch


class SamplingError(ValueError):
    """Invalid sampling parameters, or target logits nothing can be sampled from."""


# Below this temperature sampling is greedy decoding (as in vLLM): logits / T would overflow float32 into NaN.
GREEDY_BELOW = 1e-5


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
        return self.temperature < GREEDY_BELOW


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


def uniform_values(seed: int, start: int, count: int) -> list[float]:
    """The uniforms in [0, 1) of absolute positions start .. start+count-1 (one stream per position), as floats:
    what every backend draws with (the MLX one without torch)."""
    return [random.Random((seed << 24) ^ pos).random() for pos in range(start, start + count)]


def position_uniforms(seed: int, start: int, count: int) -> torch.Tensor:
    """[count] float64 uniforms in [0, 1) for absolute positions start .. start+count-1 (one stream per position)."""
    return torch.tensor(uniform_values(seed, start, count), dtype=torch.float64)


def non_finite_rows(values: torch.Tensor) -> torch.Tensor:
    """[...] bool over the last dim: rows no token can be drawn from. -inf is a legitimate logit (a masked token) as
    long as something is left; NaN and +inf never are. All three are one fact about the row's maximum (a NaN makes
    it NaN, a +inf +inf, and it is -inf only where every logit is): one vectorised reduction. Inside the compiled
    verify, element-wise isnan / isposinf / isneginf reductions were a scalar loop over the vocabulary: 1.3 ms of a
    25 ms one-token step (int8 SmolLM2, 2-core AMX Xeon)."""
    return ~torch.isfinite(values.amax(-1))


def check_finite(values: torch.Tensor, position: int | None) -> None:
    """Refuse to pick a token from NaN / +inf logits (an fp16 overflow in the target, a broken checkpoint): a draw
    from them would be garbage. Logits that pass give finite probabilities at any temperature the sampler divides by
    (>= GREEDY_BELOW), so this one check per step suffices. [n, V]; `position`: the output position of row 0."""
    bad = non_finite_rows(values)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        where = f"output position {position + row}" if position is not None else f"row {row} of the step"
        raise SamplingError(
            f"the target's logits at {where} are not finite (NaN or inf); no token can be drawn"
        )


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[n] tokens: for each row of `probs` [n, V], the first token whose cumulative probability exceeds u * total.
    A zero-probability token is never chosen (its cumulative sum equals its predecessor's)."""
    cdf = probs.double().cumsum(-1)
    x = uniforms.to(cdf.device)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def sample_token(
    logits: torch.Tensor, params: SamplingParams, uniform: torch.Tensor | None, position: int | None = None
) -> int:
    """One token from a [V] logit vector (`uniform`: a [1] tensor from `position_uniforms`; unused when greedy)."""
    check_finite(logits[None], position)
    if params.greedy:
        return int(logits.argmax(-1))
    probs = target_probs(logits[None], params)
    return int(inverse_cdf_sample(probs, uniform)[0])


def verify_block(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    params: SamplingParams,
    uniforms: torch.Tensor | None,
    position: int | None = None,
) -> tuple[int, list[int]]:
    """Accept the longest prefix of `draft_tokens` equal to the target's own tokens, and add the target's next one.

    logits:       [n + 1, V] target logits at the anchor and the n draft positions
    draft_tokens: [n] proposed tokens
    uniforms:     [n + 1] the uniforms of the n + 1 output positions these logits decide (sampling only)
    position:     the output position of logits[0], for error messages
    Returns (number of accepted drafts a, emitted tokens = draft_tokens[:a] + [target token]).
    """
    n = draft_tokens.shape[0]
    check_finite(logits, position)
    if params.greedy:
        target_tokens = logits.argmax(-1)
    else:
        probs = target_probs(logits, params)
        target_tokens = inverse_cdf_sample(probs, uniforms)
    matches = (target_tokens[:n] == draft_tokens.to(target_tokens.device)).int()
    a = int(matches.cumprod(0).sum())
    return a, target_tokens[: a + 1].tolist()


def verify_greedy_rows(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    reduced: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[tuple[int, list[int]]] | None:
    """`verify_block` at temperature 0 for all rows of a step at once, with ONE device-to-host transfer (the accept
    decision) instead of three per row: what keeps a GPU step from stalling once per row.

    logits [b, n + 1, V], draft_tokens [b, n]; per row (accepted drafts a, emitted tokens), or None when some row's
    logits are not finite (the caller then goes row by row, and `verify_block` names the position). `reduced`:
    (argmax, non_finite_rows) of the logits [b, n + 1] where the verify computed them already."""
    n = draft_tokens.shape[1]
    target_tokens, bad = reduced if reduced is not None else (logits.argmax(-1), non_finite_rows(logits))
    accepted = (target_tokens[:, :n] == draft_tokens.to(target_tokens.device)).int().cumprod(1).sum(1)
    host = torch.cat([bad.any(-1).long(), accepted.long(), target_tokens.flatten()]).tolist()
    b = logits.shape[0]
    if any(host[:b]):
        return None
    tokens = host[2 * b :]
    return [(a, tokens[i * (n + 1) : i * (n + 1) + a + 1]) for i, a in enumerate(host[b : 2 * b])]


# The uniforms of sampled drafts and of their acceptance tests: streams of their own, apart from the target's.
DRAFT_STREAM = 0x5EED_D4AF
ACCEPT_STREAM = 0xACCE_97ED


def verify_block_pq(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
    position: int | None = None,
) -> tuple[int, list[int]]:
    """Speculative-sampling verification of drafts drawn from `draft_probs` (None: deterministic drafts, one-hot).

    logits:          [n + 1, V] target logits at the anchor and the n draft positions
    draft_tokens:    [n] proposed tokens
    draft_probs:     [n, V] the distributions they were drawn from, or None
    accept_uniforms: [n] uniforms of the acceptance tests;  sample_uniforms: [n + 1] of the corrective/bonus draws
    Returns (number of accepted drafts a, emitted tokens = draft_tokens[:a] + [one target-side draw]).
    """
    n = draft_tokens.shape[0]
    check_finite(logits, position)
    p = target_probs(logits, params).double()  # [n + 1, V]
    drafts = draft_tokens.to(p.device)
    p_x = p[:n].gather(-1, drafts[:, None])[:, 0]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.to(p).gather(-1, drafts[:, None])[:, 0]
    ok = (accept_uniforms.to(p)[:n] * q_x < p_x).int()
    a = int(ok.cumprod(0).sum())
    if a == n:
        dist = p[n]
    else:  # rejected at slot a: the residual max(0, p - q), which is p with x removed for a one-hot q
        q = (
            torch.zeros_like(p[a]).scatter_(0, drafts[a : a + 1], 1.0)
            if draft_probs is None
            else draft_probs[a].to(p)
        )
        dist = (p[a] - q).clamp_(min=0.0)
        if not float(dist.sum()) > 0:  # q covers p exactly where it was sampled: p itself is the residual
            dist = p[a]
    last = inverse_cdf_sample(dist[None], sample_uniforms[a : a + 1])
    return a, [*drafts[:a].tolist(), int(last[0])]
