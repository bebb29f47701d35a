"""The engine's KV cache: the target's KV buffers (the drafter's context cache is drafter/context_cache.py).

Every KV layer of the engine's cache is a `KVBuffer`, in one of two modes:

    growing  (the default on a CPU) the columns in use of a buffer with room kept at the end: a verify writes its n
             columns in place instead of `torch.cat`-ing the whole cache of every layer, a rollback moves the length
    static   (the default on a GPU, attention-only targets; `--compile` anywhere) a capacity fixed up front, as
             gpt-fast's and vLLM's: a verify writes its columns where `StaticColumns.columns` says (a tensor, so the
             write is the same kernel at every position) and the layer attends over the whole buffer under a
             [b, 1, n, capacity] mask the engine builds (`static_mask`); the columns past the valid length are stale
             and masked (on a CPU in fp32 the mask covers only the columns in use, rounded up to MASK_STEP and
             narrower than the capacity, and the attention reads only those: `attention.narrow_mask`). A verify of
             n tokens by b rows has one shape per (b, n, capacity), the engine pads n to a few buckets (`bucket`),
             no position enters the graph, and a rollback is a length moved on the host: what compiled.py needs to
             compile the verify.

The static mode serves attention-only targets without sliding windows; sliding-window and recurrent targets decode
in the growing mode (their windows and recurrent states are rolled back by the engine, not by a length).

The drafter's `DraftContextCache` follows the target: static beside a static target cache (capacity-wide buffers, the
columns past those in use padding that the mask rule hides), so its block pass (`DFlashDraftModel.block_pass`) has
one shape per (rows, capacity) and can be compiled with the verify; the accepted context is written into it eagerly
before (its length changes every step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..kernels.static_buffers import CAPACITY_STEP, static_buffer, tagged
from ..targets.recurrent import has_kv, is_recurrent_layer

VERIFY_BUCKETS = (1, 2, 4, 8, 16, 32)
MASK_STEP = 64  # a narrow static mask (attention.narrow_mask) covers a multiple of this many columns


class StaticColumns:
    """What the layers of one static cache share: their capacity, and the columns the next forward writes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.columns: torch.Tensor | None = None  # [n] long, on the device
        self.mark_static = False  # tag the buffers as fixed addresses (CUDA graphs replay on them)


class _Columns:
    """`keys` / `values`: the columns in use of a buffer. Assigning a tensor makes it the buffer's content (a static
    layer copies it into its capacity; a growing one takes the tensor as its buffer), unless it is the buffer cut
    shorter (a crop), which only moves the length."""

    def __init__(self, buffer: str, length: str) -> None:
        self.buffer, self.length = buffer, length

    def __get__(self, layer: Any, owner: type) -> torch.Tensor | None:
        buf = getattr(layer, self.buffer)
        return None if buf is None else buf[:, :, : getattr(layer, self.length)]

    def __set__(self, layer: Any, value: torch.Tensor | None) -> None:
        old = getattr(layer, self.buffer)
        if value is None or value.dim() != 4:
            setattr(layer, self.buffer, None)
            setattr(layer, self.length, 0)
            return
        cropped = (
            old is not None and value.data_ptr() == old.data_ptr() and value.stride() == old.stride()
            and value.shape[:2] == old.shape[:2] and value.shape[3] == old.shape[3]
        )  # fmt: skip
        if not cropped:
            static = layer.static
            if static is None:
                setattr(layer, self.buffer, value)
            else:
                width = value.shape[2]
                if width > static.capacity:
                    raise RuntimeError(f"{width} columns do not fit a static cache of {static.capacity}")
                if old is None or old.shape[:2] != value.shape[:2]:
                    old = static_buffer(value, static.capacity, static.mark_static)
                    setattr(layer, self.buffer, old)
                old[:, :, :width] = value
        setattr(layer, self.length, value.shape[-2])


