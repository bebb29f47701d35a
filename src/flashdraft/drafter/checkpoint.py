"""A drafter checkpoint's files: where they are (a local directory, or a hub id for online users), its config read
alone (checks before anything heavy loads), the provenance flashdraft writes into it, the mask token's input row it
may ship (vLLM's `mask_embedding.pt`), and the error a bad one raises. The drafter itself is model.py."""

from __future__ import annotations

import json
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
