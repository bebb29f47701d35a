"""The register-level kernels of inductor's C++ GEMM template that the frozen CPU graphs (compiled.compile_whole) run.

inductor compiles every linear of a frozen CPU graph into its GEMM template: blocks of the weight packed once at
compile time, a loop over cache blocks, and at its core a *micro-kernel* that multiplies a few rows by a few dozen
columns in registers. inductor chooses that micro-kernel from a table of configurations (ISA, dtypes, register
block). `register_cpu_gemm_kernels` edits the table, once per process, before the first frozen graph:

    fp32 rows x int8 weights   inductor's fp32 kernel with int8 weights (`--quantize int8 --dtype float32`), which
                               torch 2.13 lists for bf16 rows only
    bf16 x bf16 or int8, AMX   inductor's AMX kernels (`tdpbf16ps` on tiles), at every row count: inductor's rule
                               that skips them for a weight-only-int8 GEMM of fewer than 5 static rows is lifted
    bf16 x bf16 or int8,       `Bf16DotMicroGemm` below: `vdpbf16ps`, two products per fp32 lane and instruction,
    avx512_bf16 without AMX    the weight packed in pairs of k (inductor's VNNI2 layout, as for AMX); int8
                               weights made bf16 (exactly) as they are loaded, their scales the template's epilogue;
                               inductor's own bf16 x int8 kernels step aside (a row's bits changed with the verify's
                               length)
    bf16 x bf16, avx512 only   inductor's widening fp32 kernel with 4 x 48 register blocks

Every kernel here sums each output along k in one order, in one register lane or tile row, whatever the register
block and whatever the number of rows in the call, so a row keeps its bits at any verify length (batch invariance:
the verify of n tokens gives each the bits of the one-token step). `bf16_rows_kernel` says which serves bf16 rows.
`tests/test_cpu_gemm.py`, `tests/test_static_cache.py` and `tests/test_quantize.py` hold them to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from . import cpp_build

# The pair kernel's register block: 8 rows x 48 columns (24 fp32 accumulators, 3 weight vectors and a broadcast row
# of avx512's 32 registers); the widening kernel's 4 x 48. On a Zen 4 EPYC, SmolLM2's decoder linears at 8 / 16 rows:
# bf16 7.3 / 10.6 ms against 8.2 / 11.4 with 4 x 48 blocks, int8 5.8 / 9.9 against 8.3 / 14.4, one row alike
# (benchmarks/scripts/gemm_rows_bf16.py, benchmarks/README.md 2026-11-28).
PAIR_BLOCK = (8, 48, 2)
# The pair kernel makes int8 weights bf16 by table lookups for up to this many rows (avx512_vbmi), by conversion
# for more (`Bf16DotMicroGemm`); read when a graph is compiled (benchmarks/scripts/int8_tables_ab.py sets it).
INT8_TABLES_ROWS = 4
BF16_WIDENING_BLOCK = (4, 48, 1)


# The torch releases (major.minor) whose inductor internals the edits below are made for, and the suite runs on: on
# another, nothing is edited, and the compiled paths that rely on the edits decode eagerly, saying why
# (`untested_torch`), rather than compile with kernels whose rows are not held to one summation order.
TESTED_TORCH = ("2.13",)
# what of inductor's internals was not where the edits expect it (registration's finding)
_MISSING: list[str] = []


def _release() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def untested_gemm_kernels(dtype: torch.dtype, quantize: str | None) -> str | None:
    """Why a CPU target of this dtype and quantization cannot compile with its rows held to one summation order on
    this torch (None: it can, or it does not need the edits: fp32, w8a8's and w8a16's own kernels)."""
    if quantize == "int8" or quantize is None and dtype == torch.bfloat16:
        return untested_torch()
    return None


def untested_torch() -> str | None:
    """Why the table edits do not serve on this torch (None: they do): a release they were not tested with, or
    inductor's micro-kernel table not where they expect it."""
    if _release() not in TESTED_TORCH:
        return f"flashdraft's CPU GEMM kernels are tested with torch {', '.join(TESTED_TORCH)}, not {torch.__version__}"
    register_cpu_gemm_kernels()
    if _MISSING:
        return f"inductor's micro-kernel table is not where torch {TESTED_TORCH[0]} keeps it ({_MISSING[0]})"
    return None


