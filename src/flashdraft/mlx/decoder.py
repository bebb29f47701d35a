"""The MLX decode loop: one request, DFlash or plain decoding (plain is the same loop with no drafts).

    prefill  target(prompt) -> logits, the tapped layers' features; the first token drawn at position P
    propose  prompt lookup (the text's last n-gram found earlier: what followed it), or the drafter:
             block [anchor, MASK x (B-1)] at positions anchor..anchor+B-1 over its cached context -> drafts
    verify   target([anchor] + n drafts) -> the target's token at each of the n+1 positions (sampling.py)
    accept   the longest prefix of drafts equal to them, plus the target's token after it
    rollback the target's KV cache trimmed by the n - a rejected tokens (recurrent layers: back to their state before
             the verify, the a + 1 kept tokens run again); the drafter's context grows by the anchor and the a accepted
             drafts (their features from this verify)

A block is always drafted whole (its length is part of the drafter's input) and a prefix of it verified: `block_size`
N verifies at most N tokens; "auto" lets the cost-aware policy (policy.py) choose per step on prices measured on this
device, a plain step (no draft pass) included. Never past `max_new_tokens`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.grammar import (
    Constraint,
    RowGrammar,
    compile_constraint,
    constraint_from_response_format,
    mask_logits,
)
from ..engine.lookup import LOOKUP_MAX_NGRAM, LOOKUP_MAX_TOKENS, prompt_lookup
from ..engine.request import BatchRow, GenerationError, GenerationResult, check_block_size, check_prompt_fits
from ..sampling import SamplingParams
from .drafter import DraftContext, MlxDrafter, load_drafter
from .policy import VerifyPolicy, measure_prices
from .sampling import target_tokens
from .target import MlxTarget, load_target


@dataclass
class MlxPipeline:
    """A target and its drafter on MLX (what `flashdraft generate --backend mlx` loads)."""

    target: MlxTarget
    drafter: MlxDrafter | None


def load_pipeline(target: str | Path, draft: str | Path | None, dtype: str | None = None) -> MlxPipeline:
    """The target through mlx-lm and the drafter from its z-lab checkpoint, checked against each other. `dtype`:
    the drafter's (None: the target's embedding dtype, as the torch backend casts it to the target's)."""
    from ..drafter.checkpoint import load_drafter_config
    from ..targets.target import check_drafter_fits

    tgt = load_target(target)
    if draft is None:
        return MlxPipeline(tgt, None)
    config = load_drafter_config(draft)
    check_drafter_fits(config, tgt.hidden_size, tgt.num_layers, tgt.vocab_size, tgt.name)
    if dtype is None:  # the target's activations' precision, as the torch backend casts its drafter
        dtype = tgt.dtype if tgt.dtype in ("float32", "bfloat16", "float16") else "float32"
    drafter = load_drafter(draft, dtype)
    tgt.tap(config.target_layer_ids)
    return MlxPipeline(tgt, drafter)


def _prompt_ids(input_ids: Any, target: MlxTarget, max_new_tokens: int) -> list[int]:
    if isinstance(input_ids, (str, bytes)):
        raise GenerationError("input_ids must be token ids, not text: encode the prompt first")
    ids = input_ids.tolist() if hasattr(input_ids, "tolist") else list(input_ids)
    if ids and isinstance(ids[0], list):
        if len(ids) != 1:
            raise GenerationError(f"batch size {len(ids)}: the MLX backend decodes one sequence at a time")
        ids = ids[0]
    if not ids:
        raise GenerationError("the prompt is empty")
    if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in ids):
        raise GenerationError("input_ids must be integer token ids")
    check_prompt_fits(len(ids), min(ids), max(ids), max_new_tokens, target)
    return [int(t) for t in ids]


