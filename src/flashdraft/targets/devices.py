"""Devices and dtypes as users name them (`--device cuda:1`, `--dtype bf16`): parsed, checked against this machine,
and the defaults."""

from __future__ import annotations

import torch

from .model_parts import TargetError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = dict(fp32="float32", float="float32", bf16="bfloat16", fp16="float16", half="float16")


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype from its name (`float32`, `bfloat16`, `float16`, also `fp32`/`bf16`/`fp16`); None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).strip().lower().removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise TargetError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_device(device: str | torch.device | None) -> torch.device:
    """A usable torch device (default: cuda when available, else cpu); a clear error for one this machine lacks."""
    if device is None:
        return torch.device(default_device())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise TargetError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise TargetError(
                f"device {device!r} asked for, but this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise TargetError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type != "cpu" and dev.type != "mps":
        raise TargetError(f"unsupported device {device!r}; use cpu or cuda")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise TargetError(f"device {device!r} asked for, but MPS is not available here")
    return dev


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str | torch.device) -> torch.dtype:
    """The dtype of a target left unsaid on `device` (the kernel plan's rule, kernels/plan.py)."""
    from ..kernels.plan import default_dtype as planned

    return planned(torch.device(device), None, False)
