"""Which targets the decode engine can roll back exactly, and the rollback of recurrent state.

Speculative decoding verifies a block and then forgets the rejected part of it. For attention layers that is a crop
of the KV cache. Recurrent layers (GatedDeltaNet in Qwen3.5 / Qwen3-Next, Mamba in Jamba / Falcon-H1 / Mamba2, ...)
fold every token into a fixed-size state: a crop cannot take a token back out. transformers' `DynamicCache.crop`
rolls back their conv window but silently keeps the recurrent state, so decoding would go on from a state that saw
rejected drafts. `decoding_support` says, before anything is decoded, whether a target can be rolled back exactly;
anything it cannot is refused by name.
"""

from __future__ import annotations

from typing import Any


def _cache_classes() -> tuple[type, type | None, type | None]:
    """(full-attention layer class, its base mixin, linear-attention mixin) of this transformers, if it has them."""
    import transformers.cache_utils as cu

    return (
        cu.DynamicLayer,
        getattr(cu, "CacheLayerMixin", None),
        getattr(cu, "LinearAttentionCacheLayerMixin", None),
    )


def cache_layers(config: Any) -> list[Any]:
    """The layers of a fresh `DynamicCache` for this config ([] on transformers without per-layer caches)."""
    from transformers import DynamicCache

    try:
        return list(getattr(DynamicCache(config=config), "layers", []) or [])
    except TypeError:  # transformers < 4.56: no config-built caches, every layer is a plain KV layer
        return []


def causal_lm_class(config: Any) -> type | None:
    """The `AutoModelForCausalLM` class a config loads as (no weights needed), None if there is none."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError, AttributeError):
        return None


def decoding_support(config: Any, model_class: type | None = None) -> str | None:
    """None if the engine decodes this model exactly, else why not (one sentence naming the model class).
    Needs only the config (the class is looked up when not given), so commands refuse before loading weights."""
    model_class = model_class or causal_lm_class(config)
    name = model_class.__name__ if model_class is not None else type(config).__name__
    if getattr(model_class, "_is_stateful", False):
        return (
            f"{name} keeps recurrent (SSM / linear-attention) state that a rejected draft cannot be rolled back "
            "out of, so speculative decoding would not be exact; flashdraft refuses it"
        )
    dynamic, _, linear = _cache_classes()
    for i, layer in enumerate(cache_layers(config)):
        if isinstance(layer, dynamic):
            continue
        if linear is not None and isinstance(layer, linear):
            continue  # conv-only state (LFM2): its conv window is rolled back with the KV cache
        return (
            f"{name} layer {i} uses a {type(layer).__name__} cache that flashdraft cannot roll back exactly; "
            "flashdraft refuses it"
        )
    return None
