"""The decode engine: one loop for one row or many (a request is a batch of one, as in vLLM).

    prefill   each row joins with its own prefill (batch size 1) and is merged into the batch cache
    propose   a BatchProposer gives each row its proposals (ragged; shorter rows are padded, and the padding is
              verified like any proposal, so it can only add tokens)
    verify    target(block [b, n], position ids per row, a [b, cached + n] validity mask): ONE forward for all rows
    accept    per row: verify_block on its logits, with its own sampling parameters and seed; stop and length cuts
    roll back KV: the cache keeps the columns some row still needs, a row's rejected columns become holes in its
              mask; recurrent state: each row keeps its accepted prefix (`Target.keep`: replay or stepwise)

So the batch's KV cache is one tensor per layer with C columns, and `valid[b, C]` says which column holds a real token
of which row. Rows hold different numbers of tokens, so the target gets explicit position ids, and causality follows
the columns (a new block always sits to the right of everything cached). Holes only cost attention FLOPs; the cache
is compacted (each row's tokens moved right-aligned, padding on the left) when they pile up, and after every step
for sliding-window models, whose window is measured in columns. One row never has holes: its rejected tokens are
the cache's last columns, which are cropped.

Every KV layer is a `KVBuffer`: a verify writes its columns into room kept at the end (no copy of the whole cache per
step), a rollback moves the length back. On a GPU the verify length is padded up to a bucket (1, 2, 4, 8, 16, 32, or
the block), so steps come in a handful of shapes; greedy rows are accepted with one transfer to the host per step.

A row that finishes or is cancelled leaves between steps and its cache rows are freed at once. `generate`,
`generate_ar`, `generate_batch` and the server all run this loop. At temperature 0 each row's output is the target's
own greedy decoding; at temperature > 0 it is the sample plain decoding draws with the same seed (sampling.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from typing import TYPE_CHECKING, Any

import torch

from .recurrent import append_rows, has_kv, is_recurrent_layer, select_rows
from .sampling import (
    ACCEPT_STREAM,
    SamplingParams,
    position_uniforms,
    sample_token,
    verify_block,
    verify_block_pq,
    verify_greedy_rows,
)
from .target import Target

if TYPE_CHECKING:
    from .proposers import BatchProposer


class GenerationError(ValueError):
    """Invalid generation request (batch, lengths, block size)."""


@dataclass
class GenerationResult:
    sequences: torch.Tensor  # [1, prompt + new] like transformers' generate
    prompt_length: int
    acceptance_lengths: list[int] = field(
        default_factory=list
    )  # tokens emitted per verify step, bonus included
    draft_lengths: list[int] = field(default_factory=list)  # drafts proposed per verify step
    accepted_drafts: list[int] = field(
        default_factory=list
    )  # drafts accepted per step (before stop/length cuts)
    prefill_s: float = 0.0  # prefill + first token
    decode_s: float = 0.0  # every verify step after that
    stop_reason: str = "max_new_tokens"
    proposer_stats: dict[str, Any] = field(
        default_factory=dict
    )  # e.g. steps by source for the adaptive proposer

    @property
    def new_tokens(self) -> list[int]:
        return self.sequences[0, self.prompt_length :].tolist()

    @property
    def num_new_tokens(self) -> int:
        return self.sequences.shape[1] - self.prompt_length

    @property
    def num_steps(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        """τ: mean tokens per verify step (1.0 for plain decoding)."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.num_new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens from the decode phase per second (the first token comes from prefill)."""
        n = self.num_new_tokens - 1
        return n / self.decode_s if self.decode_s > 0 and n > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_new_tokens": self.num_new_tokens,
            "num_steps": self.num_steps,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_lengths": self.acceptance_lengths,
            "draft_lengths": self.draft_lengths,
            "accepted_drafts": self.accepted_drafts,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "stop_reason": self.stop_reason,
            "proposer_stats": self.proposer_stats,
        }


