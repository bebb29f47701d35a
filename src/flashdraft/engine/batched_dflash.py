"""The batched DFlash proposer: every row drafted in one drafter forward, and the engine's one cost-aware policy (a
request alone is a batch of one): per step, prompt lookup, the drafter (chains or draft trees) or a plain step, and
how many proposals to verify, by the batch's expected tokens per second under the measured cost model (policy.py,
costs.py), corrected online by the step times observed."""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from ..drafter.model import PAD_POSITION, DFlashDraftModel, DraftContextCache
from ..kernels.static_buffers import CAPACITY_STEP
from ..sampling import DRAFT_STREAM, position_uniforms
from ..targets.capabilities import uses_static_cache
from ..targets.target import Target
from .calibration import JUMP_FORWARD_MAX_TOKENS, calibration_for
from .compiled_draft import draft_block_pass, draft_context_pass, draft_head
from .costs import CostModel, ObservedCosts
from .grammar import steer_drafts
from .lookup import LookupIndex
from .policy import BatchPolicy, expected_tokens, extended
from .proposers import BatchProposer, DFlashProposer, Paths
from .request import BatchRow, GenerationError
from .tree import (
    DraftTree,
    add_branch,
    grow_tree,
    slot_candidates,
    top_candidates,
    tree_budget,
    tree_refusal,
    tree_window,
)

# "match": deterministic (greedy) drafts accepted where they equal the target's seed-keyed sample (seed-exact);
# "pq": at T > 0, drafts sampled from the drafter's distribution and verified by speculative sampling.
DRAFT_SAMPLING = ("match", "pq")
# The drafter's LM head covers first the slots whose verify costs at most this many plain steps (`_first_slots`).
LAZY_HEAD_PRICE = 2.0
# Draft trees: candidates kept per block slot (the drafter's own draft and the slot's next most likely tokens).
TREE_WIDTH = 4
# The cost-aware policy drafts trees for batches of at most this many rows (`_trees_for`). At several rows a tree's
# costs are not in its prices (the head over every slot and its top-k over the vocabulary, the trees grown per row,
# the verify's ancestor mask for the whole batch), and they lost: served at 8 requests at once, trees 0.88x plain
# decoding where chains were 1.08x (int8, compiled, a 2-core Zen 4 EPYC, 2026-12-03).
TREE_POLICY_ROWS = 1


