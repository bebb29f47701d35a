"""Quantized targets on the CPU (`--quantize int8|w8a8|fp16`): fewer bytes read, and less arithmetic, per step.

int8: every `nn.Linear` of the model (the LM head included) becomes an `Int8Linear`: int8 weights with one scale per
output channel (symmetric, absmax / 127), applied by torch's `_weight_int8pack_mm`. The activations are the model's
dtype: bf16 by default (ATen's kernel is fast for them on CPUs with bf16 instructions), or fp32 (`--dtype float32`),
for the compiled path (`--compile`): there inductor's C++ GEMM template multiplies fp32 rows by the int8 weights
(gemm_templates.py registers the fp32 x int8 micro-kernel inductor ships but does not offer), where ATen's fp32 kernel is
slower than an fp32 matmul. Eager, an fp32 `Int8Linear` dequantizes its weight and runs an fp32 matmul (the prefill,
and a target the static cache cannot serve). The embedding stays in the model's dtype.

w8a8: every `nn.Linear` becomes a `W8A8Linear`: the int8 weights of `Int8Linear` (fp32 scales), and int8 activations,
each row quantized alone (its absmax / 127), multiplied in integers. Past a few rows int8 weights with bf16 rows are
bound by arithmetic (each weight widened to bf16, one `vdpbf16ps` per row and pair of k); int8 x int8 through
avx512_vnni's `vpdpbusd` multiplies four k per lane without widening anything. On a 2-core Zen 5 EPYC the verify of
8 / 16 tokens cost 1.38-1.48 / 1.87-2.00 one-token steps against int8 weight-only's 1.42 / 2.38, but the step itself
6.2-7.0 ms against 5.4 (each layer's rows quantized first), so there int8 weight-only is as fast or faster
(benchmarks/README.md, 2026-12-02). Integer sums are exact in any order, so a verify is batch-invariant whatever
kernel runs it. The model is a little less accurate than int8 weight-only: SmolLM2-135M's NLL on GSM8K solutions
1.906 against 1.877 (fp32 1.875; benchmarks/scripts/quantization_quality.py); llama.cpp's Q8_0 also quantizes
activations, in blocks of 32.

w8a16: every `nn.Linear` becomes a `W8A16Linear`: the int8 weights of `W8A8Linear` (fp32 scales), and each row
held as 16-bit integers (its absmax / 32639), split in two int8 halves and multiplied in integers by w8a16_cpp.py's
kernel (avx512_vnni's `vpdpbusd` for a few rows, AMX's tiles for more): the weights read as stored, nothing widened,
so a one-token step is bound by their bytes (SmolLM2-135M's decoder linears at one row: 3.1 ms against 6.0 for
int8's compiled GEMMs on a 2-core Emerald Rapids Xeon), and sixteen bits per row keep the model as close to fp32 as
int8 weight-only does (benchmarks/README.md, 2026-12-05). Integer sums are exact, so a verify is batch-invariant by
construction, eager or compiled (the op is opaque to inductor, called from its graphs). A prompt's rows take int8's
bf16 GEMM (`prefill`), as int8's do. Its kernels run on avx2 and FMA (256-bit integer products) and up to AMX, all
giving the same bits; CPUs without avx2 and FMA (Arm) get none: refused in one line.

fp16: every `nn.Linear` becomes an `Fp16Linear`: its weights rounded to fp16 once and packed for fbgemm's fp16 GEMM
(`quantized.linear_dynamic_fp16`, x86), which reads them at half the bytes of fp32 and multiplies in fp32; the
activations and everything between the linears stay fp32. On a 2-core AMD EPYC (avx2), SmolLM2's LM head (49152 x
576) over 1 / 3 / 16 rows took 1.8 / 2.0 / 6.7 ms against 3.8 / 4.1 / 9.1 ms for oneDNN's packed fp32 layer and
2.5 / 3.1 / 16.7 ms for the int8 kernel (bf16 activations). fp32 activations also keep the int8 path's trap away:
in an fp32 model whose int8 layers round their inputs to bf16, the last-bit differences of fp32 attention between a
verify and a one-token step became whole bf16 steps, and 4 of 4 DFlash outputs parted from plain decoding of the
same model (benchmarks/README.md).

A quantized model is a model of its own: lossless decoding means the output of plain decoding of that same model,
which `ar` and every speculative method run alike. So a verify's projections must give a token the bits a one-token
step gives. The int8 kernel reduces each output row in the same order whatever the number of rows. fbgemm's fp16 GEMM
does not: it cuts the rows into blocks of 1 to 6 (a fixed table per row count) and its 1- and 2-row kernels round
otherwise than the 3- to 6-row ones. `Fp16Linear` pads each call with zero rows up to a row count whose blocks are
all 3 to 6 rows high, found once per process by probing the kernel (`_fp16_row_counts`), so every row comes out of a
3- to 6-row kernel: one extra read of nothing, the kernel being bound by the weights' bytes
(`tests/test_quantize.py`).
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_info, packed_linear, w8a16_cpp

QUANTIZE_SCHEMES = ("int8", "w8a8", "w8a16", "fp16")
# A prompt's prefill takes an int8 layer through a bf16 GEMM from this many rows (`prefill`): on a 2-core Zen 4 EPYC
# a 1536 x 576 layer at 16 / 150 rows took 197 / 1809 us through ATen's int8 kernel, 195 / 735 dequantized.
PREFILL_GEMM_ROWS = 32
# Bytes of bf16 weights a model's int8 layers may keep for prompts (`Int8Linear.keeps_prefill_weight`): all of a
# model up to ~500 M parameters, of a bigger one the layers that fit, in order; the others convert per call.
PREFILL_WEIGHT_BYTES = 1 << 30
FP16_PROBE_ROWS = 1024  # row counts up to this are padded to one that rounds as a one-row call does


class QuantizeError(ValueError):
    """A quantization the engine cannot run: refused in one line, before loading (errors.py)."""


def per_channel_int8(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` ([out, in]) as int8 with one scale per output channel (absmax / 127, rounded to `scale_dtype` once,
    the scale the kernel applies): symmetric, -127..127 (never -128: the pair kernel's int8 -> bf16 tables read |w|,
    gemm_templates.py, and the activations' codes are symmetric too)."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(scale_dtype)
    quantized = torch.round(weight / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized, scales


class Int8Linear(nn.Module):
    """y = (x @ weight_int8.T) * scales + bias, for `x` in `compute_dtype` (bf16, or fp32 for the compiled path)."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        quantized, scales = per_channel_int8(linear.weight, compute_dtype)
        self.register_buffer("weight_int8", quantized.contiguous())
        self.register_buffer("scales", scales.contiguous())
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().to(compute_dtype))
        self.compute_dtype = compute_dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # A prompt's rows: the weight converted to bf16 (and packed for oneDNN where it runs bf16) once and kept,
        # where `quantize` gave this layer room for it (`prefill` says why); made at the first prefill.
        self.keeps_prefill_weight = False
        self._prefill_weight: torch.Tensor | None = None

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (a new tensor each call): for code that reads a head's weight once."""
        return self.weight_int8.to(self.compute_dtype) * self.scales[:, None]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        state["_prefill_weight"] = None  # a copy makes its own (oneDNN's packed tensor cannot be copied)
        return state

    def _prefill_product(self, rows: torch.Tensor) -> torch.Tensor:
        """(rows @ weight_int8.T) * scales for a prompt's bf16 rows: the weight converted exactly (every int8 is a
        bf16), per call, or kept; a kept weight in oneDNN's layout takes the scales in the GEMM's epilogue (its fp32
        sums scaled, then rounded once)."""
        scales = self.scales.to(rows.dtype)  # W8A16Linear's are fp32
        if not self.keeps_prefill_weight:
            return F.linear(rows, self.weight_int8.to(rows.dtype)) * scales
        if self._prefill_weight is None:
            self._prefill_weight = _pack_bf16(self.weight_int8.to(torch.bfloat16))
        if self._prefill_weight.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise.binary(
                rows, scales[None], self._prefill_weight, None, "mul"
            )
        return F.linear(rows, self._prefill_weight) * scales

    def select_rows(self, ids: torch.Tensor) -> Int8Linear:
        """The layer over the output rows `ids` only, each with the bits it has here (a drafter's vocabulary)."""
        part = copy.copy(self)
        part._buffers = dict(self._buffers)
        part.weight_int8 = self.weight_int8[ids].contiguous()
        part.scales = self.scales[ids].contiguous()
        part.bias = None if self.bias is None else self.bias[ids].contiguous()
        part.out_features = ids.numel()
        part._prefill_weight = None
        return part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).to(self.compute_dtype).contiguous()  # the kernel reads whole rows
        if self.compute_dtype == torch.float32 and not torch.compiler.is_compiling():
            # ATen's int8 kernel with fp32 rows is slower than dequantizing (the module docstring); compiled,
            # the kernel's op is what inductor's GEMM template takes over
            out = F.linear(rows, self.weight_int8.float()) * self.scales
        elif not torch.compiler.is_compiling() and _PREFILL.get() and rows.shape[0] >= PREFILL_GEMM_ROWS:
            # a prompt's rows through a bf16 GEMM (`prefill` says why); dynamo never reads the flag
            out = self._prefill_product(rows)
        else:
            out = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        scales = str(self.compute_dtype).removeprefix("torch.")
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int8 weights, {scales} scales"
        )


