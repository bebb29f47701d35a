"""The drafter's context cache: per layer, the K/V of the fused target context, kept beside the target's KV cache
(engine/kv_cache.py) and following its mode: static beside a static target cache (capacity-wide buffers, the
columns past those in use padding that the mask rule hides), so its block pass (`DFlashDraftModel.block_pass`) has
one shape per (rows, capacity) and can be compiled with the verify; the accepted context is written into it eagerly
before (its length changes every step)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels.static_buffers import CAPACITY_STEP, fixed_address, symbolic_sizes

# The position of padding in a batched context: later than any anchor, so the mask rule (context < anchor) hides it.
PAD_POSITION = 1 << 30


@dataclass
class DraftContextCache:
    """The drafter's per-layer K/V of the fused target context. Grows only with accepted tokens; holds no block K/V.

    Growing (`capacity` None): the columns in use, grown into room kept at the end of a buffer (as `KVBuffer`).
    Static (`capacity`, beside a static target cache): buffers of `capacity` columns whose positions past `length`
    are PAD_POSITION (hidden by the mask rule), so the block pass over them has one shape per (rows, capacity) and
    can be compiled; the new context is written in eagerly before it."""

    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)
    positions: torch.Tensor | None = None  # [b, c] absolute positions of the cached context
    # Batched decoding pads rows to a common length with positions no anchor reaches (PAD_POSITION); attention must
    # then go through the position mask instead of the one-block fast path.
    ragged: bool = False
    capacity: int | None = None
    length: int = 0  # static: the columns in use
    mark_static: bool = False  # static buffers tagged as fixed addresses (CUDA graphs replay on them)
    # Growing: per layer, the buffers keys[i] / values[i] are the first columns of (a tensor assigned from outside,
    # as rows joining or leaving do, starts a new one).
    _room: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    _start: int = 0  # static: where the context being written goes

    def __len__(self) -> int:
        if self.capacity is not None:
            return self.length
        return 0 if self.positions is None else self.positions.shape[1]

    @property
    def needs_mask(self) -> bool:
        return self.ragged or self.capacity is not None

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None
    ) -> None:
        """Layer `layer`'s context grows by k / v [b, heads, n, d] (layer 0 brings their `positions` [b, n]):
        written in place, no copy of what is cached (but once every ~quarter of its length, when room runs out)."""
        if self.capacity is not None:
            return self._append_static(layer, k, v, positions)
        if positions is not None:
            self.positions = (
                positions if self.positions is None else torch.cat([self.positions, positions], 1)
            )
        if len(self.keys) <= layer:
            self.keys.append(k)
            self.values.append(v)
            return
        old_k, old_v = self.keys[layer], self.values[layer]
        cached, need = old_k.shape[2], old_k.shape[2] + k.shape[2]
        room = self._room.get(layer)
        if room is None or not all(
            buf.shape[2] >= need and buf.data_ptr() == old.data_ptr() and buf.stride() == old.stride()
            and buf.shape[:2] == old.shape[:2]
            for buf, old in zip(room, (old_k, old_v), strict=True)
        ):  # fmt: skip
            size = need + max(64, need // 4)
            room = tuple(old.new_empty(*old.shape[:2], size, old.shape[3]) for old in (old_k, old_v))
            for buf, old in zip(room, (old_k, old_v), strict=True):
                buf[:, :, :cached] = old
            self._room[layer] = room
        room[0][:, :, cached:need] = k
        room[1][:, :, cached:need] = v
        self.keys[layer], self.values[layer] = room[0][:, :, :need], room[1][:, :, :need]

    def _append_static(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None
    ) -> None:
        n = k.shape[2]
        if positions is not None:  # layer 0: room for the new columns, and their positions
            self._start = self.length
            self._grow(self._start + n, positions)
            self.positions[:, self._start : self._start + n] = positions
            self.length = self._start + n
        elif self.positions is None:
            self._grow(n, torch.empty(k.shape[0], 0, dtype=torch.long, device=k.device))
        if len(self.keys) <= layer:
            for name, t in (("keys", k), ("values", v)):
                getattr(self, name).append(self._buffer(t, self.capacity))
        self.keys[layer][:, :, self._start : self._start + n] = k
        self.values[layer][:, :, self._start : self._start + n] = v

    def _grow(self, columns: int, like: torch.Tensor) -> None:
        if self.positions is not None and columns <= self.capacity:
            return
        if columns > self.capacity:
            self.capacity = -(-int(1.25 * columns) // CAPACITY_STEP) * CAPACITY_STEP
        old = self.positions
        self.positions = torch.full(
            (like.shape[0], self.capacity), PAD_POSITION, dtype=torch.long, device=like.device
        )
        if old is not None:
            self.positions[:, : self.length] = old[:, : self.length]
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                store[i] = self._buffer(t[:, :, : self.length], self.capacity)

    def _buffer(self, t: torch.Tensor, capacity: int) -> torch.Tensor:
        buf = t.new_zeros(*t.shape[:2], capacity, t.shape[3])
        buf[:, :, : t.shape[2]] = t
        return self._tag(buf)

    def add_row(self) -> None:
        """A row joins holding nothing yet: all padding."""
        if self.positions is None:
            return
        self.positions = torch.cat([self.positions, torch.full_like(self.positions[:1], PAD_POSITION)])
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                store[i] = self._tag(torch.cat([t, torch.zeros_like(t[:1])]))

    def select_rows(self, index: list[int]) -> None:
        """Only these rows stay, in this order."""
        if self.positions is None:
            return
        idx = torch.tensor(index, dtype=torch.long, device=self.positions.device)
        self.positions = self.positions[idx]
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                store[i] = self._tag(t[idx])

    def _tag(self, buf: torch.Tensor) -> torch.Tensor:
        if (
            self.mark_static and self.capacity is not None
        ):  # as the target's static buffers (`_static_buffer`)
            fixed_address(buf)
            symbolic_sizes(buf, 0, 2)
        return buf

    def keep_columns(self, order: torch.Tensor) -> None:
        """Keep, per row, the columns `order` [b, w] lists (in that order): compaction."""
        self.positions = torch.gather(self.positions, 1, order)
        idx = order[:, None, :, None]
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                store[i] = torch.gather(t, 2, idx.expand(-1, t.shape[1], -1, t.shape[3]))
        if self.capacity is not None:  # back to full width, the rest padding
            self.length = order.shape[1]
            positions, self.positions = self.positions, None
            self._grow(self.length, positions)
            self.positions[:, : self.length] = positions
