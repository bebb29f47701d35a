"""The kernel plan: how a target's arithmetic runs on its device, chosen here and only here.

`make_plan` decides once, from the device, the dtype, the quantization scheme, whether `--compile` was asked for,
what this CPU and torch offer (`CpuOffer`: its features, the kernels that build, the torch version) and the six
environment switches (read in this module alone), and returns a `KernelPlan`: a frozen value. The target is prepared
by it once (`prepare_model`: oneDNN's packed linears, the short-query attention, the fused w8a16 layers) and keeps
it (`Target.plan`); the engine reads the value (`plan.static_cache`, `plan.compile_options`, `plan.trees_exact`),
never layer types or CPU flags. What a scheme cannot run exactly is refused here, in one line, before any weight is
read (`check_quantize`); what `--compile` cannot take decodes eagerly, the plan's `compile_note` saying why.

    choice            taken when                                                      else
    packed linears    fp32 on a CPU, oneDNN present, not compiled, not training        ATen's (MKL) linears
    short-query attn  a CPU, in bf16 or fp32 or compiled, unless FLASHDRAFT_ATTENTION   transformers' SDPA function
                      is "sdpa"
    its C++ kernel    bf16 (or a w8a16 target in fp32), where it builds (AMX's tiles   two oneDNN products (fp32:
                      for bf16 scores unless FLASHDRAFT_ATTENTION_TILES=0)             SDPA's kernel)
    compiled verify   --compile, unless fp16 weights, or bf16 / int8 on a torch the    eager, through the growing or
                      GEMM kernels are not tested with, or w8a8 without its template   static cache
    static cache      compiled, or on a GPU, or fused layers (where the family allows)   the growing cache
    w8a16 kernel      --quantize w8a16: the best this CPU has (w8a16_cpp.KERNELS: avx2,  refused (no avx2 and FMA)
                      AVX-VNNI, avx512_vnni, AMX), all giving the same bits
    fused layers      w8a16 on a CPU with the attention kernel, eager or compiled,     the model's own layers
                      unless FLASHDRAFT_FUSED_LAYERS=0
    bf16 row kernel   compiled on a CPU: AMX, else the pair kernel (avx512_bf16)       inductor's own (trees refused)
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

OFF = ("0", "false", "no", "off")
SHORT_QUERY = "short_query"  # attention.NAME
REDUCED = (torch.bfloat16, torch.float16)


class KernelPlanError(ValueError):
    """A kernel setting that cannot be honoured (a malformed `$FLASHDRAFT_COMPILE`): one line."""


# ---------------------------------------------------------------- the environment switches (read here only)
def _on(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in OFF


def switches() -> dict[str, Any]:
    """The six switches that choose kernels, as this process sees them now: `$FLASHDRAFT_COMPILE` (torch.compile's
    keywords as a JSON object, replacing `compile_options`' own), `_FUSED_LAYERS` (a w8a16 target's layers
    as one operator each; on unless 0), `_ATTENTION` ("sdpa": transformers' SDPA for every query), `_ATTENTION_TILES`
    (bf16 scores on AMX's tiles; on unless 0), `_PACKED_LINEAR` (an fp32 target's linears through oneDNN; on unless
    0), `_W8A16_KERNEL` (the w8a16 kernel to serve, one of w8a16_cpp.KERNELS this CPU runs; else its best). They
    turn a kernel off for an A/B or a bug report; none changes what a model computes beyond its last bits, and the
    compiled graphs are keyed on those that change any (engine/compiled.py's `kernels_tag`: the w8a16 kernels give
    the same bits)."""
    return {
        "compile": os.environ.get("FLASHDRAFT_COMPILE") or None,
        "fused_layers": _on("FLASHDRAFT_FUSED_LAYERS"),
        "short_query_attention": os.environ.get("FLASHDRAFT_ATTENTION", "").strip().lower() != "sdpa",
        "attention_tiles": _on("FLASHDRAFT_ATTENTION_TILES"),
        "packed_linears": _on("FLASHDRAFT_PACKED_LINEAR"),
        "w8a16_kernel": os.environ.get("FLASHDRAFT_W8A16_KERNEL", "").strip().lower() or None,
    }


# ---------------------------------------------------------------- what this CPU and torch offer
def _bf16_math() -> bool:
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def _attention_kernel() -> bool:
    from . import attention_cpp

    return attention_cpp.prepare(torch.bfloat16, tiles=switches()["attention_tiles"])


def _attention_tiles() -> bool:
    from . import attention_cpp

    return _attention_kernel() and attention_cpp.tiles()


def _probe(module: str, name: str) -> Callable[[], Any]:
    def probe() -> Any:
        import importlib

        return getattr(importlib.import_module(f"{__package__}.{module}"), name)()

    return probe


# What each offer is, and how it is asked (lazily: a probe may build a C++ library or time oneDNN's int8 product).
PROBES: dict[str, Callable[[], Any]] = {
    "bf16_math": _bf16_math,  # bf16 instructions (avx512_bf16 or AMX), where bf16 is not emulated
    "onednn_fp32": _probe("packed_linear", "available"),  # oneDNN's packed fp32 linear
    "fp16": _probe("quantize", "fp16_available"),  # fbgemm's fp16 GEMM
    "w8a8_exact": _probe("quantize", "w8a8_exact"),  # oneDNN's int8 product exact (VNNI)
    "w8a8_compiles": _probe("quantize", "w8a8_compiles"),  # inductor's int8 x int8 micro-kernels
    "w8a16": _probe("quantize", "w8a16_available"),  # w8a16_cpp's kernel built and serving
    "w8a16_kernels": _probe("w8a16_cpp", "available_kernels"),  # the w8a16 kernels this CPU runs, least first
    "attention_kernel": _attention_kernel,  # attention_cpp's kernel built
    "attention_tiles": _attention_tiles,  # and scoring bf16 on AMX's tiles
    "untested_torch": _probe(
        "gemm_templates", "untested_torch"
    ),  # why the GEMM kernels do not serve, or None
    "bf16_rows": _probe("gemm_templates", "bf16_rows_kernel"),  # "amx", "pairs" or None
    "features": _probe("cpu_info", "cpu_features"),  # the CPU's instruction-set features
}


class CpuOffer:
    """What this CPU and this torch offer the plan, each asked when needed (the probes keep what is costly to learn:
    a built library, a timed product). `known` sets an offer without asking (tests plan for another CPU:
    `CpuOffer(bf16_math=False, w8a8_exact=False, w8a16=False)`)."""

    def __init__(self, **known: Any) -> None:
        unknown = set(known) - set(PROBES)
        if unknown:
            raise TypeError(f"CpuOffer: no such offer {sorted(unknown)} (they are {sorted(PROBES)})")
        self._known = dict(known)

    def __call__(self, what: str) -> Any:
        return self._known[what] if what in self._known else PROBES[what]()


_THIS_CPU = CpuOffer()


def this_cpu() -> CpuOffer:
    """This machine's offer (one per process)."""
    return _THIS_CPU


# ---------------------------------------------------------------- the plan
@dataclass(frozen=True)
class KernelPlan:
    """How a target's arithmetic runs: made by `make_plan`, read by the engine and the reports."""

    device: torch.device
    dtype: torch.dtype
    quantize: str | None = None  # "int8", "w8a8", "w8a16", "fp16" (quantize.py) or None
    compile_options: Mapping[str, Any] | None = field(
        default=None, compare=False
    )  # torch.compile's; None: eager
    static_cache: bool = False  # the engine verifies through the static cache (kv_cache.py)
    packed_linears: bool = False  # fp32 linears through oneDNN's packed weights (packed_linear.py)
    attention: str = "sdpa"  # SHORT_QUERY (attention.py) or "sdpa"
    attention_kernel: bool = False  # short bf16 queries through attention_cpp's kernel
    attention_tiles: bool = False  # its bf16 scores on AMX's tiles
    fused_layers: bool = False  # a w8a16 target's decoder layers as decoder_layer_cpp's operator
    w8a16_kernel: str | None = None  # the w8a16 products' kernel (w8a16_cpp.KERNELS; all give the same bits)
    bf16_rows: str | None = (
        None  # compiled on a CPU: the kernel holding bf16 rows to one order ("amx", "pairs")
    )
    compile_note: str | None = None  # why `--compile` decodes eagerly here, if it was asked for and does
    compile_asked: bool = False
    pack_asked: bool = True
    offer: CpuOffer = field(default=_THIS_CPU, compare=False, repr=False)

    @property
    def compiled(self) -> bool:
        return self.compile_options is not None

    @property
    def compiled_cpu_reduced(self) -> bool:
        """Compiled on a CPU in reduced precision (bf16 / fp16), where exactness rests on the row kernels."""
        return self.compiled and self.device.type == "cpu" and self.dtype in REDUCED

    @property
    def trees_exact(self) -> bool:
        """Whether a draft tree's verify gives each node the bits of its path's one-token steps, as far as the
        kernels go: always, but compiled on a CPU in reduced precision only with attention_cpp's kernel (hidden
        columns add nothing, wherever they are) and a bf16 row kernel (a row's bits whatever the rows beside it)."""
        return not self.compiled_cpu_reduced or (self.attention_kernel and self.bf16_rows is not None)

    @property
    def row_invariant(self) -> bool:
        """Whether the kernels give a token the same bits in a verify of any length as in a one-token step, by their
        construction (tests/test_row_invariance.py): then DFlash's output is plain decoding's bit for bit, near-ties
        included. Where False a token's logits can differ in their last bits between the two, and an output can part
        from plain decoding where two tokens nearly tie.

        Compiled on a CPU in bf16: inductor's GEMM template for every linear (`inductor_passes.one_gemm_choice`),
        its rows held to one order by a row kernel (`bf16_rows`), the attention by attention_cpp's kernel. Eager on
        a CPU: products in integers (w8a8, w8a16) or int8 weights with bf16 rows on bf16 instructions (not
        emulated), around attention_cpp's kernel. Not eager fp32 / bf16 / fp16 (oneDNN's, MKL's and fbgemm's
        reductions may follow the row count), nor fp32 compiled (its attention products are ATen's GEMMs), nor a
        GPU. A path not claimed may still hold rows on a given CPU (bf16 eager on an AMX Xeon did): measured, not
        promised."""
        if self.device.type != "cpu":
            return False
        if self.quantize == "w8a16":  # every product in integers, eager or compiled, in bf16 or fp32 rows
            return self.attention_kernel
        if self.compiled:
            rows = self.dtype == torch.bfloat16 and self.bf16_rows is not None and self.attention_kernel
            return rows and takes_gemm_template(self.compile_options)
        if self.quantize == "w8a8":
            return self.attention_kernel
        return self.quantize == "int8" and self.attention_kernel and bool(self.offer("bf16_math"))

    @property
    def compile_key(self) -> str:
        """The compile options as text the same in every process: what graphs and prices are kept under."""
        return options_key(self.compile_options)

    def replace(self, **changes: Any) -> KernelPlan:
        """This plan with `changes` (tests and benchmarks: `plan.replace(static_cache=True)`)."""
        return dataclasses.replace(self, **changes)

    def declined(self, why: str) -> KernelPlan:
        """The plan as made without `--compile` (packed linears and all), its note saying why."""
        eager = make_plan(
            self.device,
            self.dtype,
            self.quantize,
            compile=False,
            pack_linears=self.pack_asked,
            offer=self.offer,
        )
        note = f"--compile: {why}; decoding eagerly" if self.compile_asked else None
        return eager.replace(compile_note=note, compile_asked=self.compile_asked, static_cache=False)

    def describe(self) -> str:
        """One line: the kernels this plan runs (logs, bench reports)."""
        parts = [str(self.device), str(self.dtype).removeprefix("torch.")]
        if self.quantize:
            parts.append(self.quantize)
        parts.append("compiled" if self.compiled else "eager")
        if self.static_cache:
            parts.append("static cache")
        if self.packed_linears:
            parts.append("oneDNN packed linears")
        if self.attention == SHORT_QUERY:
            kernel = " (C++ kernel, AMX tiles)" if self.attention_tiles else " (C++ kernel)"
            parts.append("short-query attention" + (kernel if self.attention_kernel else ""))
        if self.w8a16_kernel:
            parts.append(f"w8a16 by {self.w8a16_kernel}")
        if self.fused_layers:
            parts.append("fused w8a16 layers")
        if self.bf16_rows:
            parts.append(f"bf16 rows by {self.bf16_rows}")
        parts.append("row-invariant" if self.row_invariant else "rows within rounding")
        return ", ".join(parts)


def default_dtype(
    device: torch.device, quantize: str | None, compile: bool, offer: CpuOffer | None = None
) -> torch.dtype:
    """The dtype left unsaid: bf16 on a GPU, fp32 on a CPU (bf16 is slower than fp32 for small-batch products on
    CPUs without AMX). A quantized model's activations: fp32 for fp16 weights; for int8 ones bf16, but fp32 when
    compiled on a CPU without bf16 instructions (avx512_bf16 or AMX), where bf16 is emulated and inductor's GEMM
    template multiplies fp32 rows by the int8 weights (benchmarks/README.md, 2026-11-28); and for w8a16 on such a
    CPU, eager too (its kernel reads fp32 rows as well as bf16 ones, and every other operation would be emulated)."""
    if quantize is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    bf16_math = (offer or _THIS_CPU)("bf16_math")
    if quantize == "fp16" or not bf16_math and (compile or quantize == "w8a16"):
        return torch.float32
    return torch.bfloat16


def make_plan(
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    quantize: str | None = None,
    compile: bool = False,
    *,
    pack_linears: bool = True,
    offer: CpuOffer | None = None,
) -> KernelPlan:
    """The plan for a target on `device` in `dtype` (None: `default_dtype`), quantized by `quantize`, compiled or
    not; `pack_linears` False for training (its weights change). Refuses (quantize.QuantizeError, KernelPlanError)
    what cannot run exactly here, before anything is loaded. The target's own refusals (a family the static cache
    does not serve) come after, from the target (`KernelPlan.declined`)."""
    offer = offer or _THIS_CPU
    device = torch.device(device)
    check_quantize(quantize, dtype, device, offer=offer)
    dtype = dtype or default_dtype(device, quantize, compile, offer)
    env = switches()
    cpu = device.type == "cpu"
    options, why = None, None
    if compile:
        options, why = _compile_choice(device, dtype, quantize, offer)
    compiled = options is not None
    short = cpu and env["short_query_attention"] and (dtype in (torch.bfloat16, torch.float32) or compiled)
    attention = SHORT_QUERY if short else "sdpa"
    # bf16's short queries, and a w8a16 target's in fp32 too (the CPUs without bf16 instructions run it in fp32,
    # and its rows hold only around this kernel: `row_invariant`)
    kernel_dtype = dtype == torch.bfloat16 or dtype == torch.float32 and quantize == "w8a16"
    kernel = attention == SHORT_QUERY and kernel_dtype and bool(offer("attention_kernel"))
    # a w8a16 target's decoder layers as one operator each at decode (it calls the attention kernel), eager or
    # compiled; it reads and writes the static cache
    fused = cpu and quantize == "w8a16" and kernel and env["fused_layers"]
    return KernelPlan(
        device=device,
        dtype=dtype,
        quantize=quantize,
        compile_options=options,
        static_cache=compiled or device.type == "cuda" or fused,
        packed_linears=(
            pack_linears and cpu and not compiled and dtype == torch.float32 and quantize is None
            and env["packed_linears"] and bool(offer("onednn_fp32"))
        ),
        attention=attention,
        attention_kernel=kernel,
        attention_tiles=kernel and bool(offer("attention_tiles")),
        fused_layers=fused,
        w8a16_kernel=_w8a16_kernel(env["w8a16_kernel"], offer) if quantize == "w8a16" else None,
        bf16_rows=offer("bf16_rows") if compiled and cpu and dtype == torch.bfloat16 else None,
        compile_note=f"--compile: {why}; decoding eagerly" if why else None,
        compile_asked=compile,
        pack_asked=pack_linears,
        offer=offer,
    )  # fmt: skip


def _w8a16_kernel(asked: str | None, offer: CpuOffer) -> str:
    """The w8a16 kernel a plan serves: `asked` ($FLASHDRAFT_W8A16_KERNEL) where this CPU runs it, else its best."""
    have = tuple(offer("w8a16_kernels"))
    if asked is None:
        return have[-1]
    if asked not in have:
        raise KernelPlanError(
            f"FLASHDRAFT_W8A16_KERNEL={asked} does not run on this CPU (these do: {', '.join(have)})"
        )
    return asked


def check_quantize(
    scheme: str | None, dtype: torch.dtype | None, device: torch.device, offer: CpuOffer | None = None
) -> None:
    """Refuse, in one line and before loading, what a scheme cannot run fast or at all here (`offer`: what the CPU
    offers; None: this machine's)."""
    from . import quantize
    from .quantize import QuantizeError

    if scheme is None:
        return
    offer = offer or _THIS_CPU
    if scheme not in quantize.QUANTIZE_SCHEMES:
        raise QuantizeError(
            f"--quantize must be one of {', '.join(quantize.QUANTIZE_SCHEMES)}, got {scheme!r}"
        )
    if device.type != "cpu":
        raise QuantizeError(
            f"--quantize {scheme} is for CPUs (torch's {scheme} weight kernel); on a GPU run bf16"
        )
    if scheme == "fp16":
        if not offer("fp16"):
            raise QuantizeError(
                "--quantize fp16 needs fbgemm's fp16 kernel, which this torch lacks (x86 builds have it)"
            )
        if dtype is not None and dtype != torch.float32:
            raise QuantizeError(
                f"--quantize fp16 runs fp32 activations around its fp16 weights, not "
                f"{str(dtype).removeprefix('torch.')}: use --dtype float32 or leave --dtype out"
            )
        return
    if scheme == "w8a8" and not offer("w8a8_exact"):
        raise QuantizeError(quantize.w8a8_refusal())
    if scheme == "w8a16" and not offer("w8a16"):
        raise QuantizeError(quantize.w8a16_refusal())
    if dtype is not None and dtype not in (torch.bfloat16, torch.float32):
        raise QuantizeError(
            f"--quantize {scheme} runs bf16 activations (or fp32 ones), not "
            f"{str(dtype).removeprefix('torch.')}: use --dtype bfloat16, float32, or leave --dtype out"
        )


def _compile_choice(
    device: torch.device, dtype: torch.dtype, quantize: str | None, offer: CpuOffer
) -> tuple[dict[str, Any] | None, str | None]:
    """torch.compile's options for this target, or None and why it decodes eagerly."""
    if quantize == "fp16":  # an opaque packed weight (quantize.Fp16Linear): nothing inductor can fuse
        return None, "fp16 weights run through fbgemm's own kernel, which is not compiled"
    # rows held to one summation order by gemm_templates.py's kernels, made for one torch
    row_kernels = quantize == "int8" or quantize is None and dtype == torch.bfloat16
    if device.type == "cpu" and row_kernels and (why := offer("untested_torch")):
        return None, why
    options = compile_options(device)
    if quantize == "w8a8" and (why := _w8a8_refusal(options, offer)):  # a CPU's scheme (`check_quantize`)
        return None, why
    return options, None


def _w8a8_refusal(options: Mapping[str, Any], offer: CpuOffer) -> str | None:
    """Why a w8a8 target (quantize.W8A8Linear) cannot compile with these options, or None. Its graphs hold the int8
    weight as a frozen constant that only inductor's C++ GEMM template reads (ATen's op takes oneDNN's packed
    layout), so the CPU needs the template's int8 micro-kernels and the options must freeze and take the template
    (as the CPU defaults do; a `$FLASHDRAFT_COMPILE` may not)."""
    if not offer("w8a8_compiles"):
        return "int8 activations compile through inductor's avx512_vnni or AMX kernels, which this CPU lacks"
    if not takes_gemm_template(options):
        return (
            "int8 activations compile only frozen, through inductor's C++ GEMM template (freezing, "
            "max_autotune_gemm and its CPP backend), which $FLASHDRAFT_COMPILE leaves out"
        )
    return None


def takes_gemm_template(options: Mapping[str, Any] | None) -> bool:
    """Whether torch.compile with these options freezes the graph and lowers its GEMMs through inductor's C++
    template (freezing, max_autotune_gemm and its CPP backend), as the CPU defaults do; a `$FLASHDRAFT_COMPILE`
    may not."""
    from torch._inductor import config as inductor_config

    inductor = (options or {}).get("options") or {}
    backends = inductor.get("max_autotune_gemm_backends", inductor_config.max_autotune_gemm_backends)
    templates = inductor.get("max_autotune") or inductor.get("max_autotune_gemm")
    return bool(inductor.get("freezing") and templates and "CPP" in str(backends).upper().split(","))


def compile_options(device: torch.device, training: bool = False) -> dict[str, Any]:
    """torch.compile's keywords: `$FLASHDRAFT_COMPILE` (a JSON object, e.g. {"backend": "cudagraphs"} to capture
    graphs without inductor's code generation), else for decoding CUDA graphs of inductor's kernels on a GPU and
    frozen C++ kernels on a CPU (engine/compiled.py's docstring); for `training`, inductor's defaults (shapes
    change with every micro-batch and weights with every step: no graphs, nothing frozen)."""
    env = switches()["compile"]
    if env:
        try:
            options = json.loads(env)
        except ValueError:
            options = None
        if not isinstance(options, dict):
            raise KernelPlanError(
                f"FLASHDRAFT_COMPILE must be a JSON object of torch.compile options, got {env!r}"
            )
        return {k: v for k, v in options.items() if k != "mode"} if training else options
    if training:
        return {}
    # mode="reduce-overhead" is {"triton.cudagraphs": True}, and a mode takes no other option
    if torch.device(device).type == "cuda":
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
    `skip_guard_on_all_nn_modules_unsafe`). Safe because engine/compiled.py's `compile_whole` gives every compiled
    function a code object of its own, and each serves one model: dynamo keeps graphs per code object, and every
    model goes through the same code (the verify, the block pass, the head), so with shared code and no guard on the
    module a second model of the same shapes ran the first one's graph, whose frozen constants are the first model's
    weights (found 2026-11-26; a test builds two). Guarding which module it is (`ID_MATCH`) also told them apart, at
    1 ms a call."""
    return [not entry.orig_guard.source.is_unspecialized_nn_module() for entry in guard_entries]


def options_key(options: Mapping[str, Any] | None) -> str:
    """`options` as text that is the same in every process (a function by its name, not its address): what the
    compiled graphs and the cost model are kept under."""
    return json.dumps(options, sort_keys=True, default=lambda o: getattr(o, "__qualname__", type(o).__name__))


# ---------------------------------------------------------------- a model prepared by its plan
def is_kernel_linear(module: Any) -> bool:
    """Whether `module` is one of the kernels' linear layers (oneDNN's packed fp32, fbgemm's fp16, the int8 kinds):
    it runs as it is, in its own precision (`compute_dtype`), its dense weight perhaps nowhere in memory."""
    from .packed_linear import PackedLinear
    from .quantize import Fp16Linear, Int8Linear

    return isinstance(module, (PackedLinear, Fp16Linear, Int8Linear))


def prepare_model(model: torch.nn.Module, plan: KernelPlan) -> bool:
    """Put `model`'s modules on `plan`'s kernels (idempotent; before anything is traced): its fp32 linears packed by
    oneDNN or plain (inductor packs its own), its attention the short-query one, a w8a16 model's decoder layers
    fused. Whether its LM head module was replaced (the caller reads it again)."""
    from . import attention, packed_linear

    if plan.packed_linears and not packed_linear.is_sharded(model):
        replaced = packed_linear.pack_linears(model)
    else:
        replaced = packed_linear.unpack_linears(model)
    if plan.attention == SHORT_QUERY and attention.runs_sdpa(model):
        attention.use(model, plan.dtype if plan.attention_kernel else None)
    if plan.w8a16_kernel:
        from . import w8a16_cpp

        w8a16_cpp.set_kernel(plan.w8a16_kernel)  # one per process: all give the same bits
    if plan.fused_layers:
        from . import decoder_layer_cpp

        decoder_layer_cpp.fuse(model, plan.dtype)  # a decode step's layer in one call each (its docstring)
    return replaced > 0
