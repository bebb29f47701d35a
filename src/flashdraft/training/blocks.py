"""The training blocks of one sequence (paper §3): anchors, the blocks anchored at them, their labels and loss
weights, and the drafter's training forward over all of a sequence's blocks at once (`train.py` runs the steps)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..drafter.config import DFlashConfig
from ..drafter.model import DFlashDraftModel, block_inputs
from ..targets.target import Target
from .sharding import full_tensor


class TrainError(ValueError):
    """A training run asked for something it cannot do (shown as one line by the CLI)."""


def default_gamma(block_size: int) -> float:
    """Loss-decay gamma from the paper: 7 for B=16, 5 for B=10, 4 for B=8 (linear in between, B/2 - 1 beyond)."""
    table = {16: 7.0, 10: 5.0, 8: 4.0}
    if block_size in table:
        return table[block_size]
    return max(1.0, block_size / 2 - 1 if block_size > 10 else block_size / 2)


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B] loss weights per block slot: 0 for the anchor slot, exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `num_anchors` sorted positions t with loss_mask[t] and loss_mask[t+1] (uniform, no replacement)."""
    valid = loss_mask[:-1] & loss_mask[1:]
    candidates = valid.nonzero().flatten()
    if candidates.numel() > num_anchors:
        pick = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
        candidates = candidates[pick]
    return candidates.sort().values


@dataclass
class Blocks:
    """N blocks of one sequence, flattened to N*B query slots."""

    input_ids: torch.Tensor  # [N*B] anchor token, then mask ids
    positions: torch.Tensor  # [N*B] anchor + slot
    labels: torch.Tensor  # [N*B] token at anchor + slot (0 where out of range)
    weights: torch.Tensor  # [N*B] loss weight (0 for slot 0, unsupervised or out-of-range labels)


def make_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    weights: torch.Tensor,
) -> Blocks:
    """Same-position labels: slot k of the block anchored at t predicts token[t + k]."""
    seq_len = input_ids.shape[0]
    slots = torch.arange(block_size)
    positions = anchors[:, None] + slots[None, :]  # [N, B]
    in_range = positions < seq_len
    safe = positions.clamp(max=seq_len - 1)
    labels = torch.where(in_range, input_ids[safe], torch.zeros_like(safe))
    supervised = in_range & loss_mask[safe]
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[:, 0] = input_ids[anchors]
    slot_w = weights[None, :].expand_as(positions)
    return Blocks(
        input_ids=block_ids.flatten(),
        positions=positions.flatten(),
        labels=labels.flatten(),
        weights=(slot_w * supervised).flatten(),
    )


def _unwrapped(draft: torch.nn.Module) -> DFlashDraftModel:
    """The drafter itself, through a DDP wrapper."""
    return getattr(draft, "module", draft)


def _config(draft: torch.nn.Module) -> DFlashConfig:
    return _unwrapped(draft).config


def _block_inputs(draft: torch.nn.Module, target: Target, ids: torch.Tensor) -> torch.Tensor:
    inner = _unwrapped(draft)
    return block_inputs(inner.config, target.embed_tokens.weight, ids, inner.mask_embedding)


def draft_hidden_for_blocks(
    draft: torch.nn.Module, target: Target, features: torch.Tensor, blocks: Blocks, num_blocks: int
) -> torch.Tensor:
    """The training forward for one sequence: all its blocks at once, context = every position's features.
    The drafter's attention rule keeps block j to context < anchor_j and to itself. Returns [N*B, H]."""
    seq_len = features.shape[0]
    device = features.device
    block_embeds = _block_inputs(draft, target, blocks.input_ids.to(device))[None]
    context_positions = torch.arange(seq_len, device=device)[None]
    hidden = draft(
        block_embeds,
        blocks.positions.to(device)[None],
        target_features=features[None],
        context_positions=context_positions,
        num_blocks=num_blocks,
    )
    return hidden[0]


def pad_blocks(blocks: Sequence[Blocks], block_size: int, mask_token_id: int) -> Blocks:
    """Stack the blocks of several sequences into [k, N_max * B] tensors. A padding block is anchored at position 0
    with weight 0: it sees no context (the rule is context < anchor) and only itself, so it cannot produce a NaN and
    adds nothing to the loss."""
    width = max(b.input_ids.numel() for b in blocks)
    k = len(blocks)
    out = Blocks(
        input_ids=torch.full((k, width), mask_token_id, dtype=torch.long),
        positions=torch.arange(width).remainder(block_size).repeat(k, 1),
        labels=torch.zeros((k, width), dtype=torch.long),
        weights=torch.zeros((k, width)),
    )
    for i, b in enumerate(blocks):
        q = b.input_ids.numel()
        out.input_ids[i, :q] = b.input_ids
        out.positions[i, :q] = b.positions
        out.labels[i, :q] = b.labels
        out.weights[i, :q] = b.weights
    return out


def draft_hidden_for_padded_blocks(
    draft: torch.nn.Module,
    target: Target,
    features: torch.Tensor,
    blocks: Blocks,
    block_size: int,
) -> torch.Tensor:
    """`draft_hidden_for_blocks` for k right-padded sequences in one forward: features [k, S_max, T*H], blocks from
    `pad_blocks` ([k, N_max * B]). A row's padding sits at positions past its last token, hence past every anchor
    of that row, so the context rule (context < anchor) already hides it. Returns [k, N_max * B, H]."""
    k, s_max = features.shape[:2]
    device = features.device
    context_positions = torch.arange(s_max, device=device).repeat(k, 1)
    return draft(
        _block_inputs(draft, target, blocks.input_ids.to(device)),
        blocks.positions.to(device),
        target_features=features,
        context_positions=context_positions,
        num_blocks=blocks.input_ids.shape[1] // block_size,
    )


@torch.no_grad()
def init_layers_from_target(draft: DFlashDraftModel, target: Target) -> int:
    """Start the drafter's layers as copies of the target's top layers (same-named tensors of equal shape:
    attention and MLP projections, layer norms; q_norm/k_norm stay at one where the target has none). Returns the
    number of tensors copied."""
    copied = 0
    n = len(draft.layers)
    for i, layer in enumerate(draft.layers):
        source = dict(target.layers[target.num_layers - n + i].named_parameters())
        for name, param in layer.named_parameters():
            src = source.get(name)
            if src is not None and src.shape == param.shape:
                param.copy_(
                    full_tensor(src).to(param.device, param.dtype)
                )  # every rank, for a sharded target
                copied += 1
    if copied == 0:
        raise TrainError("no drafter layer tensor matches the target's layers in name and shape")
    return copied


def has_anchor(loss_mask: torch.Tensor) -> bool:
    mask = loss_mask.bool()
    return bool((mask[:-1] & mask[1:]).any())
