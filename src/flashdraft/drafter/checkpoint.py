"""A drafter checkpoint's files: where they are (a local directory, or a hub id for online users), its config read
alone (checks before anything heavy loads), the provenance flashdraft writes into it, the mask token's input row it
may ship (vLLM's `mask_embedding.pt`), and the error a bad one raises. The drafter itself is model.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .config import CONFIG_NAME, DFlashConfig, DFlashConfigError


class DFlashCheckpointError(ValueError):
    """A drafter checkpoint whose files are missing, unreadable or do not match its config."""


MASK_EMBEDDING_NAME = "mask_embedding.pt"


def load_mask_embedding(file: Path, hidden_size: int) -> torch.Tensor | None:
    """The mask token's input row a checkpoint ships beside its weights (vLLM's `mask_embedding.pt`), or None."""
    if not file.exists():
        return None
    try:
        row = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is one line
        raise DFlashCheckpointError(f"cannot read {file}: {e}") from None
    if not isinstance(row, torch.Tensor) or row.numel() != hidden_size or not row.is_floating_point():
        raise DFlashCheckpointError(f"{file} must hold one embedding row of {hidden_size} floats")
    return row.reshape(hidden_size).float()


def read_weights(path: Path, load: Callable[[str], dict[str, Any]]) -> tuple[dict[str, Any], Path]:
    """(the drafter's tensors under z-lab's names, the first file read) from `model.safetensors` or its shards in
    `path`, each read by `load` (safetensors' torch loader, or MLX's): an exporter's "model." prefix removed, an
    embedding or head dropped (the target's are used), DFlash2's codebooks saved as nn.Embedding renamed."""
    from .config import WEIGHTS_NAME

    files = (
        [path / WEIGHTS_NAME] if (path / WEIGHTS_NAME).exists() else sorted(path.glob("model-*.safetensors"))
    )
    if not files:
        raise DFlashCheckpointError(f"no {WEIGHTS_NAME} in {path}")
    state: dict[str, Any] = {}
    for file in files:
        try:
            state.update(load(str(file)))
        except Exception as e:  # noqa: BLE001 - any unreadable file is one line
            raise DFlashCheckpointError(f"cannot read drafter weights {file}: {e}") from None
    state = {k.removeprefix("model."): v for k, v in state.items()}  # z-lab's files have no prefix
    state.pop("embed_tokens.weight", None)
    state.pop("lm_head.weight", None)
    for name in ("predecessor_codebook", "successor_codebook"):
        key = f"candidate_selector.{name}"
        if f"{key}.weight" in state and key not in state:
            state[key] = state.pop(f"{key}.weight")
    return state, files[0]


def check_weights(state: dict[str, Any], expected: dict[str, Any], source: Path) -> None:
    """Refuse tensors whose names or shapes are not the ones the config's drafter has (`expected`: its own)."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise DFlashCheckpointError(
            f"{source} does not match its config: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise DFlashCheckpointError(
                f"tensor {name} has shape {tuple(tensor.shape)} but the config implies {tuple(expected[name].shape)}"
            )


def load_drafter_config(path: str | Path) -> DFlashConfig:
    """The drafter's config alone (no weights): for checks before anything heavy is loaded."""
    return DFlashConfig.from_pretrained(resolve_draft_path(path))


def resolve_draft_path(path: str | Path) -> str:
    """A local directory, or a hub id resolved through huggingface_hub when available (online users)."""
    p = Path(path)
    if p.is_file():
        raise DFlashCheckpointError(
            f"drafter {str(path)!r} is a file; give the drafter's directory (with config.json and model.safetensors)"
        )
    if p.exists():
        return str(p)
    if str(path).startswith(("/", "./", "../", "~")) or str(path).count("/") != 1:
        raise DFlashCheckpointError(f"drafter directory {str(path)!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors", "*.md"])
    except Exception as e:  # offline, unknown repo, ...
        raise DFlashCheckpointError(
            f"drafter {path!r} is neither a local directory nor a reachable hub repo: {e}"
        ) from None


def read_model_card_meta(path: str | Path) -> dict[str, Any]:
    """flashdraft provenance stored in config.json (empty for z-lab drafters)."""
    try:
        return json.loads((Path(path) / CONFIG_NAME).read_text()).get("flashdraft", {}) or {}
    except (OSError, json.JSONDecodeError, DFlashConfigError):
        return {}
