"""One C++ kernel for `--quantize w8a16` on a CPU: int8 weights (a scale per output channel) times rows held as
16-bit integers, in integer arithmetic, so a row's result never depends on the kernel, the order of its sums or the
rows beside it.

Each input row is scaled alone by its absmax (x16 = round(x * 32639 / absmax), |x16| <= 32639), multiplied by the
int8 weights in integers (exact), and the output is

    y = fp32(sum(x16 * w)) * absmax / 32639 * scale_column  (+ bias)      the sum rounded once, then fp32

Sixteen bits per row keep more of it than bf16's eight (the per-row step is absmax / 32639; SmolLM2-135M's NLL in
benchmarks/README.md), and no weight is widened: the weights are read as they are stored, the kernel bound by
their bytes. On a 2-core Emerald Rapids Xeon SmolLM2-135M's 120 decoder linears took 3.1 ms at one row against
6.0 ms for the int8 x bf16 GEMMs inductor compiles (`--quantize int8`; benchmarks/README.md, 2026-12-05).

Four kernels, one layout (`pack`: the weight in tiles of 16 columns x 64 inputs, an input quad's 16 x 4 bytes a
64-byte line). Each computes the same exact sum and rounds it once, so all give the same bits:

    kernel            the CPU has            the product
    avx2              avx2 and FMA           x16 times the weights widened to 16 bits (vpmaddwd), int32 for 512
                                             inputs at a time, then double
    avx_vnni          AVX-VNNI (Alder Lake)  x16 split in two int8 code rows, 256 * hi + lo with lo in [-128, 127];
                                             vpdpbusd (256-bit) on unsigned codes, 128 x the column sum taken back
    avx512_vnni       avx512_vnni and _bf16  the same at 512 bits
    avx512_vnni+amx   and AMX's tiles        past a few rows: tdpbssd on tiles of 16 split code rows

The split kernels' two int32 sums H and L (|sum| <= 128 * 127 * K) meet as 256 H + L in double. A CPU may have a
later kernel without an earlier one (a Zen 4: avx512_vnni, no AVX-VNNI); the best it has serves (`prepare`;
`set_kernel` picks another for tests and benchmarks). The library builds with inductor's compiler and flags
(cpp_build.py, cached on disk) on first use; a CPU without avx2 and FMA (an Arm CPU: NEON's `sdot` and `i8mm`'s
`smmla` would be its instructions, none written) gets no kernel, and `--quantize w8a16` is refused there in one line
(quantize.py).
"""

from __future__ import annotations

from typing import Any

import torch

from . import cpp_build

# the packed layout's tile: 16 output columns x 64 inputs (64 bytes a quad of inputs)
TILE_COLUMNS, TILE_INPUTS = 16, 64
HALF = 32639  # a row's absmax maps here: 127 * 256 + 127, both halves int8
PREFETCH = 2048  # bytes ahead in each weight stream the kernels prefetch, by default (`set_prefetch`)

_library = torch.library.Library("flashdraft", "FRAGMENT")
_library.define(
    "w8a16_linear(Tensor x, Tensor packed, Tensor scales, Tensor colsums, Tensor? bias) -> Tensor"
)
# the kernels, from the least the CPU must have (the library's `Kernel`: the index + 1; 0 is none)
KERNELS = ("avx2", "avx_vnni", "avx512_vnni", "avx512_vnni+amx")
_isa: int | None = None  # None: not built yet; then 0 (no kernel) or the serving kernel's KERNELS index + 1
_have: tuple[str, ...] = ()  # the kernels this CPU runs (`prepare`), least first
_loaded: Any = None  # the loaded library (kept, so it stays loaded)


def prepare() -> bool:
    """Build (or load from inductor's cache) the library, whose loading registers the operator's CPU kernel;
    whether a kernel serves on this CPU (the best it has). Outside any graph being traced."""
    global _isa, _loaded, _have
    if _isa is None:
        _isa = 0
        if missing_features():  # nothing to build: without them the build fails (or the library cannot run)
            return False
        _loaded = cpp_build.load(source(), "the w8a16 kernel")
        if _loaded is not None:
            built = int(_loaded.flashdraft_w8a16_built(int(torch.cpu._init_amx())))
            _have = tuple(name for i, name in enumerate(KERNELS) if built >> (i + 1) & 1)
            _isa = int(_loaded.flashdraft_w8a16_isa(int(torch.cpu._init_amx()), len(KERNELS)))
    return _isa > 0


