"""The drafter's loss: weighted cross-entropy (and an optional KL to the target) through the frozen LM head.

    loss = sum_k w_k [CE(lm_head(h_k), y_k) + kl * KL(p_target || q_draft)] / sum w     w_k = exp(-(k-1)/gamma)

computed chunk by chunk of rows, so the full [rows, V] logits are never materialised with their gradient
(`_FrozenHeadCrossEntropy`); `target_distribution` gives the target's own next-token distribution for the KL term.

DFlash2 drafters add `selector_loss`, the candidate selector's cross-entropy over each slot's top-k candidates:

    + selector_weight * sum_k w_k CE(score(. | y_{k-1}, h_k), y_k) / sum w      (slots whose y_k is a candidate)

with the true previous token as predecessor (the anchor for slot 1), as the public DFlash2 trainers (SpecForge,
NeMo) train it; a slot whose label is not among its candidates has nothing to select and adds nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..drafter.config import DFlashConfig
from ..targets.target import Target


class _FrozenHeadCrossEntropy(torch.autograd.Function):
    """sum_i w_i * [CE(q_i, y_i) + kl * KL(p_i || q_i)] for a frozen LM head, row chunk by row chunk, where
    q_i = softmax(softcap(m * (h_i W^T + b))) is the draft's distribution (m: the drafter's output multiplier) and
    p_i (optional) the target's own.

    The head is frozen, so the only gradient is d/dh = w * ((1 + kl) q - onehot - kl p) * softcap' * m @ W. Computing it
    in the forward, while each [chunk, V] logit block is still in cache-sized memory, replaces log_softmax, its
    backward and the zero-filled logit gradient (the elementwise passes over V that dominated a CPU step) with
    in-place ops, and never keeps more than one logit chunk alive (the memory bound the chunked LM head exists for).
    The target's distribution comes per sequence position (`soft_probs` [S, V], `soft_entropy` [S]) and is read
    per row at `soft_index` (the position before the row's label), so it costs one head pass over the sequence.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden,
        weight,
        bias,
        labels,
        weights,
        chunk_size,
        softcap,
        multiplier,
        soft_probs,
        soft_entropy,
        soft_index,
        kl,
    ):
        n = hidden.shape[0]
        need_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.empty(
            hidden.shape if need_grad else (0,), dtype=torch.float32, device=hidden.device
        )
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.empty(n, dtype=torch.bool, device=hidden.device)
        use_kl = soft_probs is not None and kl > 0
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            y, w = labels[s:e], weights[s:e].float()
            logits = F.linear(hidden[s:e].to(weight.dtype), weight, bias).float()
            if multiplier != 1.0:
                logits.mul_(multiplier)
            if softcap:
                capped = torch.tanh(logits.div_(softcap))
                dcap = 1.0 - capped * capped  # d softcap(z) / dz
                logits = capped.mul_(softcap)
            row_max, argmax = logits.max(dim=-1)
            correct[s:e] = argmax == y
            label_logit = logits.gather(1, y[:, None])[:, 0]
            if use_kl:
                p = soft_probs[soft_index[s:e]].float()  # [chunk, V] the target's distribution for these rows
                p_dot_z = (p * logits).sum(-1)
            probs = logits.sub_(row_max[:, None]).exp_()  # in place: logits are not needed any more
            denom = probs.sum(-1)
            log_z = denom.log() + row_max
            row_loss = log_z - label_logit
            if use_kl:  # KL(p || q) = sum p log p - sum p log q = -H(p) + log Z - sum p z
                row_loss = row_loss + kl * (log_z - p_dot_z - soft_entropy[soft_index[s:e]])
            total += (row_loss * w).sum()
            if not need_grad:
                continue
            grad = probs.div_(denom[:, None])
            if use_kl:
                grad.mul_(1.0 + kl).sub_(p, alpha=kl)
            grad[torch.arange(e - s, device=grad.device), y] -= 1.0
            grad.mul_(w[:, None])
            if softcap:
                grad.mul_(dcap)
            if multiplier != 1.0:
                grad.mul_(multiplier)
            grad_hidden[s:e] = (grad.to(weight.dtype) @ weight).float()
        ctx.save_for_backward(grad_hidden)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_total, _grad_correct):  # type: ignore[override]
        (grad_hidden,) = ctx.saved_tensors
        return (grad_hidden * grad_total).to(ctx.hidden_dtype), *([None] * 11)


@torch.no_grad()
def target_distribution(target: Target, last_hidden: torch.Tensor, chunk_size: int = 1024):
    """(probabilities [S, V], entropies [S]) of the target's next-token distribution at every position, from its
    final (normed) hidden states: what the KL term distils."""
    probs = torch.empty(
        last_hidden.shape[0], target.vocab_size, dtype=torch.float32, device=last_hidden.device
    )
    entropy = torch.empty(last_hidden.shape[0], dtype=torch.float32, device=last_hidden.device)
    for s in range(0, last_hidden.shape[0], chunk_size):
        logp = target.lm_head_logits(last_hidden[s : s + chunk_size]).log_softmax(-1)
        p = logp.exp()
        probs[s : s + chunk_size] = p
        entropy[s : s + chunk_size] = -(p * logp).sum(-1)
    return probs, entropy


