"""Outputs that differ from plain decoding: where they differ, and whether the difference is a near-tie.

Below float32 a batched verify and a one-token step round differently, so greedy outputs can part from plain
decoding where two tokens are all but tied. A real bug must not hide among those: at the first differing token the
target is run again both ways on the shared prefix,

* as plain decoding (`ar`) ran it: the prompt prefilled, then the reference tokens one step at a time; the logits
  of the step that chose the reference token give the **plain margin** (reference token minus the method's: ≥ 0,
  since plain decoding chose the reference, and 0 on an exact tie, where the lower token id wins);
* as a verify runs it: the prefix but its last `block` tokens in one forward, then those tokens in one forward;

and the largest logit difference between the two at that position is the **path difference**: how far two ways of
computing the same position disagree in this dtype on this device. A flip is a **near-tie** when the plain margin is
within the path difference (or the dtype's rounding of the largest logit); otherwise it is **unexplained**, which is
what a bug looks like.

An image prompt (`multimodal.ImagePrompt`) is replayed with its image: the prompt's prefill takes the processor's
outputs (in the batched replay, covering the shared tokens after the prompt as well).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

NEAR_TIE = "near-tie"
UNEXPLAINED = "unexplained"


def _prompt(target: Any, prompt: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """A prompt's token ids [1, n] and its image inputs ({} for text)."""
    from ..targets.multimodal import as_prompt

    ids, inputs = as_prompt(prompt)
    return ids[:1].cpu(), dict(inputs or {})


@torch.inference_mode()
def plain_logits_at(
    target: Any, prompt: Any, reference_ids: list[int], positions: Sequence[int]
) -> dict[int, torch.Tensor]:
    """The logits plain decoding chose `reference_ids[i]` from, for each i in `positions`: one replay of `ar`
    (the prompt prefilled, with its images if it has any, then one token a step) as far as the last of them."""
    from ..targets.multimodal import check_prompt_inputs

    wanted, last, out = set(positions), max(positions), {}
    device = target.device
    cache = target.new_cache()
    ids, inputs = _prompt(target, prompt)
    first = target.forward(
        ids.to(device), cache, last_logits_only=True, inputs=check_prompt_inputs(target, inputs), prefill=True
    )
    logits = first.logits[0, -1]
    for i in range(last + 1):
        if i in wanted:
            out[i] = logits
        if i < last:
            token = torch.tensor([[reference_ids[i]]], device=device)
            logits = target.forward(token, cache, last_logits_only=True).logits[0, -1]
    return out


@torch.inference_mode()
def batched_logits(
    target: Any,
    prefix: torch.Tensor,
    block: int,
    inputs: dict[str, Any] | None = None,
    prompt_length: int = 1,
) -> torch.Tensor:
    """The logits after `prefix` as a verify computes them: all but its last `block` tokens in one forward (with
    the prompt's image `inputs`, which cover its first `prompt_length` tokens), then those in one more."""
    from ..targets.multimodal import covering

    n = prefix.shape[1]
    k = min(block, n - max(1, prompt_length))
    cache = target.new_cache()
    images = covering(target, inputs, prompt_length, n - k) if inputs else None
    out = target.forward(prefix[:, : n - k], cache, inputs=images)
    if k < 1:  # the first answer token: the prefill's own logits, as every method has them
        return out.logits[0, -1]
    return target.forward(prefix[:, n - k :], cache).logits[0, -1]


def classify_flip(
    step: torch.Tensor, batched: torch.Tensor, reference_token: int, method_token: int, dtype: torch.dtype
) -> dict[str, Any]:
    """The near-tie test at one position, from the plain step's logits and the batched forward's."""
    margin = float(step[reference_token] - step[method_token])
    path_difference = float((step - batched).abs().max())
    rounding = float(torch.finfo(dtype).eps * step.abs().max())
    return {
        "plain_margin": margin,
        "batched_margin": float(batched[reference_token] - batched[method_token]),
        "path_difference": path_difference,
        "rounding": rounding,
        "plain_argmax": int(step.argmax()),
        "verdict": NEAR_TIE if margin <= max(path_difference, rounding) else UNEXPLAINED,
    }


def weigh_flips(
    target: Any,
    prompt: Any,
    reference_ids: list[int],
    differing: Sequence[tuple[Any, list[int]]],
    block: int,
) -> list[dict[str, Any] | None]:
    """The near-tie test for every method output of one prompt (token ids or an `ImagePrompt`) that parts from the
    reference (`differing`: its
    record, with `first_mismatch`, and its tokens); None where an output only ends at another length (no token of
    the method's to weigh against the reference's). One replay of plain decoding serves them all."""
    tested = [
        (k, record.first_mismatch, ids)
        for k, (record, ids) in enumerate(differing)
        if record.first_mismatch < min(len(reference_ids), len(ids))
    ]
    flips: list[dict[str, Any] | None] = [None] * len(differing)
    if not tested:
        return flips
    steps = plain_logits_at(target, prompt, reference_ids, [i for _, i, _ in tested])
    prompt_ids, inputs = _prompt(target, prompt)
    batched: dict[int, torch.Tensor] = {}
    for k, i, ids in tested:
        if i not in batched:
            shared = torch.tensor([reference_ids[:i]], dtype=torch.long).view(1, -1)
            prefix = torch.cat([prompt_ids, shared], dim=1).to(target.device)
            length = prompt_ids.shape[1] if inputs else 1
            batched[i] = batched_logits(target, prefix, block, inputs, length)
        flips[k] = classify_flip(steps[i], batched[i], reference_ids[i], ids[i], target.dtype)
    return flips


def mismatch_entry(
    record: Any,
    reference_ids: list[int],
    method_ids: list[int],
    tokenizer: Any,
    flip: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One differing output for results.json and the report: the tokens around the first difference, and the
    near-tie test there (greedy runs)."""
    i = record.first_mismatch or 0
    lo = max(0, i - 8)

    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else str(ids)

    entry = {
        "dataset": record.dataset,
        "conversation_id": record.conversation_id,
        "turn": record.turn,
        "method": record.method,
        "first_mismatch": i,
        "reference_tokens": len(reference_ids),
        "method_tokens": len(method_ids),
        "reference_ids": reference_ids[lo : i + 8],
        "method_ids": method_ids[lo : i + 8],
        "reference_text": text(reference_ids[lo : i + 8]),
        "method_text": text(method_ids[lo : i + 8]),
    }
    if flip is not None:
        entry.update(flip)
    return entry


def verdict_counts(details: list[dict[str, Any]]) -> dict[str, int]:
    counts = {NEAR_TIE: 0, UNEXPLAINED: 0}
    for entry in details:
        if entry.get("verdict") in counts:
            counts[entry["verdict"]] += 1
    return counts