class W8A8Linear(Int8Linear):
    """y = dequant(quant(x) @ weight_int8.T) + bias: int8 weights (one scale per output channel, as `Int8Linear`)
    and int8 activations, each row of `x` quantized alone (symmetric, its absmax / 127), multiplied in integers.

    The product of a row's int8 codes with an int8 weight column is exact in int32 whatever the kernel, the order of
    its sum or the rows beside it, and the scales are applied element by element after it: a token gets the same
    bits in a verify of any length as in a one-token step (batch invariance by construction, not by a kernel's
    reduction order). Compiled, `onednn.qlinear_pointwise` is what inductor's C++ GEMM template lowers with its
    avx512_vnni micro-kernel (`vpdpbusd`: 64 products per instruction, no weight widened) or AMX's, the
    quantization of the rows and the scales fused around it in one kernel; the activation codes are unsigned (code
    + 128, the template's zero point, its compensation a constant per column). Eager (a prefill, a target the static
    cache cannot serve), oneDNN's int8 GEMM on the weight in its own layout, made once. The weight is held as
    [in, out] (`weight_kn`), the layout the template's lowering reads from the frozen graph's constants."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype = torch.bfloat16) -> None:
        nn.Module.__init__(self)
        if not w8a8_exact():  # checked before any layer is made, as `check_quantize` does before loading
            raise QuantizeError(w8a8_refusal())
        quantized, scales = per_channel_int8(linear.weight, torch.float32)
        self.register_buffer("weight_kn", quantized.t().contiguous())
        self.register_buffer("scales", scales.contiguous())  # fp32: the epilogue is fp32
        self.register_buffer("zero_points", torch.zeros(scales.numel(), dtype=torch.int32), persistent=False)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.compute_dtype = compute_dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._onednn: torch.Tensor | None = None  # oneDNN's packed copy of the weight, for eager calls

    @property
    def weight_int8(self) -> torch.Tensor:  # type: ignore[override]
        """The int8 weight as [out, in] (a view)."""
        return self.weight_kn.t()

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (a new tensor each call)."""
        return (self.weight_int8.float() * self.scales[:, None]).to(self.compute_dtype)

    def select_rows(self, ids: torch.Tensor) -> W8A8Linear:
        part = copy.copy(self)
        part._buffers = dict(self._buffers)
        part.weight_kn = self.weight_kn[:, ids].contiguous()
        part.scales = self.scales[ids].contiguous()
        part.zero_points = self.zero_points[ids].contiguous()
        part.bias = None if self.bias is None else self.bias[ids].contiguous()
        part.out_features = ids.numel()
        part._onednn = None
        return part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127
        codes = (torch.round(rows / scale).clamp(-127, 127) + W8A8_ZERO_POINT).to(torch.uint8)
        if torch.compiler.is_compiling():
            weight = self.weight_kn  # a constant of the frozen graph: the template packs it at compile time
        else:
            if self._onednn is None:
                self._onednn = torch.ops.onednn.qlinear_prepack(self.weight_int8.contiguous(), None)
            weight = self._onednn
        out = torch.ops.onednn.qlinear_pointwise(
            codes, 1.0, W8A8_ZERO_POINT, weight, self.scales, self.zero_points, None, 1.0, 0,
            torch.float32, "none", [], "",
        )  # fmt: skip
        out = out * scale
        if self.bias is not None:
            out = out + self.bias
        return out.to(self.compute_dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int8 weights and activations"
        )


