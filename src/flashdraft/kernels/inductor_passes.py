"""inductor's passes over the frozen CPU graphs (engine/compiled.py's `compile_whole`), registered once per process:
which GEMM kernel each linear takes (`one_gemm_choice`: the C++ template, never a timing's choice), the int8 and
w8a16 linears of one input as one GEMM (`_register_int8_concat_linear`, `_register_w8a16_concat_linear`), and no
oneDNN copy of the weights (`_no_onednn_prepack`). They act only inside a frozen graph's compile
(`FROZEN_COMPILE.active`, set by `compile_whole`); gemm_templates.py registers the micro-kernels the template runs."""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from . import w8a16_cpp
from .gemm_templates import bf16_rows_kernel, register_cpu_gemm_kernels

# `active` while a frozen graph compiles on this thread (compile_whole): the passes act only then
FROZEN_COMPILE = threading.local()


def register_frozen_passes() -> None:
    """Once per process, before any frozen graph: every pass below and gemm_templates.py's micro-kernels."""
    _register_one_gemm_choice()
    register_cpu_gemm_kernels()
    _register_int8_concat_linear()
    _register_w8a16_concat_linear()
    _no_onednn_prepack()


def _no_onednn_prepack() -> None:
    """Once per process, before any frozen graph: inductor's freezing passes no longer repack constant linear
    weights as oneDNN tensors. Every linear of a frozen graph runs through the C++ GEMM template
    (`one_gemm_choice`), which packs its own copy at compile time, so the oneDNN copies were never read; and a
    graph holding a oneDNN tensor is never written to inductor's FX graph cache ("mkldnn tensors unpickleable"),
    so every process compiled the frozen graphs again (about 6 minutes for SmolLM2-135M's verify, block pass and
    head on a 2-core EPYC). The passes register their patterns once per process (a cached init that registers
    nothing while oneDNN is off): if a frozen graph elsewhere in the process registered them first, graphs are
    compiled as before, uncached."""
    if getattr(_no_onednn_prepack, "done", False):
        return
    _no_onednn_prepack.done = True
    try:
        from torch._inductor.fx_passes import mkldnn_fusion

        init = mkldnn_fusion._mkldnn_weight_pack_init
        enabled = torch._C._get_mkldnn_enabled()
    except (ImportError, AttributeError):  # another torch: packing, and compiling, as before
        return
    # not `torch.backends.mkldnn.flags`: it also sets TF32, with a warning
    torch._C._set_mkldnn_enabled(False)
    try:
        init()
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def _freezing_replacement() -> Any:
    """inductor's `register_replacement` bound to its freezing patterns (a replacement made in the graphs
    compile_whole freezes, forward only), or None where this torch has no such pass."""
    try:
        import torch._inductor.lowering  # noqa: F401 - inductor's modules import in this order
        from torch._inductor.fx_passes.freezing_patterns import pass_patterns
        from torch._inductor.pattern_matcher import fwd_only, register_replacement
    except (ImportError, AttributeError):
        return None

    def register(pattern: Any, replacement: Any, example_inputs: list[Any], **kwargs: Any) -> None:
        register_replacement(pattern, replacement, example_inputs, fwd_only, pass_patterns[0], **kwargs)

    return register


def _register_int8_concat_linear() -> None:
    """Once per process, before any frozen graph: inductor's freezing passes turn int8 linears that read the same
    rows (an attention's q / k / v projections, an MLP's gate and up) into one GEMM over their weights and scales
    concatenated (constants, folded once at compile time), its output split. inductor has this fusion for fp32
    weights and bf16-dequantized int8 ones (`cpp.enable_concat_linear`, off by default), not for the kernel op
    `Int8Linear` calls. On a 2-core AMD EPYC (avx2) SmolLM2-135M's int8 x fp32 step ran 211 GEMMs of 7-39 us each;
    121 GEMMs do the same work with fewer calls and wider outputs per call (benchmarks/README.md). Every output
    column is still its row's dot product with its weight row, summed as the template sums any row (tested at the
    fused widths), for the rows of `int8_concat_row_dtypes`."""
    if getattr(_register_int8_concat_linear, "done", False):
        return
    _register_int8_concat_linear.done = True
    register = _freezing_replacement()
    if register is None:  # another torch: one GEMM per linear, as before
        return
    int8_mm = torch.ops.aten._weight_int8pack_mm.default

    def frozen(match: Any, names: tuple[str, ...]) -> bool:
        """Rows of `int8_concat_row_dtypes`, and the weights and scales the graph's constants, in a graph
        compile_whole freezes."""
        rows = match.kwargs["x"].meta.get("val")
        return (
            getattr(FROZEN_COMPILE, "active", False)
            and rows is not None
            and rows.dtype in int8_concat_row_dtypes()
            and all(match.kwargs[name].op == "get_attr" for name in names)
        )

    def three(x, w1, w2, w3, s1, s2, s3):
        return int8_mm(x, w1, s1), int8_mm(x, w2, s2), int8_mm(x, w3, s3)

    def three_as_one(x, w1, w2, w3, s1, s2, s3):
        out = int8_mm(x, torch.cat((w1, w2, w3)), torch.cat((s1, s2, s3)))
        return out.split([w1.size(0), w2.size(0), w3.size(0)], dim=1)

    def two(x, w1, w2, s1, s2):
        return int8_mm(x, w1, s1), int8_mm(x, w2, s2)

    def two_as_one(x, w1, w2, s1, s2):
        out = int8_mm(x, torch.cat((w1, w2)), torch.cat((s1, s2)))
        return out.split([w1.size(0), w2.size(0)], dim=1)

    rows = functools.partial(torch.empty, (8, 16))
    weight = functools.partial(torch.empty, (8, 16), dtype=torch.int8)
    scale = functools.partial(torch.empty, (8,))
    for pattern, replacement, names in (
        (three, three_as_one, ("w1", "w2", "w3", "s1", "s2", "s3")),
        (two, two_as_one, ("w1", "w2", "s1", "s2")),
    ):
        k = len(names) // 2
        register(
            pattern,
            replacement,
            [rows()] + [weight() for _ in range(k)] + [scale() for _ in range(k)],
            extra_check=functools.partial(frozen, names=names),
            exclusive_arg_names=names,
        )


