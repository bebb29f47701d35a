"""Proposers: who suggests the next tokens for the target to verify (one class per method, one interface).

The decode loop (generate.py) talks to a proposer through three calls:

    start(features)                     after prefill, with the target features of the prompt
    propose(anchor, position, n) -> ids n draft tokens following `anchor` (which sits at `position`)
    accept(features)                    features of the tokens the target just fixed (anchor + accepted drafts)

`tap_layer_ids` says which target layers the proposer needs; an empty tuple means none are captured.
"""

from __future__ import annotations

import torch

from .model import DFlashDraftModel, DraftContextCache
from .target import Target, TargetError


class Proposer:
    tap_layer_ids: tuple[int, ...] = ()
    max_block_size: int = 1  # anchor + proposals

    def start(self, features: torch.Tensor | None) -> None:  # noqa: B027 - optional hook
        pass

    def propose(self, anchor_token: int, anchor_position: int, num_tokens: int) -> torch.Tensor:
        raise NotImplementedError

    def accept(self, features: torch.Tensor | None) -> None:  # noqa: B027 - optional hook
        pass


class NoProposer(Proposer):
    """Plain autoregressive decoding through the same loop: nothing proposed, one target token per step."""

    def propose(self, anchor_token: int, anchor_position: int, num_tokens: int) -> torch.Tensor:
        return torch.empty(0, dtype=torch.long)


class DFlashProposer(Proposer):
    """A DFlash drafter: one non-causal forward over [anchor, MASK x n] proposes n tokens at once."""

    def __init__(self, draft: DFlashDraftModel, target: Target) -> None:
        target.check_drafter(draft.config)
        self.draft = draft
        self.target = target
        self.tap_layer_ids = tuple(draft.config.target_layer_ids)
        self.max_block_size = draft.config.block_size
        self.mask_token_id = draft.config.mask_token_id
        self.cache = DraftContextCache()
        self._pending: torch.Tensor | None = None  # target features not yet projected into the draft cache

    def start(self, features: torch.Tensor | None) -> None:
        if features is None:
            raise TargetError("the DFlash proposer needs target features from prefill")
        self.cache = DraftContextCache()
        self._pending = features

    def accept(self, features: torch.Tensor | None) -> None:
        if features is None:
            raise TargetError("the DFlash proposer needs target features of the accepted tokens")
        # Concatenate: when no drafting happened since the last call (end of generation), keep what was pending.
        self._pending = features if self._pending is None else torch.cat([self._pending, features], dim=1)

    @torch.no_grad()
    def propose(self, anchor_token: int, anchor_position: int, num_tokens: int) -> torch.Tensor:
        return self.draft_logits(anchor_token, anchor_position, num_tokens).argmax(-1)  # the draft is greedy

    @torch.no_grad()
    def draft_logits(self, anchor_token: int, anchor_position: int, num_tokens: int) -> torch.Tensor:
        """[num_tokens, V] draft logits for the slots after the anchor; absorbs the pending context."""
        device = self.target.device
        context_start = len(self.cache)
        pending = self._pending
        n_ctx = 0 if pending is None else pending.shape[1]
        if context_start + n_ctx != anchor_position:
            # The draft context must hold exactly the tokens before the anchor, or acceptance silently collapses.
            raise RuntimeError(
                f"draft context covers {context_start + n_ctx} tokens, anchor is at {anchor_position}"
            )
        block_ids = torch.full((1, num_tokens + 1), self.mask_token_id, dtype=torch.long, device=device)
        block_ids[0, 0] = anchor_token
        block_positions = torch.arange(anchor_position, anchor_position + num_tokens + 1, device=device)[None]
        context_positions = torch.arange(context_start, anchor_position, device=device)[None]
        hidden = self.draft(
            self.target.embed(block_ids),
            block_positions,
            target_features=pending,
            context_positions=context_positions,
            cache=self.cache,
        )
        self._pending = None
        # Slot k predicts the token at anchor + k (same-position prediction); slot 0's output is unused.
        return self.target.lm_head_logits(hidden[0, 1:])