W8A8_ZERO_POINT = 128  # the activation codes' offset: the micro-kernels multiply unsigned by signed bytes


class W8A16Linear(Int8Linear):
    """y = (x16 @ weight_int8.T) * scales + bias, x16 each row of `x` as 16-bit integers (its absmax / 32639), in
    integers (w8a16_cpp.py: the product's bits do not depend on the rows beside it or the kernel). The weight is
    held in the kernel's tiles (`packed`, with each column's sum); `weight_int8` unpacks it. A prompt's rows
    (`prefill`) take `Int8Linear`'s bf16 GEMM on the dequantized weight."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype = torch.bfloat16) -> None:
        nn.Module.__init__(self)
        if not w8a16_available():  # the kernel is built (its operator registered) before any layer runs
            raise QuantizeError(w8a16_refusal())
        quantized, scales = per_channel_int8(linear.weight, torch.float32)
        bias = linear.bias
        self.compute_dtype = compute_dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._hold(quantized, scales, None if bias is None else bias.detach().float())
        self.keeps_prefill_weight = False
        self._prefill_weight: torch.Tensor | None = None

    def _hold(self, quantized: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        packed, colsums = w8a16_cpp.pack(quantized)
        self.register_buffer("packed", packed)
        self.register_buffer("colsums", colsums)
        self.register_buffer("scales", scales.float().contiguous())  # fp32: the kernel's epilogue is fp32
        self.register_buffer("bias", bias)

    @property
    def weight_int8(self) -> torch.Tensor:  # type: ignore[override]
        """The int8 weight as [out, in] (a new tensor each call)."""
        return w8a16_cpp.unpack(self.packed, self.out_features, self.in_features)

    @property
    def weight(self) -> torch.Tensor:
        return (self.weight_int8.float() * self.scales[:, None]).to(self.compute_dtype)

    def select_rows(self, ids: torch.Tensor) -> W8A16Linear:
        part = copy.copy(self)
        part._buffers = {}
        bias = None if self.bias is None else self.bias[ids].contiguous()
        part._hold(self.weight_int8[ids], self.scales[ids], bias)
        part.out_features = ids.numel()
        part._prefill_weight = None
        return part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).to(self.compute_dtype).contiguous()
        if not torch.compiler.is_compiling() and _PREFILL.get() and rows.shape[0] >= PREFILL_GEMM_ROWS:
            out = self._prefill_product(rows)  # a prompt's rows: int8's bf16 GEMM (`prefill`)
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
        else:
            out = w8a16_cpp.w8a16_linear(rows, self.packed, self.scales, self.colsums, self.bias)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int8 weights, "
            "16-bit integer activations"
        )


def w8a16_refusal() -> str:
    """The one line that refuses `--quantize w8a16` where its kernel does not serve, naming what the CPU lacks."""
    lacks = " and ".join(w8a16_cpp.missing_features())
    why = f"this one lacks {lacks}" if lacks else "did not build here (the warning above says why)"
    if lacks and cpu_info.cpu_features().startswith("aarch64"):  # what an Arm kernel would use, not written
        why += " (an Arm kernel would multiply with NEON's sdot or i8mm's smmla: none is written)"
    return f"--quantize w8a16 needs a CPU with avx2 and FMA (its integer kernel), which {why}: use --quantize int8"


def w8a16_available() -> bool:
    """w8a16_cpp.py's kernel serves on this CPU (avx2 and FMA at least; built on first call)."""
    return w8a16_cpp.prepare()


