"""The sampling law of flashdraft/sampling.py on host arrays, for the MLX backend (no torch).

The token at absolute position p is the inverse-CDF draw, at the uniform U(seed, p), of the target's distribution
after temperature, top-k, then top-p. Verification draws the target's token at every position of a block with those
same uniforms and keeps the longest prefix of drafts equal to them, plus the target's token after it: so DFlash's
output at temperature > 0 is token for token the output of plain sampling with the same seed, as on torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..sampling import SamplingError, SamplingParams, uniform_values


def target_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """[n, V] float64 probabilities after temperature, top-k and top-p (transformers' order), from [n, V] logits."""
    z = logits.astype(np.float32) / np.float32(params.temperature)
    v = z.shape[-1]
    if params.top_k and params.top_k < v:
        kth = -np.partition(-z, params.top_k - 1, axis=-1)[:, params.top_k - 1 : params.top_k]
        z = np.where(z < kth, -np.inf, z)
    if params.top_p < 1.0:
        order = np.argsort(-z, axis=-1, kind="stable")
        sorted_z = np.take_along_axis(z, order, axis=-1)
        p = _softmax(sorted_z)
        mass_before = np.cumsum(p, axis=-1, dtype=np.float32) - p
        remove_sorted = mass_before >= np.float32(params.top_p)
        remove_sorted[:, 0] = False
        remove = np.zeros_like(remove_sorted)
        np.put_along_axis(remove, order, remove_sorted, axis=-1)
        z = np.where(remove, -np.inf, z)
    return _softmax(z).astype(np.float64)


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def check_finite(maxima: np.ndarray, position: int) -> None:
    """Refuse to draw from NaN / +inf logits, one line naming the output position. `maxima`: each row's largest logit
    (NaN and +inf make it so; it is -inf only where every logit is)."""
    bad = ~np.isfinite(maxima)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise SamplingError(
            f"the target's logits at output position {position + row} are not finite (NaN or inf); no token can be "
            "drawn"
        )


def target_tokens(logits: Any, params: SamplingParams, seed: int, position: int) -> list[int]:
    """The target's token at each of n consecutive output positions from position on: [n, V] float32 logits, an MLX
    array or a host one. Greedy reads back only each row's maximum and argmax; sampling reads the rows."""
    check_finite(np.asarray(logits.max(axis=-1)), position)
    if params.greedy:
        return np.asarray(logits.argmax(axis=-1)).tolist()
    probs = target_probs(np.asarray(logits), params)
    cdf = np.cumsum(probs, axis=-1)
    u = np.asarray(uniform_values(seed, position, logits.shape[0]))[:, None] * cdf[:, -1:]
    picks = [int(np.searchsorted(row, x, side="right")) for row, x in zip(cdf, u[:, 0], strict=True)]
    return [min(t, logits.shape[-1] - 1) for t in picks]
