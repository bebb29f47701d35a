"""Which targets the decode engine can roll back exactly, and the rollback of recurrent state.

Speculative decoding verifies a block and then forgets the rejected part of it. For attention layers that is a crop
of the KV cache. Recurrent layers (GatedDeltaNet in Qwen3.5 / Qwen3-Next, Mamba in Jamba / Falcon-H1 / Mamba2, ...)
fold every token into a fixed-size state: a crop cannot take a token back out. transformers' `DynamicCache.crop`
rolls back their conv window but silently keeps the recurrent state, so decoding would go on from a state that saw
rejected drafts. `decoding_support` says, before anything is decoded, whether a target can be rolled back exactly;
anything it cannot is refused by name.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@functools.cache  # asked per cache layer at every crop: 60 times a step for SmolLM2
def _cache_classes() -> tuple[type, type | None, type | None]:
    """(full-attention layer class, its base mixin, linear-attention mixin) of this transformers, if it has them."""
    import transformers.cache_utils as cu

    return (
        getattr(cu, "DynamicLayer", ()),
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
    except Exception:  # a config transformers cannot build a cache from: the model builds its own (plain KV)
        return []


def causal_lm_class(config: Any) -> type | None:
    """The `AutoModelForCausalLM` class a config loads as (no weights needed), None if there is none."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError, AttributeError):
        return None


# Families whose single, batched and served decoding is tested equal to plain greedy decoding without a cache
# (tests/test_hybrid.py). Other families with recurrent layers may well work the same way, but are refused until a
# test says so: a lossless engine does not guess.
VERIFIED_RECURRENT = frozenset(
    {
        "qwen3_5",
        "qwen3_5_text",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen3_next",
        "jamba",
        "falcon_h1",
        "mamba2",
        "lfm2",
        "nemotron_h",
        "olmo_hybrid",
        "zaya",
        "lfm3",
    }
)


def _model_type(config: Any) -> str:
    return str(getattr(config, "model_type", "") or "")


def decoding_support(
    config: Any, model_class: type | None = None, model: nn.Module | None = None
) -> str | None:
    """None if the engine decodes this model exactly, else why not (one sentence naming the model class).
    Needs only the config (the class is looked up when not given), so commands refuse before loading weights."""
    model_class = model_class or causal_lm_class(config)
    name = model_class.__name__ if model_class is not None else type(config).__name__
    dynamic, _, linear = _cache_classes()
    layers = cache_layers(config)
    recurrent = [i for i, layer in enumerate(layers) if is_recurrent_layer(layer)]
    own_cache = None if recurrent else _own_cache(model_class)
    if own_cache:
        return f"{name} {own_cache}, so speculative decoding could not roll it back exactly; flashdraft refuses it"
    why = None
    if getattr(model_class, "_is_stateful", False) and not recurrent:
        why = (
            "its recurrent state is not kept in a transformers linear-attention cache (transformers >= 5.20)"
        )
    elif any(is_recurrent_layer(layer) and _is_sliding_layer(layer) for layer in layers):
        why = "a layer shares one cache between a sliding window and a recurrent state"
    elif recurrent and _model_type(config) not in VERIFIED_RECURRENT:
        why = (
            f"its model type {_model_type(config)!r} has not been verified with flashdraft's rollback (verified: "
            f"{', '.join(sorted(VERIFIED_RECURRENT))})"
        )
    elif recurrent:
        # Exact by snapshot + replay when every recurrent (or conv) state lives in a transformers linear-attention
        # cache layer and is written by one mixer module that takes the cache as an argument.
        mixers = find_mixers(model) if model is not None else _mixer_layer_ids(model_class, config)
        missing = sorted(set(recurrent) - set(mixers))
        if missing:
            why = f"no mixer module that can be replayed writes the recurrent state of layers {missing}"
    if why:
        return (
            f"{name} keeps recurrent (SSM / linear-attention) state that flashdraft cannot roll back exactly "
            f"({why}), so speculative decoding would not be exact; flashdraft refuses it"
        )
    import transformers.cache_utils as cu

    stateless = getattr(cu, "DummyLayer", ())  # layers that reuse another layer's KV (gemma-4) or hold none
    for i, layer in enumerate(layers):
        # A layer class a model defines for itself (DeepSeek-V4's compressor caches derive from the sliding-window
        # layer) holds state that a crop does not roll back.
        own = type(layer).__module__ != cu.__name__
        if own or (not isinstance(layer, (dynamic, stateless)) and not is_recurrent_layer(layer)):
            return (
                f"{name} layer {i} uses a {type(layer).__name__} cache that flashdraft cannot roll back exactly; "
                "flashdraft refuses it"
            )
    return None


