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
         layers of one input as one GEMM: kernels/inductor_passes.py), and dynamo's
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

import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..kernels import attention_cpp, inductor_passes
from ..kernels.gemm_templates import bf16_rows_kernel, register_cpu_gemm_kernels
from ..kernels.plan import make_plan, switches
from ..kernels.static_buffers import symbolic_sizes
from ..sampling import non_finite_rows
from ..targets.target import TargetError, TargetOutput
from .kv_cache import kv_layers


def compile_verify(target: Any) -> str | None:
    """Have the engine verify on `target` through the static cache, compiled (CUDA graphs on a GPU, inductor's
    kernels on a CPU): the target re-planned with `--compile` (kernels/plan.py) and prepared by its new plan. Returns
    a one-line note when the target cannot take it (it then decodes eagerly, as exactly). `load_target(...,
    compiled=True)` plans it so from the start."""
    plan = make_plan(
        target.device, target.dtype, target.quantize, compile=True, pack_linears=target.plan.pack_asked
    )
    return target.use_plan(plan).compile_note


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

    inductor_passes.register_frozen_passes()
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
        inductor_passes.FROZEN_COMPILE.active = True  # one GEMM choice, the concatenations (their docstrings)
        try:
            with unrecorded():
                return compiled(*args)
        finally:
            inductor_passes.FROZEN_COMPILE.active = False
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
    """A hash of this file, compiled_draft.py and the kernels' gemm_templates.py, inductor_passes.py, plan.py,
    attention.py, attention_cpp.py, w8a16_cpp.py, decoder_layer_cpp.py and C++ sources: the kernels chosen or written
    there (the plan, GEMM choices, register blocks, micro-kernels, the attention, w8a16's operator, the fused layer,
    the drafter's graphs), which the graphs frozen in inductor's cache
    and the cost model's prices depend on."""
    import hashlib
    from pathlib import Path

    digest = hashlib.sha256()
    kernels = Path(attention_cpp.__file__).parent  # the modules choosing kernels, and the C++ sources (csrc/)
    names = (
        "gemm_templates.py",
        "inductor_passes.py",
        "plan.py",
        "attention.py",
        "attention_cpp.py",
        "w8a16_cpp.py",
        "decoder_layer_cpp.py",
    )
    sources = [Path(__file__), Path(__file__).with_name("compiled_draft.py"), *(kernels / n for n in names)]
    for path in [*sources, *sorted((kernels / "csrc").iterdir())]:
        digest.update(path.read_bytes())
    env = switches()
    digest.update(str(env["fused_layers"]).encode())
    digest.update(str(env["attention_tiles"]).encode())  # AMX's scores or the vectors'
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


def fresh_options(compile_options: dict[str, Any]) -> dict[str, Any]:
    """torch.compile's keywords with their nested dicts copied (torch.compile changes the `options` it is given)."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in compile_options.items()}


class VerifyForward:
    """The target's verify over a static cache, with its layer taps: a `TargetOutput` (logits [b, n, V] fp32, taps
    [b, n, F], and the greedy accept's argmax and non-finite flags per position, reduced from the logits inside the
    graph: one fused pass where the engine's eager reductions were five, 0.7 ms of a 15 ms bf16 step on a 2-core EPYC).
    Compiled whole (fullgraph) with `compile_options` (torch.compile's keywords); on a GPU inductor's
    `triton.cudagraphs` records a CUDA graph per shape. The taps are hooks registered once (hooks added and removed
    per call would make every call a new graph)."""

    def __init__(self, target: Any, tap_layer_ids: Sequence[int], compile_options: Mapping | None) -> None:
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
    key = (tuple(tap_layer_ids), target.plan.compile_key)
    forwards = target.model.__dict__.setdefault("_flashdraft_verify_forwards", {})
    if key not in forwards:
        forwards[key] = VerifyForward(target, tap_layer_ids, target.plan.compile_options)
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
