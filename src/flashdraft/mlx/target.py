"""An mlx-lm model as the DFlash target: loaded from a Hugging Face directory (or an MLX-converted one, quantized
included), its config normalised first, the tapped layers' outputs recorded as it runs.

    config    mlx-lm reads `config.json` itself and silently ignores what it does not know. Two ways that decodes
              other text than transformers: a field moved by transformers 5 (`rope_parameters` holds rope_theta:
              mlx-lm's llama keeps its 10000 default where SmolLM2 says 100000), and a default that differs (a llama
              config without `tie_word_embeddings` ties in mlx-lm, not in transformers). So every field mlx-lm's
              ModelArgs declares is passed explicitly, as transformers resolves it; and a field that changes the
              computation but that this family's ModelArgs does not declare is refused by name.
    taps      each tapped layer's class is swapped for a subclass whose call records its output (the DFlash
              features: the output of decoder layer l, for l in the drafter's target_layer_ids): mlx-lm's model code
              runs unchanged, no copy of it here.
    rollback  a verify's rejected tokens are trimmed from each layer's KV cache. A recurrent layer (Qwen3.5's
              GatedDeltaNet, Mamba: mlx-lm's ArraysCache) goes back to its state before the verify and the accepted
              tokens run again; a sliding window's cache loses the rejected tokens from its end. Another kind of
              state is refused before decoding, by name.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..targets.target import TargetError

# transformers fields that change what a decoder layer or the head computes, with the value that changes nothing.
# A family whose mlx-lm ModelArgs does not declare one of these, while the config sets it to something else, would be
# run approximately: refused by name.
COMPUTATION_FIELDS: dict[str, Any] = {
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "hidden_activation": "silu",
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "logit_scale": None,
    "logits_scaling": 1.0,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": None,
    "partial_rotary_factor": 1.0,
    "rope_scaling": None,
    "qk_layernorm": False,
    "use_qk_norm": False,
    "sliding_window": None,
    "layer_types": None,
}
# Recurrent families whose mlx-lm layers replace their state arrays on each call (never write into them), so a
# snapshot of the references restores them exactly (target.snapshot): Qwen3.5's GatedDeltaNet (its MoE variant runs
# the same layers). Other recurrent families are refused by name until tested.
RECURRENT_FAMILIES = {"qwen3_5", "qwen3_5_moe"}
# The activation an mlx-lm family hard-codes where it is not silu (its config field is not read).
FAMILY_ACTIVATIONS = {"gemma3_text": "gelu_pytorch_tanh", "gemma3": "gelu_pytorch_tanh"}
# RoPE types mlx-lm's `initialize_rope` computes as transformers does.
MLX_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "longrope", "mrope"}


def _rope_fields(rope: Any) -> dict[str, Any]:
    """One RoPE's transformers 5 `rope_parameters` as the `rope_theta` / `rope_scaling` pair mlx-lm reads."""
    if not isinstance(rope, dict) or not rope:
        return {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in MLX_ROPE_TYPES:
        raise TargetError(
            f"the target's RoPE type {kind!r} is not one mlx-lm computes: refused on the MLX backend"
        )
    out: dict[str, Any] = {}
    if "rope_theta" in rope:
        out["rope_theta"] = float(rope["rope_theta"])
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    out["rope_scaling"] = None if kind == "default" else {**scaling, "type": kind, "rope_type": kind}
    return out


def _rope_overrides(rope: Any, declared: set[str]) -> dict[str, Any]:
    """The RoPE fields of an mlx-lm family from transformers 5's `rope_parameters`, one RoPE or one per layer type
    (Gemma-3: full-attention layers' theta and scaling, sliding layers' `rope_local_base_freq`)."""
    if not isinstance(rope, dict) or not rope:
        return {}
    if not all(isinstance(v, dict) for v in rope.values()):
        return {k: v for k, v in _rope_fields(rope).items() if k in declared}
    if "rope_local_base_freq" not in declared or not set(rope) <= {"full_attention", "sliding_attention"}:
        raise TargetError(
            "the target's rope_parameters differ per layer type "
            f"({', '.join(rope)}): the MLX backend cannot map them onto this mlx-lm family's fields"
        )
    out = _rope_fields(rope.get("full_attention", {}))
    local = rope.get("sliding_attention")
    if local:
        if local.get("rope_type", "default") != "default":
            raise TargetError(
                "the target's sliding layers use a scaled RoPE: mlx-lm's local RoPE has no scaling"
            )
        out["rope_local_base_freq"] = float(local["rope_theta"])
    return {k: v for k, v in out.items() if k in declared}


def _layer_pattern(
    layer_types: list[str], declared: set[str], resolved: dict[str, Any]
) -> dict[str, int] | None:
    """Families whose mlx-lm model derives its layer types from an interval (Qwen3.5's `full_attention_interval`,
    Gemma-3's `sliding_window_pattern`: every k-th layer full attention): the interval that builds `layer_types`, or
    None when none does (the checkpoint's layers would not be the ones mlx-lm builds)."""
    for field_name, other in (
        ("full_attention_interval", "linear_attention"),
        ("sliding_window_pattern", "sliding_attention"),
    ):
        if field_name not in declared:
            continue
        every = resolved.get(field_name)
        if every is None:
            every = (
                layer_types.index("full_attention") + 1
                if "full_attention" in layer_types
                else len(layer_types) + 1
            )
        derived = [other if (i + 1) % int(every) else "full_attention" for i in range(len(layer_types))]
        if list(layer_types) == derived:
            return {field_name: int(every)}
    return None


def normalized_config(path: Path) -> tuple[dict[str, Any], type]:
    """(the fields to pass to mlx-lm's loader, its Model class) for the target at `path`. Raises TargetError naming
    the family or the field that mlx-lm cannot run as transformers does."""
    from mlx_lm.utils import _get_classes, load_config

    raw = load_config(path)
    if "text_config" in raw and "model_type" not in raw.get("text_config", {}):
        raw = {**raw, **raw["text_config"]}
    try:
        model_class, args_class = _get_classes(raw)
    except ValueError as e:
        raise TargetError(
            f"the MLX backend cannot run this target: {e} (mlx-lm has no such family)"
        ) from None
    declared = set(inspect.signature(args_class).parameters)
    # A family whose ModelArgs wraps a text model's (Qwen3.5, Gemma-3): that one's fields, under text_config.
    module = importlib.import_module(model_class.__module__)
    nested = "text_config" in declared and hasattr(module, "TextModelArgs")
    if nested:
        declared = set(inspect.signature(module.TextModelArgs).parameters)
    resolved = _transformers_view(path, raw)
    overrides: dict[str, Any] = {}
    # The fields transformers resolves (defaults included), passed as it resolves them: mlx-lm's own defaults differ.
    for name in declared:
        if name in resolved and name not in ("rope_parameters", "quantization", "quantization_config"):
            overrides[name] = resolved[name]
    overrides.update(_rope_overrides(resolved.get("rope_parameters"), declared))
    if "rope_parameters" in declared and isinstance(resolved.get("rope_parameters"), dict):
        overrides["rope_parameters"] = resolved["rope_parameters"]
    unmapped = []
    activation = FAMILY_ACTIVATIONS.get(
        raw["model_type"], "silu"
    )  # what mlx-lm's model runs, whatever it says
    for name in ("hidden_act", "hidden_activation"):
        if name not in declared and resolved.get(name, activation) not in (activation, None):
            unmapped.append(f"{name}={resolved[name]!r}")
    for name, neutral in COMPUTATION_FIELDS.items():
        if name in ("hidden_act", "hidden_activation"):
            continue
        value = resolved.get(name, neutral)
        if name in declared or value == neutral or value is None:
            continue
        if name == "rope_scaling" and (
            "rope_theta" in declared and not _rope_fields(value).get("rope_scaling")
        ):
            continue
        if name == "layer_types" and set(value) <= {"full_attention"}:
            continue
        if name == "layer_types" and (pattern := _layer_pattern(value, declared, resolved)) is not None:
            overrides.update(pattern)  # mlx-lm derives them from this interval
            continue
        if name == "sliding_window" and not resolved.get("use_sliding_window", "layer_types" in resolved):
            continue
        unmapped.append(f"{name}={value!r}")
    if unmapped:
        raise TargetError(
            f"mlx-lm's {raw['model_type']} model ignores {', '.join(unmapped)} from the target's config: the MLX "
            "backend would decode other text than the target, so it refuses it (use the torch backend)"
        )
    if nested:
        overrides = {"text_config": {**raw.get("text_config", raw), **overrides}}
    return overrides, model_class


def _transformers_view(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """The config as transformers resolves it (its class defaults filled in), or the raw file for a family
    transformers does not know; the raw file's own values win where both have one (an MLX conversion's fields)."""
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(path)
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        resolved = text.to_dict()
    except (OSError, ValueError, KeyError):
        resolved = {}
    resolved = {**resolved, **raw}
    if "rope_parameters" not in resolved and "rope_theta" in raw:
        resolved["rope_parameters"] = {"rope_theta": raw["rope_theta"], **(raw.get("rope_scaling") or {})}
    return resolved


class LayerTaps:
    """Records the outputs of some decoder layers of an mlx-lm model as it runs (the DFlash features)."""

    def __init__(self, layers: list[nn.Module], layer_ids: list[int]) -> None:
        self.layer_ids = list(layer_ids)
        self.outputs: dict[int, mx.array] = {}
        for i in self.layer_ids:
            if not 0 <= i < len(layers):
                raise TargetError(f"the drafter taps layer {i}, but the target has {len(layers)} layers")
            self._tap(layers[i], i)

    def _tap(self, layer: nn.Module, index: int) -> None:
        outputs = self.outputs
        base = type(layer)

        def call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            out = base.__call__(module, *args, **kwargs)
            outputs[index] = out[0] if isinstance(out, tuple) else out
            return out

        layer.__class__ = type(f"Tapped{base.__name__}", (base,), {"__call__": call})

    def features(self) -> mx.array:
        """[1, n, T*H]: the tapped layers' outputs of the last forward, concatenated (in layer-id order)."""
        return mx.concatenate([self.outputs[i] for i in self.layer_ids], axis=-1)


@dataclasses.dataclass(
    eq=False
)  # hashed by identity: structured output caches its grammar compiler per target
class MlxTarget:
    """The target on MLX: the mlx-lm model, its tokenizer, its taps, and what the drafter reads from it."""

    model: nn.Module
    tokenizer: Any
    name: str
    config: dict[str, Any]
    taps: LayerTaps | None = None

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def embed_tokens(self) -> nn.Module:
        inner = getattr(self.model, "model", None) or getattr(self.model, "language_model", None)
        embed = getattr(inner, "embed_tokens", None)
        if embed is None:
            raise TargetError(
                f"cannot find the token embedding of mlx-lm's {self.config.get('model_type')} model"
            )
        return embed

    @property
    def vocab_size(self) -> int:
        embed = self.embed_tokens
        return int(getattr(embed, "num_embeddings", 0) or embed.weight.shape[0])

    @property
    def dtype(self) -> str:
        """The precision its activations run in ("bfloat16", ...): its embedding's output's (a quantized table's
        scales' dtype)."""
        return str(self.embed(mx.array([0])).dtype).removeprefix("mlx.core.")

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def max_context(self) -> int:
        return int(self.config.get("max_position_embeddings") or 1 << 20)

    @property
    def eos_token_ids(self) -> list[int]:
        """The config's end tokens and the tokenizer's: where a request stops unless it names its own."""
        eos = self.config.get("eos_token_id")
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        return sorted(ids | ({tok_eos} if tok_eos is not None else set()))

    # What the server's routes ask of a target (serve/routes.py): text-only, prompts through the chat template.
    takes_images = False
    processor = None

    def encode_prompt(
        self,
        prompt: Any,
        chat: bool = True,
        enable_thinking: bool | None = None,
        system: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """[1, n] prompt ids (a torch tensor, as the torch target's: the server and the benchmark read either)."""
        import torch

        from ..targets.target import encode_chat

        if self.tokenizer is None:
            raise TargetError("this target has no tokenizer; pass token ids instead of text")
        return torch.tensor(
            [encode_chat(self.tokenizer, prompt, chat, enable_thinking, system, template_kwargs)]
        )

    def tap(self, layer_ids: list[int]) -> None:
        if self.taps is None:
            self.taps = LayerTaps(self.layers, layer_ids)
        elif self.taps.layer_ids != list(layer_ids):
            raise TargetError(f"this target is tapped at layers {self.taps.layer_ids}, not {list(layer_ids)}")

    def embed(self, ids: mx.array) -> mx.array:
        """The embedding table's raw rows (no scaling: the drafter's `input_embedding_scale` is its own)."""
        return self.embed_tokens(ids)

    def head(self, hidden: mx.array) -> mx.array:
        """The LM head's logits for hidden rows (the drafter's output goes through the target's head)."""
        head = getattr(self.model, "lm_head", None)
        return head(hidden) if head is not None else self.embed_tokens.as_linear(hidden)

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def check_rollback(self, cache: list[Any]) -> None:
        """Refuse, before decoding, a cache the decode loop could not roll back after a rejected draft."""
        from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

        family = self.config.get("model_type")
        for i, layer in enumerate(cache):
            if isinstance(layer, ArraysCache) and family not in RECURRENT_FAMILIES:
                raise TargetError(
                    f"target layer {i} of mlx-lm's {family} model keeps a recurrent state: its rollback on the MLX "
                    f"backend is tested for {', '.join(sorted(RECURRENT_FAMILIES))} only (use the torch backend)"
                )
            if not isinstance(layer, (KVCache, RotatingKVCache, ArraysCache)):
                raise TargetError(
                    f"target layer {i} keeps a state of its own ({type(layer).__name__}): rolling it back after a "
                    "rejected draft is not implemented on the MLX backend yet (use the torch backend)"
                )

    @staticmethod
    def snapshot(cache: list[Any]) -> list[Any] | None:
        """The recurrent layers' states before a verify (GatedDeltaNet's conv and SSM states, Mamba's), or None when
        every layer is a KV cache (trimmed instead). mlx-lm's layers replace their state arrays, never write into
        them, so keeping the references is the snapshot."""
        from mlx_lm.models.cache import ArraysCache

        states = [list(layer.cache) if isinstance(layer, ArraysCache) else None for layer in cache]
        return states if any(s is not None for s in states) else None

    def rollback(self, cache: list[Any], snapshot: list[Any] | None, verified: list[int], keep: int) -> None:
        """Undo a verify of `verified` tokens but its first `keep`: KV caches trimmed; with recurrent layers, every
        layer back to `snapshot` and the kept tokens run again (a recurrent state cannot be trimmed; z-lab's MLX code
        replays the recurrence from recorded inputs instead, cheaper, not done here)."""
        from mlx_lm.models.cache import RotatingKVCache

        drop = len(verified) - keep if snapshot is None else len(verified)
        for layer, state in zip(cache, snapshot or [None] * len(cache), strict=True):
            if state is not None:
                layer.cache = list(state)
            elif isinstance(layer, RotatingKVCache):
                _trim_window(layer, drop)
            else:
                layer.trim(drop)
        if snapshot is not None:
            logits, _ = self.forward(verified[:keep], cache)
            mx.eval(logits, [layer.state for layer in cache])

    def forward(self, ids: list[int], cache: list[Any]) -> tuple[mx.array, mx.array | None]:
        """(logits [n, V] float32, features [n, T*H] or None when untapped) for `ids` after what `cache` holds."""
        logits = self.model(mx.array([ids]), cache=cache)[0].astype(mx.float32)
        features = self.taps.features()[0] if self.taps is not None else None
        return logits, features


def _trim_window(layer: Any, n: int) -> None:
    """Take the last n tokens out of a sliding window's cache right after a verify of several tokens. mlx-lm
    appends a multi-token input to the window in time order, keeping window - 1 older tokens whatever the input's
    length; so cutting the input's last n leaves the very state a verify of the kept tokens alone would have left
    (z-lab's MLX code rolls a window back the same way)."""
    if n <= 0:
        return
    layer.keys = layer.keys[..., :-n, :]
    layer.values = layer.values[..., :-n, :]
    layer.offset -= n
    layer._idx = layer.keys.shape[2]


def load_target(name: str | Path) -> MlxTarget:
    """A target by pack name, local directory (Hugging Face or MLX-converted) or hub id, on MLX."""
    from mlx_lm.utils import load_model
    from transformers import AutoTokenizer

    from ..models.packs import resolve_model

    path = Path(resolve_model(str(name)))
    if not path.exists():  # a hub id: its files, as transformers would fetch them
        try:
            from huggingface_hub import snapshot_download

            path = Path(
                snapshot_download(str(name), allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt"])
            )
        except Exception as e:  # offline, unknown repo, gated: one line
            raise TargetError(f"target {str(name)!r} is not a directory and cannot be fetched: {e}") from None
    if not (path / "config.json").exists():
        raise TargetError(f"target {str(name)!r}: no config.json in {path}")
    overrides, _ = normalized_config(path)
    try:
        model, config = load_model(path, model_config=overrides)
    except (ValueError, FileNotFoundError) as e:
        raise TargetError(f"mlx-lm cannot load target {name!r}: {str(e).splitlines()[0]}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):  # a target without one decodes token ids
        tokenizer = None
    if not hasattr(model, "layers"):
        raise TargetError(f"mlx-lm's {config.get('model_type')} model does not expose its decoder layers")
    return MlxTarget(model=model, tokenizer=tokenizer, name=str(name), config={**config, **overrides})
