"""Proposers: who suggests the next tokens for the target to verify (one class per method).

The engine (engine.py) talks to one interface, `BatchProposer`, for every batch, a request being a batch of one:

    add(row, features)                  a row joined (with the target features of its prompt)
    remove(keep)                        only these rows stay
    propose(rows, max_drafts) -> ids    each row's proposals (ragged; at most max_drafts[i], or a draft tree:
                                        `tree_parents(i)` says its shape, at most max_drafts[i] deep)
    timed(rows, n, context, seconds)    what the verify forward cost (online cost corrections)
    observe(rows, proposed, accepted, paths)  how many of each row's proposals the target accepted (trees: which)
    accept(rows, features)              features of the tokens each row just fixed (anchor + accepted drafts)

Two implement it: `BatchedDFlashProposer` (batched_dflash.py) drafts every row in ONE drafter forward and picks one
verify length for the batch (one row or many: the cost-aware policy); `PerRowProposers` runs one single-sequence `Proposer` per row
(plain decoding, prompt lookup, test doubles), whose interface is the same calls for one row:

    bind_history(tokens)                once: the live list of prompt + fixed tokens (for lookup proposers)
    start(features)                     after prefill, with the target features of the prompt
    propose(anchor, position, n) -> ids at most n draft tokens following `anchor` (which sits at `position`)
    observe(num_proposed, num_accepted) how many of them the target accepted
    accept(features)                    features of the tokens the target just fixed (anchor + accepted drafts)

`tap_layer_ids` says which target layers a proposer needs; an empty tuple means none are captured.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..drafter.model import (
    DFlashDraftModel,
    DraftContextCache,
    block_inputs,
    draft_logits,
    scale_draft_logits,
)
from ..drafter.vocab import drafter_vocabulary, expand_logits, restrict_head, vocabulary_key
from ..kernels.plan import is_kernel_linear
from ..targets.target import Target, TargetError
from .request import BatchRow

# Per row, the proposals of a draft tree the target accepted (tree.py), None for a chain; None: no tree rows.
Paths = list[list[int] | None] | None


class Proposer:
    tap_layer_ids: tuple[int, ...] = ()
    max_block_size: int = 1  # anchor + proposals

    def bind_history(self, tokens: list[int]) -> None:  # noqa: B027 - optional hook
        pass

    def start(self, features: torch.Tensor | None) -> None:  # noqa: B027 - optional hook
        pass

    def observe(self, num_proposed: int, num_accepted: int) -> None:  # noqa: B027 - optional hook
        pass

    def stats(self) -> dict[str, Any]:
        return {}

    def propose(self, anchor_token: int, anchor_position: int, num_tokens: int) -> torch.Tensor:
        raise NotImplementedError

    def accept(self, features: torch.Tensor | None) -> None:  # noqa: B027 - optional hook
        pass


class NoProposer(Proposer):
    """Plain autoregressive decoding through the same loop: nothing proposed, one target token per step."""

    def propose(self, anchor_token: int, anchor_position: int, num_tokens: int) -> torch.Tensor:
        return torch.empty(0, dtype=torch.long)


_CASTS: weakref.WeakKeyDictionary[DFlashDraftModel, dict[torch.dtype, tuple[int, DFlashDraftModel]]] = (
    weakref.WeakKeyDictionary()
)


def cast_drafter(draft: DFlashDraftModel, dtype: torch.dtype) -> DFlashDraftModel:
    """The drafter in `dtype`: one copy per drafter and dtype, kept while the drafter lives and made again when its
    weights change (their version counters), so what is compiled for the copy (its block pass: seconds on a CPU) is
    compiled once, not at every `generate()`. The copy leaves behind what was cached on the drafter for its own
    precision (its compiled block passes)."""
    version = sum(p._version for p in draft.parameters())
    copies = _CASTS.setdefault(draft, {})
    hit = copies.get(dtype)
    if hit is not None and hit[0] == version:
        return hit[1]
    cached = {k: draft.__dict__.pop(k) for k in list(draft.__dict__) if k.startswith("_flashdraft_")}
    try:
        cast = copy.deepcopy(draft).to(dtype)
    finally:
        draft.__dict__.update(cached)
    copies[dtype] = (version, cast)
    return cast


class DFlashProposer(Proposer):
    """A DFlash drafter: one non-causal forward over [anchor, MASK x n] proposes n tokens at once."""

    def __init__(self, draft: DFlashDraftModel, target: Target, dtype: torch.dtype | None = None) -> None:
        """`dtype`: run the drafter and its copy of the LM head in this precision (e.g. bf16 beside an fp32 target
        on CPUs with fast bf16); the drafter only proposes, so its precision cannot change the output."""
        target.check_drafter(draft.config)
        self.target = target
        head = target.lm_head
        # A head packed for oneDNN (packed_linear.py), for fbgemm's fp16 GEMM or quantized to int8 (quantize.py)
        # runs as it is, in its own precision: its dense weight may not exist, or be four times its bytes.
        packed = is_kernel_linear(head) and dtype in (
            None,
            head.compute_dtype,
        )
        self.packed_head = head if packed else None
        self.head_weight = None if packed else head.weight
        self.head_bias = None if packed else getattr(head, "bias", None)  # a packed head adds its own
        # The drafter's vocabulary (vocab.py): the head over those rows only, logits expanded to every token.
        self.vocab_size = head.out_features if packed else self.head_weight.shape[0]
        self.vocab_ids = drafter_vocabulary(draft, target, self.vocab_size)
        if self.vocab_ids is not None:
            self.vocab_ids = self.vocab_ids.to(target.device)
            # made once per target head and vocabulary (a generate() makes a proposer)
            heads = target.model.__dict__.setdefault("_flashdraft_vocab_heads", {})
            key = (id(head), packed, vocabulary_key((self.vocab_ids, self.vocab_size)))
            if key not in heads:
                heads[key] = restrict_head(
                    head if packed else self.head_weight, self.head_bias, self.vocab_ids
                )
            if packed:
                self.packed_head = heads[key]
            else:
                self.head_weight, self.head_bias = heads[key]
        if dtype is not None and dtype != draft.fc.weight.dtype:
            draft = cast_drafter(draft, dtype)
        if not packed and dtype is not None and dtype != self.head_weight.dtype:
            self.head_weight = self.head_weight.to(dtype)
            self.head_bias = None if self.head_bias is None else self.head_bias.to(dtype)
        self.draft = draft
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
        return self.draft_confidences(anchor_token, anchor_position, num_tokens)[0]  # the draft is greedy

    @torch.no_grad()
    def draft_logits(self, anchor_token: int, anchor_position: int, num_tokens: int) -> torch.Tensor:
        """[num_tokens, V] draft logits for the slots after the anchor; absorbs the pending context."""
        return self.head_logits(self.draft_hidden(anchor_token, anchor_position, num_tokens)[0])

    @torch.no_grad()
    def draft_hidden(self, anchor_token: int, anchor_position: int, num_tokens: int) -> torch.Tensor:
        """[1, num_tokens, H] draft hidden states of the slots after the anchor; absorbs the pending context."""
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
            self.block_inputs(block_ids),
            block_positions,
            target_features=pending,
            context_positions=context_positions,
            cache=self.cache,
        )
        self._pending = None
        # Slot k predicts the token at anchor + k (same-position prediction); slot 0's output is unused.
        return hidden[:, 1:]

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, V] float32 draft logits of the target's LM head (in the drafter's precision) for [rows, H] states,
        with the drafter's output multiplier and soft-capping."""
        if self.packed_head is not None:
            logits = scale_draft_logits(self.draft.config, self.packed_head(hidden.float()).float())
        else:
            logits = draft_logits(self.draft.config, hidden, self.head_weight, self.head_bias)
        return logits if self.vocab_ids is None else expand_logits(logits, self.vocab_ids, self.vocab_size)

    def block_inputs(self, block_ids: torch.Tensor) -> torch.Tensor:
        return block_inputs(
            self.draft.config, self.target.embed_tokens.weight, block_ids, self.draft.mask_embedding
        )

    @torch.no_grad()
    def draft_confidences(
        self, anchor_token: int, anchor_position: int, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(greedy draft tokens, the drafter's confidence in each) for the slots after the anchor (v1: each slot's
        argmax and its probability; DFlash2: the candidate selector's path)."""
        hidden = self.draft_hidden(anchor_token, anchor_position, num_tokens)
        logits = self.head_logits(hidden[0])[None]
        anchor = torch.tensor([anchor_token], device=hidden.device)
        tokens, confidence = self.draft.propose_tokens(hidden, logits, anchor)
        return tokens[0], confidence[0]


# ---------------------------------------------------------------------------------------------------------- proposers
class BatchProposer:
    """Who proposes for the rows of a batch. Rows are addressed by their index in the batch (which changes as rows
    leave: `remove` says which stay)."""

    tap_layer_ids: tuple[int, ...] = ()
    max_block_size: int = 1
    # True: rows that sample (T > 0) get drafts drawn from the drafter's distribution, verified by speculative
    # sampling against `draft_probs` (sampling.verify_block_pq); False: deterministic drafts, seed-exact verification.
    sampled_drafts: bool = False
    # padded_lengths[n - 1]: the length the engine pads a verify of n tokens to (its bucket; set by the decoder,
    # None: verified as proposed). The policy prices a verify at the length that really runs.
    padded_lengths: list[int] | None = None

    def draft_probs(self, index: int) -> torch.Tensor | None:
        """[n, V] distributions the last proposal of row `index` was drawn from (None: deterministic, one-hot)."""
        return None

    def tree_parents(self, index: int) -> list[int] | None:
        """The last proposal of row `index` as a draft tree (tree.py): each token's parent among them, -1 for the
        anchor (None: a chain)."""
        return None

    def add(self, row: BatchRow, features: torch.Tensor | None) -> None:
        """A row joined at the end of the batch, with the target features of its prompt."""

    def remove(self, keep: list[int]) -> None:
        """Only the rows at these indices stay (in this order)."""

    def propose(self, rows: list[BatchRow], max_drafts: list[int]) -> list[torch.Tensor]:
        raise NotImplementedError

    def observe(
        self, rows: list[BatchRow], proposed: list[int], accepted: list[int], paths: Paths = None
    ) -> None:
        """How many of each row's own proposals the target accepted (tree rows: `paths[i]`, which of them)."""

    def accept(self, rows: list[BatchRow], features: list[torch.Tensor | None]) -> None:
        """Features [1, k, F] of the k tokens each row just fixed (anchor + accepted)."""

    def stats(self, index: int) -> dict[str, Any]:
        return {}

    def timed(self, rows: int, tokens_per_row: int, context: int, seconds: float) -> None:
        """How long the target took to verify `rows` x `tokens_per_row` tokens after about `context` cached ones."""


class PerRowProposers(BatchProposer):
    """One single-sequence `Proposer` per row (plain decoding, prompt lookup, a fixed-block `DFlashProposer`,
    test doubles): each row proposes on its own; the step verifies the longest proposal."""

    def __init__(self, factory: Callable[[], Proposer]) -> None:
        self.factory = factory
        self.proposers: list[Proposer] = []
        probe = factory()
        self.tap_layer_ids = probe.tap_layer_ids
        self.max_block_size = probe.max_block_size
        self._spare: Proposer | None = probe

    def add(self, row: BatchRow, features: torch.Tensor | None) -> None:
        proposer, self._spare = self._spare or self.factory(), None
        proposer.bind_history(row.history)
        proposer.start(features)
        self.proposers.append(proposer)

    def remove(self, keep: list[int]) -> None:
        self.proposers = [self.proposers[i] for i in keep]

    def propose(self, rows: list[BatchRow], max_drafts: list[int]) -> list[torch.Tensor]:
        return [
            p.propose(row.tokens[-1], row.anchor_position, m).view(-1).cpu()
            if m > 0
            else torch.empty(0, dtype=torch.long)
            for p, row, m in zip(self.proposers, rows, max_drafts, strict=True)
        ]

    def observe(
        self, rows: list[BatchRow], proposed: list[int], accepted: list[int], paths: Paths = None
    ) -> None:
        for p, n, a in zip(self.proposers, proposed, accepted, strict=True):
            p.observe(n, a)

    def accept(self, rows: list[BatchRow], features: list[torch.Tensor | None]) -> None:
        for p, f in zip(self.proposers, features, strict=True):
            p.accept(f)

    def stats(self, index: int) -> dict[str, Any]:
        return self.proposers[index].stats()


__all__ = ["BatchProposer", "DFlashProposer", "NoProposer", "PerRowProposers", "Proposer"]