class BatchedDFlashProposer(BatchProposer):
    """A DFlash drafter drafting every row in one forward, and one verify length shared by the batch: the engine's
    one cost-aware policy, for a request alone (a batch of one) as for many rows.

    `block_size=None` (auto): per step, prompt lookup for each row (free), for a constrained row the text its
    grammar forces next (jump-forward, free; `jump_forward`), the drafter (one pass for all rows) or a plain step,
    and the shared verify length n maximising the batch's expected tokens per second,
    sum_i E_i(n) / (t_draft(b) + t_verify(b * n)), under the measured cost model. The drafter always drafts its
    full trained block (the non-causal drafter proposes differently with fewer mask slots), and its LM head first
    over the slots a verify could cheaply use, over the others only if they could pay (`_first_slots`); after the
    pass, each row keeps its draft or its free proposal (lookup match or forced text), whichever is expected to give
    more. When drafting does not beat plain steps, it is skipped for 1, 2, 4, .. steps between probes (the free
    proposals still fill them), so it comes back as soon as the text becomes predictable again, and for as many
    steps as keep the probes' loss to a tenth of the time (policy.py's `PROBE_SHARE`; several rows, whose draft pass
    costs more than their plain step, 3 %: `BATCH_PROBE_SHARE`, and a probe at once when the batch has halved since);
    a probe verifies only what beats the plain steps that follow it. Several rows speculate only where that beats
    plain steps by a margin (`BATCH_MARGIN`); `BatchPolicy` makes these choices. An integer
    `block_size` drafts and verifies that many tokens (anchor included) every step.

    `tree=N`: rows draft trees of at most N nodes instead of chains (tree.py), built best-first from each slot's few
    most likely tokens with the calibrated acceptance estimates, a row's lookup match joining as one more branch;
    the policy's E(n) is then the expected tokens of the tree of the n best nodes, so one choice of n picks the
    tree, a chain (the tree when the drafter is sure) or a plain step. Rows a tree cannot serve exactly verify
    chains: a target with recurrent layers or of a family trees are not verified on (the whole batch), a
    sliding-window one past its window, rows with a grammar, rows whose drafts are sampled (p/q), and under the
    policy a batch of several rows (TREE_POLICY_ROWS: there trees lost to chains).

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
        jump_forward: bool = True,
        dtype: torch.dtype | None = None,
        online_costs: bool = True,
        draft_sampling: str = "match",
        tree: int | None = None,
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
        self.jump_forward = jump_forward and target.tokenizer is not None
        tokenizer = target.tokenizer
        # forced texts repeat (a schema's keys, a tool call's head): each spelled once
        self._spell = functools.lru_cache(maxsize=4096)(
            lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))
        )
        self.tap_layer_ids = single.tap_layer_ids
        self.max_block_size = single.max_block_size
        self.mask_token_id = single.mask_token_id
        self.calibration = calibration_for(draft)
        # Beside a static target cache the draft context is static too, and its block pass compiled with the verify.
        self.static = uses_static_cache(target)
        self.block_pass = draft_block_pass(self.draft, target) if self.static else None
        self.context_pass = draft_context_pass(self.draft, target) if self.static else None
        # the drafter's LM head compiled beside a compiled verify (None: eager or dynamic), else the eager one
        compiled_head = (
            None
            if not self.static
            else draft_head(
                self.draft.config,
                single.head_weight,
                single.head_bias,
                target,
                module=single.packed_head,
                vocab=None if single.vocab_ids is None else (single.vocab_ids, single.vocab_size),
            )
        )
        self.head_drafts = compiled_head  # (logits, greedy drafts, confidences) in one graph
        # the logits alone (DFlash2's candidate selector reads them and selects its own drafts)
        self.head_logits = single.head_logits if compiled_head is None else lambda h: compiled_head(h)[0]
        self.cache = self._new_cache()
        self.absorbed: list[int] = []  # context tokens of each row already in the draft cache
        # per row: the [k, F] features not yet projected, as the steps gave them (joined by the next draft pass: a
        # row's pile grows by one step's tokens a step, and may grow for dozens of steps while drafting is skipped)
        self.pending: list[list[torch.Tensor]] = []
        self.counts: list[dict[str, int]] = []
        self.lookups: list[LookupIndex] = []  # per row: prompt lookup over its history
        self._last: list[tuple[str, torch.Tensor] | None] = []
        self._q: list[torch.Tensor | None] = []  # per row: the sampled drafts' distributions of this step
        self._drafted_q: list[torch.Tensor | None] = []  # per row: those of the last draft pass
        # whether a draft pass of one row, of several rows, has run with this drafter and compile options (their
        # graphs made): kept on the drafter as its graphs are, so a new proposer (a new batch) does not pay for a
        # pass the rates do not ask for
        made = self.draft.__dict__.setdefault("_flashdraft_passes_made", {})
        self.passes_made: set[bool] = made.setdefault(target.plan.compile_key, set())
        # the cost model corrected by the step times observed (`online_costs=False`: by `costs` alone)
        self.prices = None if costs is None else ObservedCosts(costs, online_costs)
        self.policy = BatchPolicy(
            self.prices
        )  # whether to draft, and the verify length (a fixed block: unused)
        if tree is not None and tree < 1:
            raise ValueError(f"a draft tree needs at least one node, got {tree}")
        # Draft trees (tree.py): why this target verifies chains only, if it does (said once by --verbose).
        self.tree_note = None if tree is None else tree_refusal(target)
        self.tree = None if tree is None or self.tree_note is not None else tree_budget(target, tree)
        self.tree_window = None if self.tree is None else tree_window(target)
        self._candidates: tuple[torch.Tensor, torch.Tensor] | None = None  # the last pass's slot candidates
        self._pass: tuple[torch.Tensor, torch.Tensor] | None = None  # the last pass's hidden, anchors
        self._trees: list[DraftTree | None] = []  # per row: its last proposal as a tree (None: a chain)
        self.tree_steps: list[int] = []  # per row: how many of its steps verified a tree

    @property
    def padded_lengths(self) -> list[int] | None:  # type: ignore[override]
        return self.policy.padded_lengths

    @padded_lengths.setter
    def padded_lengths(self, lengths: list[int] | None) -> None:
        self.policy.padded_lengths = lengths

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
        self.pending.append([features[0]])
        self.counts.append({"dflash": 0, "lookup": 0, "grammar": 0, "plain": 0})
        self.lookups.append(LookupIndex(row.history))
        self._last.append(None)
        self._q.append(None)
        self._trees.append(None)
        self.tree_steps.append(0)

    def remove(self, keep: list[int]) -> None:
        self.cache.select_rows(keep)
        if not keep:
            self.cache = self._new_cache()
        for name in ("absorbed", "pending", "counts", "lookups", "_last", "_q", "_trees", "tree_steps"):
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
            self.pending[i].append(f[0])

    def stats(self, index: int) -> dict[str, Any]:
        return {"steps_by_source": dict(self.counts[index]), "tree_steps": self.tree_steps[index]}

    # -------------------------------------------------------------- the draft pass
    @torch.no_grad()
    def draft_rows(self, rows: list[BatchRow], slots: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(greedy drafts [b, B-1], the drafter's confidence in each) for every row, in one forward; on the device
        (a fixed block goes to the verify without a stop on the host). `slots`: the LM head over the first `slots`
        slots only (drafts [b, slots]); `draft_more_slots` adds the others from the same pass."""
        device = self.target.device
        b, block = len(rows), self.max_block_size
        pending = [(torch.cat(p) if len(p) > 1 else p[0]) if p else None for p in self.pending]
        width = max(0 if p is None else p.shape[0] for p in pending)
        c = self.cache
        # Padding in the cache (rows hold fewer real columns than it has), counted on the host: no wait on the device.
        padded = c.positions is not None and min(self.absorbed) < len(c)
        features, context_positions = None, None
        if width:
            first = next(p for p in pending if p is not None)
            features = torch.zeros(b, width, first.shape[-1], dtype=first.dtype, device=device)
            context_positions = torch.full((b, width), PAD_POSITION, dtype=torch.long, device=device)
            for i, (p, row) in enumerate(zip(pending, rows, strict=True)):
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
            context_pass=self.context_pass,
        )
        self.pending = [[] for _ in range(b)]
        self._compact()
        # Slot k predicts the token at anchor + k; slot 0's output is unused.
        self._pass = (hidden, anchors)
        slots = block - 1 if slots is None else min(slots, block - 1)
        # the drafter's logits over the vocabulary only where something reads more than the greedy drafts (a tree
        # reads each slot's few most likely tokens: the compiled head reduces them itself)
        read_logits = self.sampled_drafts or any(r.grammar is not None for r in rows)
        top = TREE_WIDTH if self._trees_for(b) else 0
        logits, tokens, confidence, *candidates = self._slot_drafts(
            hidden[:, 1 : 1 + slots], anchors, read_logits, top
        )
        self._candidates = slot_candidates(*candidates, tokens, confidence) if top else None
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

    @torch.no_grad()
    def draft_more_slots(self, tokens: torch.Tensor, confidence: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The last pass's drafts and confidences [b, k] completed to every slot: the LM head over the slots after
        the first k (a greedy v1 drafter's slots are independent argmaxes)."""
        hidden, anchors = self._pass
        b, have = tokens.shape
        _, more, sure = self._slot_drafts(hidden[:, 1 + have :], anchors, logits=False)
        more, sure = more.to(tokens.device), sure.to(confidence.device)
        return torch.cat([tokens, more], 1), torch.cat([confidence, sure], 1)

    def chain_head(self, hidden: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The head over slot states [k, H] as a greedy chain's draft pass runs it (the cost model times it)."""
        anchors = torch.zeros(1, dtype=torch.long, device=hidden.device)
        return self._slot_drafts(hidden[None], anchors, logits=False)

    def _slot_drafts(
        self, hidden: torch.Tensor, anchors: torch.Tensor, logits: bool = True, top: int = 0
    ) -> tuple[torch.Tensor | None, ...]:
        """(logits [b, k, V], greedy drafts [b, k], the drafter's confidence in each) from slot states [b, k, H]:
        the drafts from the compiled head's own reduction where it made them (a v1 drafter), else `propose_tokens`.
        `logits=False`: None for the logits where the compiled head can leave them out. `top`: each slot's `top`
        most likely tokens and their probabilities [b, k, top] follow (tree.top_candidates)."""
        b, k, _ = hidden.shape
        flat = hidden.reshape(b * k, -1)
        if self.head_drafts is not None and self.draft.candidate_selector is None:
            out, *reduced = self.head_drafts(flat, logits, top)
            out = None if out is None else out.view(b, k, -1)
            if top and out is not None:  # the logits were asked for: the candidates from them
                reduced += top_candidates(out, top)
            return out, *(t.view(b, k, *t.shape[1:]) for t in reduced)
        out = self.head_logits(flat).view(b, k, -1)
        drafts = self.draft.propose_tokens(hidden, out, anchors)
        return (out, *drafts, *(top_candidates(out, top) if top else ()))

    def _first_slots(self, rows: list[BatchRow], context: int) -> int | None:
        """How many slots the LM head covers first (None: all): on a CPU the head over a block's 15 slots cost 1.5x
        its cost over 4 (SmolLM2-135M's 49152 x 576 head, compiled, bf16: 7.9 against 5.8 ms on a 2-core AMD EPYC,
        a third of a DFlash step), and a verify long enough to use the other slots is priced there at several plain
        steps, so the policy rarely takes them; the first slots are those whose verify costs at most
        `LAZY_HEAD_PRICE` plain steps. Only where the slots are independent argmaxes and serve a chain: a v1
        drafter, no draft trees, no grammar (its steering reads every slot), no sampled (p/q) drafts."""
        if self.costs is None or self._trees_for(len(rows)) or self.draft.candidate_selector is not None:
            return None
        if any(r.grammar is not None or (self.sampled_drafts and not r.sampling.greedy) for r in rows):
            return None
        b, slots = len(rows), self.max_block_size - 1
        drafts = torch.arange(1, slots + 1)
        lengths = self.policy.padded(drafts + 1)
        price = self.prices.verify_s(b, lengths, context)
        plain = self.costs.verify_s(b * self.policy.padded(torch.ones(1, dtype=torch.long)), context)
        cheap = (price <= LAZY_HEAD_PRICE * plain * self.prices.ratio(b)).nonzero()
        first = int(cheap[-1]) + 1 if len(cheap) else 1
        return None if first >= slots else first

    def draft_probs(self, index: int) -> torch.Tensor | None:
        return self._q[index]

    def tree_parents(self, index: int) -> list[int] | None:
        tree = self._trees[index]
        return None if tree is None else tree.parents

    def _trees_for(self, rows: int) -> bool:
        """Whether a draft pass of `rows` rows gives trees: always with a fixed block; under the cost-aware policy
        for at most TREE_POLICY_ROWS rows, and a lone row after only passes of several keeps chains (its tree head
        would be a graph compiled mid-answer; the several-row graphs serve its chain, compiled_draft.py)."""
        if self.tree is None:
            return False
        if self.costs is None:
            return True
        return rows <= TREE_POLICY_ROWS and (rows > 1 or not self.passes_made or False in self.passes_made)

    def _tree_for(self, index: int, row: BatchRow, depth: int, budget: int) -> DraftTree | None:
        """Row `index`'s best-first tree of at most `budget` nodes, `depth` deep, from the last draft pass (None
        where a tree cannot serve it exactly, or the pass gave no candidates: its verify then takes a chain)."""
        if self._candidates is None or depth < 1 or row.grammar is not None:
            return None
        if self.sampled_drafts and not row.sampling.greedy:
            return None
        longest = max(budget, self.max_block_size)  # the verify block, whichever row sets its length
        if self.tree_window is not None and row.anchor_position + longest + 2 >= self.tree_window:
            return None
        tokens, p = self._candidates
        confidence, table = p[index, :depth], self.calibration.draft
        keys = self.calibration.draft_keys(confidence, candidates=True)
        below = self.calibration.draft_keys(confidence, candidates=True, below=True)
        return grow_tree(tokens[index, :depth], table.p(keys), keys, budget, below=(table.p(below), below))

    # -------------------------------------------------------------- the policy
    def _free_proposal(
        self, row: BatchRow, lookup: LookupIndex, max_tokens: int
    ) -> tuple[str, list[int], torch.Tensor, torch.Tensor]:
        """A row's proposal that costs no draft pass: (source, tokens, keys, expected tokens by proposals verified).
        Its lookup match, or for a constrained row the text its grammar forces next if that is expected to give
        more."""
        proposal, start = [], 0
        if self.use_lookup and max_tokens > 0:
            proposal, start = lookup.with_key(max_tokens)
        keys, expected = self.calibration.lookup.run(start, len(proposal))
        if row.grammar is not None and self.jump_forward and max_tokens > 0:
            t0 = time.perf_counter()
            forced = row.grammar.jump_forward(self._spell, min(max_tokens, JUMP_FORWARD_MAX_TOKENS))
            row.result.grammar_s += time.perf_counter() - t0
            if forced:
                forced_keys, forced_expected = self.calibration.grammar.run(0, len(forced))
                if forced_expected[-1] > expected[-1]:
                    return "grammar", forced, forced_keys, forced_expected
        return "lookup", proposal, keys, expected

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
            out = [tokens[i, :k] for i, k in enumerate(keep)]
            self._trees = [None] * b
            for i, (row, k) in enumerate(zip(rows, keep, strict=True)):
                tree = self._tree_for(i, row, k, self.tree) if self.tree else None
                if tree is None:
                    continue
                # its N nodes, also where the best N are the block's first N drafts (a chain)
                out[i] = tree.tokens
                if not tree.is_chain:
                    self._trees[i] = tree
                    self._last[i] = ("tree", tree)
                    self.tree_steps[i] += 1
            return out

        context = sum(row.anchor_position for row in rows) // b
        top = max(max_drafts)
        policy = self.policy
        plain_rate = policy.plain_rate(b, context)
        bar = policy.bar(b, plain_rate)  # the rate speculating must beat
        # Free proposals (lookup matches, forced text): the rate of verifying them alone, without a draft pass.
        free = [
            self._free_proposal(row, lookup, m)
            for row, lookup, m in zip(rows, self.lookups, max_drafts, strict=True)
        ]
        longest_free = max(len(f[1]) for f in free)
        free_n, free_rate = (
            policy.batch_rate([f[3] for f in free], 0.0, context, min(top, longest_free))
            if longest_free
            else (0, 0.0)
        )
        # Draft when its expected rate beats this step's free proposals, and always once the skipped steps are over
        # (the rate that made it skip is stale then: a probe measures it again, or lookup would keep it off
        # forever).
        # The first step and the first of several rows draft whatever the rates say: their graphs (compiled) are
        # made there, not in the middle of a later answer (the server's warm-up decodes one row, then two). A lone
        # row after several needs no graph of its own (the several-row graph takes it doubled, compiled_draft.py).
        first_pass = not self.passes_made or b > 1 and True not in self.passes_made
        draft_now = top > 0 and policy.draft_now(b, bar, free_rate, first_pass)
        self._q = [None] * b
        self._trees = [None] * b
        if not draft_now:
            policy.skipped()
            use_free = free_n > 0 and free_rate > bar
            out = []
            for i, ((source, proposal, keys, _), m) in enumerate(zip(free, max_drafts, strict=True)):
                k = min(free_n, len(proposal), m) if use_free else 0
                self._last[i] = (source, keys[:k]) if k else None
                self.counts[i][source if k else "plain"] += 1
                out.append(torch.tensor(proposal[:k], dtype=torch.long))
            return out

        t0 = time.perf_counter()
        self.passes_made.add(b > 1)
        first = self._first_slots(rows, context)
        tokens, confidence = self.draft_rows(rows, first)
        tokens, confidence = tokens.cpu(), confidence.cpu()  # the policy reads them on the host
        # priced with the head over the slots it covered (the lazy head skips the others)
        skipped = 0 if first is None else self.max_block_size - 1 - first
        draft_s = self.prices.draft_s(b, context, skipped, time.perf_counter() - t0)

        def choose(tokens: torch.Tensor, confidence: torch.Tensor) -> tuple[list, int, float, int]:
            choices = self._choices(rows, max_drafts, tokens, confidence, free)
            longest = max(top, *(len(c[3]) - 1 for c in choices))  # a tree may hold more nodes than its depth
            return choices, *policy.batch_rate([c[3] for c in choices], draft_s, context, longest), longest

        choices, n, rate, longest = choose(tokens, confidence)
        if first is not None and top > first:
            # The other slots could only pay if, even with each of them as sure as the last one drafted (a slot is
            # accepted only after every slot before it, so its chance is at most the last one's), some longer
            # verify beat this choice and plain steps: then the head covers them too and the choice is made again.
            bound = [
                extended(c[3], m - first) if c[0] == "dflash" and m > first else c[3]
                for c, m in zip(choices, max_drafts, strict=True)
            ]
            if policy.batch_rate(bound, draft_s, context, top)[1] > max(rate, bar):
                tokens, confidence = self.draft_more_slots(tokens, confidence)
                choices, n, rate, longest = choose(tokens.cpu(), confidence.cpu())
        if rate < bar:  # the pass is paid and plain steps come next: verify only what beats them
            n = policy.batch_rate([c[3] for c in choices], draft_s, context, longest, bar)[0]
        policy.drafted(rate, bar, b, draft_s, plain_rate)
        out = []
        for i, (source, toks, k, _, tree) in enumerate(choices):
            self._last[i] = (source, k[:n]) if n else None
            self.counts[i][source if n else "plain"] += 1
            if tree is not None and not (tree := tree.first(n)).is_chain:
                self._trees[i] = tree
                self._last[i] = ("tree", tree)
                self.tree_steps[i] += 1
            q = self._drafted_q[i]
            self._q[i] = q[: len(toks[:n])] if source == "dflash" and q is not None else None
            out.append(toks[:n])
        return out

    def _choices(
        self,
        rows: list[BatchRow],
        max_drafts: list[int],
        tokens: torch.Tensor,
        confidence: torch.Tensor,
        free: list[tuple[str, list[int], torch.Tensor, torch.Tensor]],
    ) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, DraftTree | None]]:
        """Per row: (source, tokens, keys, expected tokens by proposals verified, tree): its draft (a chain, or a
        tree) or its free proposal (`_free_proposal`), whichever is expected to give more."""
        keys = self.calibration.draft_keys(confidence)
        choices = []
        for i, (row, m) in enumerate(zip(rows, max_drafts, strict=True)):
            tree = self._tree_for(i, row, m, self.tree or 0)
            if tree is not None:
                source, proposal, lookup_keys, _ = free[i]
                if source == "lookup" and proposal:  # the lookup match joins the tree as a branch
                    tree_keys = lookup_keys + self.calibration.tree_lookup_key
                    p = self.calibration.draft.p(tree_keys)
                    tree = add_branch(tree, proposal, p, tree_keys, self.tree)
                candidate = ("dflash", tree.tokens, tree.keys, tree.expected_tokens(), tree)
            else:
                p_draft = self.calibration.draft.p(keys[i, :m])
                candidate = ("dflash", tokens[i, :m], keys[i, :m], expected_tokens(p_draft), None)
            source, proposal, fkeys, free_expected = free[i]
            if len(proposal) and free_expected[-1] > candidate[3][-1]:
                candidate = (source, torch.tensor(proposal, dtype=torch.long), fkeys, free_expected, None)
            choices.append(candidate)
        return choices

    def timed(self, rows: int, tokens_per_row: int, context: int, seconds: float) -> None:
        if self.prices is not None:
            self.prices.verify_timed(rows, tokens_per_row, context, seconds)

    def observe(
        self, rows: list[BatchRow], proposed: list[int], accepted: list[int], paths: Paths = None
    ) -> None:
        for i, (n, a) in enumerate(zip(proposed, accepted, strict=True)):
            last = self._last[i]
            if last is None or n == 0:
                continue
            source, keys = last
            if (
                source == "tree"
            ):  # each node whose parent was accepted was a trial, each node on the path a hit
                tree, path = keys, paths[i]
                tried = [j for j, p in enumerate(tree.parents) if p < 0 or p in path]
                self.calibration.draft.record(tree.keys[tried], tree.keys[path])
                self._last[i] = None
                continue
            table = getattr(self.calibration, "draft" if source == "dflash" else source)
            table.update(keys, n, a)
            self._last[i] = None


__all__ = ["DRAFT_SAMPLING", "BatchedDFlashProposer"]