def as_target(target: Target | Any) -> Target:
    return target if isinstance(target, Target) else Target(target)


def _as_input_ids(input_ids: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    if isinstance(input_ids, (str, bytes)):
        raise GenerationError(
            "input_ids must be token ids, not text: encode the prompt first, e.g. target.encode_prompt(text)"
        )
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise GenerationError(
                f"input_ids must be an integer tensor of token ids, got dtype {input_ids.dtype}"
            )
        ids = input_ids.long()
    else:
        rows = input_ids if len(input_ids) and isinstance(input_ids[0], (list, tuple)) else [input_ids]
        bad = next(
            (t for row in rows for t in row if isinstance(t, bool) or not isinstance(t, Integral)), None
        )
        if bad is not None:
            raise GenerationError(
                f"input_ids must be integer token ids, found {bad!r} ({type(bad).__name__})"
            )
        try:
            ids = torch.tensor(input_ids, dtype=torch.long)
        except (ValueError, TypeError) as e:
            raise GenerationError(f"input_ids must be a [n] or [1, n] list of token ids: {e}") from None
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2:
        raise GenerationError(f"input_ids must be [1, n] or [n], got shape {tuple(ids.shape)}")
    if ids.shape[0] != 1:
        raise GenerationError(
            f"batch size {ids.shape[0]}: generate() decodes one sequence; use generate_batch() for several prompts"
        )
    if ids.shape[1] == 0:
        raise GenerationError("the prompt is empty")
    return ids.to(device)


def check_request(
    target: Target, input_ids: torch.Tensor | Sequence[int], max_new_tokens: int
) -> torch.Tensor:
    """The prompt as a [1, n] id tensor on the target's device, after the checks every request gets."""
    target.check_decodable()
    ids = _as_input_ids(input_ids, target.device)
    prompt_len = ids.shape[1]
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if prompt_len + max_new_tokens > target.max_context:
        raise GenerationError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's context of "
            f"{target.max_context} tokens"
        )
    if int(ids.max()) >= target.vocab_size or int(ids.min()) < 0:
        raise GenerationError(f"prompt holds token ids outside the vocabulary (0..{target.vocab_size - 1})")
    return ids


def cut_emitted(emitted: list[int], remaining: int, stops: set[int]) -> tuple[list[int], bool]:
    """A step's emitted tokens cut to the `remaining` budget and after the first stop token (which a stop ends the
    output inside an accepted run with); returns (tokens kept, whether a stop token ended them)."""
    emitted = emitted[:remaining]
    for i, tok in enumerate(emitted):
        if tok in stops:
            return emitted[: i + 1], True
    return emitted, False


def check_block_size(block_size: int | str | None, max_block_size: int | None) -> int | None:
    """The verify length (anchor included) as the engine takes it: None for "auto" (the cost-aware policy chooses per
    step), else an integer in 1..max_block_size (the drafter's trained block; None: no drafter to bound it). The one
    check from the command line (`--block-size`) to the engine."""
    if block_size is None or (isinstance(block_size, str) and block_size.strip().lower() == "auto"):
        return None
    if isinstance(block_size, str):
        try:
            block_size = int(block_size)
        except ValueError:
            raise GenerationError(f"block_size must be 'auto' or an integer, got {block_size!r}") from None
    if not isinstance(block_size, Integral) or isinstance(block_size, bool) or block_size < 1:
        raise GenerationError(f"block_size must be 'auto' or a positive integer, got {block_size!r}")
    if max_block_size is not None and block_size > max_block_size:
        raise GenerationError(
            f"block_size must be between 1 and the drafter's block size {max_block_size}, got {block_size}"
        )
    return int(block_size)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
        _sync(self.prompt.device)
        if reason:
            self.result.stop_reason = reason
        self.result.decode_s = time.perf_counter() - self.started
        device = self.prompt.device
        self.result.sequences = torch.cat(
            [self.prompt, torch.tensor([self.tokens], dtype=torch.long, device=device)], dim=1
        )