def w8a8_available() -> bool:
    """torch has oneDNN's int8 linear here (x86 builds)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


def _onednn_int8_product(codes: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's int8 linear as W8A8Linear calls it eagerly, unscaled: codes [M, K] (signed, -127..127, passed as
    code + 128) times weight [N, K] (int8) -> [M, N] fp32."""
    packed = torch.ops.onednn.qlinear_prepack(weight.contiguous(), None)
    ones = torch.ones(weight.shape[0], dtype=torch.float32)
    zeros = torch.zeros(weight.shape[0], dtype=torch.int32)
    unsigned = (codes.to(torch.int16) + W8A8_ZERO_POINT).to(torch.uint8)
    return torch.ops.onednn.qlinear_pointwise(
        unsigned, 1.0, W8A8_ZERO_POINT, packed, ones, zeros, None, 1.0, 0, torch.float32, "none", [], "",
    )  # fmt: skip


@functools.cache
def w8a8_exact() -> bool:
    """oneDNN's int8 linear gives the exact integer product here, codes at their extremes included. Without VNNI
    (`vpdpbusd`: avx512_vnni, avx_vnni, AMX) oneDNN multiplies unsigned by signed bytes with avx2's `vpmaddubsw`,
    whose 16-bit sums of two products saturate: (127 + 128) x 127 x 2 = 64770 is clipped to 32767, so a layer
    is not the product of its codes (on a Zen 3 EPYC, 53% of a test layer's outputs off by up to 0.52). Asked of
    the kernel itself, once per process, at 1 and 5 rows: that also sees `ONEDNN_MAX_CPU_ISA` keeping oneDNN from
    the CPU's VNNI. Every sum here is below 2^24, so exact in the fp32 the op returns (past 2^24 the op's fp32
    rounds a sum, as it does whatever rows share the call: the bits stay each row's own)."""
    if not w8a8_available():
        return False
    k, n = 256, 32
    generator = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
    extremes = torch.where(torch.arange(k) % 3 == 0, -127, 127).to(torch.int8)  # 127 x 127 in most pairs
    weight[: n // 2] = extremes
    for rows in (1, 5):
        codes = torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=generator)
        codes[0] = extremes
        want = codes.long() @ weight.long().T
        if not torch.equal(_onednn_int8_product(codes, weight).long(), want):
            return False
    return True


