"""Proposers: who suggests the next tokens for the target to verify (one class per method).

The engine (engine.py) talks to one interface, `BatchProposer`, for every batch, a request being a batch of one:

    add(row, features)                  a row joined (with the target features of its prompt)
    remove(keep)                        only these rows stay
    propose(rows, max_drafts) -> ids    each row's proposals (ragged; at most max_drafts[i])
    timed(rows, n, context, seconds)    what the verify forward cost (online cost corrections)
    observe(rows, proposed, accepted)   how many of each row's proposals the target accepted
    accept(rows, features)              features of the tokens each row just fixed (anchor + accepted drafts)

Two implement it: `BatchedDFlashProposer` drafts every row in ONE drafter forward and picks one verify length for
the batch (one row or many: the cost-aware policy); `PerRowProposers` runs one single-sequence `Proposer` per row
(plain decoding, prompt lookup, test doubles), whose interface is the same calls for one row:

    bind_history(tokens)                once: the live list of prompt + fixed tokens (for lookup proposers)
    start(features)                     after prefill, with the target features of the prompt
    propose(anchor, position, n) -> ids at most n draft tokens following `anchor` (which sits at `position`)
    observe(num_proposed, num_accepted) how many of them the target accepted
    accept(features)                    features of the tokens the target just fixed (anchor + accepted drafts)

`tap_layer_ids` says which target layers a proposer needs; an empty tuple means none are captured.

The cost-aware policy (`block_size="auto"`, `BatchedDFlashProposer`) is one policy for one row and for many: per
step, prompt lookup, the DFlash drafter or a plain step, and how many proposals to verify, by the batch's expected
tokens per second under the measured cost model (policy.py, costs.py), corrected online by the step times observed.
"""

from __future__ import annotations

import copy
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .compiled import draft_block_pass
from .costs import CostModel
from .grammar import steer_drafts
from .kv_cache import CAPACITY_STEP, uses_static_cache
from .model import PAD_POSITION, DFlashDraftModel, DraftContextCache, block_inputs, draft_logits
from .policy import AcceptanceTable, confidence_keys, confidence_table, expected_tokens
from .request import GenerationError
from .sampling import DRAFT_STREAM, position_uniforms
from .target import Target, TargetError

if TYPE_CHECKING:
    from .engine import BatchRow


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
        return draft_logits(self.draft.config, hidden, self.head_weight, self.head_bias)

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


# "match": deterministic (greedy) drafts accepted where they equal the target's seed-keyed sample (seed-exact);
# "pq": at T > 0, drafts sampled from the drafter's distribution and verified by speculative sampling.
DRAFT_SAMPLING = ("match", "pq")
LOOKUP_MAX_TOKENS = 10
LOOKUP_MAX_NGRAM = 3
MAX_SKIP_STEPS = 32


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

    def add(self, row: BatchRow, features: torch.Tensor | None) -> None:
        """A row joined at the end of the batch, with the target features of its prompt."""

    def remove(self, keep: list[int]) -> None:
        """Only the rows at these indices stay (in this order)."""

    def propose(self, rows: list[BatchRow], max_drafts: list[int]) -> list[torch.Tensor]:
        raise NotImplementedError

    def observe(self, rows: list[BatchRow], proposed: list[int], accepted: list[int]) -> None:
        """How many of each row's own proposals the target accepted."""

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

    def observe(self, rows: list[BatchRow], proposed: list[int], accepted: list[int]) -> None:
        for p, n, a in zip(self.proposers, proposed, accepted, strict=True):
            p.observe(n, a)

    def accept(self, rows: list[BatchRow], features: list[torch.Tensor | None]) -> None:
        for p, f in zip(self.proposers, features, strict=True):
            p.accept(f)

    def stats(self, index: int) -> dict[str, Any]:
        return self.proposers[index].stats()


