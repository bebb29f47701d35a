"""Batched speculative decoding with ragged acceptance, and the step-wise decoder continuous batching runs on.

Every step, each row of the batch has an anchor (its last fixed token) and up to n-1 proposals; all rows are
verified in ONE target forward of [b, n] tokens, and each row keeps its own accepted prefix:

    propose   a BatchProposer gives each row its proposals (ragged; shorter rows are padded, and the padding is
              verified like any proposal, so it can only add tokens)
    verify    target(block [b, n], position ids per row, a [b, cached + n] validity mask)
    accept    per row: verify_block on its logits, with its own sampling parameters and seed
    roll back the cache keeps the columns some row still needs; a row's rejected columns become holes in its mask

So the batch's KV cache is one tensor per layer with C columns, and `valid[b, C]` says which column holds a real token
of which row. Rows hold different numbers of tokens, so the target gets explicit position ids, and causality follows
the columns (a new block always sits to the right of everything cached). Holes only cost attention FLOPs; the cache
is compacted (each row's tokens moved right-aligned, padding on the left) when they pile up, and after every step
for sliding-window models, whose window is measured in columns.

A row joins with its own prefill (batch size 1, exactly `generate`'s) and is merged into the batch cache; a row that
finishes or is cancelled leaves between steps and its cache rows are freed at once. Greedy output per row equals
decoding it alone (fp32); sampling is seed-exact per row as in `generate`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .costs import CostModel, load_or_measure_costs
from .generate import GenerationError, GenerationResult, check_request, cut_emitted
from .model import PAD_POSITION, DFlashDraftModel, DraftContextCache
from .policy import confidence_keys, expected_tokens
from .proposers import (
    _CALIBRATIONS,
    LOOKUP_MAX_TOKENS,
    MAX_SKIP_STEPS,
    AdaptiveProposer,
    DFlashProposer,
    NoProposer,
    Proposer,
    _Calibration,
    lookup_with_keys,
)
from .recurrent import append_rows, has_kv, is_recurrent_layer, select_rows
from .sampling import SamplingParams, position_uniforms, sample_token, verify_block
from .target import Target


@dataclass(eq=False)
class BatchRow:
    """One sequence of the batch: its request, its progress and its result."""

    prompt: torch.Tensor  # [1, P]
    max_new_tokens: int
    sampling: SamplingParams
    stops: set[int]
    seed: int
    on_tokens: Callable[[list[int]], Any] | None = None
    tokens: list[int] = field(default_factory=list)  # generated so far
    history: list[int] = field(default_factory=list)  # prompt + generated (for lookup proposers)
    result: GenerationResult | None = None
    done: bool = False
    started: float = 0.0  # when its prefill ended (its decode time counts from there)
    tag: Any = None  # the caller's (e.g. the server's request handle)

    @property
    def anchor_position(self) -> int:
        """Position of the anchor (the last fixed token, not yet in the cache) = tokens the cache holds."""
        return self.prompt.shape[1] + len(self.tokens) - 1

    def uniforms(self, start: int, count: int) -> torch.Tensor | None:
        return None if self.sampling.greedy else position_uniforms(self.seed, start, count)

    def finish(self, reason: str | None = None) -> None:
        self.done = True
        if reason:
            self.result.stop_reason = reason
        self.result.decode_s = time.perf_counter() - self.started
        device = self.prompt.device
        self.result.sequences = torch.cat(
            [self.prompt, torch.tensor([self.tokens], dtype=torch.long, device=device)], dim=1
        )


# ---------------------------------------------------------------------------------------------------------- proposers
class BatchProposer:
    """Who proposes for the rows of a batch. Rows are addressed by their index in the batch (which changes as rows
    leave: `remove` says which stay)."""

    tap_layer_ids: tuple[int, ...] = ()
    max_block_size: int = 1

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
    """One single-sequence `Proposer` per row (the per-sequence policy: each row chooses its own verify length
    under single-sequence costs; the step verifies the longest)."""

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
    """A DFlash drafter drafting every row in one forward, and one verify length shared by the batch.

    `block_size=None` (auto): per step, prompt lookup for each row (free), the drafter (one pass for all rows) or
    a plain step, and the shared verify length n maximising the batch's expected tokens per second,
    sum_i E_i(n) / (t_draft(b) + t_verify(b * n)), under the measured cost model. An integer drafts and verifies
    that many tokens (anchor included) every step.

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
    ) -> None:
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
        self.tap_layer_ids = single.tap_layer_ids
        self.max_block_size = single.max_block_size
        self.mask_token_id = single.mask_token_id
        self.calibration = _CALIBRATIONS.setdefault(draft, _Calibration())
        self.cache = DraftContextCache(ragged=True)
        self.absorbed: list[int] = []  # context tokens of each row already in the draft cache
        self.pending: list[torch.Tensor | None] = []  # [k, F] features not yet projected, per row
        self.counts: list[dict[str, int]] = []
        self._last: list[tuple[str, torch.Tensor] | None] = []
        self.draft_rate: float | None = None  # the batch's expected tokens/s when drafting (EMA)
        self.skip_steps = 0
        self.skip_left = 0
        # Online corrections of the cost model (measured / predicted, EMA): a batched forward with ragged masks and
        # a padded draft context cost what the single-row measurements cannot say.
        self.verify_ratio: dict[tuple[int, int], float] = {}  # by (rows, tokens per row)
        self.draft_ratio = 1.0

    # -------------------------------------------------------------- rows
    def add(self, row: BatchRow, features: torch.Tensor | None) -> None:
        if features is None:
            raise GenerationError("the DFlash proposer needs target features from prefill")
        c = self.cache
        if c.positions is not None:  # the new row holds nothing in the draft cache yet: all padding
            c.positions = torch.cat([c.positions, torch.full_like(c.positions[:1], PAD_POSITION)])
            c.keys = [torch.cat([k, torch.zeros_like(k[:1])]) for k in c.keys]
            c.values = [torch.cat([v, torch.zeros_like(v[:1])]) for v in c.values]
        self.absorbed.append(0)
        self.pending.append(features[0])
        self.counts.append({"dflash": 0, "lookup": 0, "plain": 0})
        self._last.append(None)

    def remove(self, keep: list[int]) -> None:
        c = self.cache
        if c.positions is not None:
            idx = torch.tensor(keep, dtype=torch.long, device=c.positions.device)
            c.positions = c.positions[idx]
            c.keys = [k[idx] for k in c.keys]
            c.values = [v[idx] for v in c.values]
            if not keep:
                self.cache = DraftContextCache(ragged=True)
        for name in ("absorbed", "pending", "counts", "_last"):
            old = getattr(self, name)
            setattr(self, name, [old[i] for i in keep])
        self._compact()

    def _compact(self) -> None:
        """Move each row's context left (order kept) when padding fills more than half of the draft cache."""
        c = self.cache
        if c.positions is None:
            return
        real = c.positions != PAD_POSITION
        counts = real.sum(1)
        width = int(counts.max()) if len(counts) else 0
        if c.positions.shape[1] <= 2 * width + 32:
            return
        # Stable order: real columns first, in their order, then padding.
        order = torch.argsort((~real).int(), dim=1, stable=True)[:, :width]
        c.positions = torch.gather(c.positions, 1, order)
        idx = order[:, None, :, None]
        c.keys = [torch.gather(k, 2, idx.expand(-1, k.shape[1], -1, k.shape[3])) for k in c.keys]
        c.values = [torch.gather(v, 2, idx.expand(-1, v.shape[1], -1, v.shape[3])) for v in c.values]

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
        """(greedy drafts [b, B-1], the drafter's probability of each) for every row, in one forward."""
        device = self.target.device
        b, block = len(rows), self.max_block_size
        lengths = [0 if p is None else p.shape[0] for p in self.pending]
        width = max(lengths)
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
        hidden = self.draft(
            self.target.embed(block_ids),
            block_positions,
            target_features=features,
            context_positions=context_positions,
            cache=self.cache,
        )
        self.pending = [None] * b
        self._compact()
        # Slot k predicts the token at anchor + k; slot 0's output is unused.
        logits = self.single.head_logits(hidden[:, 1:].reshape(b * (block - 1), -1)).view(b, block - 1, -1)
        probs, tokens = logits.softmax(-1).max(-1)
        return tokens.cpu(), probs.cpu()

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
        tokens_per_row = torch.arange(1, max_n + 2)
        step_s = propose_s + self.costs.verify_s(b * tokens_per_row, context) * torch.tensor(
            [self._verify_ratio(b, int(n)) for n in tokens_per_row]
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
            return [tokens[i, : min(self.fixed - 1, m)] for i, m in enumerate(max_drafts)]

        context = sum(row.anchor_position for row in rows) // b
        top = max(max_drafts)
        plain_rate = b / (float(self.costs.verify_s(b, context)) * self._verify_ratio(b, 1))
        lookups = [self._lookup(row, m) for row, m in zip(rows, max_drafts, strict=True)]
        lookup_probs = [self.calibration.lookup.p(keys) for _, keys in lookups]
        lookup_n, lookup_rate = (
            self._batch_rate(lookup_probs, 0.0, context, min(top, LOOKUP_MAX_TOKENS))
            if any(len(p) for p in lookup_probs)
            else (0, 0.0)
        )
        draft_now = (
            top > 0 and self.skip_left == 0 and (self.draft_rate is None or self.draft_rate >= lookup_rate)
        )
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
        predicted = self.costs.draft_batch_s(b, context)
        self.draft_ratio = _ema(self.draft_ratio, (time.perf_counter() - t0) / max(predicted, 1e-9))
        keys = confidence_keys(confidence, self.calibration.confidence_bins)
        choices = []  # per row: (source, tokens, keys, acceptance probabilities)
        for i, m in enumerate(max_drafts):
            p_draft = self.calibration.draft.p(keys[i, :m])
            candidate = ("dflash", tokens[i, :m], keys[i, :m], p_draft)
            proposal, lkeys = lookups[i]
            if len(proposal) and expected_tokens(lookup_probs[i])[-1] > expected_tokens(p_draft)[-1]:
                candidate = ("lookup", torch.tensor(proposal, dtype=torch.long), lkeys, lookup_probs[i])
            choices.append(candidate)
        draft_s = self.costs.draft_batch_s(b, context) * self.draft_ratio
        n, rate = self._batch_rate([c[3] for c in choices], draft_s, context, top)
        self.draft_rate = rate if self.draft_rate is None else 0.5 * self.draft_rate + 0.5 * rate
        if self.draft_rate > max(plain_rate, lookup_rate):
            self.skip_steps = 0
        else:  # drafting does not pay for this batch right now: lookup or plain steps, then probe again
            self.skip_steps = min(MAX_SKIP_STEPS, max(1, 2 * self.skip_steps))
            self.skip_left = self.skip_steps
        out = []
        for i, (source, toks, k, _) in enumerate(choices):
            self._last[i] = (source, k[:n]) if n else None
            self.counts[i][source] += 1
            out.append(toks[:n])
        return out

    def _verify_ratio(self, rows: int, tokens_per_row: int) -> float:
        """Measured / predicted step time for this shape (the nearest shape measured so far: same row count
        first)."""
        if not self.verify_ratio:
            return 1.0
        key = min(self.verify_ratio, key=lambda k: (abs(k[0] - rows), abs(k[1] - tokens_per_row)))
        return self.verify_ratio[key]

    def timed(self, rows: int, tokens_per_row: int, context: int, seconds: float) -> None:
        if self.costs is None:
            return
        predicted = float(self.costs.verify_s(rows * tokens_per_row, context))
        old = self.verify_ratio.get((rows, tokens_per_row))
        ratio = seconds / max(predicted, 1e-9)
        self.verify_ratio[rows, tokens_per_row] = ratio if old is None else _ema(old, ratio)

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
def _is_sliding(target: Target) -> bool:
    cfg = target.config
    types = getattr(cfg, "layer_types", None) or []
    return bool(getattr(cfg, "sliding_window", None)) and (
        not types or any("sliding" in str(t) for t in types) or getattr(cfg, "use_sliding_window", True)
    )


def _batch_cache(target: Target) -> Any:
    """A cache of full-attention layers for every model (sliding windows come from the mask, over columns), beside
    the recurrent layers of a hybrid target."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if target.recurrent is None:
        return DynamicCache()
    cache = DynamicCache(config=target.model.config)
    cache.layers = [
        DynamicLayer() if has_kv(layer) and not is_recurrent_layer(layer) else layer for layer in cache.layers
    ]
    return cache


def _kv_layers(cache: Any) -> list[Any]:
    return [layer for layer in cache.layers if has_kv(layer)]


class BatchDecoder:
    """Rows join (`add`), advance together (`step`) and leave (finished, or `cancel`) between steps."""

    def __init__(self, target: Target, proposer: BatchProposer, max_batch_size: int | None = None) -> None:
        target.check_decodable()
        self.target = target
        self.proposer = proposer
        self.max_batch_size = max_batch_size
        self.rows: list[BatchRow] = []
        self.cache: Any = None
        self.valid: torch.Tensor | None = None  # [b, C] bool: which cache column holds a token of which row
        self.sliding = _is_sliding(target)
        self.block_size = proposer.max_block_size

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def full(self) -> bool:
        return self.max_batch_size is not None and len(self.rows) >= self.max_batch_size

    # -------------------------------------------------------------- joining
    @torch.no_grad()
    def add(
        self,
        input_ids: torch.Tensor | Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        on_tokens: Callable[[list[int]], Any] | None = None,
        tag: Any = None,
    ) -> BatchRow:
        """Prefill a new row and put it in the batch (unless its first token already ends it: then it is
        returned done and never joins)."""
        if self.full:
            raise GenerationError(f"the batch is full ({self.max_batch_size} rows)")
        ids = check_request(self.target, input_ids, max_new_tokens)
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        stops = set(self.target.eos_token_ids if stop_token_ids is None else stop_token_ids)
        row = BatchRow(ids, max_new_tokens, sampling, stops, seed, on_tokens, tag=tag)
        t0 = time.perf_counter()
        cache = _batch_cache(self.target)
        out = self.target.forward(ids, cache, self.proposer.tap_layer_ids, last_logits_only=True)
        prompt_len = ids.shape[1]
        first = sample_token(out.logits[0, -1], sampling, row.uniforms(prompt_len, 1))
        row.tokens.append(first)
        row.history.extend([*ids[0].tolist(), first])
        row.started = time.perf_counter()
        row.result = GenerationResult(sequences=ids, prompt_length=prompt_len, prefill_s=row.started - t0)
        reason = None
        if first in stops:
            reason = "stop_token"
        elif max_new_tokens == 1:
            reason = "max_new_tokens"
        if on_tokens and on_tokens([first]) is True and reason is None:
            reason = "caller"
        if reason is not None:
            row.finish(reason)
            return row
        self._merge(cache, prompt_len)
        self.rows.append(row)
        self.proposer.add(row, out.features)
        return row

    def _merge(self, cache: Any, length: int) -> None:
        """Append a prefilled single-row cache: right-aligned, so every row's latest token sits in the last column."""
        device = self.target.device
        if self.cache is None:
            self.cache = cache
            self.valid = torch.ones(1, length, dtype=torch.bool, device=device)
            return
        width = self.valid.shape[1]
        total = max(width, length)
        for big, small in zip(self.cache.layers, cache.layers, strict=True):
            if is_recurrent_layer(big):
                append_rows(big, small)
            if not has_kv(big):
                continue
            for name in ("keys", "values"):
                a, s = getattr(big, name), getattr(small, name)
                merged = a.new_zeros(a.shape[0] + 1, a.shape[1], total, a.shape[3])
                merged[:-1, :, total - width :] = a
                merged[-1, :, total - length :] = s[0]
                setattr(big, name, merged)
        valid = torch.zeros(self.valid.shape[0] + 1, total, dtype=torch.bool, device=device)
        valid[:-1, total - width :] = self.valid
        valid[-1, total - length :] = True
        self.valid = valid

    # -------------------------------------------------------------- leaving
    def cancel(self, row: BatchRow, reason: str = "cancelled") -> None:
        """Take a row out now (the client went away); its cache rows are freed."""
        if row in self.rows:
            self._remove([r for r in self.rows if r is not row])
        if not row.done:
            row.finish(reason)

    def _remove(self, keep_rows: list[BatchRow]) -> None:
        keep = [i for i, r in enumerate(self.rows) if any(r is k for k in keep_rows)]
        if len(keep) == len(self.rows):
            return
        self.proposer.remove(keep)
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache, self.valid = None, None
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.valid.device)
        self.valid = self.valid[idx]
        used = self.valid.any(0)  # drop columns no remaining row uses
        cols = used.nonzero().squeeze(1) if not bool(used.all()) else None
        if cols is not None:
            self.valid = self.valid[:, cols]
        for layer in self.cache.layers:
            if is_recurrent_layer(layer):
                select_rows(layer, idx)
            if not has_kv(layer):
                continue
            for name in ("keys", "values"):
                t = getattr(layer, name)[idx]
                setattr(layer, name, t if cols is None else t[:, :, cols])

    def _compact(self) -> None:
        """Right-align every row's tokens (no holes) once holes pile up, or at once for sliding-window models
        (their window is measured in columns, so a hole would narrow it)."""
        counts = self.valid.sum(1)
        width = int(counts.max())
        columns = self.valid.shape[1]
        aligned = torch.arange(columns, device=self.valid.device)[None] >= columns - counts[:, None]
        if columns == width and bool((aligned == self.valid).all()):
            return
        if not self.sliding and columns <= int(1.25 * width) + 16:
            return  # holes are cheap until they pile up
        # Per row: padding columns first (any, they stay masked), then its valid columns in order.
        order = torch.argsort(self.valid.int(), dim=1, stable=True)[:, columns - width :]
        for layer in _kv_layers(self.cache):
            for name in ("keys", "values"):
                t = getattr(layer, name)
                idx = order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
                setattr(layer, name, torch.gather(t, 2, idx))
        self.valid = torch.arange(width, device=self.valid.device)[None] >= width - counts[:, None]

    # -------------------------------------------------------------- one step for every row
    @torch.no_grad()
    def step(self) -> list[BatchRow]:
        """Propose, verify and accept once for every row; returns the rows that finished (and left)."""
        rows = self.rows
        if not rows:
            return []
        device = self.target.device
        remaining = [r.max_new_tokens - len(r.tokens) for r in rows]
        max_drafts = [min(self.block_size - 1, m - 1) for m in remaining]
        proposals = self.proposer.propose(rows, max_drafts)
        for p, m in zip(proposals, max_drafts, strict=True):
            if p.shape[0] > max(m, 0):
                raise RuntimeError(
                    f"{type(self.proposer).__name__} proposed {p.shape[0]} tokens, at most {m} allowed"
                )
        n = 1 + max(p.shape[0] for p in proposals)
        block = torch.empty(len(rows), n, dtype=torch.long)
        for i, (row, p) in enumerate(zip(rows, proposals, strict=True)):
            block[i, 0] = row.tokens[-1]
            block[i, 1 : 1 + p.shape[0]] = p
            block[i, 1 + p.shape[0] :] = (
                p[-1] if p.shape[0] else row.tokens[-1]
            )  # padding, verified like drafts
        block = block.to(device)
        starts = torch.tensor([r.anchor_position for r in rows], device=device)
        positions = starts[:, None] + torch.arange(n, device=device)
        mask = torch.cat([self.valid, torch.ones(len(rows), n, dtype=torch.bool, device=device)], 1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = self.target.forward(
            block, self.cache, self.proposer.tap_layer_ids, attention_mask=mask.long(), position_ids=positions
        )

        kept = torch.zeros(len(rows), n, dtype=torch.bool, device=device)
        finished, features, own_accepted = [], [], []
        for i, row in enumerate(rows):
            drafts = block[i, 1:]
            accepted, emitted = verify_block(
                out.logits[i], drafts, row.sampling, row.uniforms(row.anchor_position + 1, n)
            )
            real = proposals[i].shape[0]
            own_accepted.append(min(accepted, real))
            emitted, stopped = cut_emitted(emitted, remaining[i], row.stops)
            reason = "stop_token" if stopped else None
            row.tokens.extend(emitted)
            row.history.extend(emitted)
            res = row.result
            res.acceptance_lengths.append(len(emitted))
            res.draft_lengths.append(real)
            res.accepted_drafts.append(own_accepted[-1])
            if row.on_tokens and row.on_tokens(emitted) is True and reason is None:
                reason = "caller"
            if reason is None and len(row.tokens) >= row.max_new_tokens:
                reason = "max_new_tokens"
            kept[i, : accepted + 1] = True
            features.append(None if out.features is None else out.features[i : i + 1, : accepted + 1])
            if reason is not None:
                res.proposer_stats = self.proposer.stats(i)
                row.finish(reason)
                finished.append(row)
        # Recurrent state: each row keeps its anchor + accepted drafts (its KV columns are masked below).
        self.target.keep(self.cache, [int(k.sum()) for k in kept])
        # Verify forward + acceptance bookkeeping: what a step costs besides proposing.
        self.proposer.timed(len(rows), n, int(starts.float().mean()), time.perf_counter() - t0)
        self.proposer.observe(rows, [p.shape[0] for p in proposals], own_accepted)
        self.proposer.accept(rows, features)

        # Roll back: keep the block columns some row still needs; a row's rejected columns become holes.
        self.valid = torch.cat([self.valid, kept], 1)
        if finished:
            self._remove([r for r in rows if not r.done])  # also drops the columns nobody uses
        if self.rows:
            last = int(self.valid.any(0).nonzero().max()) + 1
            if last < self.valid.shape[1]:
                self.target.crop(self.cache, last)
                self.valid = self.valid[:, :last]
            self._compact()
        return finished


# ---------------------------------------------------------------------------------------------------------- API
def batch_proposer(
    target: Target,
    draft: DFlashDraftModel | Callable[[], Proposer] | None,
    block_size: int | str | None = "auto",
    policy: str = "shared",
    costs: CostModel | None = None,
) -> BatchProposer:
    """The proposer for a batch: plain (`draft=None`), a DFlash drafter (`policy` "shared": one batched draft pass
    and a shared verify length; "per-sequence": an adaptive proposer per row), or a factory of per-row proposers."""
    auto = block_size is None or block_size == "auto"
    if isinstance(block_size, str) and not auto:
        raise GenerationError(f"block_size must be 'auto' or an integer, got {block_size!r}")
    if draft is None:
        return PerRowProposers(NoProposer)
    if isinstance(draft, DFlashDraftModel):
        target.check_drafter(draft.config)
        if not auto and (not isinstance(block_size, int) or not 1 <= block_size <= draft.config.block_size):
            raise GenerationError(
                f"block_size must be between 1 and the drafter's block size {draft.config.block_size}, "
                f"got {block_size!r}"
            )
        if policy not in ("shared", "per-sequence"):
            raise GenerationError(f"policy must be 'shared' or 'per-sequence', got {policy!r}")
        if auto:
            costs = costs or load_or_measure_costs(target, draft)
            if policy == "per-sequence":
                return PerRowProposers(lambda: AdaptiveProposer(draft, target, costs))
            return BatchedDFlashProposer(draft, target, costs)
        return BatchedDFlashProposer(draft, target, block_size=block_size)
    if callable(draft):
        return PerRowProposers(draft)
    raise TypeError(
        f"draft must be a DFlashDraftModel, a proposer factory or None, got {type(draft).__name__}"
    )


def generate_batch(
    target: Target | Any,
    draft: DFlashDraftModel | Callable[[], Proposer] | None,
    prompts: Sequence[torch.Tensor | Sequence[int]],
    max_new_tokens: int | Sequence[int] = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    block_size: int | str | None = "auto",
    seed: int | Sequence[int] | None = None,
    costs: CostModel | None = None,
    policy: str = "shared",
    max_batch_size: int | None = None,
) -> list[GenerationResult]:
    """Decode several prompts together: each row's output is what `generate` gives it alone (greedy, fp32) or the
    same seed-exact sample. `draft=None` decodes plainly in a batch; a callable makes one `Proposer` per row.
    With `max_batch_size`, waiting prompts join as rows finish (continuous batching)."""
    target = target if isinstance(target, Target) else Target(target)
    if not len(prompts):
        return []
    sampling = SamplingParams(temperature, top_p, top_k)
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(prompts)
    if len(limits) != len(prompts) or len(seeds) != len(prompts):
        raise GenerationError("max_new_tokens and seed must be one value or one per prompt")
    for ids, limit in zip(prompts, limits, strict=True):  # every request is checked before any work
        check_request(target, ids, limit)
    decoder = BatchDecoder(target, batch_proposer(target, draft, block_size, policy, costs), max_batch_size)
    results: list[GenerationResult | None] = [None] * len(prompts)
    waiting = list(range(len(prompts)))
    while waiting or len(decoder):
        while waiting and not decoder.full:
            i = waiting.pop(0)
            row = decoder.add(prompts[i], limits[i], sampling, stop_token_ids, seeds[i], tag=i)
            if row.done:
                results[i] = row.result
        for row in decoder.step():
            results[row.tag] = row.result
    return results  # type: ignore[return-value]


__all__ = [
    "BatchDecoder",
    "BatchProposer",
    "BatchRow",
    "BatchedDFlashProposer",
    "PerRowProposers",
    "batch_proposer",
    "generate_batch",
]
