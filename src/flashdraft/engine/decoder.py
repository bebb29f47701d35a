"""The decode engine: one loop for one row or many (a request is a batch of one, as in vLLM).

    prefill   each row joins with its own prefill (batch size 1) and is merged into the batch cache
    propose   a BatchProposer gives each row its proposals (ragged; shorter rows are padded, and the padding is
              verified like any proposal, so it can only add tokens)
    verify    target(block [b, n], position ids per row, a [b, cached + n] validity mask): ONE forward for all rows
    constrain rows with a grammar (structured output): their logits masked position by position along their block
              by the grammar's state after the drafts before it (grammar.py); free rows are untouched
    accept    per row: verify_block on its logits, with its own sampling parameters and seed; stop and length cuts
    roll back KV: the cache keeps the columns some row still needs, a row's rejected columns become holes in its
              mask; recurrent state: each row keeps its accepted prefix (`Target.keep`: replay or stepwise)

So the batch's KV cache is one tensor per layer with C columns, and `valid[b, C]` says which column holds a real token
of which row. Rows hold different numbers of tokens, so the target gets explicit position ids, and causality follows
the columns (a new block always sits to the right of everything cached). Holes only cost attention FLOPs; the cache
is compacted (each row's tokens moved right-aligned, padding on the left) when they pile up, and after every step
for sliding-window models, whose window is measured in columns. One row never has holes: its rejected tokens are
the cache's last columns, which are cropped.

Every KV layer is a `KVBuffer` (kv_cache.py): a verify writes its columns in place and a rollback moves a length. On
a GPU the cache is static (a capacity fixed when rows join, attention over the whole buffer under the engine's mask),
verify lengths are padded to a few buckets (1, 2, 4, 8, 16, 32, or the block), and the verify (with the drafter's
block pass) can be compiled (`--compile`, compiled.py and compiled_draft.py: a CUDA graph per shape on a GPU,
frozen C++ kernels on a CPU). `valid` lives on the host, so a step waits for the device once: greedy rows are
accepted with one transfer (a drafter's fixed block goes to the verify without a stop; the cost-aware policy reads
the drafts and their confidences on the host, a second one).

A row that finishes or is cancelled leaves between steps and its cache rows are freed at once. `generate`,
`generate_ar`, `generate_batch` and the server all run this loop. At temperature 0 each row's output is the target's
own greedy decoding; at temperature > 0 it is the sample plain decoding draws with the same seed (sampling.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..kernels import attention
from ..sampling import (
    ACCEPT_STREAM,
    SamplingParams,
    position_uniforms,
    sample_token,
    verify_block,
    verify_block_pq,
    verify_greedy_rows,
)
from ..targets.capabilities import is_sliding, uses_static_cache
from ..targets.multimodal import as_prompt, check_prompt_inputs
from ..targets.recurrent import append_rows, has_kv, is_recurrent_layer, select_rows
from ..targets.target import Target, TargetOutput
from .compiled import verify_forward
from .grammar import Constraint, RowGrammar, compile_constraint, mask_logits
from .kv_cache import (
    VERIFY_BUCKETS,
    batch_cache,
    bucket,
    kv_layers,
    narrow_width,
    reserve,
    set_length,
    static_mask,
)
from .request import BatchRow, GenerationError, GenerationResult, check_request, sync
from .tree import block_layout, depths, tree_refusal, tree_window, verify_tree

if TYPE_CHECKING:
    from .proposers import BatchProposer


def cut_emitted(emitted: list[int], remaining: int, stops: set[int]) -> tuple[list[int], bool]:
    """A step's emitted tokens cut to the `remaining` budget and after the first stop token (which a stop ends the
    output inside an accepted run with); returns (tokens kept, whether a stop token ended them)."""
    emitted = emitted[:remaining]
    for i, tok in enumerate(emitted):
        if tok in stops:
            return emitted[: i + 1], True
    return emitted, False


# ---------------------------------------------------------------------------------------------------------- decoder
class BatchDecoder:
    """Rows join (`add`), advance together (`step`) and leave (finished, or `cancel`) between steps."""

    def __init__(
        self,
        target: Target,
        proposer: BatchProposer,
        max_batch_size: int | None = None,
        block_size: int | None = None,
    ) -> None:
        """`block_size`: at most this many tokens verified per row and step (anchor included); None: the
        proposer's block."""
        target.check_decodable()
        self.target = target
        self.proposer = proposer
        self.max_batch_size = max_batch_size
        self.rows: list[BatchRow] = []
        self.cache: Any = None
        # [b, C] bool, on the host: which cache column holds a token of which row (every decision on it is taken
        # without waiting for the device; a verify sends it over as its mask)
        self.valid: torch.Tensor | None = None
        self.sliding = is_sliding(target)
        # Draft trees (tree.py): why this target cannot verify them exactly, if it cannot; a sliding window's size.
        self.tree_refusal, self.tree_window = tree_refusal(target), tree_window(target)
        on_gpu = target.device.type == "cuda"
        # The static cache (kv_cache.py): the target's kernel plan says (compiled, or on a GPU), where the target
        # allows it (tests run it on the CPU eagerly: `target.use_plan(target.plan.replace(static_cache=True))`).
        self.static = uses_static_cache(target)
        self.verify = verify_forward(target, proposer.tap_layer_ids) if self.static else None
        self.narrow_mask = self.static and attention.narrow_mask(target.model, target.device, target.dtype)
        # Verify lengths padded up to a few sizes on a GPU and with the static cache, so a step has one of a handful
        # of shapes (what a captured graph needs); the padding is verified like drafts, so it can only add tokens.
        self.verify_buckets: tuple[int, ...] | None = VERIFY_BUCKETS if on_gpu or self.static else None
        self.block_size = proposer.max_block_size if block_size is None else block_size
        if not 1 <= self.block_size <= proposer.max_block_size:
            raise GenerationError(
                f"block_size must be between 1 and the proposer's block size {proposer.max_block_size}, "
                f"got {self.block_size}"
            )
        buckets = self.verify_buckets
        proposer.padded_lengths = (
            [bucket(n, self.block_size, buckets) for n in range(1, self.block_size + 1)] if buckets else None
        )

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
        constraint: Constraint | None = None,
    ) -> BatchRow:
        """Prefill a new row and put it in the batch (unless its first token already ends it: then it is
        returned done and never joins). `constraint`: the output must match it (structured output, grammar.py);
        an invalid one raises GrammarError before any decoding."""
        if self.full:
            raise GenerationError(f"the batch is full ({self.max_batch_size} rows)")
        ids = check_request(self.target, input_ids, max_new_tokens)
        inputs = check_prompt_inputs(self.target, as_prompt(input_ids)[1])  # an image prompt's pixels etc.
        grammar = None if constraint is None else RowGrammar(compile_constraint(self.target, constraint))
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        stops = set(self.target.eos_token_ids if stop_token_ids is None else stop_token_ids)
        row = BatchRow(ids, max_new_tokens, sampling, stops, seed, on_tokens, tag=tag, grammar=grammar)
        sync(self.target.device)
        t0 = time.perf_counter()
        cache = batch_cache(self.target)
        out = self.target.forward(
            ids, cache, self.proposer.tap_layer_ids, last_logits_only=True, inputs=inputs, prefill=True
        )
        row.rope_offset = self.target.rope_offset(inputs)
        prompt_len = ids.shape[1]
        last = out.logits[:, -1:].contiguous()
        if grammar is not None and mask_logits(last, {0: []}, {0: grammar}):
            row.result = GenerationResult(sequences=ids, prompt_length=prompt_len)
            row.started = time.perf_counter()
            row.result.prefill_s = row.started - t0
            row.finish("no_allowed_token")  # the grammar allows no first token with this tokenizer
            return row
        first = sample_token(last[0, 0], sampling, row.uniforms(prompt_len, 1), prompt_len)
        row.tokens.append(first)
        row.history.extend([*ids[0].tolist(), first])
        if grammar is not None:
            grammar.advance([first])
        sync(self.target.device)
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
        self._merge(cache, prompt_len, max_new_tokens)
        self.rows.append(row)
        self.proposer.add(row, out.features)
        if self.static and self.verify.compiled:
            self._compile_ahead()
        return row

    def _compile_ahead(self) -> None:
        """Compiled: the verify's two graphs with these taps (one token; 2-64 tokens, symbolic) made now, so a step
        that first verifies one token (the policy's plain step) does not compile mid-answer; once for one row and
        once for several (dynamo keeps a size of 1 apart). Their columns are written past the valid length and
        dropped (a length moved back), as a rejected block's are."""
        # dynamo guards on the grad mode: each mode's graphs are others
        key = (torch.is_inference_mode_enabled(), len(self.rows) > 1)
        if key in self.verify.compiled_ahead:
            return
        self.verify.compiled_ahead.add(key)
        columns = self.valid.shape[1]
        device = self.target.device
        last = torch.tensor([r.tokens[-1] for r in self.rows], device=device)[:, None]
        starts = torch.tensor([r.anchor_position for r in self.rows], device=device)
        for n in (1, 2):
            self.forward_block(last.expand(-1, n), starts[:, None] + torch.arange(n, device=device))
            set_length(self.cache, columns)

    def _merge(self, cache: Any, length: int, new_tokens: int) -> None:
        """Append a prefilled single-row cache: right-aligned, so every row's latest token sits in the last column."""
        if self.cache is None:
            self.cache = cache
            self.valid = torch.ones(1, length, dtype=torch.bool)
            if self.static:
                self._reserve(length, new_tokens)
            return
        width = self.valid.shape[1]
        total = max(width, length)
        if self.static:
            self._reserve(total, new_tokens)
        for big, small in zip(self.cache.layers, cache.layers, strict=True):
            if is_recurrent_layer(big):
                append_rows(big, small)
            if not has_kv(big):
                continue
            if self.static:
                big.add_static_row(small.keys, small.values, total)
                continue
            for name in ("keys", "values"):
                a, s = getattr(big, name), getattr(small, name)
                merged = a.new_zeros(a.shape[0] + 1, a.shape[1], total, a.shape[3])
                merged[:-1, :, total - width :] = a
                merged[-1, :, total - length :] = s[0]
                setattr(big, name, merged)
        valid = torch.zeros(self.valid.shape[0] + 1, total, dtype=torch.bool)
        valid[:-1, total - width :] = self.valid
        valid[-1, total - length :] = True
        self.valid = valid

    def _reserve(self, columns: int, new_tokens: int) -> None:
        """Static cache: room for `columns` plus what the rows (and the one joining, `new_tokens`) may still
        write; the verify grows it further if holes need more."""
        ahead = max([r.max_new_tokens - len(r.tokens) for r in self.rows] + [new_tokens]) + self.block_size
        reserve(self.cache, columns + ahead, mark_static=self.verify.compiled)

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
        self.valid = self.valid[keep]
        used = self.valid.any(0)  # drop columns no remaining row uses
        cols = used.nonzero().squeeze(1) if not bool(used.all()) else None
        if cols is not None:
            self.valid = self.valid[:, cols]
            cols = cols.to(self.target.device)
        idx = torch.tensor(keep, dtype=torch.long, device=self.target.device)
        for layer in self.cache.layers:
            if is_recurrent_layer(layer):
                select_rows(layer, idx)
            if not has_kv(layer):
                continue
            if self.static:
                layer.keep_static_rows(idx, cols)
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
        aligned = torch.arange(columns)[None] >= columns - counts[:, None]
        if columns == width and bool((aligned == self.valid).all()):
            return
        if not self.sliding and columns <= int(1.25 * width) + 16:
            return  # holes are cheap until they pile up
        # Per row: padding columns first (any, they stay masked), then its valid columns in order.
        order = torch.argsort(self.valid.int(), dim=1, stable=True)[:, columns - width :].to(
            self.target.device
        )
        for layer in kv_layers(self.cache):
            for name in ("keys", "values"):
                t = getattr(layer, name)
                idx = order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
                setattr(layer, name, torch.gather(t, 2, idx))
        self.valid = torch.arange(width)[None] >= width - counts[:, None]

    # -------------------------------------------------------------- one step for every row
    def _block(self, rows: list[BatchRow], proposals: list[torch.Tensor], n: int) -> torch.Tensor:
        """[b, n] on the device: each row's anchor, its proposals, then padding (its last proposal again, verified
        like drafts). Proposals of one length that are on the device already (a drafter's fixed block) stay there."""
        device = self.target.device
        anchors = torch.tensor([r.tokens[-1] for r in rows])
        k = proposals[0].shape[0]
        if all(p.shape[0] == k and p.device == device for p in proposals):
            anchors = anchors.to(device)[:, None]
            drafts = torch.stack(proposals) if k else anchors[:, :0]
            pad = (drafts[:, -1:] if k else anchors).expand(-1, n - 1 - k)
            return torch.cat([anchors, drafts, pad], 1)
        block = torch.empty(len(rows), n, dtype=torch.long)
        block[:, 0] = anchors
        for i, p in enumerate(proposals):
            block[i, 1 : 1 + p.shape[0]] = p
            block[i, 1 + p.shape[0] :] = p[-1] if p.shape[0] else anchors[i]
        return block.to(device)

    def forward_block(
        self, block: torch.Tensor, positions: torch.Tensor, tree: torch.Tensor | None = None
    ) -> TargetOutput:
        """The target's forward over the block [b, n] after the cache, which then holds the block's columns.
        `tree` [b, n, n] bool: which block columns each one sees (draft trees, tree.py; None: causal)."""
        n = block.shape[1]
        if (
            self.target.multimodal_rope
        ):  # the model's defaults follow its last prefill: positions always given
            shifts = [r.rope_offset for r in self.rows]
            positions = self.target.model_positions(positions, torch.tensor(shifts) if any(shifts) else None)
        if self.static:
            columns = self.valid.shape[1]
            # A narrow mask (the columns in use, rounded up: what the attention reads) stays narrower than the
            # capacity: one free column is kept. A mask as wide as the cache is another graph (dynamo guards on
            # whether the keys cut to its width are the whole buffer).
            static = reserve(
                self.cache, columns + n + int(self.narrow_mask), mark_static=self.verify.compiled
            )
            static.columns = torch.arange(columns, columns + n, device=block.device)
            valid = self.valid.to(block.device, non_blocking=True)
            tree = None if tree is None else tree.to(block.device, non_blocking=True)
            width = narrow_width(columns + n, static.capacity) if self.narrow_mask else static.capacity
            mask = static_mask(valid, n, width, self.target.dtype, tree)
            out = self.verify(block, positions, mask, self.cache)
            set_length(self.cache, columns + n)
            return out
        if tree is not None:  # a [b, 1, n, C + n] additive mask: each row's cached columns, then its tree
            valid = self.valid[:, None, :].expand(-1, n, -1)
            sees = torch.cat([valid, tree], 2)[:, None].to(block.device)
            mask = torch.zeros(sees.shape, dtype=self.target.dtype, device=block.device)
            mask.masked_fill_(~sees, torch.finfo(self.target.dtype).min)
            return self.target.forward(
                block, self.cache, self.proposer.tap_layer_ids, attention_mask=mask, position_ids=positions
            )
        # Without holes every row holds the same C tokens: no explicit mask (one row always; the causal fast path of
        # SDPA stays available). Positions are always given: a model without them counts the cache's tokens, and
        # transformers >= 5.25 counts those of a linear-attention layer (layer 0 of Qwen3.5 and LFM2), which the
        # rollback and the batch's column bookkeeping do not keep.
        mask = None
        if not bool(self.valid.all()):
            mask = torch.cat([self.valid, self.valid.new_ones(len(self.valid), n)], 1).long().to(block.device)
        return self.target.forward(
            block, self.cache, self.proposer.tap_layer_ids, attention_mask=mask, position_ids=positions
        )

    def _check_tree(self, row: BatchRow, n: int) -> None:
        """A draft tree is verified under a mask of its own (no sliding window, no recurrent state): a proposer that
        gives one where that is not exact (a block of n reaching past a sliding window) is a bug, never run."""
        if self.tree_refusal is not None:
            raise RuntimeError(f"a draft tree was proposed for a target with {self.tree_refusal}")
        if self.tree_window is not None and row.anchor_position + n + 1 >= self.tree_window:
            raise RuntimeError(f"a draft tree was proposed past the target's {self.tree_window}-token window")

    def _gather_block(self, order: torch.Tensor, n: int) -> None:
        """Draft trees: the first columns of each row's block (the cache's last n) taken from the block's columns
        `order` [b, m] (its accepted path first), so the columns it keeps are the block's first ones, as a chain's
        are; the block's other columns are dropped, as a rejected chain's are."""
        m = order.shape[1]
        order = order.to(self.target.device)
        for layer in kv_layers(self.cache):
            for name in ("keys", "values"):
                tail = getattr(layer, name)[:, :, -n:]
                idx = order[:, None, :, None].expand(-1, tail.shape[1], -1, tail.shape[3])
                tail[:, :, :m].copy_(torch.gather(tail, 2, idx))

    @staticmethod
    def _constrain(rows: list[BatchRow], block: torch.Tensor, out: TargetOutput) -> dict[int, int]:
        """Structured output: each constrained row's logits masked by its grammar along its block (grammar.py);
        returns the rows whose grammar allows no token at some position, and that position."""
        grammars = {i: r.grammar for i, r in enumerate(rows) if r.grammar is not None}
        if not grammars:
            return {}
        out.greedy = None  # reduced from the logits before their masking: the accept reduces the masked ones
        if not out.logits.is_contiguous():
            out.logits = out.logits.contiguous()
        drafts = block[list(grammars), 1:].tolist()
        return mask_logits(out.logits, dict(zip(grammars, drafts, strict=True)), grammars)

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
        # Draft trees (tree.py): each tree row's parents over the block; chains keep the causal block.
        trees = {i: t for i in range(len(rows)) if (t := self.proposer.tree_parents(i)) is not None}
        for i, (p, m) in enumerate(zip(proposals, max_drafts, strict=True)):
            length = max(depths(trees[i]), default=-1) + 1 if i in trees else p.shape[0]
            if length > max(m, 0):
                raise RuntimeError(
                    f"{type(self.proposer).__name__} proposed {length} tokens deep, at most {m} allowed"
                )
        n = 1 + max(p.shape[0] for p in proposals)
        if self.verify_buckets:
            n = bucket(n, self.block_size, self.verify_buckets)
        for i in trees:
            self._check_tree(rows[i], n)
        block = self._block(rows, proposals, n)
        starts = torch.tensor([r.anchor_position for r in rows], device=device)
        parents, tree_mask, block_ids = None, None, None
        if trees:
            parents, depth, tree_mask = block_layout(trees, [p.shape[0] for p in proposals], n)
            positions = starts[:, None] + depth.to(device)
            block_ids = block.tolist()
        else:
            positions = starts[:, None] + torch.arange(n, device=device)
        t0 = time.perf_counter()
        out = self.forward_block(block, positions, tree_mask)
        t_grammar = time.perf_counter()
        dead = self._constrain(rows, block, out)
        # the batch's masking time, shared out among its constrained rows (a row's grammar_s is its part: the
        # server sums them)
        t_grammar = (time.perf_counter() - t_grammar) / max(1, sum(r.grammar is not None for r in rows))

        kept = torch.zeros(len(rows), n, dtype=torch.bool)
        finished, features, own_accepted, kept_counts = [], [], [], []
        paths: list[list[int] | None] = [None] * len(rows)  # tree rows: the nodes their target accepted
        order = torch.arange(n).repeat(len(rows), 1) if trees else None  # tree rows: their path first
        moved = 0  # the longest path: the columns a tree row keeps are at most its path's
        # Greedy rows: one accept decision for all of them, one transfer to the host.
        greedy = [i for i, r in enumerate(rows) if r.sampling.greedy and i not in trees]
        # No copy of the logits when every row is greedy.
        pick = slice(None) if len(greedy) == len(rows) else greedy
        reduced = None if out.greedy is None else (out.greedy[0][pick], out.greedy[1][pick])
        decided = verify_greedy_rows(out.logits[pick], block[pick, 1:], reduced) if greedy else None
        decided = dict(zip(greedy, decided, strict=True)) if decided is not None else {}
        for i, row in enumerate(rows):
            real = proposals[i].shape[0]
            path = None
            if i in decided:
                accepted, emitted = decided[i]
            elif i in trees:
                path, emitted = verify_tree(
                    out.logits[i],
                    block_ids[i],
                    parents[i],
                    row.sampling,
                    row.uniforms(row.anchor_position + 1, n),
                    None if out.greedy is None else (out.greedy[0][i], out.greedy[1][i]),
                )
                accepted = len(path) - 1
            elif self.proposer.sampled_drafts and not row.sampling.greedy:  # speculative sampling (p/q)
                start = row.anchor_position + 1
                accepted, emitted = verify_block_pq(
                    out.logits[i, : real + 1],
                    proposals[i],
                    self.proposer.draft_probs(i),
                    row.sampling,
                    position_uniforms(row.seed ^ ACCEPT_STREAM, start, real),
                    row.uniforms(start, real + 1),
                    start,
                )
            else:
                accepted, emitted = verify_block(
                    out.logits[i],
                    block[i, 1:],
                    row.sampling,
                    row.uniforms(row.anchor_position + 1, n),
                    row.anchor_position + 1,
                )
            reason = None
            if i in dead and dead[i] <= accepted:  # the grammar allows no token there: the row ends before it
                accepted, emitted, reason = dead[i], emitted[: dead[i]], "no_allowed_token"
            if path is None:
                own_accepted.append(min(accepted, real))
            else:
                paths[i] = [c - 1 for c in path[1 : accepted + 1] if c <= real]
                own_accepted.append(len(paths[i]))
                order[i] = torch.tensor(path + [c for c in range(n) if c not in path])
                moved = max(moved, len(path))
            emitted, stopped = cut_emitted(emitted, remaining[i], row.stops)
            if stopped:
                reason = "stop_token"
            row.tokens.extend(emitted)
            row.history.extend(emitted)
            if row.grammar is not None:
                t = time.perf_counter()
                row.grammar.advance(emitted)
                row.result.grammar_s += t_grammar + time.perf_counter() - t
            res = row.result
            res.acceptance_lengths.append(len(emitted))
            res.draft_lengths.append(real)
            res.accepted_drafts.append(own_accepted[-1])
            if row.on_tokens and row.on_tokens(emitted) is True and reason is None:
                reason = "caller"
            if reason is None and len(row.tokens) >= row.max_new_tokens:
                reason = "max_new_tokens"
            kept[i, : accepted + 1] = True
            kept_counts.append(accepted + 1)
            taken = slice(None, accepted + 1) if path is None else path[: accepted + 1]
            features.append(None if out.features is None else out.features[i : i + 1, taken])
            if reason is not None:
                res.proposer_stats = self.proposer.stats(i)
                row.finish(reason)
                finished.append(row)
        if trees and not bool((order[:, :moved] == torch.arange(moved)).all()):
            self._gather_block(order[:, :moved], n)
        # Recurrent state: each row keeps its anchor + accepted drafts (its KV columns are masked below).
        self.target.keep(self.cache, kept_counts)
        # Verify forward + acceptance bookkeeping: what a step costs besides proposing.
        context = sum(r.anchor_position for r in rows) // len(rows)
        self.proposer.timed(len(rows), n, context, time.perf_counter() - t0)
        self.proposer.observe(rows, [p.shape[0] for p in proposals], own_accepted, paths)
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


__all__ = ["BatchDecoder", "cut_emitted"]
