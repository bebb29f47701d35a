"""Proposers: who suggests the next tokens for the target to verify (one class per method, one interface).

The decode loop (generate.py) talks to a proposer through three calls:

    bind_history(tokens)                once: the live list of prompt + fixed tokens (for lookup proposers)
    start(features)                     after prefill, with the target features of the prompt
    propose(anchor, position, n) -> ids at most n draft tokens following `anchor` (which sits at `position`)
    observe(num_proposed, num_accepted) how many of them the target accepted
    accept(features)                    features of the tokens the target just fixed (anchor + accepted drafts)

`tap_layer_ids` says which target layers the proposer needs; an empty tuple means none are captured.

`AdaptiveProposer` is the default: per step it picks prompt lookup, the DFlash drafter or a plain step, and how many
proposals to verify, by expected tokens per second under the measured cost model (policy.py, costs.py).
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from .costs import CostModel
from .model import DFlashDraftModel, DraftContextCache
from .policy import AcceptanceTable, best_verify_length, confidence_keys, confidence_table
from .target import Target, TargetError


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


class DFlashProposer(Proposer):
    """A DFlash drafter: one non-causal forward over [anchor, MASK x n] proposes n tokens at once."""

    def __init__(self, draft: DFlashDraftModel, target: Target, dtype: torch.dtype | None = None) -> None:
        """`dtype`: run the drafter and its copy of the LM head in this precision (e.g. bf16 beside an fp32 target
        on CPUs with fast bf16); the drafter only proposes, so its precision cannot change the output."""
        target.check_drafter(draft.config)
        self.target = target
        self.head_weight = target.lm_head.weight
        self.head_bias = getattr(target.lm_head, "bias", None)
        if dtype is not None and dtype != draft.fc.weight.dtype:
            draft = copy.deepcopy(draft).to(dtype)
        if dtype is not None and dtype != self.head_weight.dtype:
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
        return self.head_logits(hidden[0, 1:])

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, V] float32 logits of the target's LM head (in the drafter's precision) for [rows, H] states.
        Rows must be 2-D: a 3-D strided input would send the head through bmm with a copy of the whole weight."""
        logits = F.linear(hidden.to(self.head_weight.dtype), self.head_weight, self.head_bias).float()
        softcap = self.target._softcap
        return torch.tanh(logits / softcap) * softcap if softcap else logits

    @torch.no_grad()
    def draft_confidences(
        self, anchor_token: int, anchor_position: int, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(greedy draft tokens, the drafter's probability of each) for the slots after the anchor."""
        probs, tokens = self.draft_logits(anchor_token, anchor_position, num_tokens).softmax(-1).max(-1)
        return tokens, probs


def prompt_lookup(
    tokens: list[int], max_tokens: int, max_ngram: int = 3, window: int = 4096
) -> tuple[list[int], int]:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the longest trailing n-gram
    (n = max_ngram .. 1) within the last `window` tokens. Returns (proposal, n), ([], 0) when nothing matches."""
    if max_tokens <= 0 or len(tokens) < 2:
        return [], 0
    start = max(0, len(tokens) - window)
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        first = tail[0]
        # latest occurrence ending before the tail itself
        for i in range(len(tokens) - n - 1, start - 1, -1):
            if tokens[i] == first and tokens[i : i + n] == tail:
                follow = tokens[i + n : i + n + max_tokens]
                if follow:
                    return follow, n
                break
    return [], 0


LOOKUP_MAX_TOKENS = 10
LOOKUP_MAX_NGRAM = 3
MAX_SKIP_STEPS = 32
PROBE_AFTER_STEPS = 8


def lookup_with_keys(history: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Prompt lookup's proposal and the keys of its acceptance table: (matched n-gram size, slot)."""
    proposal, ngram = prompt_lookup(history, min(max_tokens, LOOKUP_MAX_TOKENS), LOOKUP_MAX_NGRAM)
    return proposal, (ngram - 1) * LOOKUP_MAX_TOKENS + torch.arange(len(proposal))


class _Calibration:
    """Acceptance tables of one drafter/target pair, shared by every generation in the process."""

    def __init__(self) -> None:
        self.confidence_bins = 20
        self.draft = confidence_table(self.confidence_bins)
        # Lookup: keyed by (matched n-gram size, slot); prior 0.5 for the first slot, lower further out.
        self.lookup = AcceptanceTable(
            [0.5 * 0.9**slot for _ in range(LOOKUP_MAX_NGRAM) for slot in range(LOOKUP_MAX_TOKENS)]
        )


_CALIBRATIONS: weakref.WeakKeyDictionary[DFlashDraftModel, _Calibration] = weakref.WeakKeyDictionary()


class AdaptiveProposer(Proposer):
    """DFlash drafter + prompt lookup with a cost-aware verify length (the default `block_size="auto"`).

    Each step, before paying for a draft pass, compare the best expected rate (tokens/s) of
      - prompt lookup (no draft cost; acceptance learned per n-gram size and slot),
      - the drafter (its recent expected rate), and
      - a plain step (1 token per one-token verify).
    When the drafter runs, it drafts its full trained block (the non-causal drafter proposes differently with fewer
    mask slots) and the verify length n maximises E(n) / (t_draft + t_verify(n + 1)) from its per-slot confidences,
    calibrated online. When drafting does not pay, it is skipped for 1, 2, 4, .. steps between probes, so it comes
    back as soon as the text becomes predictable again.
    """

    def __init__(
        self, draft: DFlashDraftModel, target: Target, costs: CostModel, lookup: bool = True
    ) -> None:
        self.costs = costs
        self.dflash = DFlashProposer(draft, target, dtype=getattr(torch, costs.draft_dtype, None))
        self.tap_layer_ids = self.dflash.tap_layer_ids
        self.max_block_size = self.dflash.max_block_size
        self.use_lookup = lookup
        self.calibration = _CALIBRATIONS.setdefault(draft, _Calibration())
        self.history: list[int] = []
        self._reset()

    def _reset(self) -> None:
        self.draft_rate: float | None = None  # expected tokens/s of the drafter (EMA of its best rate)
        self.skip_steps = 0
        self.skip_left = 0
        self._last: tuple[str, torch.Tensor] | None = None
        self.counts = {"dflash": 0, "lookup": 0, "plain": 0}
        self.steps_without_draft = 0

    def bind_history(self, tokens: list[int]) -> None:
        self.history = tokens

    def start(self, features: torch.Tensor | None) -> None:
        self._reset()
        self.dflash.start(features)

    def accept(self, features: torch.Tensor | None) -> None:
        self.dflash.accept(features)

    def stats(self) -> dict[str, Any]:
        return {"steps_by_source": dict(self.counts)}

    def _lookup_option(self, max_tokens: int, context: int) -> tuple[list[int], torch.Tensor, int, float]:
        if not self.use_lookup:
            return [], torch.empty(0, dtype=torch.long), 0, 0.0
        proposal, keys = lookup_with_keys(self.history, max_tokens)
        if not proposal:
            return [], torch.empty(0, dtype=torch.long), 0, 0.0
        p = self.calibration.lookup.p(keys)
        n, rate = best_verify_length(p, self.costs.step_s(len(proposal), context, 0.0))
        return proposal, keys, n, rate

    @torch.no_grad()
    def propose(self, anchor_token: int, anchor_position: int, num_tokens: int) -> torch.Tensor:
        device = self.dflash.target.device
        context = anchor_position
        plain_rate = 1.0 / float(self.costs.verify_s(1, context))
        lookup, lookup_keys, lookup_n, lookup_rate = self._lookup_option(num_tokens, context)
        drafting_pays = self.draft_rate is None or self.draft_rate > plain_rate
        # While the drafter's rate is unknown, lookup may go first, but the drafter is tried within a few steps
        # (where verifying is nearly free, a GPU, some lookup match would otherwise always win).
        probe = self.draft_rate is None and self.steps_without_draft >= PROBE_AFTER_STEPS
        self.steps_without_draft += 1
        if (
            lookup_n
            and not probe
            and (lookup_rate >= (self.draft_rate or 0.0) or self.skip_left > 0 or not drafting_pays)
        ):
            self.skip_left = max(0, self.skip_left - 1)  # a skipped drafting step, whoever filled it
            self._last = ("lookup", lookup_keys[:lookup_n])
            self.counts["lookup"] += 1
            return torch.tensor(lookup[:lookup_n], dtype=torch.long, device=device)
        if self.skip_left > 0:
            self.skip_left -= 1
            self._last = None
            self.counts["plain"] += 1
            return torch.empty(0, dtype=torch.long, device=device)

        # Draft the full block; verify as many slots as pay for themselves.
        self.steps_without_draft = 0
        block = self.max_block_size - 1
        tokens, confidence = self.dflash.draft_confidences(anchor_token, anchor_position, block)
        keys = confidence_keys(confidence, self.calibration.confidence_bins)
        p = self.calibration.draft.p(keys)[:num_tokens]
        n, rate = best_verify_length(p, self.costs.step_s(len(p), context, self.costs.draft_s(context)))
        # One unsure step says little (the next anchor may be easy): skip on the running expected rate.
        self.draft_rate = rate if self.draft_rate is None else 0.5 * self.draft_rate + 0.5 * rate
        if self.draft_rate > plain_rate:
            self.skip_steps = 0
        else:  # not worth it right now: plain steps (or lookup) for a while, then probe again
            self.skip_steps = min(MAX_SKIP_STEPS, max(1, 2 * self.skip_steps))
            self.skip_left = self.skip_steps
        self._last = ("dflash", keys[:n])
        self.counts["dflash"] += 1
        return tokens[:n].to(device)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        if self._last is None:
            return
        source, keys = self._last
        table = self.calibration.draft if source == "dflash" else self.calibration.lookup
        table.update(keys.cpu(), num_proposed, num_accepted)
        self._last = None
