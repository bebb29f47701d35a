"""Buffers that compiled graphs hold across calls (the target's static KV cache, engine/kv_cache.py, and the
drafter's context cache, drafter/context_cache.py): a capacity fixed up front, a fixed address where CUDA graphs
replay on it, sizes dynamo treats as symbolic from the first compile."""

from __future__ import annotations

import torch

CAPACITY_STEP = 256  # static capacities are multiples of this (a new capacity is a new CUDA graph)


def symbolic_sizes(t: torch.Tensor | None, *dims: int) -> None:
    """These sizes of `t` are symbolic from the first compile, so a capacity, a verify length or a number of rows
    first met mid-answer costs no compile: dynamo would make a size symbolic only after seeing it change, one whole
    compile later, and on an H100 each such recompile of SmolLM2's verify took 20-50 s in the middle of an answer
    (benchmarks/smollm2-135m-instruct-gpu/, 2026-11-26). Sizes 1 stay specialised, as dynamo keeps them. On a GPU
    the CUDA graphs are still recorded per concrete size, which costs a few replays, not a compile."""
    if t is None:
        return
    for dim in dims:
        if t.shape[dim] > 1:
            torch._dynamo.maybe_mark_dynamic(t, dim % t.dim())


def static_buffer(like: torch.Tensor, capacity: int, mark_static: bool) -> torch.Tensor:
    return tagged(like.new_zeros(like.shape[0], like.shape[1], capacity, like.shape[3]), mark_static)


def tagged(buf: torch.Tensor, mark_static: bool) -> torch.Tensor:
    if mark_static:  # compiled: symbolic rows and capacity, and a fixed address for CUDA graphs
        fixed_address(buf)
        symbolic_sizes(buf, 0, 2)
    return buf


def fixed_address(buf: torch.Tensor) -> None:
    """Tag a cache buffer as one address that CUDA graphs replay on. Only on a GPU: on a CPU inductor freezes the
    graph's parameters, and dynamo freezes tensors tagged so with them, a cache's capacity included (a later
    capacity then failed a frozen size: "expected size 768==256")."""
    if buf.device.type == "cuda":
        torch._dynamo.mark_static_address(buf)
