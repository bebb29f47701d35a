"""The on-disk layout of a training data directory (`regenerate.regenerate` writes it, `dataset` reads it): its
manifest, its shards and their headers, and the offline features' files.

Everything is written to a temporary name and renamed into place:

* ``manifest.json``: what the data is (target, chat-template mode, sampling settings, sources) and running counts.
* ``shard-NNNNN.jsonl``: one shard per chunk of finished prompts. Line 1 is a header
  ``{"header": {"done": [prompt keys], "skipped": {reason: [keys]}, "stats": {...}}}``; every further line is a
  sequence ``{"id", "source", "input_ids": [int], "loss_mask": [0|1]}``. The headers are the only record of which
  prompts are finished, so a killed run loses at most the chunk it was working on. A sequence whose prompt had
  images (an image+question record, image-text targets) also holds ``"images": [{"path", "sha256"}]`` and
  ``"image_text"`` (what the processor was given): no pixels; the trainer redoes the image prefill from the files
  (`multimodal.sequence_image_inputs`) and stops with one line if a file is gone or changed.

Each sequence is exactly ``prompt ids + generated ids``: the prompt as the target's chat template tokenises it (what
`Target.encode_prompt` feeds the target at inference), followed by the ids the target generated, up to and including
its end-of-turn token; the loss mask is 1 on the generated ids only. No text round trip, so no re-tokenisation drift.
For multi-turn conversations, turn k+1 is the template of the conversation so far (with the target's own earlier
answers) plus the next generation; when that template starts with the previous sequence the turns share one
sequence, otherwise (templates that rewrite history, e.g. strip reasoning) each turn becomes its own sequence.

Offline features (``compute_features``) live in ``features-manifest.json``, ``features-NNNNN.safetensors`` (one
tensor ``features`` [tokens, len(layer_ids) * hidden], sequences back to back; the ids and lengths of its sequences
are in the file's metadata) and ``features-index.json``. They may share the data directory or live in their own
(then the features manifest points at the data directory).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..files import atomic_write_text

FORMAT = "flashdraft-data"
FEATURES_FORMAT = "flashdraft-features"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
FEATURES_MANIFEST = "features-manifest.json"
FEATURES_INDEX = "features-index.json"
SHARD_GLOB = "shard-*.jsonl"
FEATURES_GLOB = "features-*.safetensors"


class DataError(ValueError):
    """Training data cannot be produced or read as asked."""


def package_version() -> str:
    from .._version import __version__

    return __version__


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from None


def shard_header(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    try:
        return json.loads(first)["header"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise DataError(f"{path} is not a flashdraft data shard (bad header line)") from None


def shard_paths(directory: Path) -> list[Path]:
    return sorted(directory.glob(SHARD_GLOB))


def next_shard_index(paths: Sequence[Path]) -> int:
    return 1 + max((int(p.stem.rsplit("-", 1)[-1]) for p in paths), default=-1)


def _check_settings(path: Path, existing: dict[str, Any], settings: dict[str, Any], what: str) -> None:
    old = existing.get("settings", {})
    diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
    if diff:
        details = "; ".join(f"{k}: existing {old.get(k)!r}, requested {settings.get(k)!r}" for k in diff)
        raise DataError(
            f"{path} already holds {what} made with different settings ({details}); "
            "use a new output directory instead of mixing data"
        )


def open_manifest(
    path: Path, fmt: str, settings: dict[str, Any], what: str, wrong_format: str
) -> dict[str, Any]:
    """The manifest at `path` if it was made with the same `settings` (resume), else a fresh one."""
    if not path.exists():
        return {
            "format": fmt,
            "format_version": FORMAT_VERSION,
            "created": utc_now(),
            "settings": settings,
            "wall_time_s": 0.0,
        }
    manifest = read_json(path)
    if manifest.get("format") != fmt:
        raise DataError(wrong_format)
    _check_settings(path.parent, manifest, settings, what)
    return manifest


def target_info(target: Any) -> dict[str, Any]:
    """The target's shape as a manifest records it (offline features are refused from another target's data)."""
    return {
        "model_type": getattr(target.config, "model_type", None),
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
    }


def sum_counts(headers: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """A manifest's running counts, summed over its shards' headers (the only record of what is done)."""
    counts: dict[str, Any] = {
        "prompts": 0,
        "sequences": 0,
        "tokens": 0,
        "answer_tokens": 0,
        "generated_tokens": 0,
        "truncated": 0,
        "no_eos": 0,
        "skipped": 0,
        "skipped_by_reason": {},
        "shards": 0,
    }
    for h in headers:
        counts["shards"] += 1
        counts["prompts"] += len(h["done"])
        for k in ("sequences", "tokens", "answer_tokens", "generated_tokens", "truncated", "no_eos"):
            counts[k] += int(h["stats"].get(k, 0))
        for reason, keys in h.get("skipped", {}).items():
            counts["skipped"] += len(keys)
            counts["skipped_by_reason"][reason] = counts["skipped_by_reason"].get(reason, 0) + len(keys)
    return counts