class MlxDecoder:
    """Rows join (`add`), advance (`step`) and leave (finished, or `cancel`) between steps: the torch engine's
    `BatchDecoder` surface, so `generate` and the server run the same loop. The MLX backend decodes one row at a time
    (`max_batch_size` 1): a request is a batch of one, and the server queues the others."""

    static = False  # nothing compiled: the server has no graphs to warm up

    def __init__(
        self,
        target: MlxTarget,
        drafter: MlxDrafter | None,
        block_size: int | str | None = "auto",
        lookup: bool = False,
        max_batch_size: int | None = 1,
    ) -> None:
        """`block_size`: at most this many tokens verified per step (anchor included), "auto" (or None) the
        cost-aware policy; `drafter` None: plain decoding, or with `lookup` prompt-lookup decoding."""
        if max_batch_size not in (None, 1):
            raise GenerationError("the MLX backend decodes one request at a time (max_batch_size 1)")
        self.target, self.drafter, self.lookup = target, drafter, lookup
        self.max_batch_size = 1
        self.rows: list[BatchRow] = []
        self._state: dict[int, _RowState] = {}
        limit = drafter.block_size if drafter is not None else LOOKUP_MAX_TOKENS + 1 if lookup else 1
        fixed = check_block_size(block_size, limit) if limit > 1 else 1
        self.block_size = fixed or limit
        self.policy: VerifyPolicy | None = None
        if drafter is not None and fixed is None:  # "auto": the cost-aware policy, on this device's prices
            if drafter.prices is None:
                drafter.prices = measure_prices(target, drafter)
            # What it learns (acceptance, whether drafting pays) carries over from request to request.
            if drafter.policy is None or drafter.policy.prices is not drafter.prices:
                drafter.policy = VerifyPolicy(drafter.prices, drafter.block_size - 1)
            self.policy = drafter.policy

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def full(self) -> bool:
        return len(self.rows) >= self.max_batch_size

    def add(
        self,
        input_ids: Any,
        max_new_tokens: int,
        sampling: SamplingParams,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        on_tokens: Callable[[list[int]], Any] | None = None,
        tag: Any = None,
        constraint: Any = None,
    ) -> BatchRow:
        """Prefill a new row (its first token drawn); it joins unless that token already ends it."""
        import torch  # the row's prompt as the engine's rows hold it (its result's ids come from it)

        if self.full:
            raise GenerationError(f"the batch is full ({self.max_batch_size} row)")
        ids = _prompt_ids(input_ids, self.target, max_new_tokens)
        seed = int(seed) if seed is not None else int(np.random.default_rng().integers(0, 2**62))
        stops = set(self.target.eos_token_ids if stop_token_ids is None else stop_token_ids)
        grammar = None if constraint is None else RowGrammar(compile_constraint(self.target, constraint))
        row = BatchRow(
            torch.tensor([ids]), max_new_tokens, sampling, stops, seed, on_tokens, tag=tag, grammar=grammar
        )
        cache = self.target.make_cache()
        self.target.check_rollback(cache)
        t0 = time.perf_counter()
        logits, features = self.target.forward(ids, cache)
        state = _RowState(cache, DraftContext())
        if self.drafter is not None:
            state.context.append(self.drafter.context_kv(features, 0))
        state.policy = self.policy
        last = logits[-1:] if grammar is None else np.array(logits[-1:])  # a grammar masks host rows
        if grammar is not None and _constrain(last, [], grammar) == 0:
            row.result = GenerationResult(sequences=row.prompt, prompt_length=len(ids))
            row.started = time.perf_counter()
            row.result.prefill_s = row.started - t0
            row.finish("no_allowed_token")  # the grammar allows no first token with this tokenizer
            return row
        first = target_tokens(last, sampling, seed, len(ids))[0]
        if grammar is not None:
            grammar.advance([first])
        row.tokens.append(first)
        row.history.extend([*ids, first])
        row.started = time.perf_counter()
        row.result = GenerationResult(
            sequences=row.prompt, prompt_length=len(ids), prefill_s=row.started - t0
        )
        reason = "stop_token" if first in stops else "max_new_tokens" if max_new_tokens == 1 else None
        if on_tokens and on_tokens([first]) is True and reason is None:
            reason = "caller"
        if reason is not None:
            row.finish(reason)
            return row
        self.rows.append(row)
        self._state[id(row)] = state
        return row

    def cancel(self, row: BatchRow, reason: str = "cancelled") -> None:
        """Take a row out now (the client went away); its caches are dropped."""
        if row in self.rows:
            self.rows.remove(row)
            self._state.pop(id(row), None)
        if not row.done:
            row.finish(reason)

    def step(self) -> list[BatchRow]:
        """One speculative step of every row; returns the rows it finished."""
        finished = []
        for row in list(self.rows):
            if self._advance(row, self._state[id(row)]):
                self.rows.remove(row)
                del self._state[id(row)]
                finished.append(row)
        return finished

    def _advance(self, row: BatchRow, state: _RowState) -> bool:
        target, drafter, policy = self.target, self.drafter, state.policy
        prompt_len = row.prompt.shape[1]
        anchor, anchor_position = (
            row.tokens[-1],
            prompt_len + len(row.tokens) - 1,
        )  # not yet seen by the target
        drafts: list[int] = []
        confidences: list[float] = []
        ngram = 0  # > 0: the drafts are prompt lookup's, from an n-gram match of this size
        n = min(self.block_size - 1, row.max_new_tokens - len(row.tokens) - 1)
        if n > 0 and (self.lookup or policy is not None):
            found, ngram = prompt_lookup(row.history, min(n, LOOKUP_MAX_TOKENS), LOOKUP_MAX_NGRAM)
            take = len(found) if policy is None else policy.lookup_length(ngram, len(found)) if found else 0
            drafts, ngram = found[:take], ngram if take else 0
        if drafter is not None and n > 0 and not ngram and (policy is None or policy.draft_now()):
            drafts, confidences = drafter.draft(
                target, state.context, anchor, anchor_position, policy is not None
            )
            drafts = drafts[: n if policy is None else min(n, policy.choose(confidences))]
        snapshot = target.snapshot(state.cache) if drafts else None
        logits, features = target.forward([anchor, *drafts], state.cache)
        dead = None
        if row.grammar is not None:  # its masks are written into host rows
            logits = np.array(logits)
            dead = _constrain(logits, drafts, row.grammar)
        verified = target_tokens(logits, row.sampling, row.seed, anchor_position + 1)
        a = 0
        while a < len(drafts) and drafts[a] == verified[a]:
            a += 1
        if policy is not None and drafts:
            if ngram:
                policy.observe_lookup(ngram, len(drafts), a)
            else:
                policy.observe(confidences, len(drafts), a)
        if len(drafts) > a:  # the rejected drafts leave the target's cache
            target.rollback(state.cache, snapshot, [anchor, *drafts], a + 1)
        if drafter is not None:  # the anchor and the accepted drafts join the drafter's context
            state.context.append(drafter.context_kv(features[: a + 1], anchor_position))
        emitted, reason = verified[: a + 1], None
        if dead is not None and dead <= a:  # the grammar allows no token there: the row ends before it
            emitted, reason = emitted[:dead], "no_allowed_token"
        for i, tok in enumerate(emitted):
            if tok in row.stops:
                emitted, reason = emitted[: i + 1], "stop_token"
                break
        emitted = emitted[: row.max_new_tokens - len(row.tokens)]
        if row.grammar is not None:
            row.grammar.advance(emitted)
        row.tokens.extend(emitted)
        row.history.extend(emitted)
        result = row.result
        result.acceptance_lengths.append(len(emitted))
        result.draft_lengths.append(len(drafts))
        result.accepted_drafts.append(a)
        if reason is None and len(row.tokens) >= row.max_new_tokens:
            reason = "max_new_tokens"
        if row.on_tokens and row.on_tokens(emitted) is True and reason is None:
            reason = "caller"
        if reason is not None:
            row.finish(reason)
        return reason is not None


