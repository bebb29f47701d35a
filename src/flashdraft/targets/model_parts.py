"""Where a Hugging Face model keeps what the engine reads, found by shape and name rather than by family: its decoder
layers and final norm, the auto class that loads it (causal LM or image-text), and whether its multimodal RoPE
takes the positions the engine gives it; and `TargetError`, what a lookup that fails raises. Config and module
lookups only; `target.Target`, the memory planner (memory_plan.py) and FSDP2 sharding (sharding.py) use them."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn


class TargetError(ValueError):
    """The target model cannot be used as asked (target.py re-exports it, where its users import it from)."""


def decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    """The ModuleList holding the decoder layers (model.model.layers for most families; in an image-text model the
    language model's, searched first: a vision tower may have as many blocks)."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    for root in (decoder, model) if isinstance(decoder, nn.Module) else (model,):
        candidates = [
            (name, m)
            for name, m in root.named_modules()
            if isinstance(m, nn.ModuleList) and len(m) == num_layers
        ]
        if candidates:
            break
    if not candidates:
        raise TargetError(f"cannot find the {num_layers} decoder layers of {type(model).__name__}")
    return min(candidates, key=lambda c: c[0].count("."))[1]


def mrope_refusal(model: nn.Module, mrope: nn.Module | None) -> str | None:
    """Why a multimodal-RoPE target cannot be decoded exactly here, or None. The engine gives such a model explicit
    [4, b, n] positions on every step (`Target.model_positions`: the text positions the mask is built from, then the
    three rotary ones), which its language model must split; transformers' Qwen-VL, Qwen3.5, GLM-4V, ERNIE-VL, ...
    do (`position_ids.shape[0] == 4`). One that does not would read the four rows as rotary sections: refused before
    decoding rather than decoded wrong."""
    if mrope is None:
        return None
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    try:
        source = inspect.getsource(type(decoder).forward)
    except (AttributeError, OSError, TypeError):
        source = ""
    if "shape[0] == 4" in source:
        return None
    kind = getattr(model.config, "model_type", type(model).__name__)
    return (
        f"its multimodal RoPE ({kind}) takes no text positions beside the rotary ones ([4, batch, tokens]), which "
        "the engine gives every decode step"
    )


def final_norm(model: nn.Module) -> nn.Module | None:
    """The decoder's final norm (applied before the LM head), or None."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    for attr in ("norm", "final_layernorm", "ln_f", "final_norm", "norm_f"):
        if isinstance(getattr(base, attr, None), nn.Module):
            return getattr(base, attr)
    return None


def causal_lm_class(config: Any) -> bool:
    """transformers has a causal-LM class for this config."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(config, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def image_text_class(config: Any) -> str | None:
    """The image-text-to-text class transformers has for this config, if any."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(getattr(config, "model_type", None))