def register_cpu_gemm_kernels(without: frozenset[str] = frozenset()) -> None:
    """Once per process: the table edits above, but those named in `without` ("fp32-int8", "amx", "bf16-pairs",
    "bf16-four-rows", "int8-whole-k": benchmarks compare with inductor's own, or the pair kernel with AMX). On a torch
    they are not tested with, or without such a table, nothing changes (`untested_torch` says so)."""
    if getattr(register_cpu_gemm_kernels, "done", False):
        return
    register_cpu_gemm_kernels.done = True
    register_cpu_gemm_kernels.without = without  # in compiled.kernels_tag: the graphs cached under it
    if _release() not in TESTED_TORCH:
        return
    try:
        import torch._inductor.lowering  # noqa: F401 - before codegen: inductor's modules import in this order
        from torch._inductor.codegen import cpp_micro_gemm as micro
        from torch._inductor.cpu_vec_isa import VecAVX2, VecAVX512, pick_vec_isa

        configs = micro.micro_gemm_configs[micro.CppMicroGemmFP32Vec]
    except (ImportError, AttributeError, KeyError) as e:
        _MISSING.append(f"{type(e).__name__}: {e}")
        return
    isa = pick_vec_isa()
    amx = getattr(micro, "CppMicroGemmAMX", None) in micro.micro_gemm_configs and isinstance(
        isa, micro.VecAMX
    )
    pairs = bool(getattr(isa, "is_avx512_bf16_supported", lambda: False)())
    if "fp32-int8" not in without:
        _fp32_int8(micro, configs, VecAVX2, VecAVX512)
    if "bf16-four-rows" not in without:
        _bf16_widening_four_rows(micro, configs, VecAVX512, pairs="bf16-pairs" not in without)
    if "bf16-pairs" not in without:
        _bf16_pairs(micro, configs, VecAVX512)
        if "int8-whole-k" not in without:
            _int8_pairs_whole_k()
    if amx and "amx" not in without:
        _amx_at_any_rows(micro)
        _SERVING["bf16"] = _SERVING["default"] = "amx"
    elif pairs and "bf16-pairs" not in without:
        _SERVING["bf16"] = _SERVING["default"] = "pairs"


# Which kernel serves bf16 rows in the graphs compiled from here on ("amx", "pairs" or None: inductor's own), read
# by the table's checks as inductor chooses; set by `register_cpu_gemm_kernels` (with "default", this CPU's), changed
# by `serving_bf16_rows`.
_SERVING: dict[str, str | None] = {"bf16": None, "default": None}


def bf16_rows_kernel() -> str | None:
    """The kernel that serves this process's bf16 rows (bf16 or int8 weights) in a frozen graph, each row's bits
    whatever the rows beside it: "amx" (CPUs with AMX), "pairs" (`Bf16DotMicroGemm`, avx512_bf16 without AMX), or
    None (inductor's own kernels, whose rows are not held to that). Asked before the first frozen graph (a tree
    refusal, a test), it registers the kernels as that graph would."""
    register_cpu_gemm_kernels()  # once per process; a benchmark's `without` registers first
    return _SERVING["bf16"]


def bf16_row_kernels() -> tuple[str, ...]:
    """The kernels that can serve bf16 rows on this CPU (`serving_bf16_rows`): AMX and the pair kernel on an AMX
    CPU, the pair kernel with avx512_bf16, none elsewhere."""
    register_cpu_gemm_kernels()
    return {"amx": ("amx", "pairs"), "pairs": ("pairs",)}.get(_SERVING["default"] or "", ())


@contextlib.contextmanager
def serving_bf16_rows(kernel: str) -> Iterator[None]:
    """Graphs compiled inside serve bf16 rows with `kernel` (one of `bf16_row_kernels()`): tests and benchmarks
    compare AMX with the pair kernel on one CPU. compiled.kernels_tag names it, so cached graphs stay apart."""
    if kernel not in bf16_row_kernels():
        raise ValueError(
            f"bf16 rows cannot be served by {kernel!r} on this CPU (it has {bf16_row_kernels()})"
        )
    before = _SERVING["bf16"]
    _SERVING["bf16"] = kernel
    try:
        yield
    finally:
        _SERVING["bf16"] = before