def _constrain(logits: np.ndarray, drafts: list[int], grammar: RowGrammar) -> int | None:
    """A constrained row's logits [n + 1, V] masked in place, position j by the grammar's state after the first j
    drafts (engine/grammar.py's rule, through xgrammar's masks on a view of the same memory); returns the first
    position no token can take there, or None."""
    import torch

    view = torch.from_numpy(logits)[None]  # [1, n + 1, V], the same memory
    return mask_logits(view, {0: drafts}, {0: grammar}).get(0)


@dataclass
class _RowState:
    """What a row keeps on MLX between steps: the target's KV cache, the drafter's context, its policy."""

    cache: list[Any]
    context: DraftContext
    policy: VerifyPolicy | None = None


def decode(
    target: MlxTarget,
    drafter: MlxDrafter | None,
    input_ids: Any,
    max_new_tokens: int = 256,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    block_size: int | str | None = "auto",
    stop_token_ids: Sequence[int] | None = None,
    on_tokens: Callable[[list[int]], Any] | None = None,
    lookup: bool = False,
    response_format: Any = None,
) -> GenerationResult:
    """One request through `MlxDecoder`. `drafter` None: plain decoding (one token per target forward), or with
    `lookup` prompt-lookup decoding (proposals copied from earlier in the text)."""
    params = SamplingParams(temperature, top_p, top_k)
    decoder = MlxDecoder(target, drafter, block_size, lookup)
    constraint = response_format
    if response_format is not None and not isinstance(response_format, Constraint):
        constraint = constraint_from_response_format(response_format)  # OpenAI's dict, as the torch API takes
    row = decoder.add(
        input_ids, max_new_tokens, params, stop_token_ids, seed, on_tokens, constraint=constraint
    )
    while not row.done:
        decoder.step()
    return row.result


def generate(target: MlxTarget | MlxPipeline, drafter: MlxDrafter | None = None, *args: Any, **kwargs: Any):
    """DFlash decoding on MLX (`decode` with the pipeline's drafter); the same arguments as `decode`."""
    if isinstance(target, MlxPipeline):
        target, drafter = target.target, target.drafter
    if drafter is None:
        raise GenerationError("generate needs a drafter: use generate_ar for plain decoding")
    return decode(target, drafter, *args, **kwargs)


def generate_ar(target: MlxTarget | MlxPipeline, *args: Any, **kwargs: Any) -> GenerationResult:
    """Plain decoding on MLX: one token per target forward, the same loop and sampling law."""
    if isinstance(target, MlxPipeline):
        target = target.target
    kwargs.pop("block_size", None)
    return decode(target, None, *args, **kwargs)
