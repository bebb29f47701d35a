"""DFlash drafter configuration, read and written exactly as z-lab's published `config.json`.

A z-lab drafter config is a Qwen3 config (`model_type: "qwen3"`) plus DFlash fields:

    architectures        ["DFlashDraftModel"], or ["DFlash2DraftModel"] with DFlash2's conv_* and selector_* keys
    num_target_layers    number of decoder layers of the target (only used for the default layer taps)
    block_size           top level in older files, inside `dflash_config` in newer ones (we read both)
    dflash_config        {"mask_token_id": int, "target_layer_ids": [ints], ...}

`target_layer_ids` are 0-based ids of target decoder layers whose OUTPUT is tapped, i.e. Hugging Face
`hidden_states[id + 1]`. Fields that would change the drafter's semantics but that this implementation does not
implement (attention sinks, partial RoPE, ...) are refused, because loading them silently would
only show up later as a collapsed acceptance rate.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..files import atomic_write_text

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURE_V2 = "DFlash2DraftModel"
# DFlash2's keys (in dflash_config, or at the top level): the grouped dynamic causal convolutions around each
# sublayer and the candidate selector. All four are required by a DFlash2 drafter and refused by a v1 one.
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


class DFlashConfigError(ValueError):
    """A drafter config that cannot be loaded as given."""


# Keys inside `dflash_config` we understand. Anything else there is treated as an unknown semantic change.
_KNOWN_DFLASH_KEYS = {
    "mask_token_id",
    "mask_token",
    "target_layer_ids",
    "block_size",
    "use_swa",
    "swa_window_size",
    "causal",
    # Read as z-lab does: dflash_config first, then the top level.
    "num_target_layers",
    "input_embedding_scale",
    "output_multiplier",
    "final_logit_softcapping",
    "is_neox_style",
    "eagle_aux_hidden_state_layer_ids",
    *DFLASH2_KEYS,
    # Training metadata only; harmless for inference.
    "num_anchors",
    "loss_decay_gamma",
}

# Top-level (or dflash_config) fields that change what the drafter computes. Refused unless at a neutral value.
_REFUSED_FIELDS = {
    "attention_sink_bias": "attention sinks (MiMo-style drafters)",
    "attention_value_scale": "a value-scaling attention variant",
    "backbone_rotary_base": "a separate RoPE base for target features",
    "sample_from_anchor": "the DSpark anchor-sampling layout",
}
# RoPE types implemented (static frequencies; `dynamic` rescales with the sequence length and is refused).
ROPE_TYPES = ("default", "linear", "yarn", "llama3")
# Fields allowed only when they equal a neutral value.
_NEUTRAL_VALUES = {"partial_rotary_factor": 1.0}


def build_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """z-lab's default layer taps: `num_features` layers spread from layer 1 to layer L-3 (0-based).

    Uses Python's round() like the reference implementation, so defaults match byte for byte
    (e.g. 36 layers, 5 taps -> [1, 9, 17, 25, 33]).
    """
    if num_features < 1:
        raise DFlashConfigError(f"need at least one target layer tap, got {num_features}")
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:  # 3 layers or fewer (z-lab's rule would tap layer -1): all but the last
        start, end = 0, max(0, num_target_layers - 2)
    span = end - start
    return [int(round(start + (i * span) / (num_features - 1))) for i in range(num_features)]


@dataclass
class DFlashConfig:
    """Architecture and DFlash settings of a drafter (Qwen3-style decoder layers, no embedding, no LM head)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    # Non-default RoPE (rope_type linear / yarn / llama3 and its parameters), computed by transformers' own RoPE
    # functions; None = plain RoPE at rope_theta.
    rope_scaling: dict[str, Any] | None = None
    # GPT-J style RoPE (rotating channel pairs 2i, 2i+1) for a drafter whose config says `is_neox_style: false`;
    # the default is the neox / Qwen3 style (channels i and i + d/2).
    rope_interleaved: bool = False
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    # Causality inside the block, z-lab's rule: None (unset) = sliding_attention layers causal, full ones not;
    # True / False (an explicit top-level `is_causal`) = every layer causal / none.
    causal: bool | None = None
    # The block input is the target's raw embedding row times this (z-lab's rule: the target's own embedding module,
    # e.g. Gemma's sqrt(H) scaling, is not applied); flashdraft writes the target's scale here for its drafters.
    input_embedding_scale: float = 1.0
    # Draft logits = lm_head(h) * output_multiplier, then tanh(x / c) * c with c = final_logit_softcapping (if set).
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # DFlash2 (None for a v1 drafter): a grouped dynamic causal convolution of `conv_kernel_size` taps before and
    # after each attention and MLP sublayer (one dynamic kernel per group of `conv_group_size` channels), and a
    # candidate selector walking the `selector_top_k` best tokens of every slot with a rank-`selector_rank` term.
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Provenance written by flashdraft (target id, chat-template mode, training data, ...). z-lab loaders
    # ignore unknown keys, so it travels with the checkpoint harmlessly.
    flashdraft: dict[str, Any] = field(default_factory=dict)
    # Unrecognised but harmless keys of a loaded file, written back unchanged.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = [FULL_ATTENTION] * self.num_hidden_layers
        self.validate()

    @property
    def is_dflash2(self) -> bool:
        return self.conv_kernel_size is not None

    @property
    def architecture(self) -> str:
        return ARCHITECTURE_V2 if self.is_dflash2 else ARCHITECTURE

    def layer_is_causal(self, layer_type: str) -> bool:
        """Whether a layer of this type is causal inside the block (z-lab: `is_causal` if set, else sliding)."""
        return layer_type == SLIDING_ATTENTION if self.causal is None else self.causal

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        if self.hidden_size <= 0 or self.num_hidden_layers <= 0:
            raise DFlashConfigError("hidden_size and num_hidden_layers must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DFlashConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise DFlashConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        for kind in self.layer_types:
            if kind not in (FULL_ATTENTION, SLIDING_ATTENTION):
                raise DFlashConfigError(
                    f"unsupported layer type {kind!r} (expected full_attention/sliding_attention)"
                )
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise DFlashConfigError("sliding_attention layers need a positive sliding_window")
        if self.block_size < 2:
            raise DFlashConfigError(
                f"block_size must be at least 2 (anchor + one mask slot), got {self.block_size}"
            )
        if not self.target_layer_ids:
            raise DFlashConfigError("target_layer_ids is empty")
        for i in self.target_layer_ids:
            if not 0 <= i < self.num_target_layers:
                raise DFlashConfigError(
                    f"target layer id {i} is outside the target's {self.num_target_layers} decoder layers "
                    f"(valid ids are 0..{self.num_target_layers - 1})"
                )
        v2 = [getattr(self, key) for key in DFLASH2_KEYS]
        if any(v is not None for v in v2):
            if any(v is None for v in v2):
                missing = [k for k, v in zip(DFLASH2_KEYS, v2, strict=True) if v is None]
                raise DFlashConfigError(f"a DFlash2 drafter needs {', '.join(missing)} as well")
            if self.hidden_size % self.conv_group_size:
                raise DFlashConfigError(
                    f"conv_group_size {self.conv_group_size} does not divide hidden_size {self.hidden_size}"
                )
            if self.selector_top_k > self.vocab_size:
                raise DFlashConfigError(
                    f"selector_top_k {self.selector_top_k} exceeds the vocabulary ({self.vocab_size})"
                )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DFlashConfigError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary (0..{self.vocab_size - 1})"
            )

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DFlashConfig:
        d = copy.deepcopy(raw)
        archs = d.pop("architectures", None) or [ARCHITECTURE]
        if ARCHITECTURE not in archs and ARCHITECTURE_V2 not in archs:
            raise DFlashConfigError(
                f"architectures={archs}: this is not a DFlash drafter (expected {ARCHITECTURE!r} or "
                f"{ARCHITECTURE_V2!r})"
            )
        is_v2 = ARCHITECTURE_V2 in archs
        model_type = d.pop("model_type", "qwen3")
        if model_type != "qwen3":
            raise DFlashConfigError(
                f"model_type={model_type!r}: DFlash drafters are Qwen3-style (model_type 'qwen3')"
            )
        dflash = d.pop("dflash_config", None) or {}
        unknown = set(dflash) - _KNOWN_DFLASH_KEYS
        for key in sorted(set(dflash) | set(d)):
            value = dflash.get(key, d.get(key))
            if key in _REFUSED_FIELDS and value not in (None, False, 0):
                raise DFlashConfigError(
                    f"config field {key!r}={value!r} asks for {_REFUSED_FIELDS[key]}, which flashdraft does not "
                    "implement; refusing to load rather than silently computing something else"
                )
            if key in _NEUTRAL_VALUES and value is not None and value != _NEUTRAL_VALUES[key]:
                raise DFlashConfigError(
                    f"config field {key!r}={value!r} is not supported (only {_NEUTRAL_VALUES[key]})"
                )
        unknown -= set(_REFUSED_FIELDS)
        if unknown:
            raise DFlashConfigError(
                f"unknown dflash_config fields {sorted(unknown)}; refusing to guess their meaning"
            )
        for key in _REFUSED_FIELDS:
            dflash.pop(key, None)
            d.pop(key, None)
        if d.get("v_head_dim") not in (None, d.get("head_dim")):
            raise DFlashConfigError(f"v_head_dim={d['v_head_dim']} differs from head_dim; not supported")
        d.pop("v_head_dim", None)
        d.pop("partial_rotary_factor", None)

        def need(key: str) -> Any:
            if key not in d:
                raise DFlashConfigError(f"drafter config is missing required field {key!r}")
            return d.pop(key)

        hidden_size = need("hidden_size")
        num_hidden_layers = need("num_hidden_layers")
        num_attention_heads = need("num_attention_heads")
        num_key_value_heads = d.pop("num_key_value_heads", num_attention_heads)
        head_dim = d.pop("head_dim", None) or hidden_size // num_attention_heads
        if "num_target_layers" not in d and "num_target_layers" in dflash:
            d["num_target_layers"] = dflash["num_target_layers"]
        num_target_layers = need("num_target_layers")

        def draft_value(key: str, default: Any) -> Any:
            """z-lab's precedence: dflash_config, then the top level, then the default."""
            value = dflash.get(key, d.get(key, default))
            d.pop(key, None)
            return default if value is None else value

        def positive(key: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise DFlashConfigError(f"config field {key!r}={value!r} must be a positive number")
            return float(value)

        input_embedding_scale = positive("input_embedding_scale", draft_value("input_embedding_scale", 1.0))
        output_multiplier = positive("output_multiplier", draft_value("output_multiplier", 1.0))
        softcap = draft_value("final_logit_softcapping", 0.0)
        final_logit_softcapping = positive("final_logit_softcapping", softcap) if softcap else None
        dflash2: dict[str, int | None] = {}
        for key in DFLASH2_KEYS:
            value = draft_value(key, None)
            if value is not None and not is_v2:
                raise DFlashConfigError(
                    f"config field {key!r} belongs to DFlash2 drafters, but architectures is {archs}"
                )
            if is_v2 and value is None:
                raise DFlashConfigError(f"DFlash2 drafter config is missing {key!r} (in dflash_config)")
            if is_v2 and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise DFlashConfigError(f"DFlash2 config field {key!r}={value!r} must be a positive integer")
            dflash2[key] = value

        block_size = dflash.get("block_size", d.get("block_size"))
        both = dflash.get("block_size") is not None and d.get("block_size") is not None
        if both and int(dflash["block_size"]) != int(d["block_size"]):
            raise DFlashConfigError(
                f"block_size disagrees: top level {d['block_size']} vs dflash_config {dflash['block_size']}"
            )
        d.pop("block_size", None)
        if block_size is None:
            raise DFlashConfigError("block_size is missing (looked at top level and in dflash_config)")

        if "mask_token_id" not in dflash:
            raise DFlashConfigError("dflash_config.mask_token_id is missing")
        target_layer_ids = dflash.get("target_layer_ids")
        # vLLM's capture ids (the input of layer i, i.e. the output of layer i - 1) win over target_layer_ids there;
        # kept as they are on export.
        eagle_ids = dflash.get("eagle_aux_hidden_state_layer_ids", d.get("eagle_aux_hidden_state_layer_ids"))
        if eagle_ids is not None:
            if not isinstance(eagle_ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in eagle_ids
            ):
                raise DFlashConfigError(
                    f"eagle_aux_hidden_state_layer_ids={eagle_ids!r} must be a list of layer indices >= 1"
                )
            target_layer_ids = [i - 1 for i in eagle_ids]
        if target_layer_ids is None:
            # z-lab's code default ties the number of taps to the number of draft layers.
            target_layer_ids = build_target_layer_ids(num_target_layers, num_hidden_layers)

        rope_theta = d.pop("rope_theta", None)
        rope_parameters = d.pop("rope_parameters", None)
        rope_scaling = d.pop("rope_scaling", None)
        scaling = None
        for rope in (rope_parameters, rope_scaling):
            if rope:
                rope_type = rope.get("rope_type", rope.get("type", "default"))
                if rope_type not in ROPE_TYPES:
                    raise DFlashConfigError(
                        f"RoPE type {rope_type!r} is not supported (only {', '.join(ROPE_TYPES)})"
                    )
                rope_theta = rope.get("rope_theta", rope_theta)
                if rope_type != "default":
                    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")}
                    scaling["rope_type"] = rope_type
        if rope_theta is None:
            rope_theta = 10000.0

        layer_types = d.pop("layer_types", None)
        sliding_window = d.pop("sliding_window", None)
        use_sliding_window = d.pop("use_sliding_window", False)
        max_window_layers = d.pop("max_window_layers", num_hidden_layers)
        if dflash.get("use_swa"):
            use_sliding_window = True
            sliding_window = dflash.get("swa_window_size", sliding_window)
        if not layer_types:
            # Qwen3's rule: layers from max_window_layers on use the window when it is enabled.
            sliding = bool(use_sliding_window and sliding_window)
            layer_types = [
                SLIDING_ATTENTION if sliding and i >= max_window_layers else FULL_ATTENTION
                for i in range(num_hidden_layers)
            ]
        top_neox = d.pop("is_neox_style", True)
        neox = dflash.get("is_neox_style", top_neox)
        if not isinstance(neox, bool):
            raise DFlashConfigError(f"is_neox_style={neox!r} must be true or false")
        is_causal = d.pop("is_causal", None)
        if is_causal is None:  # not read by z-lab's package, but some converters write it
            is_causal = dflash.get("causal")
        causal = None if is_causal is None else bool(is_causal)

        hidden_act = d.pop("hidden_act", "silu")
        if hidden_act != "silu":
            raise DFlashConfigError(f"hidden_act={hidden_act!r} is not supported (Qwen3 drafters use silu)")
        dtype = d.pop("dtype", None) or d.pop("torch_dtype", None) or "bfloat16"
        d.pop("torch_dtype", None)
        flashdraft_meta = d.pop("flashdraft", {}) or {}
        cfg = cls(
            hidden_size=hidden_size,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=head_dim,
            vocab_size=need("vocab_size"),
            num_target_layers=num_target_layers,
            target_layer_ids=[int(i) for i in target_layer_ids],
            mask_token_id=int(dflash["mask_token_id"]),
            block_size=int(block_size),
            rms_norm_eps=float(d.pop("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            rope_interleaved=not neox,
            max_position_embeddings=int(d.pop("max_position_embeddings", 32768)),
            attention_bias=bool(d.pop("attention_bias", False)),
            layer_types=list(layer_types),
            sliding_window=sliding_window,
            causal=causal,
            input_embedding_scale=input_embedding_scale,
            output_multiplier=output_multiplier,
            final_logit_softcapping=final_logit_softcapping,
            **dflash2,
            hidden_act=hidden_act,
            initializer_range=float(d.pop("initializer_range", 0.02)),
            dtype=str(dtype),
            bos_token_id=d.pop("bos_token_id", None),
            eos_token_id=d.pop("eos_token_id", None),
            flashdraft=flashdraft_meta,
        )
        if dflash.get("mask_token") is not None:
            cfg.extra["_mask_token"] = dflash["mask_token"]
        for key in (
            "auto_map",
            "attention_dropout",
            "tie_word_embeddings",
            "use_cache",
            "transformers_version",
        ):
            d.pop(key, None)
        cfg.extra.update(d)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The z-lab `config.json` layout (Qwen3 fields + DFlash fields)."""
        uses_window = SLIDING_ATTENTION in self.layer_types
        dflash: dict[str, Any] = {
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
        if "_mask_token" in self.extra:
            dflash["mask_token"] = self.extra["_mask_token"]
        if self.causal:
            dflash["causal"] = True
        # In dflash_config, where every z-lab loader (torch and MLX) reads them; written only when not neutral.
        if self.input_embedding_scale != 1.0:
            dflash["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        if self.is_dflash2:
            dflash.update({key: getattr(self, key) for key in DFLASH2_KEYS})
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "block_size": self.block_size,
            "bos_token_id": self.bos_token_id,
            "dflash_config": dflash,
            "dtype": self.dtype,
            "eos_token_id": self.eos_token_id,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "hidden_size": self.hidden_size,
            "initializer_range": self.initializer_range,
            "intermediate_size": self.intermediate_size,
            "layer_types": list(self.layer_types),
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "model_type": "qwen3",
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_theta": self.rope_theta,
            "sliding_window": self.sliding_window if uses_window else None,
            "tie_word_embeddings": False,
            "use_cache": True,
            "use_sliding_window": uses_window,
            "vocab_size": self.vocab_size,
        }
        if self.causal is not None:
            out["is_causal"] = self.causal
        if self.rope_interleaved:
            out["is_neox_style"] = False
        if self.flashdraft:
            out["flashdraft"] = self.flashdraft
        for key, value in self.extra.items():
            if not key.startswith("_"):
                out.setdefault(key, value)
        return out

    @classmethod
    def from_pretrained(cls, path: str | Path) -> DFlashConfig:
        path = Path(path)
        file = path / CONFIG_NAME if path.is_dir() else path
        if not file.exists():
            raise DFlashConfigError(f"no {CONFIG_NAME} found at {path}")
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DFlashConfigError(f"{file} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise DFlashConfigError(f"{file} does not hold a JSON object")
        return cls.from_dict(raw)

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path / CONFIG_NAME, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    # ------------------------------------------------------------------ construction from a target
    @classmethod
    def for_target(
        cls,
        target_config: Any,
        *,
        num_layers: int = 5,
        block_size: int = 16,
        mask_token_id: int,
        target_layer_ids: list[int] | None = None,
        intermediate_size: int | None = None,
        num_target_features: int = 5,
        vocab_size: int | None = None,
        input_embedding_scale: float | None = None,
        arch: str = "dflash",
    ) -> DFlashConfig:
        """A drafter config with the target's widths (hidden, heads, head_dim, RoPE), as z-lab's drafters have.
        The drafter's block input and logits are the target's own: `input_embedding_scale` is the target's embedding
        scale (`Target.input_embedding_scale` when a loaded target is at hand; from the config otherwise) and the
        target's logit soft-capping, if any, caps the draft logits too. `arch="dflash2"` adds DFlash2's convolutions
        (kernel 2, groups of 16 channels) and candidate selector (top 16, rank 256 capped at the hidden size), the
        published Qwen3.8-27B-DFlash2 settings."""
        if arch not in ARCHS:
            raise DFlashConfigError(f"unknown drafter architecture {arch!r} (choose from {', '.join(ARCHS)})")
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        n_target = int(tc.num_hidden_layers)
        # A target without attention (Mamba2) has no head count to copy: heads of 64 (or 128) dimensions.
        heads = getattr(tc, "num_attention_heads", None)
        if not heads:
            head_dim = 128 if tc.hidden_size % 128 == 0 and tc.hidden_size >= 2048 else 64
            heads = max(1, tc.hidden_size // head_dim)
        heads = int(heads)
        head_dim = (getattr(tc, "head_dim", None) if getattr(tc, "num_attention_heads", None) else None) or (
            tc.hidden_size // heads
        )
        rope_theta = _rope_theta_of(tc)
        if input_embedding_scale is None:
            input_embedding_scale = embedding_scale_of(tc)
        if target_layer_ids is None:
            target_layer_ids = build_target_layer_ids(n_target, min(num_target_features, n_target))
        return cls(
            hidden_size=int(tc.hidden_size),
            intermediate_size=int(
                intermediate_size or getattr(tc, "intermediate_size", None) or 4 * int(tc.hidden_size)
            ),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            vocab_size=int(vocab_size or tc.vocab_size),
            num_target_layers=n_target,
            target_layer_ids=list(target_layer_ids),
            mask_token_id=mask_token_id,
            block_size=block_size,
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6) or 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=int(getattr(tc, "max_position_embeddings", 32768) or 32768),
            input_embedding_scale=float(input_embedding_scale),
            final_logit_softcapping=getattr(tc, "final_logit_softcapping", None) or None,
            **(
                _dflash2_defaults(int(tc.hidden_size), int(vocab_size or tc.vocab_size))
                if arch == "dflash2"
                else {}
            ),
            bos_token_id=getattr(tc, "bos_token_id", None),
            eos_token_id=getattr(tc, "eos_token_id", None),
        )


ARCHS = ("dflash", "dflash2")


def _dflash2_defaults(hidden_size: int, vocab_size: int) -> dict[str, int]:
    group = 16 if hidden_size % 16 == 0 else next(g for g in (8, 4, 2, 1) if hidden_size % g == 0)
    return {
        "conv_kernel_size": 2,
        "conv_group_size": group,
        "selector_rank": min(256, hidden_size),
        "selector_top_k": min(16, vocab_size),
    }


def embedding_scale_of(config: Any) -> float:
    """The factor a target's embedding applies to its raw rows, from its config: sqrt(hidden_size) for the Gemma
    families (their embedding is normalised by it), 1 otherwise. `Target.input_embedding_scale` reads the loaded
    module instead."""
    if str(getattr(config, "model_type", "")).startswith("gemma"):
        return float(config.hidden_size) ** 0.5
    return 1.0


def _rope_theta_of(config: Any) -> float:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        # Per-layer-type dicts (Gemma3: {"full_attention": {...}, "sliding_attention": {...}}).
        if "rope_theta" not in params and FULL_ATTENTION in params:
            params = params[FULL_ATTENTION]
        if params.get("rope_theta"):
            return float(params["rope_theta"])
    theta = getattr(config, "rope_theta", None)
    return float(theta) if theta else 10000.0


def choose_mask_token_id(tokenizer: Any, embedding_rows: int) -> int:
    """A mask id for a new drafter. Its embedding row stays frozen, so it must be a token chat never produces:
    an unused row past the tokenizer if there is one (as Qwen3's 151669), else an added special token that
    neither the chat template nor bos/eos/pad use (e.g. SmolLM2's `<repo_name>`), else the last row."""
    n_tok = len(tokenizer) if tokenizer is not None else embedding_rows
    if embedding_rows > n_tok:
        return n_tok
    if tokenizer is not None:
        used = {
            tokenizer.bos_token_id,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            tokenizer.unk_token_id,
        }
        template = str(getattr(tokenizer, "chat_template", "") or "")
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        for tid, token in sorted(added.items()):
            content = getattr(token, "content", str(token))
            if tid not in used and content not in template and 0 <= tid < embedding_rows:
                return int(tid)
    return embedding_rows - 1