class BatchedDFlashProposer(BatchProposer):
    """A DFlash drafter drafting every row in one forward, and one verify length shared by the batch: the engine's
    one cost-aware policy, for a request alone (a batch of one) as for many rows.

    `block_size=None` (auto): per step, prompt lookup for each row (free), the drafter (one pass for all rows) or
    a plain step, and the shared verify length n maximising the batch's expected tokens per second,
    sum_i E_i(n) / (t_draft(b) + t_verify(b * n)), under the measured cost model. The drafter always drafts its
    full trained block (the non-causal drafter proposes differently with fewer mask slots); after the pass, each row
    keeps its draft or its lookup match, whichever is expected to give more. When drafting does not beat plain
    steps, it is skipped for 1, 2, 4, .. steps between probes (lookup still fills them), so it comes back as soon as
    the text becomes predictable again. An integer `block_size` drafts and verifies that many tokens (anchor
    included) every step.

    The drafter's context cache is batched too: rows are padded to a common length with PAD_POSITION, which the
    drafter's mask rule (context before the anchor) never shows to a block.
    """

    def __init__(
        self,
        draft: DFlashDraftModel,
        target: Target,
        costs: CostModel | None = None,
        block_size: int | None = None,
        lookup: bool = True,
        dtype: torch.dtype | None = None,
        online_costs: bool = True,
        draft_sampling: str = "match",
    ) -> None:
        if draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(
                f"draft_sampling must be one of {', '.join(DRAFT_SAMPLING)}, not {draft_sampling!r}"
            )
        self.sampled_drafts = draft_sampling == "pq"
        if block_size is None and costs is None:
            raise ValueError("the automatic verify length needs a cost model")
        if dtype is None and costs is not None:
            dtype = getattr(torch, costs.draft_dtype, None)
        single = DFlashProposer(draft, target, dtype=dtype)  # checks the pair; casts drafter and head
        self.single = single  # its drafter copy and LM head are the ones used here
        self.draft = single.draft
        self.target = target
        self.costs = costs
        self.fixed = block_size
        self.use_lookup = lookup
        self.online_costs = online_costs
        self.tap_layer_ids = single.tap_layer_ids
        self.max_block_size = single.max_block_size
        self.mask_token_id = single.mask_token_id
        self.calibration = _CALIBRATIONS.setdefault(draft, _Calibration())
        # Beside a static target cache the draft context is static too, and its block pass compiled with the verify.
        self.static = uses_static_cache(target)
        self.block_pass = draft_block_pass(self.draft, target) if self.static else None
        self.cache = self._new_cache()
        self.absorbed: list[int] = []  # context tokens of each row already in the draft cache
        self.pending: list[torch.Tensor | None] = []  # [k, F] features not yet projected, per row
        self.counts: list[dict[str, int]] = []
        self._last: list[tuple[str, torch.Tensor] | None] = []
        self._q: list[torch.Tensor | None] = []  # per row: the sampled drafts' distributions of this step
        self._drafted_q: list[torch.Tensor | None] = []  # per row: those of the last draft pass
        self.draft_rate: float | None = None  # the batch's expected tokens/s when drafting (EMA)
        self.skip_steps = 0
        self.skip_left = 0
        # Online corrections of the cost model (measured / predicted, EMA), for batches of 2+ rows only: a batched
        # forward with ragged masks and a padded draft context cost what the single-row measurements cannot say.
        # One row is the shape the cost model measured; correcting it only fed timing noise into the choice (at one
        # row it measured 1.18x over plain against 1.36x without, in one run: benchmarks/README.md). One ratio per
        # row count, which every verify of that many rows updates (plain steps included), so a busy spell and its
        # end reach all verify lengths at once; the draft pass is priced relative to the verify (its ratio over the
        # verify ratio of the moment). `online_costs=False` prices by `costs` alone (a cost model written by hand).
        # A batched verify's cost does not follow rows x tokens as one row's does (16 rows of 2 tokens measured
        # about 1.27x further above the cost model's price than 16 rows of 1, on the 2-core AMD EPYC), so each
        # (rows, tokens per row) shape keeps its own factor over its row count's ratio: the level follows every
        # verify, the shape only the verifies of that shape.
        self.verify_ratio: dict[int, float] = {}  # by rows
        self.verify_shape: dict[tuple[int, int], float] = {}  # by (rows, tokens per row), over verify_ratio
        self.draft_ratio: float | None = None  # (measured / predicted draft) / verify ratio, EMA

    def _new_cache(self) -> DraftContextCache:
        return DraftContextCache(
            ragged=True,
            capacity=CAPACITY_STEP if self.static else None,
            mark_static=self.block_pass is not None,
        )

    # -------------------------------------------------------------- rows
    def add(self, row: BatchRow, features: torch.Tensor | None) -> None:
        if features is None:
            raise GenerationError("the DFlash proposer needs target features from prefill")
        self.cache.add_row()  # it holds nothing in the draft cache yet: all padding
        self.absorbed.append(0)
        self.pending.append(features[0])
        self.counts.append({"dflash": 0, "lookup": 0, "plain": 0})
        self._last.append(None)
        self._q.append(None)

    def remove(self, keep: list[int]) -> None:
        self.cache.select_rows(keep)
        if not keep:
            self.cache = self._new_cache()
        for name in ("absorbed", "pending", "counts", "_last", "_q"):
            old = getattr(self, name)
            setattr(self, name, [old[i] for i in keep])
        self._compact()

    def _compact(self) -> None:
        """Move each row's context left (order kept) when padding fills more than half of the draft cache."""
        c = self.cache
        if c.positions is None:
            return
        width = max(self.absorbed, default=0)  # the real columns of each row, counted on the host
        if len(c) <= 2 * width + 32:
            return
        # Stable order: real columns first, in their order, then padding.
        real = c.positions[:, : len(c)] != PAD_POSITION
        c.keep_columns(torch.argsort((~real).int(), dim=1, stable=True)[:, :width])

    def accept(self, rows: list[BatchRow], features: list[torch.Tensor | None]) -> None:
        for i, f in enumerate(features):
            if f is None:
                raise GenerationError("the DFlash proposer needs target features of the accepted tokens")
            p = self.pending[i]
            self.pending[i] = f[0] if p is None else torch.cat([p, f[0]])

    def stats(self, index: int) -> dict[str, Any]:
        return {"steps_by_source": dict(self.counts[index])}

    # -------------------------------------------------------------- the draft pass
    @torch.no_grad()
    def draft_rows(self, rows: list[BatchRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """(greedy drafts [b, B-1], the drafter's confidence in each) for every row, in one forward; on the device
        (a fixed block goes to the verify without a stop on the host)."""
        device = self.target.device
        b, block = len(rows), self.max_block_size
        lengths = [0 if p is None else p.shape[0] for p in self.pending]
        width = max(lengths)
        c = self.cache
        # Padding in the cache (rows hold fewer real columns than it has), counted on the host: no wait on the device.
        padded = c.positions is not None and min(self.absorbed) < len(c)
        features, context_positions = None, None
        if width:
            feat_dim = next(p for p in self.pending if p is not None).shape[-1]
            features = torch.zeros(b, width, feat_dim, dtype=self.pending[0].dtype, device=device)
            context_positions = torch.full((b, width), PAD_POSITION, dtype=torch.long, device=device)
            for i, (p, row) in enumerate(zip(self.pending, rows, strict=True)):
                if p is None:
                    continue
                if self.absorbed[i] + p.shape[0] != row.anchor_position:
                    raise RuntimeError(
                        f"row {i}: draft context covers {self.absorbed[i] + p.shape[0]} tokens, "
                        f"anchor is at {row.anchor_position}"
                    )
                features[i, : p.shape[0]] = p
                context_positions[i, : p.shape[0]] = torch.arange(
                    self.absorbed[i], self.absorbed[i] + p.shape[0], device=device
                )
                self.absorbed[i] += p.shape[0]
        anchors = torch.tensor([row.tokens[-1] for row in rows], device=device)
        block_ids = torch.full((b, block), self.mask_token_id, dtype=torch.long, device=device)
        block_ids[:, 0] = anchors
        starts = torch.tensor([row.anchor_position for row in rows], device=device)
        block_positions = starts[:, None] + torch.arange(block, device=device)
        # One row with no padding left in its cache is the one-block fast path (no mask); padding needs the mask.
        c.ragged = b > 1 or padded
        hidden = self.draft(
            self.single.block_inputs(block_ids),
            block_positions,
            target_features=features,
            context_positions=context_positions,
            cache=self.cache,
            block_pass=self.block_pass,
        )
        self.pending = [None] * b
        self._compact()
        # Slot k predicts the token at anchor + k; slot 0's output is unused.
        logits = self.single.head_logits(hidden[:, 1:].reshape(b * (block - 1), -1)).view(b, block - 1, -1)
        tokens, confidence = self.draft.propose_tokens(hidden[:, 1:], logits, anchors)
        if self.draft.candidate_selector is None:  # constrained greedy rows: drafts the grammar allows
            for i, row in enumerate(rows):
                if row.grammar is not None and (row.sampling.greedy or not self.sampled_drafts):
                    t0 = time.perf_counter()
                    steer_drafts(row.grammar, logits[i], tokens[i], confidence[i])
                    row.result.grammar_s += time.perf_counter() - t0
        self._drafted_q = [None] * b
        if (
            self.sampled_drafts
        ):  # rows that sample draw their drafts from the drafter's processed distribution
            for i, row in enumerate(rows):
                if row.sampling.greedy:
                    continue
                u = position_uniforms(row.seed ^ DRAFT_STREAM, row.anchor_position + 1, block - 1)
                drawn, q = self.draft.sample_tokens(
                    hidden[i : i + 1, 1:], logits[i : i + 1], anchors[i], row.sampling, u
                )
                tokens[i] = drawn
                self._drafted_q[i] = q
        return tokens, confidence

    def draft_probs(self, index: int) -> torch.Tensor | None:
        return self._q[index]

    # -------------------------------------------------------------- the policy
    def _lookup(self, row: BatchRow, max_tokens: int) -> tuple[list[int], torch.Tensor]:
        if not self.use_lookup or max_tokens <= 0:
            return [], torch.empty(0, dtype=torch.long)
        return lookup_with_keys(row.history, max_tokens)

    def _batch_rate(
        self, probs: list[torch.Tensor], propose_s: float, context: int, max_n: int
    ) -> tuple[int, float]:
        """(shared number of proposals n, expected batch tokens/s) over n = 0..max_n."""
        b = len(probs)
        expected = torch.zeros(max_n + 1)
        for p in probs:
            e = expected_tokens(p[:max_n])
            expected += torch.cat([e, e[-1:].expand(max_n + 1 - len(e))])
        tokens_per_row = self._padded(torch.arange(1, max_n + 2))
        step_s = propose_s + self.costs.verify_s(b * tokens_per_row, context) * self._verify_ratios(
            b, tokens_per_row
        )
        rates = expected / step_s
        n = int(torch.argmax(rates))
        return n, float(rates[n])

    @torch.no_grad()
    def propose(self, rows: list[BatchRow], max_drafts: list[int]) -> list[torch.Tensor]:
        b = len(rows)
        if self.fixed is not None:  # the paper's setting: draft and verify a fixed block for every row
            tokens, _ = self.draft_rows(rows)
            self._last = [None] * b
            for c in self.counts:
                c["dflash"] += 1
            keep = [min(self.fixed - 1, m) for m in max_drafts]
            self._q = [None if q is None else q[:k] for q, k in zip(self._drafted_q, keep, strict=True)]
            return [tokens[i, :k] for i, k in enumerate(keep)]

        context = sum(row.anchor_position for row in rows) // b
        top = max(max_drafts)
        plain = self._padded(torch.ones(1, dtype=torch.long))
        plain_rate = b / float(self.costs.verify_s(b * plain, context) * self._verify_ratios(b, plain))
        lookups = [self._lookup(row, m) for row, m in zip(rows, max_drafts, strict=True)]
        lookup_probs = [self.calibration.lookup.p(keys) for _, keys in lookups]
        lookup_n, lookup_rate = (
            self._batch_rate(lookup_probs, 0.0, context, min(top, LOOKUP_MAX_TOKENS))
            if any(len(p) for p in lookup_probs)
            else (0, 0.0)
        )
        # Draft when its expected rate beats this step's lookup, and always once the skipped steps are over (the
        # rate that made it skip is stale then: a probe measures it again, or lookup would keep it off forever).
        probe = self.draft_rate is None or self.draft_rate <= plain_rate
        draft_now = top > 0 and self.skip_left == 0 and (probe or self.draft_rate >= lookup_rate)
        self._q = [None] * b
        if not draft_now:
            self.skip_left = max(0, self.skip_left - 1)
            use_lookup = lookup_n > 0 and lookup_rate > plain_rate
            out = []
            for i, ((proposal, keys), m) in enumerate(zip(lookups, max_drafts, strict=True)):
                k = min(lookup_n, len(proposal), m) if use_lookup else 0
                self._last[i] = ("lookup", keys[:k]) if k else None
                self.counts[i]["lookup" if k else "plain"] += 1
                out.append(torch.tensor(proposal[:k], dtype=torch.long))
            return out

        t0 = time.perf_counter()
        tokens, confidence = self.draft_rows(rows)
        tokens, confidence = tokens.cpu(), confidence.cpu()  # the policy reads them on the host
        predicted = self.costs.draft_batch_s(b, context)
        if self.online_costs and b > 1:  # the first measurement counts at once, as for the verify
            ratio = (time.perf_counter() - t0) / max(predicted, 1e-9) / self._verify_ratio(b)
            self.draft_ratio = ratio if self.draft_ratio is None else _ema(self.draft_ratio, ratio)
        keys = confidence_keys(confidence, self.calibration.confidence_bins)
        choices = []  # per row: (source, tokens, keys, acceptance probabilities)
        for i, m in enumerate(max_drafts):
            p_draft = self.calibration.draft.p(keys[i, :m])
            candidate = ("dflash", tokens[i, :m], keys[i, :m], p_draft)
            proposal, lkeys = lookups[i]
            if len(proposal) and expected_tokens(lookup_probs[i])[-1] > expected_tokens(p_draft)[-1]:
                candidate = ("lookup", torch.tensor(proposal, dtype=torch.long), lkeys, lookup_probs[i])
            choices.append(candidate)
        draft_s = self.costs.draft_batch_s(b, context)
        if b > 1:
            draft_s *= (self.draft_ratio or 1.0) * self._verify_ratio(b)
        n, rate = self._batch_rate([c[3] for c in choices], draft_s, context, top)
        self.draft_rate = rate if self.draft_rate is None else 0.5 * self.draft_rate + 0.5 * rate
        # Skipping compares with plain steps only: a lookup match is this step's luck, taken whenever it wins, not a
        # reason to stop drafting.
        if self.draft_rate > plain_rate:
            self.skip_steps = 0
        else:  # drafting does not pay for this batch right now: lookup or plain steps, then probe again
            self.skip_steps = min(MAX_SKIP_STEPS, max(1, 2 * self.skip_steps))
            self.skip_left = self.skip_steps
        out = []
        for i, (source, toks, k, _) in enumerate(choices):
            self._last[i] = (source, k[:n]) if n else None
            self.counts[i][source] += 1
            q = self._drafted_q[i]
            self._q[i] = q[: len(toks[:n])] if source == "dflash" and q is not None else None
            out.append(toks[:n])
        return out

    def _padded(self, tokens_per_row: torch.Tensor) -> torch.Tensor:
        """The verify lengths that really run for these proposed ones (their buckets)."""
        if self.padded_lengths is None:
            return tokens_per_row
        table = torch.tensor(self.padded_lengths)
        return table[(tokens_per_row - 1).clamp(max=len(table) - 1)]

    def _verify_ratio(self, rows: int) -> float:
        """Measured / predicted verify time at this many rows (the nearest row count measured so far; 1 for one
        row, the measured shape)."""
        if rows == 1 or not self.verify_ratio:
            return 1.0
        return self.verify_ratio[min(self.verify_ratio, key=lambda r: abs(r - rows))]

    def _verify_ratios(self, rows: int, tokens_per_row: torch.Tensor) -> torch.Tensor:
        """Measured / predicted verify time of `rows` rows of each of these token counts (the row count's ratio
        times each shape's own factor, where that shape has been measured)."""
        if rows == 1:
            return torch.ones(len(tokens_per_row))
        level = self._verify_ratio(rows)
        return torch.tensor([level * self.verify_shape.get((rows, int(t)), 1.0) for t in tokens_per_row])

    def timed(self, rows: int, tokens_per_row: int, context: int, seconds: float) -> None:
        if self.costs is None or not self.online_costs or rows == 1:
            return
        predicted = float(self.costs.verify_s(rows * tokens_per_row, context))
        ratio = seconds / max(predicted, 1e-9)
        old = self.verify_ratio.get(rows)
        if old is not None:
            key = (rows, tokens_per_row)
            shape = ratio / old
            self.verify_shape[key] = (
                _ema(self.verify_shape[key], shape) if key in self.verify_shape else shape
            )
        self.verify_ratio[rows] = ratio if old is None else _ema(old, ratio)

    def observe(self, rows: list[BatchRow], proposed: list[int], accepted: list[int]) -> None:
        for i, (n, a) in enumerate(zip(proposed, accepted, strict=True)):
            last = self._last[i]
            if last is None or n == 0:
                continue
            source, keys = last
            table = self.calibration.draft if source == "dflash" else self.calibration.lookup
            table.update(keys, n, a)
            self._last[i] = None


def _ema(old: float, new: float, keep: float = 0.8) -> float:
    return keep * old + (1.0 - keep) * new


# ---------------------------------------------------------------------------------------------------------- decoder
