"""Outputs that differ from plain decoding: where they differ, and whether the difference is a near-tie.

Below float32 a batched verify and a one-token step round differently, so greedy outputs can part from plain
decoding where two tokens are all but tied. A real bug must not hide among those: at the first differing token the
target is run again both ways on the shared prefix,

* as plain decoding runs it: the prefix cached, then a one-token step, whose logits give the **plain margin**
  (reference token minus the method's token; plain decoding chose the reference, so it is ≥ 0 up to rounding);
* as a verify runs it: the prefix minus its last `block` tokens cached, then those tokens in one forward;

and the largest logit difference between the two is the **path difference**: how far the two ways of computing
the same position disagree in this dtype on this device. A flip is a **near-tie** when the plain margin is within
the path difference (or within the dtype's rounding of the largest logit); otherwise it is **unexplained**, which
is what a bug looks like.
"""

from __future__ import annotations

from typing import Any

import torch

NEAR_TIE = "near-tie"
UNEXPLAINED = "unexplained"


@torch.inference_mode()
def classify_flip(
    target: Any,
    prompt_ids: torch.Tensor,
    shared: list[int],
    reference_token: int,
    method_token: int,
    block: int,
) -> dict[str, Any]:
    """The near-tie test at one differing position: `shared` is the output both runs emitted before it."""
    shared_ids = torch.tensor(shared, dtype=torch.long, device=target.device).view(1, -1)
    prefix = torch.cat([prompt_ids[:1].to(target.device), shared_ids], dim=1)
    n = prefix.shape[1]
    cache = target.new_cache()
    target.forward(prefix[:, :-1], cache)
    step = target.forward(prefix[:, -1:], cache).logits[0, -1]
    k = max(1, min(block, n - 1))
    cache = target.new_cache()
    target.forward(prefix[:, : n - k], cache)
    batched = target.forward(prefix[:, n - k :], cache).logits[0, -1]
    margin = float(step[reference_token] - step[method_token])
    path_difference = float((step - batched).abs().max())
    rounding = float(torch.finfo(target.dtype).eps * step.abs().max())
    return {
        "plain_margin": margin,
        "batched_margin": float(batched[reference_token] - batched[method_token]),
        "path_difference": path_difference,
        "rounding": rounding,
        "plain_argmax": int(step.argmax()),
        "verdict": NEAR_TIE if margin <= max(path_difference, rounding) else UNEXPLAINED,
    }


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


def flip_of(
    target: Any,
    prompt_ids: torch.Tensor,
    reference_ids: list[int],
    method_ids: list[int],
    first: int,
    block: int,
) -> dict[str, Any] | None:
    """The near-tie test where two greedy outputs part; None where one output simply ends first (no token of the
    method's to weigh against the reference's)."""
    if first >= len(reference_ids) or first >= len(method_ids) or prompt_ids.shape[1] + first < 2:
        return None
    return classify_flip(
        target, prompt_ids, reference_ids[:first], reference_ids[first], method_ids[first], block
    )


def verdict_counts(details: list[dict[str, Any]]) -> dict[str, int]:
    counts = {NEAR_TIE: 0, UNEXPLAINED: 0}
    for entry in details:
        if entry.get("verdict") in counts:
            counts[entry["verdict"]] += 1
    return counts
