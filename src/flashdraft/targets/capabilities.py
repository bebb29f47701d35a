"""What the engine can run on a target, decided from its configuration before any decoding: its static KV cache
(`--compile`, and on a GPU by default) serves attention-only families verified token for token against plain
decoding, without sliding windows, whose attention takes the engine's mask as given."""

from __future__ import annotations

from typing import Any

from ..kernels import attention as short_query


def is_sliding(target: Any) -> bool:
    cfg = target.config
    types = getattr(cfg, "layer_types", None) or []
    return bool(getattr(cfg, "sliding_window", None)) and (
        not types or any("sliding" in str(t) for t in types) or getattr(cfg, "use_sliding_window", True)
    )


# Families whose attention takes the engine's [b, 1, n, capacity] mask as given, checked token for token against plain
# decoding (tests/test_static_cache.py). Others (ALiBi, custom masks) keep the growing cache: exact, just eager.
STATIC_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def static_refusal(target: Any) -> str | None:
    """Why the static mode cannot serve this target (None: it can)."""
    if target.recurrent is not None:
        return "recurrent layers"
    if is_sliding(target):
        return "sliding-window attention"
    family = getattr(target.config, "model_type", None)
    if family not in STATIC_FAMILIES:
        return f"a model family ({family}) the static cache is not verified on (it serves {', '.join(STATIC_FAMILIES)})"
    return mask_refusal(target)


def mask_refusal(target: Any) -> str | None:
    """Why the target's attention cannot take a mask the engine builds (None: it takes it as given)."""
    attention = getattr(target.model.config, "_attn_implementation", None)
    if attention not in (None, "sdpa", "eager", short_query.NAME):
        return f"{attention} attention, which does not take the engine's mask"
    return None


def static_capable(target: Any) -> bool:
    """Whether the static mode serves this target: an attention-only family verified on it, no sliding window,
    attention that takes an explicit mask."""
    return static_refusal(target) is None


def uses_static_cache(target: Any) -> bool:
    """Whether the engine verifies on `target` through the static cache: its kernel plan's choice (compiled, or on a
    GPU), where the target allows it."""
    return target.plan.static_cache and static_capable(target)