def _amx_at_any_rows(micro: Any) -> None:
    """inductor skips its AMX micro-kernels for a weight-only-int8 GEMM (bf16 rows, int8 weights) whose row count is
    static and below 5 (`create_micro_gemm`'s `skip_amx_kernel_for_woq`): the one-token verify (1 row) then ran an
    avx512 kernel and the verify of 2-64 tokens (a symbolic row count) AMX, and a row's bits changed with the
    verify's length (12 of 24 int8 DFlash outputs of a bench run parted from plain decoding). Here the choice for
    such a GEMM is made as for 5 rows while AMX serves (the micro-kernel runs any row count): on a 2-core Xeon with
    AMX every row of SmolLM2's int8 verify of 1-16 tokens had the one-token step's bits, and the verify of 1 / 4 / 16
    tokens took 17.2 / 19.4 / 26.7 ms against 26.5 / 24.2 / 55.2 through the pair kernel
    (benchmarks/scripts/amx_small_m.py, benchmarks/README.md 2026-11-29). The modules that imported the function by
    name get the wrapper too."""
    import sys

    choose = micro.create_micro_gemm

    def create_micro_gemm(
        name: Any, m: Any, n: Any, k: Any, input_dtype: Any, input2_dtype: Any, *args, **kwargs
    ):
        woq = input_dtype == torch.bfloat16 and input2_dtype in (torch.int8, torch.uint8)
        if _SERVING["bf16"] == "amx" and woq and getattr(m, "is_number", isinstance(m, int)) and int(m) < 5:
            m = 5
        return choose(name, m, n, k, input_dtype, input2_dtype, *args, **kwargs)

    for module in list(sys.modules.values()):
        if (
            getattr(module, "__name__", "").startswith("torch._inductor")
            and module.__dict__.get("create_micro_gemm") is choose
        ):
            module.create_micro_gemm = create_micro_gemm


def _fp32_int8(micro: Any, configs: list[Any], avx2: type, avx512: type) -> None:
    """inductor's C++ GEMM template may multiply fp32 rows by int8 weights (`aten._weight_int8pack_mm`, the scales
    its epilogue). Its fp32 micro-kernel already converts int8 weights to fp32 as it loads them (the path its bf16 x
    int8 kernels use), but torch 2.13 lists no fp32 x int8 configuration, so inductor fell back to ATen's kernel: on
    a 2-core AMD EPYC (avx2) SmolLM2's LM head and 30 MLP projections at one row took 30 ms through ATen and 3.6 ms
    through the template (4 rows: 164 against 4.7 ms), where fp32 weights take 9.3. The configurations added are the
    fp32 ones' register blockings with int8 weights."""
    for isa, blockings in (
        (avx512, [(8, 48, 1), (8, 32, 1), (16, 16, 1)]),
        (avx2, [(4, 24, 1), (4, 16, 1), (8, 8, 1)]),
    ):
        configs += micro.generate_gemm_config(
            isa,
            blockings,
            input_dtype=torch.float32,
            input2_dtype=torch.int8,
            output_dtype=torch.float32,
            compute_dtype=torch.float32,
        )


def _bf16_widening_four_rows(micro: Any, configs: list[Any], avx512: type, pairs: bool) -> None:
    """Where avx512 has no bf16 instructions, inductor's widening kernel (bf16 loaded, converted to fp32, FMA) with
    a 4 x 48 register block, not 8 x 48 (or 8 x 32, 16 x 16). The template takes one block for every row count, and
    compiled by g++ 12 its 5- to 8-row kernels spill their 24 accumulators to the stack at every step of k: on a
    2-core AMD EPYC SmolLM2's 30 MLP up-projections at 8 / 16 rows took 14.8 / 28.8 ms against 6.0 / 10.8 ms with
    4 x 48 blocks. Where the pair kernel serves (`pairs`), this one does not. AMX's kernels are another class:
    untouched."""

    def bf16_avx512(c: Any) -> bool:
        return c.vec_isa_cls is avx512 and c.input_dtype == c.input2_dtype == torch.bfloat16

    configs[:] = [c for c in configs if not bf16_avx512(c)] + micro.generate_gemm_config(
        avx512,
        [BF16_WIDENING_BLOCK],
        input_dtype=torch.bfloat16,
        output_dtype=torch.float32,
        extra_check=_unless_pairs(None) if pairs else None,
    )