def _own_cache(model_class: type | None) -> str | None:
    """Why a model class keeps its context outside a transformers `DynamicCache`, if it does: its forward takes no
    cache (GPT-1: it recomputes the context), or it declines the default cache for one of its own (RWKV's state,
    xLSTM, XLNet's mems; transformers 5.25 dropped the `_is_stateful` flag that named the recurrent ones)."""
    if model_class is None or getattr(model_class, "_is_stateful", False):
        return None
    params = inspect.signature(model_class.forward).parameters
    if not any(a in params for a in ("cache", "past_key_values", "cache_params")):
        return "takes no cache in its forward"
    supports = getattr(model_class, "_supports_default_dynamic_cache", None)
    try:
        declines = supports is not None and not supports()
    except TypeError:  # an instance method (older transformers)
        declines = False
    return "keeps its context in a cache of its own, not a transformers DynamicCache" if declines else None


def _is_sliding_layer(layer: Any) -> bool:
    import transformers.cache_utils as cu

    return isinstance(layer, cu.DynamicSlidingWindowLayer)


def _mixer_layer_ids(model_class: type | None, config: Any) -> list[int]:
    """Layer indices of the replayable mixers of a model of this class and config, found on a meta-device copy."""
    if model_class is None:
        return []
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # a model that cannot be built on the meta device: no mixer found, refused
        return []
    return sorted(find_mixers(model))


# ------------------------------------------------------------------------------------------------ exact rollback
def _linear_mixin() -> type | None:
    return _cache_classes()[2]


def is_recurrent_layer(layer: Any) -> bool:
    """A cache layer holding conv / recurrent state (possibly beside a KV cache, as in Falcon-H1)."""
    linear = _linear_mixin()
    return linear is not None and isinstance(layer, linear)


def has_recurrent_layers(config: Any) -> bool:
    return any(is_recurrent_layer(layer) for layer in cache_layers(config))


def has_kv(layer: Any) -> bool:
    """A cache layer with a KV cache (keys/values over token columns)."""
    _, base, _ = _cache_classes()
    return base is None or isinstance(layer, base)