def _register_w8a16_concat_linear() -> None:
    """Once per process, before any frozen graph: `--quantize w8a16` layers that read the same rows (q / k / v, gate
    / up) as one call of w8a16_cpp.py's kernel over their packed weights concatenated (folded once at freezing),
    its output split: the kernel's calls are opaque to inductor, each one from its graph's wrapper, and SmolLM2-135M
    makes 121 a step instead of 211. Each output is its row's exact integer sum, whatever the width. Only where every
    layer but the last fills whole tiles of 16 outputs (the packed weights then line up), and without biases.
    Registered once the kernel is built (a w8a16 layer builds it): tracing the patterns runs the operator."""
    if getattr(_register_w8a16_concat_linear, "done", False) or w8a16_cpp.kernels() is None:
        return
    _register_w8a16_concat_linear.done = True
    register = _freezing_replacement()
    if register is None:  # another torch: one call per linear, as before
        return
    op = torch.ops.flashdraft.w8a16_linear.default

    def tiles(match: Any, names: tuple[str, ...]) -> bool:
        """The packed weights, scales and column sums the graph's constants, every layer but the last a whole
        number of tiles wide."""
        scales = [match.kwargs[name] for name in names if name.startswith("s")]
        widths = [node.meta["val"].shape[0] for node in scales if "val" in node.meta]
        return (
            all(match.kwargs[name].op == "get_attr" for name in names)
            and len(widths) == len(scales)
            and all(width % w8a16_cpp.TILE_COLUMNS == 0 for width in widths[:-1])
        )

    def three(x, p1, p2, p3, s1, s2, s3, c1, c2, c3):
        return op(x, p1, s1, c1, None), op(x, p2, s2, c2, None), op(x, p3, s3, c3, None)

    def three_as_one(x, p1, p2, p3, s1, s2, s3, c1, c2, c3):
        out = op(x, torch.cat((p1, p2, p3)), torch.cat((s1, s2, s3)), torch.cat((c1, c2, c3)), None)
        return out.split([s1.size(0), s2.size(0), s3.size(0)], dim=1)

    def two(x, p1, p2, s1, s2, c1, c2):
        return op(x, p1, s1, c1, None), op(x, p2, s2, c2, None)

    def two_as_one(x, p1, p2, s1, s2, c1, c2):
        out = op(x, torch.cat((p1, p2)), torch.cat((s1, s2)), torch.cat((c1, c2)), None)
        return out.split([s1.size(0), s2.size(0)], dim=1)

    rows = functools.partial(torch.empty, (8, 64))
    packed = functools.partial(torch.empty, (1, 1, 16, 16, 4), dtype=torch.int8)
    scale = functools.partial(torch.empty, (16,))
    colsum = functools.partial(torch.empty, (16,), dtype=torch.int32)
    for pattern, replacement, k in ((three, three_as_one, 3), (two, two_as_one, 2)):
        names = tuple(f"{kind}{i}" for kind in "psc" for i in range(1, k + 1))
        register(
            pattern,
            replacement,
            [rows()]
            + [packed() for _ in range(k)]
            + [scale() for _ in range(k)]
            + [colsum() for _ in range(k)],
            extra_check=functools.partial(tiles, names=names),
            exclusive_arg_names=names,
        )


def int8_concat_row_dtypes() -> tuple[torch.dtype, ...]:
    """The rows whose int8 layers of one input `_register_int8_concat_linear` makes one GEMM: fp32 (the template's
    fp32 kernel), and bf16 where AMX or gemm_templates's pair kernel serves them (`bf16_rows_kernel`), which sum a column
    in one order at any width. inductor's own bf16 x int8 kernels, elsewhere, are left as they are."""
    return (torch.float32, torch.bfloat16) if bf16_rows_kernel() else (torch.float32,)


def _register_one_gemm_choice() -> None:
    """Once per process, `one_gemm_choice` among inductor's autotuning filters (it acts only inside the frozen
    graphs' compiles, `compile_whole`)."""
    if getattr(_register_one_gemm_choice, "done", False):
        return
    from torch._inductor import select_algorithm

    select_algorithm.add_preprocessing_fn(one_gemm_choice)
    _register_one_gemm_choice.done = True


def one_gemm_choice(choices: list[Any]) -> list[Any]:
    """inductor's candidate kernels for one GEMM of a frozen CPU graph, cut to one: its C++ template where it has
    one, else the first (ATen's). inductor's own choice times the candidates when each graph compiles, so two graphs
    of the same model (the verify with and without the drafter's taps, the one-token step and the verify) could
    take different kernels for the same linear, whose bf16 sums round differently: on a 2-core AMD EPYC
    (avx512_bf16) 5 of 16 outputs of one bench run differed from plain decoding on near-ties, none in the run
    before. The template sums each row alone in the same order at any row count, so one choice gives a token the
    same bits at any verify length, in any graph and process (benchmarks/README.md, 2026-11-27), and no graph
    spends its compile timing kernels."""
    if not getattr(FROZEN_COMPILE, "active", False) or len(choices) < 2:
        return choices
    from torch._inductor.select_algorithm import ExternKernelCaller

    templates = [c for c in choices if not isinstance(c, ExternKernelCaller)]  # on a CPU: the C++ template
    return (templates or choices)[:1]
