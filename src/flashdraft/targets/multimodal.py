"""Image prompts for image-text targets (Qwen3-VL, Qwen3.5/3.6 composites, Gemma-3, LLaVA, Idefics3/SmolVLM, ...).

An image only enters the prefill: the target's processor turns the images and the text into token ids, where each
image is a run of placeholder tokens, plus the pixels and whatever else the model's forward takes with them (image
grids, token types). The prefill runs the vision tower once and merges its output into those placeholders; every
step after it is the usual engine on token ids. The drafter sees the image through the target's hidden states at
the placeholder positions, like any other context.

    ImagePrompt        token ids [1, n] + the processor's other outputs (`inputs`), what the engine prefills
    as_prompt          token ids, an `ImagePrompt` or a processor's output (a mapping with `input_ids`) -> ids, inputs
    load_image         a file path, a `data:` URL, bytes or a PIL image -> an RGB image, or one clear `ImageError`
    encode_image_prompt   text or chat messages + images -> an `ImagePrompt`, through the processor's chat template
    image_refs / sequence_image_inputs   a training row's images: recorded as files and hashes, and the prefill's
                       inputs redone from them for the trainer (`data.regenerate`, `Target.features`)

Multimodal RoPE (Qwen-VL, Qwen3.5, GLM-4V) counts an image's tokens as fewer positions than it has tokens, so the text
after it sits at shifted positions; the engine keeps that shift per row (`Target.rope_offset`) and gives the model
explicit positions on every step (`Target.model_positions`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .target import Target, TargetError

MAX_IMAGE_BYTES = 32 * 2**20  # an encoded image larger than this is refused before it is decoded
MAX_IMAGE_PIXELS = 50_000_000  # decoded width x height (about 7000 x 7000), Pillow's own bomb limit is 89 M


class ImageError(TargetError):
    """An image that cannot be used: unreadable, too large, remote, or given to a text-only target."""


@dataclass
class ImagePrompt:
    """A prompt with images, as the engine prefills it: `input_ids` [1, n] (each image a run of placeholder tokens)
    and `inputs`, the processor's other outputs for the model's forward (pixel_values, image_grid_thw, ...); `text`,
    what the processor was given (its chat template's output), where `encode_image_prompt` made it."""

    input_ids: torch.Tensor
    inputs: dict[str, Any] = field(default_factory=dict)
    text: str | None = None

    @property
    def shape(self) -> torch.Size:
        return self.input_ids.shape


def as_prompt(prompt: Any) -> tuple[Any, dict[str, Any] | None]:
    """(token ids, the model's other prefill inputs or None) for a prompt given as token ids, an `ImagePrompt`, or
    a processor's output (a mapping holding `input_ids`; its attention mask is dropped: one row has no padding)."""
    if isinstance(prompt, ImagePrompt):
        return prompt.input_ids, dict(prompt.inputs) or None
    if isinstance(prompt, Mapping):
        if "input_ids" not in prompt:
            raise ImageError("a prompt given as a mapping must hold the processor's `input_ids`")
        inputs = {
            k: v for k, v in prompt.items() if k not in ("input_ids", "attention_mask") and v is not None
        }
        return prompt["input_ids"], inputs or None
    return prompt, None


def refuse_images(target: Target, inputs: dict[str, Any] | None) -> None:
    """An `ImageError` for prefill inputs given to a target that takes no images."""
    if inputs and not target.takes_images:
        raise ImageError(f"target {target.name} is a text-only model: it cannot take images")


def check_prompt_inputs(target: Target, inputs: dict[str, Any] | None) -> dict[str, Any] | None:
    """The prefill inputs on the target's device, pixels in its dtype; refused for a target that takes no images."""
    if not inputs:
        return None
    refuse_images(target, inputs)
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            v = v.to(target.device, dtype=target.dtype if v.is_floating_point() else v.dtype)
        out[k] = v
    return out


# ---------------------------------------------------------------------------------------------------------- images
def load_image(source: Any, allow_files: bool = True, name: str | None = None) -> Any:
    """An RGB PIL image from a path, a `data:image/...;base64,` URL, raw bytes or a PIL image. Remote URLs are not
    fetched (`ImageError`), nor local files unless `allow_files`."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:  # pragma: no cover - pillow comes with the `vision` extra
        raise ImageError("images need Pillow: pip install 'flashdraft[vision]'") from None
    label = name or (str(source)[:60] if isinstance(source, (str, Path)) else type(source).__name__)
    if isinstance(source, Image.Image):
        return _checked(source, label).convert("RGB")
    if isinstance(source, Path):
        source = str(source)
    if isinstance(source, str):
        if source.startswith("data:"):
            data = _data_url(source, label)
        elif source.startswith(("http://", "https://")):
            raise ImageError(
                f"image {label}: remote URLs are not fetched (this server reads no network); send it as a data: URL"
            )
        else:
            if not allow_files:
                raise ImageError(
                    f"image {label}: local files are not read unless the server is started with --allow-local-images"
                )
            path = Path(source.removeprefix("file://")).expanduser()
            if not path.is_file():
                raise ImageError(f"image {label}: no such file")
            if path.stat().st_size > MAX_IMAGE_BYTES:
                raise ImageError(f"image {label}: {path.stat().st_size} bytes, more than {MAX_IMAGE_BYTES}")
            data = path.read_bytes()
    elif isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    else:
        raise ImageError(f"image {label}: give a path, a data: URL, bytes or a PIL image")
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"image {label}: {len(data)} bytes, more than {MAX_IMAGE_BYTES}")
    try:
        image = Image.open(io.BytesIO(data))
        _checked(image, label)
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        raise ImageError(f"image {label}: not an image Pillow can decode") from None
    return image.convert("RGB")


def _checked(image: Any, label: str) -> Any:
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageError(f"image {label}: {width}x{height} pixels, more than {MAX_IMAGE_PIXELS}")
    if width < 1 or height < 1:
        raise ImageError(f"image {label}: empty ({width}x{height})")
    return image


def _data_url(url: str, label: str) -> bytes:
    head, _, payload = url.partition(",")
    if not head.startswith("data:image/") or ";base64" not in head or not payload:
        raise ImageError(f"image {label}: a data URL must be data:image/<type>;base64,<data>")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageError(f"image {label}: more than {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"image {label}: the data URL is not valid base64") from None


# ---------------------------------------------------------------------------------------------------------- prompts
def image_messages(
    prompt: str | Sequence[dict[str, Any]], count: int, system: str | None = None
) -> list[dict[str, Any]]:
    """Chat messages in the processors' content-part form: a text prompt becomes one user turn with `count` image
    parts before its text; messages keep their parts (`{"type": "image"}` where an image goes)."""
    if isinstance(prompt, str):
        messages = [
            {
                "role": "user",
                "content": [*({"type": "image"} for _ in range(count)), {"type": "text", "text": prompt}],
            }
        ]
    else:
        messages = [dict(m) for m in prompt]
        for m in messages:
            if isinstance(m.get("content"), str):
                m["content"] = [{"type": "text", "text": m["content"]}]
    if system is not None:
        messages = [{"role": "system", "content": [{"type": "text", "text": system}]}, *messages]
    return messages


def encode_image_prompt(
    target: Target,
    prompt: str | Sequence[dict[str, Any]],
    images: Sequence[Any],
    system: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> ImagePrompt:
    """An `ImagePrompt` for text (or chat messages whose content parts place the images) and `images` (as
    `load_image` takes them, in order), through the target's processor and its chat template."""
    if not target.takes_images:
        raise ImageError(f"target {target.name} is a text-only model: it cannot take images")
    if target.processor is None:
        raise ImageError(f"target {target.name} was loaded without an image processor (it has none saved, or was "
                         "loaded for text: --images): it cannot take images")  # fmt: skip
    pictures = [load_image(im) for im in images]
    messages = image_messages(prompt, len(pictures), system)
    placed = sum(1 for m in messages for part in m["content"] if part.get("type") in ("image", "image_url"))
    if placed != len(pictures):
        raise ImageError(f"the messages place {placed} image(s), but {len(pictures)} were given")
    processor = target.processor
    if getattr(processor, "chat_template", None):
        kwargs = {
            k: v for k, v in (template_kwargs or {}).items() if k not in ("tokenize", "add_generation_prompt")
        }
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    else:  # no template: each image's placeholder, then the text
        marker = getattr(processor, "image_token", None) or "<image>"
        text = marker * len(pictures) + "\n".join(
            part.get("text", "") for m in messages for part in m["content"] if part.get("type") == "text"
        )
    try:
        encoded = processor(text=[text], images=pictures or None, return_tensors="pt")
    except (ValueError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ImageError(f"the processor of {target.name} refused the images: {first}") from None
    ids, inputs = as_prompt(dict(encoded))
    return ImagePrompt(ids.long(), inputs or {}, text)


# -------------------------------------------------------------------------------------------------- training rows
def image_refs(images: Sequence[str]) -> list[dict[str, str]]:
    """How a training sequence records its images: each file's path and the sha256 of its bytes. No pixels are
    stored (a data set stays token ids); the trainer reads the files again (`sequence_image_inputs`), and the hash
    tells it when a file is no longer the one the target answered."""
    refs = []
    for source in images:
        if source.startswith(("data:", "http://", "https://")):
            raise ImageError(f"image {source[:40]}...: training rows take image files, not URLs")
        path = Path(source).expanduser()
        load_image(path, name=str(path))  # readable, an image, within limits: refused now, not mid-training
        refs.append({"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()})
    return refs


def sequence_image_inputs(
    target: Target, input_ids: torch.Tensor, images: Sequence[dict[str, str]], text: str
) -> dict[str, Any]:
    """The processor's other outputs (pixels, image grids, token types) for a stored training sequence [1, S] whose
    prompt had `images` (`image_refs`) and was the processor's `text`: the forward over the whole sequence then
    sees the images as the target did when it answered. Per-token inputs cover the answer too (text tokens: 0).
    An image file that is missing or changed, or a processor that no longer gives the stored prompt ids, is one
    `ImageError`."""
    if not target.takes_images or target.processor is None:
        raise ImageError(f"target {target.name} is a text-only model: the data holds image prompts")
    pictures = []
    for ref in images:
        path = Path(ref["path"])
        if not path.is_file():
            raise ImageError(f"image {path}: no such file (the data set refers to it)")
        if hashlib.sha256(path.read_bytes()).hexdigest() != ref["sha256"]:
            raise ImageError(f"image {path}: changed since the data was regenerated (its sha256 differs)")
        pictures.append(load_image(path))
    encoded = target.processor(text=[text], images=pictures, return_tensors="pt")
    prompt_ids, inputs = as_prompt(dict(encoded))
    n = prompt_ids.shape[1]
    if n > input_ids.shape[1]:
        raise ImageError(
            f"a sequence's image prompt is {n} tokens, more than the {input_ids.shape[1]} trained on: raise "
            "max_length"
        )
    if not torch.equal(prompt_ids[0].long().cpu(), input_ids[0, :n].cpu()):
        raise ImageError(
            f"the processor of {target.name} no longer gives the stored prompt's token ids for images "
            f"{', '.join(Path(r['path']).name for r in images)}: regenerate the data with this target"
        )
    return covering(target, inputs or {}, n, input_ids.shape[1])


def covering(target: Target, inputs: dict[str, Any], prompt_length: int, length: int) -> dict[str, Any]:
    """An image prompt's inputs (its `prompt_length` tokens) for a forward over `length` tokens that start with it:
    the per-token ones ([1, prompt_length]: token types) padded with 0, the text's type; the others as they are."""
    out = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape == (1, prompt_length):
            value = torch.nn.functional.pad(value, (0, length - prompt_length))
        out[key] = value
    return check_prompt_inputs(target, out) or {}


__all__ = [
    "ImageError",
    "ImagePrompt",
    "as_prompt",
    "check_prompt_inputs",
    "encode_image_prompt",
    "image_messages",
    "image_refs",
    "load_image",
    "sequence_image_inputs",
]
