"""Any Hugging Face decoder-only causal LM seen through what DFlash needs from it.

The drafter borrows four things from its frozen target: the token embedding (block inputs), the LM head (draft
logits), the outputs of a few decoder layers (the context features), and a KV cache that can be rolled back after
a partially rejected block. `Target` provides exactly these, for Llama, Qwen2/3, Mistral, Gemma and any other
`AutoModelForCausalLM` whose decoder layers sit in one `nn.ModuleList`.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..kernels.plan import KernelPlan, make_plan, prepare_model
from ..kernels.quantize import prefill as quantize_prefill
from .capabilities import static_refusal
from .devices import DTYPE_ALIASES, DTYPES, default_device, default_dtype, parse_device, parse_dtype  # noqa: F401
from .model_parts import (  # TargetError lives there (decoder_layers raises it); the package imports it from here
    TargetError,
    causal_lm_class,
    decoder_layers,
    final_norm,
    image_text_class,
    mrope_refusal,
)

log = logging.getLogger(__name__)


class DraftTargetMismatchError(TargetError):
    """The drafter was not made for this target (sizes, vocabulary, layer taps)."""


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [b, n, V] (float32)
    features: torch.Tensor | None  # [b, n, len(tap_layer_ids) * H], outputs of the tapped decoder layers
    # (argmax [b, n], non-finite [b, n]) of the logits where the verify computed them with the logits (the static
    # cache's verify: one pass over the logits inside its graph); None: the greedy accept computes them
    greedy: tuple[torch.Tensor, torch.Tensor] | None = None


class Target:
    """A frozen target model: `embed`, `lm_head_logits`, `forward` with layer taps, and cache rollback."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        name: str | None = None,
        processor: Any = None,
        plan: KernelPlan | None = None,
    ) -> None:
        """`processor` (image-text targets): the Hugging Face processor that turns images and text into the model's
        inputs (multimodal.py); its tokenizer is the target's when `tokenizer` is None. `plan`: the kernels it runs
        on (kernels/plan.py, `load_target` makes it before loading); None: planned for the model as it is given
        (its device, dtype and quantization, eager, its linears packed only if they are)."""
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.processor = processor
        self.tokenizer = tokenizer if tokenizer is not None else getattr(processor, "tokenizer", None)
        template = getattr(processor, "chat_template", None)
        if template and self.tokenizer is not None and not getattr(self.tokenizer, "chat_template", None):
            self.tokenizer.chat_template = template  # an image-text checkpoint keeps it with its processor
        self.name = name or getattr(model.config, "_name_or_path", None) or type(model).__name__
        cfg = model.config
        self.config = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.num_layers = int(self.config.num_hidden_layers)
        self.layers = decoder_layers(model, self.num_layers)
        self.embed_tokens = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        if self.lm_head is None:
            raise TargetError(f"{type(model).__name__} has no LM head: flashdraft needs a causal LM")
        self.hidden_size = int(self.embed_tokens.weight.shape[1])
        self.vocab_size = int(self.embed_tokens.weight.shape[0])  # embedding rows (may exceed the tokenizer)
        self._final_norm = final_norm(model)
        self._softcap = getattr(self.config, "final_logit_softcapping", None)
        # Old transformers scaled Gemma embeddings in the model forward, not in the embedding module.
        self._embed_scale = 1.0
        if getattr(self.config, "model_type", "") in ("gemma", "gemma2") and not hasattr(
            self.embed_tokens, "embed_scale"
        ):
            self._embed_scale = self.hidden_size**0.5
        params = inspect.signature(model.forward).parameters
        self._takes_positions = "position_ids" in params  # recurrent-only models (Mamba2) have no positions
        self.takes_cache_position = "cache_position" in params  # transformers 4.x: compiled.VerifyForward
        # The cache argument: `cache` from transformers 5.24 on (every model; the old names are deprecated there, and
        # Mamba2 ignores `past_key_values`), `cache_params` for older recurrent-only models, else `past_key_values`.
        self._cache_arg = next((a for a in ("cache", "cache_params") if a in params), None)
        if self._cache_arg == "cache_params" and "past_key_values" in params:
            self._cache_arg = None
        # Image-text targets (multimodal.py): the model takes pixels in its prefill; multimodal RoPE (Qwen-VL, Qwen3.5,
        # GLM-4V) is the module keeping `rope_deltas`, the shift of text positions after an image.
        self.takes_images = "pixel_values" in params
        self._mrope = next(
            (m for m in model.modules() if hasattr(m, "get_rope_index") and hasattr(m, "rope_deltas")), None
        )
        self._logits_to_keep_arg = next(
            (a for a in ("logits_to_keep", "num_logits_to_keep") if a in params), None
        )
        from .recurrent import RecurrentRollback, decoding_support, has_recurrent_layers

        # None: decoding is exact here
        support = decoding_support(model.config, type(model), model)
        self.unsupported_reason = support or mrope_refusal(model, self._mrope)
        # Recurrent state (GatedDeltaNet, Mamba): rolled back by snapshot + replay, not by a crop.
        self.recurrent = (
            RecurrentRollback(model)
            if self.unsupported_reason is None and has_recurrent_layers(model.config)
            else None
        )
        self._continues: bool | None = None  # probed on the first verify of a recurrent target
        if plan is None:  # the model as it is given: its linears packed for oneDNN only if they are already
            from ..kernels.packed_linear import is_packed
            from ..kernels.quantize import quantization_of

            plan = make_plan(self.device, self.dtype, quantization_of(model), pack_linears=is_packed(model))
        self.plan = plan
        self.use_plan(plan)

    def use_plan(self, plan: KernelPlan) -> KernelPlan:
        """Run on `plan`'s kernels from now on: the plan fitted to this target (a family the static cache does not
        serve decodes eagerly, the plan's `compile_note` saying why) and the model's modules prepared by it, before
        anything is traced. Returns the plan kept (`self.plan`)."""
        if plan.static_cache and (reason := static_refusal(self)) is not None:
            plan = plan.declined(f"{self.name} has {reason}, which the static cache does not serve")
        self.plan = plan
        if prepare_model(self.model, plan):  # the head packed or unpacked: read it again
            self.lm_head = self.model.get_output_embeddings()
        return plan

    @property
    def quantize(self) -> str | None:
        """The quantization scheme of its linear layers ("int8", "w8a8", "w8a16", "fp16"; kernels/quantize.py), or
        None: what the cost model and the reports key on."""
        return self.plan.quantize

    def check_decodable(self) -> None:
        """Refuse, before anything is decoded, a target whose cache cannot be rolled back exactly (training, which
        keeps no cache, is unaffected)."""
        if self.unsupported_reason is not None:
            raise TargetError(f"cannot decode with target {self.name}: {self.unsupported_reason}")

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", None) or 1 << 30)

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids from the generation config (chat models often stop on several)."""
        ids: Any = None
        gen = getattr(self.model, "generation_config", None)
        if gen is not None:
            ids = gen.eos_token_id
        if ids is None:
            ids = getattr(self.config, "eos_token_id", None)
        if ids is None and self.tokenizer is not None:
            ids = self.tokenizer.eos_token_id
        if ids is None:
            return []
        return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]

    # ------------------------------------------------------------------ what the drafter borrows
    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """What the target's first decoder layer would receive for these ids (module scaling included)."""
        # Some embeddings carry an extra `embed_norm` that must not be applied to DFlash block inputs
        # (transformers' own DFlash candidate generator bypasses it the same way).
        embed_norm = getattr(self.embed_tokens, "embed_norm", None)
        if embed_norm is not None:
            self.embed_tokens.embed_norm = nn.Identity()
        try:
            out = self.embed_tokens(input_ids)
        finally:
            if embed_norm is not None:
                self.embed_tokens.embed_norm = embed_norm
        return out * self._embed_scale if self._embed_scale != 1.0 else out

    @property
    def input_embedding_scale(self) -> float:
        """The factor `embed` applies to the raw embedding rows (Gemma's sqrt(H), 1 for most families): what a
        drafter made for this target writes as its `input_embedding_scale`."""
        module_scale = getattr(self.embed_tokens, "embed_scale", 1.0)
        return float(module_scale) * self._embed_scale

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = getattr(self.lm_head, "compute_dtype", None) or self.lm_head.weight.dtype  # int8: bf16 inputs
        logits = self.lm_head(hidden.to(dtype)).float()
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    # ------------------------------------------------------------------ forward with layer taps
    def new_cache(self) -> Any:
        from transformers import DynamicCache

        try:
            cache = DynamicCache(config=self.model.config)
        except TypeError:  # transformers < 4.56
            return DynamicCache()
        if hasattr(cache, "activate_past_recording"):
            # transformers 5.x. A sliding-window KV layer becomes a full one: the model applies the window through
            # the attention mask, and a full layer crops without a recorded past (a recording sliding layer of
            # transformers < 5.18 hands attention more keys than its mask describes). Conv-only layers (LFM2) keep
            # their past so a rejected block can be cropped; recurrent layers are rolled back by `keep` instead.
            from transformers.cache_utils import DynamicLayer

            from .recurrent import has_kv, is_recurrent_layer

            for i, layer in enumerate(cache.layers):
                if self.recurrent is not None and is_recurrent_layer(layer):
                    continue
                if getattr(layer, "is_sliding", False) and has_kv(layer):
                    cache.layers[i] = DynamicLayer()
                elif hasattr(layer, "activate_past_recording"):
                    layer.activate_past_recording()
            return cache
        # transformers 4.x: sliding-window cache layers cannot be rolled back once past their window. A full cache
        # can, and stays correct: the model applies its window through the attention mask.
        return DynamicCache()

    @contextmanager
    def _taps(self, tap_layer_ids: Sequence[int]):
        captured: dict[int, torch.Tensor] = {}
        handles = []
        for layer_id in dict.fromkeys(tap_layer_ids):

            def hook(_module, _args, output, layer_id=layer_id):
                captured[layer_id] = output[0] if isinstance(output, tuple) else output

            handles.append(self.layers[layer_id].register_forward_hook(hook))
        try:
            yield captured
        finally:
            for h in handles:
                h.remove()

    @property
    def multimodal_rope(self) -> bool:
        """Whether positions are multimodal RoPE's (an image shifts the text after it): a decode step then always
        gets explicit positions (`model_positions`), never the model's defaults, which follow its last prefill."""
        return self._mrope is not None

    def rope_offset(self, inputs: dict[str, Any] | None) -> int:
        """After a prefill with `inputs` (the processor's outputs besides the ids): how far this row's text
        positions are shifted from its token indices (multimodal RoPE counts an image's tokens as fewer positions;
        0 for other targets and for prompts without images)."""
        if self._mrope is None or not inputs or self._mrope.rope_deltas is None:
            return 0
        if not any(k.endswith("grid_thw") for k in inputs):
            return 0
        return int(self._mrope.rope_deltas.reshape(-1)[0])

    def model_positions(self, positions: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
        """What the model is given as position ids for tokens at indices `positions` [b, n]: those indices, or with
        multimodal RoPE the [4, b, n] form (the indices for the mask, then the three rotary components shifted by
        each row's `offsets` [b] from `rope_offset`)."""
        if self._mrope is None:
            return positions
        shifted = positions if offsets is None else positions + offsets.to(positions.device)[:, None]
        return torch.stack([positions, shifted, shifted, shifted])

    def model_kwargs(
        self, cache: Any | None, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> dict[str, Any]:
        """The model's keyword arguments for a forward after `cache` (its name for the cache, explicit positions
        where it takes them: in a batch rows hold different numbers of tokens)."""
        kwargs: dict[str, Any] = {self._cache_arg or "past_key_values": cache, "use_cache": cache is not None}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if position_ids is not None and self._takes_positions:
            kwargs["position_ids"] = position_ids
        return kwargs

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: Any | None,
        tap_layer_ids: Sequence[int] = (),
        last_logits_only: bool = False,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs: dict[str, Any] | None = None,
        prefill: bool = False,
    ) -> TargetOutput:
        """Run the target on `input_ids` after what `cache` holds (None: no cache, as in training); tap the
        outputs of `tap_layer_ids`. `inputs`: the processor's other outputs for an image prompt (pixel values, image
        grids, token types), given to the model with the ids (a prefill). `prefill`: the ids are a prompt, which
        every method prefills alike, so an int8 model may run its wide GEMMs otherwise than a decode step's
        (quantize.prefill).

        A tap of layer i equals Hugging Face `hidden_states[i + 1]` (for the last layer that includes the final
        norm, as in HF), without materialising every layer's states.
        """
        kwargs = self.model_kwargs(cache, attention_mask, position_ids)
        if inputs:
            kwargs.update(inputs)
        if last_logits_only and self._logits_to_keep_arg:
            kwargs[self._logits_to_keep_arg] = self._last_position(input_ids, tap_layer_ids)
        record = self.recurrent is not None and cache is not None and self._has_state(cache)
        with (
            self._taps(tap_layer_ids) as captured,
            self._recording(cache, input_ids.shape[1], record),
            quantize_prefill() if prefill and self.quantize in ("int8", "w8a16") else nullcontext(),
        ):
            out = self.model(input_ids=input_ids, **kwargs)
        features = self._concat_taps(captured, tap_layer_ids) if tap_layer_ids else None
        logits = out.logits
        if last_logits_only:
            logits = logits[:, -1:]
        return TargetOutput(logits=logits.float(), features=features)

    @torch.no_grad()
    def features(
        self, input_ids: torch.Tensor, tap_layer_ids: Sequence[int], inputs: dict[str, Any] | None = None
    ) -> torch.Tensor:
        """The tapped features alone (training): runs the decoder stack without the LM head, which on bf16 CPUs
        would also copy the whole head weight on every call. (Stopping the forward early by raising from a hook
        crashed gloo DDP workers now and then, so the few layers above the deepest tap still run.) With `inputs`
        (a sequence whose prompt had images: `multimodal.sequence_image_inputs`) the whole model runs, vision tower
        included, its head over the last token only where the model allows."""
        if inputs:
            kwargs = dict(inputs, use_cache=False)
            if self._logits_to_keep_arg:
                kwargs[self._logits_to_keep_arg] = self._last_position(input_ids, tap_layer_ids)
            with self._taps(tap_layer_ids) as captured:
                self.model(input_ids=input_ids, **kwargs)
            return self._concat_taps(captured, tap_layer_ids)
        get_decoder = getattr(self.model, "get_decoder", None)
        decoder = get_decoder() if callable(get_decoder) else None
        with self._taps(tap_layer_ids) as captured:
            (decoder if isinstance(decoder, nn.Module) else self.model)(input_ids=input_ids, use_cache=False)
        return self._concat_taps(captured, tap_layer_ids)

    @staticmethod
    def _last_position(input_ids: torch.Tensor, tap_layer_ids: Sequence[int]) -> int | torch.Tensor:
        """`logits_to_keep` for the last position's logits alone: 1, or with layers tapped that position as an
        index tensor. Given the integer, Gemma-4 runs its KV-sharing layers (its last `num_kv_shared_layers`) over
        the kept positions only, and a tap of one of those layers would hold one position instead of all of them."""
        if not tap_layer_ids:
            return 1
        return torch.tensor([input_ids.shape[1] - 1], device=input_ids.device)

    def _concat_taps(self, captured: dict[int, torch.Tensor], tap_layer_ids: Sequence[int]) -> torch.Tensor:
        """[..., len(taps) * H] in tap order; the last layer gets the final norm, as HF `hidden_states[-1]`."""
        feats = []
        for i in tap_layer_ids:
            h = captured[i]
            if i == self.num_layers - 1:
                if self._final_norm is None:
                    raise TargetError("cannot tap the last layer: the final norm of this model was not found")
                h = self._final_norm(h)
            feats.append(h)
        return torch.cat(feats, dim=-1)

    @staticmethod
    def cache_length(cache: Any) -> int:
        return int(cache.get_seq_length())

    # ------------------------------------------------------------------ rollback
    def _has_state(self, cache: Any) -> bool:
        """Whether a recurrent cache already holds a state (after prefill): only then is a forward a verify."""
        from .recurrent import is_recurrent_layer

        return any(is_recurrent_layer(layer) and layer.has_previous_state[0] for layer in cache.layers)

    @contextmanager
    def _recording(self, cache: Any, block: int, record: bool):
        if not record:
            yield
            return
        self.rollback_mode()
        with self.recurrent.recording(cache, block):
            yield

    def rollback_mode(self) -> str | None:
        """How this target's recurrent state is rolled back: "replay", "stepwise" (probed once), or None (no
        recurrent state: KV crops only)."""
        if self.recurrent is None:
            return None
        if self._continues is None:
            self._continues = self._continues_from_state()
            self.recurrent.stepwise = not self._continues
        return "stepwise" if self.recurrent.stepwise else "replay"

    @torch.no_grad()
    def _continues_from_state(self) -> bool:
        """Whether a multi-token forward after a cached prefix gives what one forward over everything gives. Some
        transformers mixers (Mamba-1, as in Jamba) restart their scan from zero instead: the engine then verifies
        their tokens one at a time (`RecurrentRollback.stepwise`)."""
        ids = (torch.arange(3, 11, device=self.device) * 7 % max(self.vocab_size - 3, 1) + 3)[None]
        full = self.forward(ids, None).logits[0, 5:]
        cache = self.new_cache()
        self.model(input_ids=ids[:, :5], **{self._cache_arg or "past_key_values": cache, "use_cache": True})
        part = self.model(
            input_ids=ids[:, 5:], **{self._cache_arg or "past_key_values": cache, "use_cache": True}
        )
        error = (part.logits[0].float() - full).abs().max()
        return bool(error <= 0.02 * full.abs().max() + 1e-3)

    def keep(self, cache: Any, keep: Sequence[int]) -> None:
        """After a verify forward of n tokens per row: row i keeps the first keep[i] of them in its recurrent state
        (snapshot + replay). KV layers are rolled back by `crop` (or masked, in a batch); this is their twin for
        recurrent layers, a no-op for targets without any."""
        if self.recurrent is not None:
            self.recurrent.keep(cache, keep)

    def crop(self, cache: Any, length: int) -> None:
        """Roll the KV cache back to `length` tokens (works with transformers 4.57 and 5.x `crop` semantics).
        Recurrent layers are left to `keep`."""
        if self.recurrent is not None:
            return self._crop_kv_layers(cache, length)
        remove = int(cache.get_seq_length()) - length
        if remove < 0:
            raise TargetError(f"cannot crop a cache of {cache.get_seq_length()} tokens to {length}")
        if remove == 0:
            return
        try:
            # Negative = tokens to remove: the only form 5.x accepts, and also understood by 4.57.
            cache.crop(-remove)
        except Exception as e:
            raise TargetError(
                f"the target's cache ({type(cache).__name__}) cannot be rolled back by {remove} tokens: {e}. "
                "Speculative decoding needs a rollback-capable cache (recurrent/hybrid targets are not supported yet)."
            ) from None
        if int(cache.get_seq_length()) != length:
            raise TargetError(f"cache rollback left {cache.get_seq_length()} tokens instead of {length}")

    @staticmethod
    def _crop_kv_layers(cache: Any, length: int) -> None:
        from transformers.cache_utils import DynamicLayer

        from .recurrent import has_kv

        for layer in cache.layers:
            if has_kv(layer) and layer.keys is not None:
                remove = layer.get_seq_length() - length
                if remove < 0:
                    raise TargetError(f"cannot crop a cache of {layer.get_seq_length()} tokens to {length}")
                if remove:
                    DynamicLayer.crop(layer, -remove)  # the KV part alone of a hybrid (Falcon-H1) layer

    # ------------------------------------------------------------------ compatibility checks
    def check_drafter(self, draft_config: Any) -> None:
        """Refuse a drafter that was not made for this target, naming the mismatch."""
        check_drafter_fits(draft_config, self.hidden_size, self.num_layers, self.vocab_size, self.name)

    # ------------------------------------------------------------------ prompts
    def encode_prompt(
        self,
        prompt: str | list[dict[str, str]],
        chat: bool = True,
        enable_thinking: bool | None = None,
        system: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """Token ids [1, n] for a prompt, through the chat template when the tokenizer has one (`template_kwargs`:
        extra variables for the template, as `chat_template_kwargs` in the OpenAI-compatible servers)."""
        if self.tokenizer is None:
            raise TargetError("this target has no tokenizer; pass token ids instead of text")
        ids = encode_chat(self.tokenizer, prompt, chat, enable_thinking, system, template_kwargs)
        return torch.tensor([ids], dtype=torch.long, device=self.device)


def encode_chat(
    tok: Any,
    prompt: str | list[dict[str, str]],
    chat: bool = True,
    enable_thinking: bool | None = None,
    system: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """A prompt's token ids through the tokenizer's chat template when it has one (every backend encodes so)."""
    if chat and getattr(tok, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        kwargs = dict(template_kwargs or {})
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        for reserved in ("conversation", "add_generation_prompt", "tokenize", "return_dict"):
            kwargs.pop(reserved, None)
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
    else:
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        ids = tok(text)["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return list(ids)


def check_drafter_fits(
    draft_config: Any, hidden_size: int, num_layers: int, vocab_size: int, target_name: str | None
) -> None:
    """Refuse a drafter whose config does not fit a target of these sizes (vocab_size = embedding rows).

    Needs only the two configs, so the CLI runs it before any weights are loaded."""
    c, name = draft_config, target_name or "the target"
    if c.hidden_size != hidden_size:
        raise DraftTargetMismatchError(
            f"drafter hidden size {c.hidden_size} != target hidden size {hidden_size}: "
            f"this drafter was made for a different target than {name}"
        )
    bad = [i for i in c.target_layer_ids if not 0 <= i < num_layers]
    if bad:
        raise DraftTargetMismatchError(
            f"drafter taps target layers {bad}, but {name} has only {num_layers} decoder layers "
            f"(valid ids 0..{num_layers - 1})"
        )
    if not 0 <= c.mask_token_id < vocab_size:
        raise DraftTargetMismatchError(
            f"drafter mask_token_id {c.mask_token_id} is outside the target's embedding rows (0..{vocab_size - 1})"
        )
    if c.vocab_size != vocab_size:
        raise DraftTargetMismatchError(
            f"vocabulary mismatch: drafter expects {c.vocab_size} tokens, target has {vocab_size}"
        )
    if c.num_target_layers != num_layers:
        warnings.warn(
            f"drafter was made for a {c.num_target_layers}-layer target, {name} has {num_layers} layers; "
            "acceptance will likely be low",
            stacklevel=3,
        )
    trained_for = (getattr(c, "flashdraft", None) or {}).get("target")
    if (
        trained_for and target_name and not str(target_name).endswith(trained_for)
    ):  # the same name ends with itself
        log.info("drafter was trained for %s, target is %s", trained_for, target_name)


def check_decodable_config(target_config: Any, target_name: str | None) -> None:
    """`Target.check_decodable` from a Hugging Face config of the target (no weights needed)."""
    from .recurrent import decoding_support

    reason = decoding_support(target_config)
    if reason is not None:
        raise TargetError(f"cannot decode with target {target_name or 'the target'}: {reason}")


def check_drafter_fits_config(draft_config: Any, target_config: Any, target_name: str | None) -> None:
    """`check_drafter_fits` from a Hugging Face config of the target (no weights needed)."""
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    sizes = int(tc.hidden_size), int(tc.num_hidden_layers), int(tc.vocab_size)
    check_drafter_fits(draft_config, *sizes, target_name)


def load_target(
    name_or_path: str,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    auto_fetch: bool = True,
    quantize: str | None = None,
    images: bool | None = None,
    pack_linears: bool = True,
    compiled: bool = False,
) -> Target:
    """Load a target by offline pack name (`smollm2-135m-instruct`, ...), local path or Hugging Face hub id;
    `quantize="int8"`: its linear layers int8 weight-only, bf16 activations (fp32 with `dtype="float32"`, for the
    compiled path); "fp16": fp16 weight-only, fp32 activations (CPU; quantize.py). `images`: load an
    image-text checkpoint whole, with its vision tower and processor, so prompts may carry images (multimodal.py);
    None: only where transformers has no text-only class for it (Qwen3-VL, LLaVA, Idefics3, ...), so a Qwen3.5
    composite loads its language model alone unless images are asked for. `pack_linears`: an fp32 target on a CPU
    runs its linear layers through oneDNN with packed weights (packed_linear.py; False for training). `compiled`: it
    will decode through `--compile`. What runs how is the kernel plan's choice (kernels/plan.py: the dtype left out
    too), made before any weight is read: what cannot run exactly is refused then, in one line."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from ..kernels.quantize import quantize as quantize_model
    from ..models.packs import resolve_model

    device = parse_device(device)
    plan = make_plan(device, parse_dtype(dtype), quantize, compiled, pack_linears=pack_linears)
    dtype = plan.dtype
    path = resolve_model(name_or_path, auto_fetch=auto_fetch)
    processor = None
    try:
        config = AutoConfig.from_pretrained(path)
        image_text = image_text_class(config)
        if images and image_text is None:
            raise TargetError(f"target {name_or_path!r} is a text-only model: it cannot take images")
        if image_text is not None and (images or not causal_lm_class(config)):
            from transformers import AutoProcessor

            model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
            try:
                processor = AutoProcessor.from_pretrained(path)
            except (OSError, ValueError):
                if images:
                    raise
                processor = None  # the processor is for images: text prompts need the tokenizer alone
            tokenizer = getattr(processor, "tokenizer", None) or AutoTokenizer.from_pretrained(path)
        else:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as e:
        if isinstance(e, TargetError):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TargetError(f"cannot load target {name_or_path!r}: {first}") from None
    model = model.to(device)
    if quantize:
        quantize_model(model, quantize)
    return Target(model, tokenizer, name=name_or_path, processor=processor, plan=plan)
