"""One C++ kernel for a short query's whole attention on a CPU (scores, softmax, values), its bits independent of
the mask's width, of the columns the mask hides and of the rows beside it.

attention.py's short-query attention ran two oneDNN products around an inductor softmax: in bf16 on a 2-core AMD
EPYC, SmolLM2-135M after 256 tokens, about 40 us per product and call, 2.4 ms of a 13 ms decode step for 60 calls,
mostly the calls' own overhead. And it could not read only the columns in use in bf16 (`attention.narrow_mask`):
oneDNN's order of summation over the columns follows their count, so a verify's token would not keep a one-token
step's bits. `flashdraft::short_attention` (an operator inductor calls from its compiled graphs as it calls ATen's)
does it in one pass per query row and head, with every reduction in a fixed order:

    score_j = (q . k_j) * scale + mask_j     fp32, over the head dimension in vector lanes then one fixed tree
    e_j     = exp(score_j - max)             fp32, element by element (masked columns skipped: max over the rest)
    out     = (sum_j e_j v_j) / (sum_j e_j)  fp32, j in increasing order, one term at a time; rounded once

A hidden column adds nothing (it is skipped), so a row's result is the same at any mask width, with or without the
stale columns of rejected drafts in between, and whatever other rows are in the call: a verify of n tokens gives
each the bits of the one-token step, and a draft tree's node (its ancestors earlier columns than it, siblings
hidden) the bits it gets on its own path (tests/test_cpu_attention.py).

On a CPU with AMX, bf16 scores go to its tiles (`tdpbf16ps`): the keys of 16 columns a tile's rows, read from the
cache in place, and up to 16 query rows its columns, so a score is a function of its query row and key column alone,
whatever the width or the rows beside it. The softmax and the values' sums stay the vector loops' above: AMX sums a
block of 32 products in an order of its own (not the columns' order one product at a time: a probe put its sums at
the sequential ones' in a third of the cases), so values summed there would give a column's weight other bits
where a draft tree moves it among hidden columns, and a one-token step (too few rows to pay for the values' pairing)
could not keep a verify's bits. SmolLM2-135M's heads on a 2-core Emerald Rapids Xeon: 1.3-1.5x faster at 4-16
queries, a microsecond slower at one (the tiles' set-up; benchmarks/README.md, 2026-12-06).
`$FLASHDRAFT_ATTENTION_TILES=0` keeps the vectors.

The operator's CPU implementation is C++ too (`TORCH_LIBRARY_IMPL`, registered as the library loads), so a compiled
graph's call goes from the dispatcher straight to the kernel: through a Python implementation each call cost 7-30 us
more (a 2-core EPYC, one query over 64 columns: warm, after a GEMM, after a pause), 30 calls a decode step of
SmolLM2-135M (the int8 one-token verify 9.36 -> 8.90 ms, benchmarks/README.md). One library for both dtypes,
compiled with inductor's compiler, flags and vector ISA and linked to libtorch (cpp_build.py: cached on disk
as inductor's kernels are) on first use, about 20 s.
"""

from __future__ import annotations

from typing import Any

import torch

from . import cpp_build

# the engine's dtype (attention.KERNEL_DTYPES), and the tests'
DTYPES = {torch.bfloat16: "at::BFloat16", torch.float32: "float"}
MASK_NONE, MASK_BOOL, MASK_ADDED = (
    0,
    1,
    2,
)  # none (causal), bool (True sees), added to the scores (query's dtype)

# csrc/short_attention.cpp: a prelude included once; then the kernel, once per dtype (its own namespace, `T` its
# element type); then the operator. These lines part the three.
_KERNEL_MARK = (
    "// ==== flashdraft: the kernel, once per dtype (in namespace k_<dtype>, T its element type) ====\n"
)
_OPERATOR_MARK = "// ==== flashdraft: the operator ====\n"

_library = torch.library.Library("flashdraft", "FRAGMENT")
_library.define(
    "short_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor"
)
# None: not tried yet; then whether the library built (its loading registered the CPU kernel)
_built: bool | None = None
_loaded: Any = None  # the loaded library (kept, so it stays loaded)
_tiles = False  # whether bf16 scores run on AMX's tiles (`prepare`)


def parts() -> tuple[str, str, str]:
    """csrc/short_attention.cpp's three parts: the prelude, the kernel (once per dtype), the operator."""
    prelude, rest = cpp_build.source_file("short_attention.cpp").split(_KERNEL_MARK)
    kernel, operator = rest.split(_OPERATOR_MARK)
    return prelude, kernel, operator


def source() -> str:
    """The library's C++ source (csrc/short_attention.cpp): the prelude, the kernel once per dtype, the operator."""
    prelude, kernel, operator = parts()
    kernels = [
        f"namespace k_{str(dtype).removeprefix('torch.')} {{\nusing T = {cpp};\n{kernel}\n}}\n"
        for dtype, cpp in DTYPES.items()
    ]
    marks = {"@NONE@": MASK_NONE, "@BOOL@": MASK_BOOL, "@ADDED@": MASK_ADDED}
    for mark, value in marks.items():
        operator = operator.replace(mark, str(value))
    return prelude + "".join(kernels) + operator


def prepare(dtype: torch.dtype, tiles: bool = True) -> bool:
    """Build (or load from inductor's cache) the library, whose loading registers the operator's CPU kernel, outside
    any graph being traced; False for a dtype it has no kernel for, or where it cannot be built (no C++ compiler,
    another torch): attention.py then keeps its two products. `tiles`: bf16 scores on AMX's tiles where the CPU
    grants them, decided at the build (the kernel plan builds it first, passing `$FLASHDRAFT_ATTENTION_TILES`)."""
    global _built, _loaded, _tiles
    if _built is None:
        _loaded = cpp_build.load(source(), "the CPU attention kernel (using two products)")
        _built = _loaded is not None
        if _built:
            _tiles = bool(_loaded.flashdraft_attention_amx(int(tiles and torch.cpu._init_amx())))
    return ready(dtype)


def tiles() -> bool:
    """Whether bf16 scores run on AMX's tiles in this process (`prepare` first)."""
    return _tiles


def set_tiles(on: bool) -> bool:
    """For tests and benchmarks: score bf16 on AMX's tiles (where the CPU grants them) or with vector FMAs from now
    on; whether the tiles serve. The two sum a score's products in other orders, so a model's bits change with it:
    never between the steps of one decode."""
    global _tiles
    if _loaded is not None:
        _tiles = bool(_loaded.flashdraft_attention_amx(int(on and torch.cpu._init_amx())))
    return _tiles


def ready(dtype: torch.dtype) -> bool:
    """Whether the kernel for `dtype` is built (`prepare`); never builds (safe while dynamo traces)."""
    return bool(_built) and dtype in DTYPES


def _fake(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, scale: float
) -> torch.Tensor:
    b, heads, n, _ = query.shape
    return query.new_empty(b, n, heads, value.shape[-1])


torch.library.register_fake("flashdraft::short_attention", _fake, lib=_library)


def short_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """query [b, h, n, d], key/value [b, kv_heads, >= W, d | dv], mask [b | 1, 1 | h, n, W] bool or added (the
    query's dtype), or None (causal over the keys) -> [b, n, h, dv]. The last dims must be contiguous."""
    return torch.ops.flashdraft.short_attention(query, key, value, mask, scale)