# ---------------------------------------------------------------------------------------------------------- decoder
def _is_sliding(target: Target) -> bool:
    cfg = target.config
    types = getattr(cfg, "layer_types", None) or []
    return bool(getattr(cfg, "sliding_window", None)) and (
        not types or any("sliding" in str(t) for t in types) or getattr(cfg, "use_sliding_window", True)
    )


def _kv_buffer_class() -> type:
    """`KVBuffer`: a DynamicLayer whose K/V live in a buffer with room to grow. A verify writes its n columns in place
    instead of `torch.cat`-ing the whole cache of every layer (a copy of all the context, every step), and a rollback
    moves the length back. What rebuilds the cache (rows joining or leaving, compaction) assigns whole tensors, which
    become the buffer. Built on first use: transformers is imported lazily."""
    global _KV_BUFFER
    if _KV_BUFFER is not None:
        return _KV_BUFFER
    from transformers.cache_utils import DynamicLayer

    class _Columns:
        """`keys` / `values`: the columns in use of a buffer. Assigning a tensor makes it the buffer, unless it is the
        buffer cut shorter (a crop), which only moves the length."""

        def __init__(self, buffer: str, length: str) -> None:
            self.buffer, self.length = buffer, length

        def __get__(self, layer: Any, owner: type) -> torch.Tensor | None:
            buf = getattr(layer, self.buffer)
            return None if buf is None else buf[:, :, : getattr(layer, self.length)]

        def __set__(self, layer: Any, value: torch.Tensor | None) -> None:
            old = getattr(layer, self.buffer)
            cropped = (
                old is not None and value is not None and value.dim() == 4 and value.data_ptr() == old.data_ptr()
                and value.stride() == old.stride() and value.shape[:2] == old.shape[:2]
                and value.shape[3] == old.shape[3]
            )  # fmt: skip
            if not cropped:
                setattr(layer, self.buffer, value if value is not None and value.dim() == 4 else None)
            setattr(layer, self.length, value.shape[-2] if getattr(layer, self.buffer) is not None else 0)

    class KVBuffer(DynamicLayer):
        # Lengths kept apart: the engine assigns keys and values one after the other.
        keys = _Columns("_k", "_len")
        values = _Columns("_v", "_vlen")

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._k = self._v = None
            self._len = self._vlen = 0
            super().__init__(*args, **kwargs)

        def lazy_initialization(self, key_states: torch.Tensor, *args: Any) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            self._k = self._v = None
            self._len = self._vlen = 0
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, length = key_states.shape[-2], self._len
            need = length + n
            k, v = self._k, self._v
            if (
                k is None
                or v is None
                or k.shape[0] != key_states.shape[0]
                or need > min(k.shape[-2], v.shape[-2])
            ):
                room = need + max(64, need // 4)  # amortised: a copy of the cache every ~need/4 columns
                for name, new in (("_k", key_states), ("_v", value_states)):
                    buf = new.new_empty(new.shape[0], new.shape[1], room, new.shape[3])
                    old = getattr(self, name)
                    if old is not None and length:
                        buf[:, :, :length] = old[:, :, :length]
                    setattr(self, name, buf)
            self._k[:, :, length:need] = key_states
            self._v[:, :, length:need] = value_states
            self._len = self._vlen = need
            return self.keys, self.values

        def get_seq_length(self, *args: Any) -> int:
            return self._len if self._k is not None else 0

        def crop(self, max_length: int) -> None:
            """`max_length` < 0: remove that many columns (4.57 and 5.x); >= 0: keep that many (4.57)."""
            keep = self._len - abs(max_length) if max_length < 0 else max_length
            self._len = self._vlen = max(0, min(self._len, keep))

    _KV_BUFFER = KVBuffer
    return KVBuffer


_KV_BUFFER: type | None = None
VERIFY_BUCKETS = (1, 2, 4, 8, 16, 32)


def _batch_cache(target: Target) -> Any:
    """A cache of full-attention layers for every model (sliding windows come from the mask, over columns), beside
    the recurrent layers of a hybrid target; every KV layer a `KVBuffer`."""
    from transformers import DynamicCache

    kv_buffer = _kv_buffer_class()
    if target.recurrent is None:
        cache = DynamicCache()
        cache.layer_class_to_replicate = kv_buffer
        return cache
    cache = DynamicCache(config=target.model.config)
    cache.layers = [
        kv_buffer() if has_kv(layer) and not is_recurrent_layer(layer) else layer for layer in cache.layers
    ]
    return cache


def _kv_layers(cache: Any) -> list[Any]:
    return [layer for layer in cache.layers if has_kv(layer)]


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
        self.valid: torch.Tensor | None = None  # [b, C] bool: which cache column holds a token of which row
        self.sliding = _is_sliding(target)
        # Verify lengths padded up to a few sizes on a GPU, so a step has one of a handful of shapes (what a captured
        # graph or a compiled kernel needs); the padding is verified like drafts, so it can only add tokens.
        self.verify_buckets: tuple[int, ...] | None = VERIFY_BUCKETS if target.device.type == "cuda" else None
        self.block_size = proposer.max_block_size if block_size is None else block_size
        if not 1 <= self.block_size <= proposer.max_block_size:
            raise GenerationError(
                f"block_size must be between 1 and the proposer's block size {proposer.max_block_size}, "
                f"got {self.block_size}"
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
        _sync(self.target.device)
        t0 = time.perf_counter()
        cache = _batch_cache(self.target)
        out = self.target.forward(ids, cache, self.proposer.tap_layer_ids, last_logits_only=True)
        prompt_len = ids.shape[1]
        first = sample_token(out.logits[0, -1], sampling, row.uniforms(prompt_len, 1), prompt_len)
        row.tokens.append(first)
        row.history.extend([*ids[0].tolist(), first])
        _sync(self.target.device)
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
        if (
            self.verify_buckets
        ):  # the next bucket, or the decoder's block if that is smaller (a fixed size too)
            n = min(max(n, self.block_size), next((b for b in self.verify_buckets if b >= n), n))
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
        # Without holes every row holds the same C tokens and its block sits at positions C.., the model's own
        # defaults: no explicit mask (one row always; the causal fast path of SDPA stays available).
        mask = None
        if not bool(self.valid.all()):
            mask = torch.cat(
                [self.valid, torch.ones(len(rows), n, dtype=torch.bool, device=device)], 1
            ).long()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = self.target.forward(
            block,
            self.cache,
            self.proposer.tap_layer_ids,
            attention_mask=mask,
            position_ids=None if mask is None else positions,
        )

        kept = torch.zeros(len(rows), n, dtype=torch.bool, device=device)
        finished, features, own_accepted, kept_counts = [], [], [], []
        # Greedy rows: one accept decision for all of them, one transfer to the host.
        greedy = [i for i, r in enumerate(rows) if r.sampling.greedy]
        # No copy of the logits when every row is greedy.
        pick = slice(None) if len(greedy) == len(rows) else greedy
        decided = verify_greedy_rows(out.logits[pick], block[pick, 1:]) if greedy else None
        decided = dict(zip(greedy, decided, strict=True)) if decided is not None else {}
        for i, row in enumerate(rows):
            real = proposals[i].shape[0]
            if i in decided:
                accepted, emitted = decided[i]
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
            kept_counts.append(accepted + 1)
            features.append(None if out.features is None else out.features[i : i + 1, : accepted + 1])
            if reason is not None:
                res.proposer_stats = self.proposer.stats(i)
                row.finish(reason)
                finished.append(row)
        # Recurrent state: each row keeps its anchor + accepted drafts (its KV columns are masked below).
        self.target.keep(self.cache, kept_counts)
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


__all__ = [
    "BatchDecoder",
    "BatchRow",
    "GenerationError",
    "GenerationResult",
    "check_block_size",
    "check_request",
    "cut_emitted",
]