def _int8_pairs_whole_k() -> None:
    """For a GEMM of static row count (the one-token step: 1 row), inductor sizes its cache blocks in Python, and
    for bf16 rows x int8 weights it counts each weight as two bytes, the bf16 copy AMX's kernel makes of it in L1
    (`_cache_blocking`'s `num_byte_B *= num_byte_A`). The pair kernel converts the weights in registers and keeps no
    copy, so the one-token step's GEMMs cut k into blocks half the size L1 holds and ran a second pass over their
    accumulators: on a 2-core Zen 5 EPYC SmolLM2's int8 verify of 1 token took 9.1 ms where 2 tokens took 6.7 (a
    symbolic row count, whose blocks are sized at run time by byte). Here the k block of such a GEMM is what L1 holds
    of the int8 weights (inductor's own rule, by byte), or the whole of k. The pair kernel sums each output along k
    in one order across k blocks (it reads C back), so only the time changes, not the bits."""
    try:
        from torch._inductor.codegen.cpp_gemm_template import CppGemmTemplate, GemmBlocking
    except ImportError:  # another torch: its own blocks
        return
    sized = CppGemmTemplate._cache_blocking

    def _cache_blocking(self: Any, num_threads: int) -> Any:
        blocking = sized(self, num_threads)
        dtypes = (self.input_nodes[0].get_dtype(), self.input_nodes[1].get_dtype())
        register = self.register_blocking
        pairs = _SERVING["bf16"] == "pairs" and tuple(register) == PAIR_BLOCK
        if not pairs or dtypes != (torch.bfloat16, torch.int8) or getattr(self, "is_dynamic_M", False):
            return blocking
        k_blocks = self.thread_blocking(num_threads).block_k
        l1 = torch.cpu.get_capabilities().get("l1d_cache_size", 0) * 0.8  # inductor's share of L1
        fits = int(l1 // (register.block_k * register.block_n)) if l1 > 0 else k_blocks
        return GemmBlocking(blocking.block_m, blocking.block_n, max(blocking.block_k, min(k_blocks, fits)))

    CppGemmTemplate._cache_blocking = _cache_blocking


def _pairs_serve(config: Any, m: Any, n: Any, k: Any, alpha: Any, num_threads: Any, **kwargs: Any) -> bool:
    """The pair kernel's `extra_check`: it serves a bf16 GEMM where it serves bf16 rows (`bf16_rows_kernel`: the CPU
    has avx512_bf16 and AMX does not serve), k is even and nothing scales the product."""
    supported = getattr(kwargs.get("vec_isa"), "is_avx512_bf16_supported", None)
    chosen = _SERVING["bf16"] == "pairs" and supported is not None and supported()
    return bool(chosen) and int(k) % 2 == 0 and alpha == 1


def _unless_pairs(own: Any) -> Any:
    """An `extra_check` that refuses where the pair kernel serves, else defers to `own` (None: accepts)."""

    def check(config: Any, m: Any, n: Any, k: Any, alpha: Any, num_threads: Any, **kwargs: Any) -> bool:
        if _pairs_serve(config, m, n, k, alpha, num_threads, **kwargs):
            return False
        return own is None or own(config, m, n, k, alpha, num_threads, **kwargs)

    return check


def _bf16_pairs(micro: Any, configs: list[Any], avx512: type) -> None:
    """`Bf16DotMicroGemm` in inductor's table, for bf16 rows x bf16 or int8 weights -> fp32 where `_pairs_serve`;
    inductor's own bf16 x int8 kernels on avx512 step aside there. Those were two kernels chosen by the number of
    rows (a 4 x 32 block summing k in blocks of 64 below 16 rows), so a row's bits changed with the verify's length
    (7 of 16 outputs of `--quantize int8 --compile` parted from plain decoding, benchmarks/README.md 2026-11-27).
    inductor's AMX kernels step aside too where the pair kernel is made to serve on an AMX CPU (`serving_bf16_rows`);
    by default AMX serves there (`_amx_at_any_rows`)."""
    import dataclasses

    def step_aside(table: list[Any], isa: type, weights: tuple[torch.dtype, ...]) -> None:
        table[:] = [
            dataclasses.replace(c, extra_check=_unless_pairs(c.extra_check))
            if c.vec_isa_cls is isa and c.input_dtype == torch.bfloat16 and c.input2_dtype in weights
            else c
            for c in table
        ]

    step_aside(configs, avx512, (torch.int8,))
    amx = getattr(micro, "CppMicroGemmAMX", None)
    if amx in micro.micro_gemm_configs:
        step_aside(micro.micro_gemm_configs[amx], micro.VecAMX, (torch.bfloat16, torch.int8))

    micro.register_micro_gemm(
        *[
            config
            for weights in (torch.bfloat16, torch.int8)
            for config in micro.generate_gemm_config(
                avx512,
                [PAIR_BLOCK],
                input_dtype=torch.bfloat16,
                input2_dtype=weights,
                output_dtype=torch.float32,
                compute_dtype=torch.float32,
                extra_check=_pairs_serve,
            )
        ]
    )(_bf16_dot_class(micro))


def _bf16_dot_class(micro: Any) -> type:
    """The class is made here, from inductor's module, because its base class is inductor's (a private API)."""

    class Bf16DotMicroGemm(micro.CppMicroGemm):
        """C (fp32) = / += A (bf16, rows x k) @ B (bf16 or int8, k x n) with `vdpbf16ps` (avx512_bf16): each
        instruction adds two products, a[k] b[k] and a[k+1] b[k+1], to each of 16 fp32 lanes, so B is read in pairs
        of k (inductor's VNNI2 layout: for each pair of k, the n columns' two values side by side, packed at compile
        time; a B that is not a frozen weight is packed here, per call). inductor's own bf16 kernel converts every
        weight to fp32 and multiplies by FMA: twice the instructions, and past 4 rows compute-bound on a Zen 4 (a
        verify of 8 / 16 tokens 1.9 / 3.0 one-token steps, benchmarks/README.md 2026-11-28). int8 weights are made
        bf16 as they are loaded, once for all the block's rows (every int8 value is a bf16): for a block of up to
        INT8_TABLES_ROWS rows by two byte-table lookups (`vpermi2b`, where the CPU has avx512_vbmi: not Cooper Lake)
        and two byte unpacks for 64 weights, else by conversion through fp32 (12 instructions for 64). Both give
        the same bf16 values; on a 2-core Zen 4 EPYC the tables took SmolLM2's decoder int8 linears at one row from
        3.79 to 3.54 ms and from 3.73 to 3.65 in two runs, within the noise at more rows
        (benchmarks/scripts/int8_tables_ab.py).

        An output's sum runs over k in pairs, in order, in one lane, from C when accumulating (the template's later
        k blocks), so its bits depend on neither the register block nor the rows beside it."""

        # the micro-kernel and its entry, inductor's Jinja templates of C++ (csrc/)
        TEMPLATE_KERNEL = cpp_build.source_file("bf16_pairs_micro_kernel.cpp.jinja")
        TEMPLATE_ENTRY = cpp_build.source_file("bf16_pairs_entry.cpp.jinja")

        def codegen_define(self, kernel: Any) -> str:
            options = {
                "int8_tables": INT8_TABLES_ROWS,
                "int8_bf16_high": [_bf16_bits(m) >> 8 for m in range(128)],
                "int8_bf16_low": [_bf16_bits(m) & 0xFF for m in range(128)],
                "declare_kernel": self.get_kernel_declaration(),
                "kernel": kernel,
                "block_m": self.register_blocking.block_m,
                "block_n": self.register_blocking.block_n,
                **self.get_common_options(),
            }
            render = micro.KernelTemplate._template_from_string
            return render(self.TEMPLATE_KERNEL).render(options) + render(self.TEMPLATE_ENTRY).render(options)

        def get_b_layout(self) -> Any:
            return micro.LayoutType.VNNI2

    return Bf16DotMicroGemm


def _bf16_bits(value: int) -> int:
    """The 16 bits of `value` as a bf16 (exact for |value| <= 256)."""
    return int(torch.tensor(float(value), dtype=torch.bfloat16).view(torch.int16).item()) & 0xFFFF