def source() -> str:
    """The library's C++ source (csrc/w8a16_linear.cpp with its constants)."""
    text = cpp_build.source_file("w8a16_linear.cpp")
    return text.replace("@HALF@", str(HALF)).replace("@PREFETCH@", str(PREFETCH))


def missing_features() -> list[str]:
    """The CPU features the kernel needs that this CPU lacks: avx2 and FMA, the least of its kernels (an Arm CPU
    lacks both)."""
    from .cpu_info import cpu_features

    have = set(cpu_features().split())
    return [name for name in ("avx2", "fma") if name not in have]


def kernels() -> str | None:
    """Which kernel serves here: one of KERNELS, or None (`prepare` first)."""
    return KERNELS[_isa - 1] if _isa else None


def available_kernels() -> tuple[str, ...]:
    """The kernels this CPU can run, least first (`prepare` first): what `set_kernel` may pick."""
    return _have


def set_kernel(name: str | None) -> str | None:
    """For tests and benchmarks: serve with kernel `name` (one of `available_kernels`; None: the best) from now on;
    the kernel serving. All give the same bits, so a model may change kernels between steps."""
    global _isa
    if name is not None and name not in available_kernels():
        raise ValueError(f"the w8a16 kernel {name!r} does not run here (these do: {available_kernels()})")
    if _loaded is not None:
        most = len(KERNELS) if name is None else KERNELS.index(name) + 1
        _isa = int(_loaded.flashdraft_w8a16_isa(int(torch.cpu._init_amx()), most))
    return kernels()


def set_vnni_rows(code_rows: int) -> None:
    """Code rows (two per input row) up to which vpdpbusd serves where AMX could (4, the default: up to 2 input rows); for
    benchmarks and tests: the two kernels give the same bits."""
    if _loaded is not None:
        _loaded.flashdraft_w8a16_vnni_rows(int(code_rows))


def set_prefetch(distance: int) -> None:
    """Bytes ahead in each weight stream the kernels prefetch (PREFETCH by default; 0: none); for benchmarks: the
    bits do not depend on it."""
    if _loaded is not None:
        _loaded.flashdraft_w8a16_prefetch(int(distance))


def pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] -> (packed [N/16, K/64, 16, 16, 4]: tiles of 16 columns x 64 inputs, zero-padded, a quad of
    inputs of 16 columns a 64-byte line; colsums [N/16 * 16] int32, each column's sum, for vpdpbusd)."""
    n, k = weight.shape
    n_pad, k_pad = -(-n // TILE_COLUMNS) * TILE_COLUMNS, -(-k // TILE_INPUTS) * TILE_INPUTS
    padded = torch.zeros(n_pad, k_pad, dtype=torch.int8, device=weight.device)
    padded[:n, :k] = weight
    packed = padded.view(n_pad // 16, 16, k_pad // 64, 16, 4).permute(0, 2, 3, 1, 4).contiguous()
    colsums = padded.sum(dim=1, dtype=torch.int32).contiguous()
    return packed, colsums


def unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """`pack`'s inverse: the int8 weight [N, K] (a new tensor)."""
    nb, kc = packed.shape[:2]
    return packed.permute(0, 3, 1, 2, 4).reshape(nb * 16, kc * 64)[:out_features, :in_features].contiguous()


def _fake(x, packed, scales, colsums, bias):  # noqa: ANN001, ANN202 - the op's schema says
    return x.new_empty(x.shape[0], scales.shape[0])


torch.library.register_fake("flashdraft::w8a16_linear", _fake, lib=_library)


def w8a16_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    colsums: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [M, K] (bf16 or fp32, contiguous) @ the packed int8 weight -> [M, N] in x's dtype, N = scales' length."""
    return torch.ops.flashdraft.w8a16_linear(x, packed, scales, colsums, bias)