def w8a8_refusal() -> str:
    """The one line that refuses `--quantize w8a8` where `w8a8_exact` is False."""
    if not w8a8_available():
        return "--quantize w8a8 needs oneDNN's int8 linear, which this torch lacks (x86 builds have it)"
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA")
    lacks = f"this CPU lacks or ONEDNN_MAX_CPU_ISA={capped} hides from oneDNN" if capped else "this CPU lacks"
    return (
        f"--quantize w8a8 needs VNNI (avx512_vnni, avx_vnni or AMX), which {lacks}: without it oneDNN's int8 "
        "products saturate (vpmaddubsw), so its layers would not be the integer product the scheme is; "
        "use --quantize int8"
    )


def w8a8_compiles() -> bool:
    """inductor's C++ GEMM template has an int8 x int8 micro-kernel for this CPU (avx512_vnni or AMX): else a
    frozen graph would call oneDNN's op on a weight not in oneDNN's layout."""
    return torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported()


_PREFILL: ContextVar[bool] = ContextVar("flashdraft_int8_prefill", default=False)


def _pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight in oneDNN's blocked layout (what inductor's frozen CPU graphs hold) where oneDNN runs bf16
    here, else as it is."""
    if packed_linear.available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return weight


@contextmanager
def prefill() -> Iterator[None]:
    """A prompt's prefill (Target.forward(prefill=True)): inside, an `Int8Linear` with bf16 rows given at least
    PREFILL_GEMM_ROWS of them dequantizes its weight (exactly: every int8 is a bf16) and runs oneDNN's bf16 GEMM,
    which is compute-bound where ATen's int8 kernel converts every weight for every few rows: SmolLM2-135M's 150-token
    prefill took 380 ms through the int8 kernel, a bf16 model's 169 ms. Its rows round otherwise than the int8
    kernel's (and with their count), so nothing but a prefill runs this way: every method prefills a prompt alike,
    and a verify or a decode step, whose tokens must have the bits of plain decoding's one-token step, never does.

    Converting the weight was a third of such a prefill (an Emerald Rapids Xeon, int8 SmolLM2-135M, 2 threads), and
    oneDNN also reorders a plain bf16 weight into its layout on every call: so a layer keeps its weight converted
    and packed after its first prefill, within the model's PREFILL_WEIGHT_BYTES (`quantize`); its 210 decoder
    layers over a 96-token prompt took 25 ms against 43 converting per call, and 16 GSM8K prompts' prefills
    0.73-0.87x the time. The scales taken into the GEMM's epilogue saved 30 of 129 us on one 96 x 576 x 1536 layer,
    within the noise of a whole prefill."""
    token = _PREFILL.set(True)
    try:
        yield
    finally:
        _PREFILL.reset(token)


class Fp16Linear(nn.Module):
    """y = x @ fp16(weight).T + bias for fp32 `x`, through fbgemm's fp16 GEMM, each row with the bits it has alone."""

    compute_dtype = torch.float32  # what callers cast inputs to (as Int8Linear says it)

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight, bias)  # the kernel adds the bias
        self._bias = bias  # also kept as it is, so reading it unpacks nothing
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def weight(self) -> torch.Tensor:
        """The fp16-rounded weight in fp32 (a new tensor each call): for code that reads a head's weight once."""
        return torch.ops.quantized.linear_unpack_fp16(self.packed)[0]

    @property
    def bias(self) -> torch.Tensor | None:
        """The bias (fp32), or None."""
        return self._bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Every op here is paid ~210 times a step for a 30-layer model: as few as the padding allows.
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if rows.dtype != torch.float32:
            rows = rows.float()
        m = rows.shape[0]
        table = _FP16_ROWS or _fp16_row_counts()
        padded = table[m] if m < len(table) else m
        if padded != m:
            rows = F.pad(rows, (0, 0, 0, padded - m))  # zero rows after the real ones, contiguous
        elif not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.ops.quantized.linear_dynamic_fp16(rows, self.packed)
        if padded != m:
            out = out[:m]
        out = out.view(*shape[:-1], self.out_features)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp16 weights (fbgemm)"