def kv_buffer_class() -> type:
    """`KVBuffer`, a transformers `DynamicLayer` (built on first use: transformers is imported lazily)."""
    global _KV_BUFFER
    if _KV_BUFFER is not None:
        return _KV_BUFFER
    from transformers.cache_utils import DynamicLayer

    class KVBuffer(DynamicLayer):
        # Lengths kept apart: the engine assigns keys and values one after the other.
        keys = _Columns("_k", "_len")
        values = _Columns("_v", "_vlen")

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._k = self._v = None
            self._len = self._vlen = 0
            self.static: StaticColumns | None = None
            super().__init__(*args, **kwargs)

        def lazy_initialization(self, key_states: torch.Tensor, *args: Any) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            self._k = self._v = None
            self._len = self._vlen = 0
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            if self.static is not None:
                # Tensors only (no Python length): the same graph serves every position. The engine moves the
                # length after the forward.
                self._k.index_copy_(2, self.static.columns, key_states)
                self._v.index_copy_(2, self.static.columns, value_states)
                return self._k, self._v
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

        def add_static_row(self, keys: torch.Tensor, values: torch.Tensor, width: int) -> None:
            """Static: a row joins with its prefill's keys and values [1, heads, n, dim], right-aligned in `width`
            columns (the rows here move right if they hold fewer); one new buffer written once, its other columns
            zero. (Through `keys =`, a joined copy would be made and then copied into a zeroed buffer.)"""
            for name, length, new in (("_k", "_len", keys), ("_v", "_vlen", values)):
                old, used, n = getattr(self, name), getattr(self, length), new.shape[2]
                rows = old.shape[0]
                buf = old.new_empty(rows + 1, *old.shape[1:])
                if used == width:
                    buf[:rows] = old  # its stale columns too: finite values the mask hides
                else:
                    buf[:rows, :, : width - used].zero_()
                    buf[:rows, :, width - used : width] = old[:, :, :used]
                    buf[:rows, :, width:].zero_()
                buf[rows, :, : width - n].zero_()
                buf[rows, :, width - n : width] = new[0]
                buf[rows, :, width:].zero_()
                setattr(self, name, tagged(buf, self.static.mark_static))
                setattr(self, length, width)

        def keep_static_rows(self, rows: torch.Tensor, columns: torch.Tensor | None) -> None:
            """Static: only `rows` stay, and of the columns in use only `columns` (None: all), moved to the front in
            order; one copy of the buffer, its stale columns too (finite values the mask hides)."""
            for name, length in (("_k", "_len"), ("_v", "_vlen")):
                kept = getattr(self, name).index_select(0, rows)
                if columns is not None:
                    kept[:, :, : columns.numel()] = kept[:, :, columns]
                    setattr(self, length, columns.numel())
                setattr(self, name, tagged(kept, self.static.mark_static))

        def make_static(self, static: StaticColumns) -> None:
            """Static mode (or a larger capacity): the columns in use move into buffers of `static.capacity`."""
            keys, values = self.keys, self.values
            self.static = static
            for name, t in (("_k", keys), ("_v", values)):
                buf = static_buffer(t, static.capacity, static.mark_static)
                buf[:, :, : t.shape[2]] = t
                setattr(self, name, buf)

    _KV_BUFFER = KVBuffer
    return KVBuffer


_KV_BUFFER: type | None = None


def batch_cache(target: Any) -> Any:
    """A cache of full-attention layers for every model (sliding windows come from the mask, over columns), beside
    the recurrent layers of a hybrid target; every KV layer a growing `KVBuffer`."""
    from transformers import DynamicCache

    kv_buffer = kv_buffer_class()
    if target.recurrent is None:
        cache = DynamicCache()
        cache.layer_class_to_replicate = kv_buffer
        return cache
    cache = DynamicCache(config=target.model.config)
    cache.layers = [
        kv_buffer() if has_kv(layer) and not is_recurrent_layer(layer) else layer for layer in cache.layers
    ]
    return cache


def kv_layers(cache: Any) -> list[Any]:
    return [layer for layer in cache.layers if has_kv(layer)]


def reserve(cache: Any, columns: int, mark_static: bool = False) -> StaticColumns:
    """Make `cache` static with room for at least `columns` columns (its capacity rounded up to CAPACITY_STEP;
    growing it copies the columns in use, once)."""
    layers = kv_layers(cache)
    static = layers[0].static
    if static is not None and static.capacity >= columns:
        return static
    capacity = -(-max(columns, int(1.25 * columns)) // CAPACITY_STEP) * CAPACITY_STEP
    static = StaticColumns(capacity)
    static.mark_static = mark_static
    for layer in layers:
        layer.make_static(static)
    return static


def set_length(cache: Any, length: int) -> None:
    """After a static forward: the layers hold `length` columns."""
    for layer in kv_layers(cache):
        layer._len = layer._vlen = length


def narrow_width(columns: int, capacity: int) -> int:
    """The width of a narrow static mask (`attention.narrow_mask`) over `columns` columns: rounded up to MASK_STEP,
    and below the capacity (a width equal to it is another graph: dynamo guards on whether the cut keys are the
    whole buffer), so the cache keeps one free column."""
    return min(capacity - 1, -(-columns // MASK_STEP) * MASK_STEP)


def static_mask(
    valid: torch.Tensor, n: int, capacity: int, dtype: torch.dtype, tree: torch.Tensor | None = None
) -> torch.Tensor:
    """[b, 1, n, capacity] additive mask of a verify of n tokens per row after the C = valid.shape[1] columns
    cached: query i of row r sees the cached columns valid for r and the block's columns C..C+i (`tree` [b, n, n]
    bool: the block columns each one sees instead, a draft tree's ancestors); the stale columns past them are
    hidden."""
    b, cached = valid.shape
    device = valid.device
    cols = torch.arange(capacity, device=device)
    sees = torch.zeros(b, n, capacity, dtype=torch.bool, device=device)
    sees[:, :, :cached] = valid[:, None, :]
    if tree is None:
        sees |= ((cols >= cached) & (cols <= cached + torch.arange(n, device=device)[:, None]))[None]
    else:
        sees[:, :, cached : cached + n] = tree
    mask = torch.zeros(b, 1, n, capacity, dtype=dtype, device=device)
    return mask.masked_fill_(~sees[:, None], torch.finfo(dtype).min)


def bucket(n: int, block_size: int, buckets: Sequence[int]) -> int:
    """The verify length n is padded to: the next bucket, or the decoder's block if that is smaller (a fixed size
    too)."""
    return min(max(n, block_size), next((b for b in buckets if b >= n), n))
