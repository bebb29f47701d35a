"""Weight-only int8 for a target on the CPU (`--quantize int8`): half the bytes a decode step reads in bf16.

Every `nn.Linear` of the model (the LM head included) becomes an `Int8Linear`: int8 weights with one bf16 scale
per output channel (symmetric, absmax / 127), applied by torch's `_weight_int8pack_mm` with bf16 activations (its
fast path on CPUs; with fp32 activations it is slower than an fp32 matmul, so int8 runs with bf16 activations only).
The embedding stays bf16. The quantized model is a model of its own: lossless decoding means the output of plain
decoding of that same model, which `ar` and every speculative method run alike. Each output row of the kernel is
reduced in the same order whatever the number of rows, so a verify's projections give the bits a one-token step
gives (`tests/test_quantize.py`).
"""

from __future__ import annotations

import torch
from torch import nn

QUANTIZE_SCHEMES = ("int8",)


class QuantizeError(ValueError):
    """A quantization the engine cannot run: refused in one line, before loading (errors.py)."""


class Int8Linear(nn.Module):
    """y = x @ (weight_int8 * scales).T + bias, for bf16 `x`."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        scales = scales.to(compute_dtype)  # the scale the kernel applies, rounded once here
        quantized = torch.round(weight / scales.float()[:, None]).clamp(-128, 127).to(torch.int8)
        self.register_buffer("weight_int8", quantized.contiguous())
        self.register_buffer("scales", scales.contiguous())
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().to(compute_dtype))
        self.compute_dtype = compute_dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (a new tensor each call): for code that reads a head's weight once."""
        return self.weight_int8.to(self.compute_dtype) * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).to(self.compute_dtype).contiguous()  # the kernel reads whole rows
        out = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights, bf16 scales"


def check_quantize(scheme: str | None, dtype: torch.dtype | None, device: torch.device) -> None:
    """Refuse, in one line and before loading, what int8 cannot run fast or at all."""
    if scheme is None:
        return
    if scheme not in QUANTIZE_SCHEMES:
        raise QuantizeError(f"--quantize must be one of {', '.join(QUANTIZE_SCHEMES)}, got {scheme!r}")
    if device.type != "cpu":
        raise QuantizeError("--quantize int8 is for CPUs (torch's int8 weight kernel); on a GPU run bf16")
    if dtype is not None and dtype != torch.bfloat16:
        raise QuantizeError(
            f"--quantize int8 runs bf16 activations (torch's int8 kernel is fast only for them), not "
            f"{str(dtype).removeprefix('torch.')}: use --dtype bfloat16 or leave --dtype out"
        )


@torch.no_grad()
def quantize_int8(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` (a bf16 model) by an Int8Linear in place; returns how many."""
    replaced = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Int8Linear(child))
                replaced += 1
    get_output = getattr(model, "get_output_embeddings", None)
    if get_output is not None and isinstance(get_output(), nn.Linear):  # a head held outside named_children
        raise QuantizeError(f"{type(model).__name__}: its LM head was not quantized")
    return replaced


def quantization_of(model: nn.Module) -> str | None:
    """ "int8" if `quantize_int8` ran on this model, else None (what the cost model and the reports key on)."""
    return "int8" if any(isinstance(m, Int8Linear) for m in model.modules()) else None
