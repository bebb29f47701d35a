"""The compiled decode path (`--compile`): the target's verify (with the greedy accept's reductions) compiled whole,
and how every compiled graph is made (`compile_whole`); the drafter's graphs, made the same way, are in
compiled_draft.py.

`compile_verify` puts a target on the static cache (kv_cache.py: one shape per rows x verify length x capacity, no
position inside a graph) and gives it torch.compile's options for its device:

    GPU  inductor's kernels captured as a CUDA graph per shape and replayed (`mode="reduce-overhead"`, spelled as
         its inductor option `triton.cudagraphs` so that the module guards can be skipped as on a CPU: on an H100 a
         compiled step's dynamo cache lookup took 243 us, a tenth of a 2.5 ms verify).
    CPU  inductor's C++ kernels with the weights frozen into the graph (`freezing`: constants), every
         linear through inductor's own C++ GEMM template (`max_autotune_gemm` with the `CPP` backend, ATen's GEMM
         where it has none: bf16 on a CPU without bf16 instructions; `one_gemm_choice`; its micro-kernels as
         gemm_templates.py registers them: bf16 pairs by `vdpbf16ps`, int8 weights with fp32 activations; the int8
         layers of one input as one GEMM, `_register_int8_concat_linear`), and dynamo's
         guards on the model's modules skipped (the target is frozen; checking its ~2,000 module guards cost 1.5 ms
         a step, and keeping only those on which module it is still 1 ms). `freezing` must also be set while dynamo traces
         (`compile_whole`): given through torch.compile's options alone it froze nothing (the engine's graphs ran
         unfrozen until 2026-11-26). Decode's linears have 1 to 16 rows per verify row, where the BLAS GEMMs run
         far from the memory bandwidth; the template runs near it. On a 2-core AMD EPYC (avx2), the fp32 LM head of
         SmolLM2 (49152 x 576) over 15 rows took 25 ms through MKL, 25 ms packed by oneDNN and 8 ms through the
         template (4 ms over 1 to 4 rows: 29 GB/s); the verify of 4 / 16 tokens after 256 went from 57 / 92 ms
         (oneDNN packed) to 36 / 75 ms in one process (benchmarks/README.md). The template is taken without timing
         it against ATen's GEMM: a timing's choice differed between graphs, and so did bf16 bits. Frozen, the packed
         weights are held beside the model's own (the eager prefill reads those): up to twice the weights' memory.

The sizes that vary (rows, verify length, capacity) are symbolic from the first compile (`kernels/static_buffers.symbolic_sizes`),
so a prompt of another length or a row joining mid-answer costs no compile; on a GPU each new concrete size records
a CUDA graph of the same compiled code. inductor keeps what it compiled in its on-disk FX graph cache
(`$TORCHINDUCTOR_CACHE_DIR`, by default under the system's temporary directory), so a second process skips the
compile: on a CPU the frozen graphs are cached under a hash of their weights (`frozen_cache_tag`), with no oneDNN
copy of the weights, which inductor cannot cache (`_no_onednn_prepack`); a second start still traces them (122-153 s
against 268 s for SmolLM2-135M with its drafter in fp32 on a 2-core EPYC). `$FLASHDRAFT_COMPILE` (a JSON object of
torch.compile's keywords) replaces the options on either device.

On a CPU a `--quantize w8a16` target's Llama-style decoder layers each run as one operator in the graph
(decoder_layer_cpp.py), where inductor's graph of the model's own layer made eight calls.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ..kernels import attention_cpp, switches
from ..kernels.gemm_templates import bf16_rows_kernel, register_cpu_gemm_kernels, untested_gemm_kernels
from ..kernels.static_buffers import symbolic_sizes
from ..sampling import non_finite_rows
from ..targets.capabilities import static_refusal
from ..targets.target import TargetError, TargetOutput
from .kv_cache import kv_layers


def compile_verify(target: Any) -> str | None:
    """Have the engine verify on `target` through the static cache, compiled: CUDA graphs on a GPU
    (inductor's `triton.cudagraphs`), inductor's kernels on a CPU. Returns a one-line note when the target cannot
    take it (it then decodes eagerly, as exactly)."""
    reason = static_refusal(target)
    if reason is not None:
        return (
            f"--compile: {target.name} has {reason}, which the static cache does not serve; decoding eagerly"
        )
    if target.quantize == "fp16":  # an opaque packed weight (quantize.Fp16Linear): nothing inductor can fuse
        return (
            "--compile: fp16 weights run through fbgemm's own kernel, which is not compiled; decoding eagerly"
        )
    if target.device.type == "cpu" and (why := untested_gemm_kernels(target.dtype, target.quantize)):
        return f"--compile: {why}; decoding eagerly"  # rows through gemm_templates.py's kernels, made for one torch
    options = compile_options(target.device)
    if target.quantize == "w8a8":  # a CPU's scheme (quantize.check_quantize)
        note = _w8a8_refusal(options)
        if note is not None:
            return f"--compile: {note}; decoding eagerly"
    target.static_cache = True
    target.compile_options = options
    from ..kernels import packed_linear

    if packed_linear.unpack_linears(target.model):  # dense layers for inductor, which packs its own
        target.lm_head = target.model.get_output_embeddings()
    from ..kernels import attention

    if attention.wanted(target.model, target.dtype, target.device, compiled=True):  # before any trace
        attention.use(target.model, target.dtype)
    if target.quantize == "w8a16" and target.device.type == "cpu" and switches.fused_layers():
        from ..kernels import decoder_layer_cpp

        decoder_layer_cpp.fuse(target.model)  # a decode step's layer in one call each (its docstring)
    return None


def _w8a8_refusal(options: dict[str, Any]) -> str | None:
    """Why a w8a8 target (quantize.W8A8Linear) cannot compile with these options, or None. Its graphs hold the int8
    weight as a frozen constant that only inductor's C++ GEMM template reads (ATen's op takes oneDNN's packed
    layout), so the CPU needs the template's int8 micro-kernels and the options must freeze and take the template
    (as the CPU defaults do; a `$FLASHDRAFT_COMPILE` may not)."""
    from torch._inductor import config as inductor_config

    from ..kernels.quantize import w8a8_compiles

    if not w8a8_compiles():
        return "int8 activations compile through inductor's avx512_vnni or AMX kernels, which this CPU lacks"
    inductor = options.get("options") or {}
    backends = inductor.get("max_autotune_gemm_backends", inductor_config.max_autotune_gemm_backends)
    backends = str(backends).upper().split(",")
    templates = inductor.get("max_autotune") or inductor.get("max_autotune_gemm")
    if not (inductor.get("freezing") and templates and "CPP" in backends):
        return (
            "int8 activations compile only frozen, through inductor's C++ GEMM template (freezing, "
            "max_autotune_gemm and its CPP backend), which $FLASHDRAFT_COMPILE leaves out"
        )
    return None


def compile_options(device: torch.device, training: bool = False) -> dict[str, Any]:
    """torch.compile's keywords: `$FLASHDRAFT_COMPILE` (a JSON object, e.g. {"backend": "cudagraphs"} to capture
    graphs without inductor's code generation), else for decoding CUDA graphs of inductor's kernels on a GPU and
    frozen C++ kernels on a CPU (the module docstring); for `training`, inductor's defaults (shapes
    change with every micro-batch and weights with every step: no graphs, nothing frozen)."""
    import json

    env = switches.compile_options_json()
    if env:
        try:
            options = json.loads(env)
        except ValueError:
            options = None
        if not isinstance(options, dict):
            raise TargetError(
                f"FLASHDRAFT_COMPILE must be a JSON object of torch.compile options, got {env!r}"
            )
        return {k: v for k, v in options.items() if k != "mode"} if training else options
    if training:
        return {}
    # mode="reduce-overhead" is {"triton.cudagraphs": True}, and a mode takes no other option
    if device.type == "cuda":
        return {"options": {"triton.cudagraphs": True, "guard_filter_fn": no_module_guards}}
    return {
        "options": {
            "freezing": True,
            "guard_filter_fn": no_module_guards,
            "max_autotune_gemm": True,
            "max_autotune_gemm_backends": "CPP,ATEN",
            # bf16 intermediates rounded where eager rounds them, whatever inductor fuses: else a sum kept in fp32
            # inside one graph's fused kernel is rounded in another's (the verify with the drafter's taps, the
            # one-token step), and 5 of 6 bf16 DFlash outputs parted from plain decoding on a 2-core EPYC
            # (avx512_bf16); with it, none (benchmarks/README.md, 2026-11-28)
            "emulate_precision_casts": True,
            # the linears of one input (q / k / v, gate / up) as one GEMM over their weights concatenated at freezing:
            # 121 GEMM calls a step where there were 211, each row's outputs the same bits (the template sums a
            # column as it sums it at any width); SmolLM2-135M bf16's verify of 1 / 4 / 8 tokens 3 / 6 / 10 % faster
            # on a 2-core EPYC (avx512_bf16), interleaved in one process (benchmarks/README.md, 2026-11-29)
            "cpp.enable_concat_linear": True,
            # inductor's `size_asserts` stay on: each opaque call's output sizes and strides are checked against what
            # its fake kernel told inductor, so a wrong fake kernel is an error, not memory written out of bounds
            # (off, the w8a16 verify of 1-8 tokens was 4-8 % faster in one run and -4 to +7 % in another: 2026-12-06)
            # the autotuning's tables of choices on stderr, at every compile: not for a user's terminal
            "autotune_num_choices_displayed": 0,
            "max_autotune_report_choices_stats": False,
        }
    }


def no_module_guards(guard_entries: Sequence[Any]) -> list[bool]:
    """dynamo's `guard_filter_fn` for frozen models: no guard on their modules (PyTorch's
    `skip_guard_on_all_nn_modules_unsafe`). Safe because `compile_whole` gives every compiled function a code object
    of its own, and each serves one model: dynamo keeps graphs per code object, and every model goes through the same
    code (the verify, the block pass, the head), so with shared code and no guard on the module a second model of
    the same shapes ran the first one's graph, whose frozen constants are the first model's weights (found
    2026-11-26; a test builds two). Guarding which module it is (`ID_MATCH`) also told them apart, at 1 ms a call."""
    return [not entry.orig_guard.source.is_unspecialized_nn_module() for entry in guard_entries]


def own_code(fn: Any) -> Any:
    """`fn` (a function or a bound method) with a code object of its own, so dynamo keeps its graphs apart from those
    of every other function made from the same source (another model's verify, block pass or head)."""
    import types

    bound = fn.__self__ if isinstance(fn, types.MethodType) else None
    func = fn.__func__ if bound is not None else fn
    if not isinstance(func, types.FunctionType):
        return fn
    copy = types.FunctionType(
        func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__, func.__closure__
    )
    copy.__kwdefaults__, copy.__qualname__ = func.__kwdefaults__, func.__qualname__
    copy.__dict__.update(func.__dict__)
    return types.MethodType(copy, bound) if bound is not None else copy


def compile_whole(fn: Any, compile_options: dict[str, Any], weights: Any = None) -> Any:
    """`torch.compile(fn, fullgraph=True, **compile_options)` on a copy of `fn`'s code (`own_code`: its graphs are its
    own) and of the options: torch.compile pops `guard_filter_fn` out of the `options` dict it is given, so the
    target's own options lost it at the verify's compile (the drafter's block pass then kept its module guards, and
    the cost model's cache key changed in the middle of a process). With `freezing` in the options, the parameters
    are frozen for real, and `weights` (the module, or modules, whose parameters and buffers `fn` reads) name the
    graph in inductor's on-disk cache (`frozen_cache_tag`)."""
    # inductor's autotuning reads tensor storages through an API torch deprecates: its warning is not the user's
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
    compiled = torch.compile(own_code(fn), fullgraph=True, **fresh_options(compile_options))
    if not compile_options.get("options", {}).get("freezing"):
        return compiled
    if weights is None:
        raise ValueError("compile_whole: a frozen graph needs the modules whose weights it freezes")

    from torch._inductor import config as inductor_config

    _register_one_gemm_choice()
    register_cpu_gemm_kernels()
    _register_int8_concat_linear()
    _register_w8a16_concat_linear()
    _no_onednn_prepack()
    unrecorded = _unrecorded_cache_artifacts()
    compiler_config = torch.compiler.config
    tag: list[str] = []  # made at the first call: hashing the weights costs a fraction of a second

    def frozen(*args: Any) -> Any:
        # dynamo reads inductor's global `freezing` when it traces (it decides whether the parameters become
        # constants of the graph); the options given to torch.compile reach inductor alone, so through them
        # nothing was frozen or packed. Set and put back by hand: `config.patch` cost 25-35 us each, every step.
        if not tag:
            tag.append(frozen_cache_tag(weights))
        before = inductor_config.freezing, compiler_config.cache_key_tag
        inductor_config.freezing, compiler_config.cache_key_tag = True, tag[0]
        _THREAD.one_gemm_choice = True
        try:
            with unrecorded():
                return compiled(*args)
        finally:
            _THREAD.one_gemm_choice = False
            inductor_config.freezing, compiler_config.cache_key_tag = before

    return frozen


def _unrecorded_cache_artifacts() -> Any:
    """A context in which what inductor writes to or reads from its on-disk caches is not also kept in memory. torch
    records every cache entry's bytes for `torch.compiler.save_cache_artifacts` and holds them for the life of the
    process; a frozen graph's entry holds the GEMM template's packed weights, so the graphs read back from the cache
    held 1.2 GB more for SmolLM2-135M fp32 (a toy of two 32 MB linears: 67 MB held after its compile and after its
    cache hit). What is recorded inside the context is dropped at its end; what others recorded is kept."""
    import contextlib

    try:
        from torch.compiler._cache import CacheArtifactManager

        return CacheArtifactManager.with_fresh_cache
    except (ImportError, AttributeError):  # another torch: recorded, as torch does
        return contextlib.nullcontext


def kernels_tag() -> str:
    """A hash of this file, compiled_draft.py, gemm_templates.py, attention.py, attention_cpp.py, w8a16_cpp.py and
    decoder_layer_cpp.py: the kernels chosen or written there (GEMM choices, register blocks, micro-kernels, the
    attention, w8a16's operator, the fused layer, the drafter's graphs), which the graphs frozen in inductor's cache
    and the cost model's prices depend on."""
    import hashlib
    from pathlib import Path

    digest = hashlib.sha256()
    kernels = Path(attention_cpp.__file__).parent  # the modules choosing kernels, and the C++ sources (csrc/)
    names = ("gemm_templates.py", "attention.py", "attention_cpp.py", "w8a16_cpp.py", "decoder_layer_cpp.py")
    sources = [Path(__file__), Path(__file__).with_name("compiled_draft.py"), *(kernels / n for n in names)]
    for path in [*sources, *sorted((kernels / "csrc").iterdir())]:
        digest.update(path.read_bytes())
    digest.update(str(switches.fused_layers()).encode())
    digest.update(str(switches.attention_tiles()).encode())  # AMX's scores or the vectors'
    digest.update(repr(sorted(getattr(register_cpu_gemm_kernels, "without", ()))).encode())  # a benchmark's
    digest.update(repr(bf16_rows_kernel()).encode())  # AMX or the pair kernel (`serving_bf16_rows`)
    return digest.hexdigest()[:8]


def frozen_cache_tag(weights: Any) -> str:
    """The name of a frozen graph's weights in inductor's on-disk FX graph cache (torch's `cache_key_tag`): this
    package's version, a hash of this file (it chooses the graphs' kernels) and a sha256 of every parameter and
    buffer of `weights` (a module or a sequence of them): names, dtypes, shapes and bytes, 0.35 s for SmolLM2-135M's
    540 MB in fp32 on a 2-core AMD EPYC. inductor keys a frozen parameter by its shape and dtype alone, yet keeps the
    GEMM template's packed copy of it in the cache entry, by value: without this tag a second model of the same
    shapes, in a later process, ran the first one's packed weights (a toy two-linear model, torch 2.13: outputs off
    by 1.0)."""
    import hashlib

    from .._version import __version__

    code = kernels_tag()
    modules = [weights] if isinstance(weights, torch.nn.Module) else list(weights)
    digest = hashlib.sha256()
    for module in modules:
        tensors = dict(module.named_parameters(remove_duplicate=False))
        tensors.update(module.named_buffers(remove_duplicate=False))
        for name, t in sorted(tensors.items()):
            if t is None:
                continue
            digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            data = t.detach().reshape(-1).contiguous().view(torch.uint8)
            digest.update(memoryview(data.cpu().numpy()))
    return f"flashdraft-{__version__}-{code}-frozen-{digest.hexdigest()[:32]}"


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
            getattr(_THREAD, "one_gemm_choice", False)
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
    from ..kernels import w8a16_cpp

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
    if not getattr(_THREAD, "one_gemm_choice", False) or len(choices) < 2:
        return choices
    from torch._inductor.select_algorithm import ExternKernelCaller

    templates = [c for c in choices if not isinstance(c, ExternKernelCaller)]  # on a CPU: the C++ template
    return (templates or choices)[:1]


def fresh_options(compile_options: dict[str, Any]) -> dict[str, Any]:
    """torch.compile's keywords with their nested dicts copied (torch.compile changes the `options` it is given)."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in compile_options.items()}


def options_key(options: dict[str, Any] | None) -> str:
    """`options` as text that is the same in every process (a function by its name, not its address): what the
    cost model is cached under."""
    import json

    return json.dumps(options, sort_keys=True, default=lambda o: getattr(o, "__qualname__", type(o).__name__))


class VerifyForward:
    """The target's verify over a static cache, with its layer taps: a `TargetOutput` (logits [b, n, V] fp32, taps
    [b, n, F], and the greedy accept's argmax and non-finite flags per position, reduced from the logits inside the
    graph: one fused pass where the engine's eager reductions were five, 0.7 ms of a 15 ms bf16 step on a 2-core EPYC).
    Compiled whole (fullgraph) with `compile_options` (torch.compile's keywords); on a GPU inductor's
    `triton.cudagraphs` records a CUDA graph per shape. The taps are hooks registered once (hooks added and removed
    per call would make every call a new graph)."""

    def __init__(self, target: Any, tap_layer_ids: Sequence[int], compile_options: dict | None) -> None:
        self.target = target
        self.taps = tuple(tap_layer_ids)
        self.compiled = compile_options is not None
        # The grad modes (inference mode or not) the engine made its graphs for before a first step
        # (engine._compile_ahead): dynamo guards on whether a tensor was made in inference mode.
        self.compiled_ahead: set[tuple[bool, bool]] = set()  # (inference mode, several rows)
        self._captured: dict[int, torch.Tensor] = {}
        for layer_id in dict.fromkeys(self.taps):
            target.layers[layer_id].register_forward_hook(self._hook(layer_id))
        fn = self._forward
        if self.compiled:
            fn = compile_whole(fn, compile_options, weights=target.model)
        self._fn = fn

    def _hook(self, layer_id: int):
        def hook(_module, _args, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def _logits_and_taps(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = self.target
        kwargs = t.model_kwargs(cache, mask, position_ids)
        if t.takes_cache_position:
            # the columns this verify writes: without them a transformers 4.x model counts the cache's length
            # itself (`get_seq_length()`, a Python int), which dynamo guards on: a graph per length until it makes
            # the length dynamic, compiled in the middle of an answer (a lone row after a batch: 3 graphs on 4.57)
            kwargs["cache_position"] = kv_layers(cache)[0].static.columns
        logits = t.model(input_ids=input_ids, **kwargs).logits.float()
        taps = t._concat_taps(self._captured, self.taps) if self.taps else None
        return logits, taps

    def _forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache: Any
    ) -> tuple[torch.Tensor, ...]:
        """The compiled graph: the logits and taps, and the greedy accept's reductions fused beside them."""
        logits, taps = self._logits_and_taps(input_ids, position_ids, mask, cache)
        return logits, taps, logits.argmax(-1), non_finite_rows(logits)

    @torch.no_grad()
    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache: Any
    ) -> TargetOutput:
        if not self.compiled:  # eager: the accept reduces the logits itself, where a row is greedy
            return TargetOutput(*self._logits_and_taps(input_ids, position_ids, mask, cache))
        self._captured.clear()  # the hooks also fire in eager forwards (prefill): the graph always starts empty
        input_ids, position_ids = fresh(input_ids), fresh(position_ids)
        symbolic_sizes(input_ids, 0, 1)  # rows, verify length
        symbolic_sizes(
            position_ids, *((0, 1) if position_ids.dim() == 2 else (1, 2))
        )  # [4, b, n]: multimodal RoPE
        symbolic_sizes(mask, 0, 2, 3)  # rows, verify length, capacity
        logits, taps, tokens, bad = run_compiled(
            self._fn, f"{self.target.name}'s verify", input_ids, position_ids, mask, cache
        )
        self._captured.clear()  # the graph's own memory: not held past the call
        # A replayed CUDA graph writes its outputs into the same memory next time: keep copies. On a CPU every
        # call's outputs are new tensors (the logits' copy cost 30-60 us).
        if self.target.device.type == "cuda":
            logits, taps, tokens, bad = (
                None if t is None else t.clone() for t in (logits, taps, tokens, bad)
            )
        return TargetOutput(logits, taps, (tokens, bad))


def verify_forward(target: Any, tap_layer_ids: Sequence[int]) -> VerifyForward:
    """The `VerifyForward` for these taps, made once per model (its hooks are registered once; a compiled one keeps
    its graphs), whichever `Target` wraps the model."""
    key = (tuple(tap_layer_ids), options_key(target.compile_options))
    forwards = target.model.__dict__.setdefault("_flashdraft_verify_forwards", {})
    if key not in forwards:
        forwards[key] = VerifyForward(target, tap_layer_ids, target.compile_options)
    return forwards[key]


def fresh(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy at storage offset 0 of a compiled function's input. dynamo keeps a graph per stride and
    storage offset too, not only per shape: `.contiguous()` keeps a slice's offset (the drafter's head met one row's
    slots one state into their tensor and a batch's at 0: two graphs, a compile in the middle of a GPU answer), and
    a plain clone keeps a [1, n] slice's row stride, the length of what it was cut from."""
    return t.clone(memory_format=torch.contiguous_format)


def run_compiled(fn: Any, what: str, *args: Any) -> Any:
    """A compiled step; its failure (a graph break under fullgraph, no compiler for inductor, ...) is one line."""
    if not getattr(_THREAD, "limit_raised", False):
        _raise_recompile_limit()
        _THREAD.limit_raised = True
    try:
        return fn(*args)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TargetError(
            f"--compile: torch.compile could not compile {what} ({type(e).__name__}: {first}); decode without "
            "--compile"
        ) from None


_THREAD = threading.local()


def _raise_recompile_limit() -> None:
    """Room for the graphs a batch that changes size needs (dynamo's default is 8 per function). Set once in each
    thread that compiles: dynamo's settings are per thread (the server decodes in its own)."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 256))
    if hasattr(config, "accumulated_recompile_limit"):
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 1024)