def weighted_block_loss(
    target: Target,
    draft_config: DFlashConfig,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    chunk_size: int = 1024,
    soft: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    kl_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_i w_i * CE(draft logits(hidden_i), label_i) over rows with w_i > 0, and per-row correctness (argmax ==
    label). Draft logits are the target's LM head with the drafter's output multiplier and soft-capping
    (`model.draft_logits`).

    `soft` = (target probabilities [S, V], their entropies [S], row -> position index [rows]) adds
    `kl_weight` * KL(target || draft) per row (distillation from the target's own distribution).
    The LM head is applied in chunks of `chunk_size` rows so that [rows, V] logits never exist all at once.
    """
    keep = weights > 0
    hidden, labels, weights = hidden[keep], labels[keep].to(hidden.device), weights[keep].to(hidden.device)
    head = target.lm_head
    soft_probs = soft_entropy = soft_index = None
    if soft is not None and kl_weight > 0:
        soft_probs, soft_entropy, soft_index = soft[0], soft[1], soft[2][keep].to(hidden.device)
    if isinstance(head, torch.nn.Linear):
        return _FrozenHeadCrossEntropy.apply(
            hidden, head.weight, head.bias, labels, weights, chunk_size, draft_config.final_logit_softcapping,
            draft_config.output_multiplier, soft_probs, soft_entropy, soft_index, float(kl_weight),
        )  # fmt: skip
    if soft_probs is not None:
        raise ValueError("the KL term needs a plain linear LM head")
    # An unusual head module: let autograd differentiate it, checkpointing chunks on GPUs to bound memory.

    def chunk_loss(h: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = target.lm_head(h.to(head.weight.dtype)).float() * draft_config.output_multiplier
        cap = draft_config.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap if cap else logits
        return (F.cross_entropy(logits, y, reduction="none") * w).sum(), (logits.argmax(-1) == y)

    total = hidden.new_zeros((), dtype=torch.float32)
    correct = []
    for s in range(0, hidden.shape[0], chunk_size):
        e = s + chunk_size
        if torch.is_grad_enabled() and hidden.is_cuda:
            loss, ok = checkpoint(chunk_loss, hidden[s:e], labels[s:e], weights[s:e], use_reentrant=False)
        else:
            loss, ok = chunk_loss(hidden[s:e], labels[s:e], weights[s:e])
        total = total + loss
        correct.append(ok)
    return total, torch.cat(correct) if correct else torch.zeros(0, dtype=torch.bool)


def selector_loss(
    selector: torch.nn.Module,
    target: Target,
    draft_config: DFlashConfig,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    block_size: int,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_k w_k CE of the DFlash2 candidate selector over slots whose label is among the slot's top-k draft
    candidates, how many such slots) for draft hidden states [N*B, H] of N blocks of `block_size` slots, flattened
    as `weights`, with same-position `labels` (slot 0's label is the anchor). Gradients reach the selector and,
    through the candidates' logits and the projected states, the drafter."""
    head = target.lm_head
    weight, bias = head.weight, getattr(head, "bias", None)
    labels = labels.to(hidden.device)
    weights = weights.to(hidden.device)
    # Predecessor of slot k: the label of slot k - 1 (slot 0 has weight 0, so wrapping there is never used).
    predecessors = labels.view(-1, block_size).roll(1, dims=1).flatten()
    keep = weights > 0
    h, y, w, prev = hidden[keep], labels[keep], weights[keep], predecessors[keep]
    top_k = selector.top_k
    candidates = torch.empty(h.shape[0], top_k, dtype=torch.long, device=h.device)
    with torch.no_grad():  # the multiplier (> 0) and soft-capping keep the order: rank the raw logits
        for s in range(0, h.shape[0], chunk_size):
            raw = F.linear(h[s : s + chunk_size].to(weight.dtype), weight, bias)
            candidates[s : s + chunk_size] = raw.topk(top_k, dim=-1).indices
    unary = (weight[candidates] @ h.to(weight.dtype)[:, :, None])[..., 0].float()  # [rows, k]
    if bias is not None:
        unary = unary + bias[candidates].float()
    unary = unary * draft_config.output_multiplier
    cap = draft_config.final_logit_softcapping
    unary = torch.tanh(unary / cap) * cap if cap else unary
    projected = selector.hidden_projection(h.to(selector.hidden_projection.weight.dtype))
    scores = selector.scores(projected, unary, candidates, prev)  # [rows, k]
    hit = candidates == y[:, None]
    present = hit.any(-1)
    ce = F.cross_entropy(scores, hit.float().argmax(-1), reduction="none")
    # Every selector weight takes part in the graph, also when no slot's label is a candidate (DDP expects it).
    total = (ce * w * present).sum() + 0.0 * sum(p.sum() for p in selector.parameters())
    return total, present.sum()