def find_mixers(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    """The modules that read and write each recurrent cache layer, by layer index, with the name of their cache
    argument: per layer, the innermost module with that `layer_idx` whose forward takes `cache_params`
    (GatedDeltaNet, Mamba, Mamba2 mixers) or, failing that, `past_key_values` or `cache` (the one name every
    module's cache argument has from transformers 5.24 on) and is no attention module (LFM2's short convolution)."""
    recurrent = {i for i, layer in enumerate(cache_layers(model.config)) if is_recurrent_layer(layer)}
    found: dict[str, tuple[nn.Module, str]] = {}
    for name, m in model.named_modules():
        if getattr(m, "layer_idx", None) not in recurrent:
            continue
        params = inspect.signature(m.forward).parameters
        arg = next((a for a in ("cache_params", "past_key_values", "cache") if a in params), None)
        if arg is not None:
            found[name] = (m, arg)
    inner = {n: v for n, v in found.items() if not any(o.startswith(n + ".") for o in found)}
    mixers: dict[int, tuple[nn.Module, str]] = {}
    for m, arg in inner.values():
        if arg != "cache_params" and "attention" in type(m).__name__.lower():
            continue
        if m.layer_idx not in mixers or arg == "cache_params":
            mixers[m.layer_idx] = (m, arg)
    return mixers


@dataclass
class _Snapshot:
    """One recurrent layer's state before a verify forward, and what its mixer was called with."""

    conv: dict[int, torch.Tensor | None]
    recurrent: dict[int, torch.Tensor | None]
    arguments: dict[str, Any]  # the mixer's bound arguments (hidden_states [b, n, H], masks, ...)
    cache_arg: str
    # Stepwise mode: the layer's (conv, recurrent) states after each token of the block.
    positions: list[tuple[dict, dict]] | None = None


class _ReplayCache:
    """What a mixer sees during a replay: the snapshot state of some rows of one layer, updated as a
    transformers `LinearAttentionLayer` would be (no past recording)."""

    def __init__(self, conv: dict, recurrent: dict, kernel: dict) -> None:
        self.conv, self.recurrent, self.kernel = conv, recurrent, kernel

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv.get(state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent.get(state_idx)

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return True

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """transformers >= 5.25: how many per-token recurrent states to return; none, as nothing is recorded."""
        return 0

    def increase_count(self, layer_idx: int, state_idx: int) -> None:
        """transformers >= 5.25: a one-token step updated the conv state in place and counts its token. A replay
        keeps no count; decoding never reads the live layers' counts either: the engine gives the model its positions."""

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        full = torch.cat([self.conv[state_idx], conv_states], dim=-1)
        self.conv[state_idx] = full[..., -self.kernel[state_idx] :]
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        self.recurrent[state_idx] = recurrent_states
        return recurrent_states

    @property
    def layers(self) -> _ReplayLayers:
        """transformers < 5.18: mixers read `cache_params.layers[layer_idx].conv_states[i]` (and
        `.recurrent_states[i]`, `.record_past`) instead of calling the getters."""
        return _ReplayLayers(self)


class _ReplayLayers:
    """Every layer index of a replay cache is its one layer: the snapshot's states, not recording."""

    record_past = False

    def __init__(self, cache: _ReplayCache) -> None:
        self.conv_states, self.recurrent_states = cache.conv, cache.recurrent

    def __getitem__(self, layer_idx: int) -> _ReplayLayers:
        return self


def _slice_rows(value: Any, rows: torch.Tensor, keep: int, batch: int, block: int) -> Any:
    """A recorded mixer argument for `rows` and the first `keep` of the block's `block` tokens."""
    if isinstance(value, torch.Tensor):
        if value.dim() >= 2 and value.shape[0] == batch and value.shape[1] == block:
            return value.index_select(0, rows.to(value.device))[:, :keep]
        if value.dim() == 1 and value.shape[0] == block:
            return value[:keep]
        if value.dim() >= 1 and value.shape[0] == batch:
            return value.index_select(0, rows.to(value.device))
        return value
    if isinstance(value, tuple):
        return tuple(_slice_rows(v, rows, keep, batch, block) for v in value)
    if isinstance(value, list):
        return [_slice_rows(v, rows, keep, batch, block) for v in value]
    if isinstance(value, dict):
        return {k: _slice_rows(v, rows, keep, batch, block) for k, v in value.items()}
    return value


class RecurrentRollback:
    """Exact rollback of recurrent state, in one of two modes.

    replay (as z-lab's MLX backend does for GatedDeltaNet): around a verify forward (`recording`), each recurrent
    mixer's layer state is copied just before the mixer runs, and the mixer's inputs are kept. After acceptance
    (`keep`), a row that keeps k < n of the block's n tokens gets its layer state back from the copy and the mixer
    re-run over its first k tokens only: the state the target would have after the accepted tokens alone. Rows that
    keep the whole block cost nothing; rows that keep the same k are replayed together. Only the mixers run again,
    not the MLPs, attention layers or the LM head.

    stepwise (the per-position snapshots of vLLM and SGLang): for mixers whose multi-token path cannot continue from
    a cached state (transformers' Mamba-1 mixers, as in Jamba, restart their scan from zero), the verify runs each
    mixer one token at a time, through its single-token decode path, and keeps the state after every token; `keep`
    puts back the one at the kept length. `stepwise` is set by the caller (`Target` probes the model).
    """

    def __init__(self, model: nn.Module) -> None:
        found = find_mixers(model)
        self.mixers = {i: m for i, (m, _) in found.items()}
        self._cache_args = {i: arg for i, (_, arg) in found.items()}
        self._signatures = {i: inspect.signature(m.forward) for i, m in self.mixers.items()}
        self._snapshots: dict[int, _Snapshot] = {}
        self._cache: Any = None
        self._block = 0
        self._replaying = False
        self.stepwise = False

    @contextmanager
    def recording(self, cache: Any, block: int):
        """Record the mixers' states and inputs during one verify forward of `block` tokens per row."""
        self._snapshots, self._cache, self._block = {}, cache, block
        handles = [
            m.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True) for i, m in self.mixers.items()
        ]
        if self.stepwise:
            for i, m in self.mixers.items():
                m.forward = self._stepwise_forward(i, m.forward)
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            if self.stepwise:
                for m in self.mixers.values():
                    del m.forward

    def _stepwise_forward(self, layer_idx: int, forward):
        def run(*args: Any, **kwargs: Any) -> torch.Tensor:
            arguments = dict(self._signatures[layer_idx].bind(*args, **kwargs).arguments)
            extra = arguments.pop("kwargs", {}) or {}
            batch, block = arguments["hidden_states"].shape[:2]
            snap = self._snapshots[layer_idx]
            snap.positions = []
            layer = self._cache.layers[layer_idx]
            states = range(layer.number_of_states)
            outputs = []
            for j in range(block):
                step = {k: _slice_position(v, j, batch, block) for k, v in arguments.items()}
                outputs.append(
                    forward(**step, **{k: _slice_position(v, j, batch, block) for k, v in extra.items()})
                )
                snap.positions.append(
                    (
                        {s: _clone(layer.conv_states[s]) for s in states if layer.conv_states[s] is not None},
                        {
                            s: _clone(layer.recurrent_states[s])
                            for s in states
                            if layer.recurrent_states[s] is not None
                        },
                    )
                )
            return torch.cat(outputs, dim=1)

        return run

    def _pre_hook(self, layer_idx: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._replaying:
                return
            bound = self._signatures[layer_idx].bind(*args, **kwargs)
            arguments = dict(bound.arguments)
            layer = self._cache.layers[layer_idx]
            states = range(layer.number_of_states)
            self._snapshots[layer_idx] = _Snapshot(
                conv={s: _clone(layer.conv_states[s]) for s in states if layer.has_previous_state[s]},
                recurrent={
                    s: _clone(layer.recurrent_states[s]) for s in states if layer.has_previous_state[s]
                },
                arguments=arguments,
                cache_arg=self._cache_args[layer_idx],
            )

        return hook

    @torch.no_grad()
    def keep(self, cache: Any, keep: Sequence[int]) -> None:
        """Row i keeps the first keep[i] tokens of the block just verified (0 <= keep[i] <= block)."""
        snapshots, block = self._snapshots, self._block
        self._snapshots, self._cache = {}, None
        if not snapshots:
            return
        by_length: dict[int, list[int]] = {}
        for row, k in enumerate(keep):
            if not 0 <= k <= block:
                raise ValueError(f"row {row} keeps {k} tokens of a {block}-token block")
            if k < block:
                by_length.setdefault(k, []).append(row)
        if not by_length:
            return
        batch = len(keep)
        self._replaying = True
        try:
            for layer_idx, snap in snapshots.items():
                if not snap.recurrent and not snap.conv:
                    continue
                layer = cache.layers[layer_idx]
                mixer = self.mixers[layer_idx]
                for k, rows in by_length.items():
                    idx = torch.tensor(rows, dtype=torch.long, device=layer.device)
                    if snap.positions is not None and k > 0:  # stepwise: the state after k tokens was kept
                        conv, rec = snap.positions[k - 1]
                        for s, t in conv.items():
                            layer.conv_states[s][idx] = t.index_select(0, idx)
                        for s, t in rec.items():
                            layer.recurrent_states[s][idx] = t.index_select(0, idx)
                        continue
                    conv = {s: t.index_select(0, idx) for s, t in snap.conv.items() if t is not None}
                    rec = {s: t.index_select(0, idx) for s, t in snap.recurrent.items() if t is not None}
                    replay = _ReplayCache(conv, rec, dict(layer.conv_kernel_size))
                    if k > 0:  # k == 0: the state before the block, as it was
                        arguments = {
                            name: replay
                            if name == snap.cache_arg
                            else _slice_rows(value, idx, k, batch, block)
                            for name, value in snap.arguments.items()
                        }
                        kwargs = arguments.pop("kwargs", {}) or {}
                        mixer(**arguments, **kwargs)
                    for s, t in replay.conv.items():
                        layer.conv_states[s][idx] = t.to(layer.conv_states[s].dtype)
                    for s, t in replay.recurrent.items():
                        layer.recurrent_states[s][idx] = t.to(layer.recurrent_states[s].dtype)
        finally:
            self._replaying = False


def _slice_position(value: Any, j: int, batch: int, block: int) -> Any:
    """A mixer argument for token j of the block alone (stepwise mode)."""
    if isinstance(value, torch.Tensor):
        if value.dim() >= 2 and value.shape[0] == batch and value.shape[1] == block:
            return value[:, j : j + 1]
        if value.dim() == 1 and value.shape[0] == block:
            return value[j : j + 1]
        return value
    if isinstance(value, tuple):
        return tuple(_slice_position(v, j, batch, block) for v in value)
    if isinstance(value, list):
        return [_slice_position(v, j, batch, block) for v in value]
    if isinstance(value, dict):
        return {k: _slice_position(v, j, batch, block) for k, v in value.items()}
    return value


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


# ------------------------------------------------------------------------------------------------ batch rows
def select_rows(layer: Any, idx: torch.Tensor) -> None:
    """Keep only these rows (in this order) of a recurrent layer's state."""
    for s in range(layer.number_of_states):
        if layer.conv_states[s] is not None:
            layer.conv_states[s] = layer.conv_states[s].index_select(0, idx.to(layer.conv_states[s].device))
        if layer.recurrent_states[s] is not None:
            layer.recurrent_states[s] = layer.recurrent_states[s].index_select(
                0, idx.to(layer.recurrent_states[s].device)
            )


def append_rows(big: Any, small: Any) -> None:
    """Append the rows of `small`'s recurrent state (a freshly prefilled row) to `big`'s."""
    for s in range(big.number_of_states):
        for name in ("conv_states", "recurrent_states"):
            a, b = getattr(big, name)[s], getattr(small, name)[s]
            if b is not None:
                getattr(big, name)[s] = b if a is None else torch.cat([a, b.to(a.dtype)], dim=0)