_FP16_ROWS: list[int] = []  # _fp16_row_counts's table, once probed


def _fp16_row_counts() -> list[int]:
    """[m] -> the least row count >= m at which fbgemm's fp16 GEMM gives every row the bits it has in a call of 3
    rows (the module docstring), probed once per process on a small random layer for m up to FP16_PROBE_ROWS."""
    if _FP16_ROWS:
        return _FP16_ROWS
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 96, generator=gen)
    packed = torch.ops.quantized.linear_prepack_fp16(weight, None)
    x = torch.randn(FP16_PROBE_ROWS + 2, 96, generator=gen)
    kernel = torch.ops.quantized.linear_dynamic_fp16
    reference = torch.cat([kernel(x[i : i + 3], packed) for i in range(0, FP16_PROBE_ROWS, 3)])
    good = [m for m in range(1, FP16_PROBE_ROWS + 1) if torch.equal(kernel(x[:m], packed), reference[:m])]
    table, nxt = [0] * (FP16_PROBE_ROWS + 1), None
    for m in range(FP16_PROBE_ROWS, 0, -1):
        if good and m == good[-1]:
            nxt = good.pop()
        table[m] = nxt if nxt is not None else m
    _FP16_ROWS[:] = table
    return _FP16_ROWS


def fp16_available() -> bool:
    """torch has fbgemm's fp16 GEMM here (its x86 builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.quantized, "linear_dynamic_fp16"
    )


@torch.no_grad()
def quantize_int8(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` (a bf16 model) by an Int8Linear in place; returns how many."""
    return _replace_linears(model, Int8Linear)


@torch.no_grad()
def quantize(model: nn.Module, scheme: str) -> int:
    """Quantize `model` in place by `scheme` (QUANTIZE_SCHEMES): every nn.Linear becomes an Int8Linear (a bf16 or
    fp32 model, whose dtype its activations keep), a W8A8Linear (likewise) or an Fp16Linear (an fp32 model); returns
    how many."""
    if scheme == "fp16":
        return _replace_linears(model, Fp16Linear)
    dtype = next(model.parameters()).dtype
    kind = {"w8a8": W8A8Linear, "w8a16": W8A16Linear}.get(scheme, Int8Linear)
    replaced = _replace_linears(model, lambda linear: kind(linear, compute_dtype=dtype))
    # room for the bf16 weights prompts run on (`prefill`)
    if kind is not W8A8Linear and dtype == torch.bfloat16:
        room = PREFILL_WEIGHT_BYTES
        for m in model.modules():
            if isinstance(m, Int8Linear) and (size := 2 * m.in_features * m.out_features) <= room:
                m.keeps_prefill_weight, room = True, room - size
    return replaced


def _replace_linears(model: nn.Module, kind: Any) -> int:
    replaced = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, kind(child))
                replaced += 1
    get_output = getattr(model, "get_output_embeddings", None)
    if get_output is not None and isinstance(get_output(), nn.Linear):  # a head held outside named_children
        raise QuantizeError(f"{type(model).__name__}: its LM head was not quantized")
    return replaced


def quantization_of(model: nn.Module) -> str | None:
    """The scheme `quantize` applied to this model ("int8", "w8a8", "w8a16", "fp16"), else None (what the cost model and the
    reports key on)."""
    for m in model.modules():
        if isinstance(m, W8A8Linear):
            return "w8a8"
        if isinstance(m, W8A16Linear):
            return "w8a16"
        if isinstance(m, Int8Linear):
            return "int8"
        if isinstance(m, Fp16Linear):
            return "fp16"
    return None
