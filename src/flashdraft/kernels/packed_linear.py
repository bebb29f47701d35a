"""fp32 linear layers on a CPU through oneDNN, their weights packed once at load: the eager decode path's matmuls.

An eager fp32 `nn.Linear` on a CPU goes to MKL's sgemm. On the 2-core AMD EPYC (avx2) of benchmarks/README.md that
reads SmolLM2-135M's LM head (49152 x 576, 113 MB) at 12 GB/s for one row and at 5 GB/s for 2-16 rows, so a verify of
2-8 tokens cost 1.6-1.7 one-token steps and a draft pass's head over 15 slots 24 ms. oneDNN's fp32 inner product on
weights reordered once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's frozen
CPU graphs call) reads it at 20 GB/s for one row and 16-18 GB/s for 2-8, and the whole model's step went 64 -> 51 ms,
its verifies of 2 / 4 / 8 tokens 108 / 118 / 102 -> 72 / 75 / 70 ms. On that CPU each output row also came out
with the same bits at 1-16 rows (measured once, not tested or relied on: benchmarks/README.md).

`pack_linears` replaces every `nn.Linear` of a loaded fp32 CPU model by a `PackedLinear` holding the packed weight
instead of the dense one, so memory stays as it was (a head tied to the embedding adds its packed copy). Used where
the engine decodes eagerly on a CPU (`load_target`); `--compile` puts the dense layers back first
(`unpack_linears`: inductor packs its own), and training never packs (gradients go through dense layers).
`$FLASHDRAFT_PACKED_LINEAR=0` keeps MKL's layers.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn


def available() -> bool:
    """torch has oneDNN's packed fp32 linear here (its x86 builds do)."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_linear_pointwise")
        and hasattr(ops, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    """y = x @ weight.T + bias through oneDNN, the weight held only in its packed layout."""

    compute_dtype = torch.float32  # what callers cast inputs to (as quantize.Int8Linear says it)

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        # The dense weight while someone else holds it (a head tied to the embedding): `weight` then returns it
        # instead of a copy, and `unpack_linears` ties it again.
        self._dense = weakref.ref(linear.weight)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight: the tied one if it is alive, else unpacked (a new tensor each call)."""
        dense = self._dense()
        return dense if dense is not None else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad and torch.is_grad_enabled():  # oneDNN's op has no gradient: a dense product
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def unpacked(self) -> nn.Linear:
        # on the meta device: no random weights drawn only to be replaced (a 7B target's would take minutes)
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        dense = self._dense()
        linear.weight = (
            dense if isinstance(dense, nn.Parameter) else nn.Parameter(self.packed.to_dense(), False)
        )
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias, requires_grad=False)
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed fp32 weight"


@torch.no_grad()
def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` by a PackedLinear in place; returns how many."""
    return _replace(model, nn.Linear, PackedLinear)


@torch.no_grad()
def unpack_linears(model: nn.Module) -> int:
    """Put dense nn.Linear layers back (tied heads tied again); returns how many."""
    return _replace(model, PackedLinear, PackedLinear.unpacked)


def is_packed(model: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in model.modules())


def is_sharded(model: nn.Module) -> bool:
    """A sharded model's parameters are DTensors (sharding.py): one rank holds no whole weight to pack."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _replace(model: nn.Module, kind: type, make) -> int:
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is kind:
                setattr(module, name, make(child))
                replaced += 1
    return replaced


__all__ = ["PackedLinear", "available", "is_packed", "pack_linears", "unpack_linears", "is_sharded"]
