"""Reading training data: `TrainingData` (the sequences of a regenerated data directory, with offline features
when present) and `compute_features` (cache the target's tapped-layer outputs for offline training)."""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..files import atomic_write
from ..progress import Reporter
from ..targets.target import DTYPES
from .data_layout import (
    FEATURES_FORMAT,
    FEATURES_GLOB,
    FEATURES_INDEX,
    FEATURES_MANIFEST,
    FORMAT,
    MANIFEST,
    DataError,
    next_shard_index,
    open_manifest,
    package_version,
    read_json,
    shard_paths,
    target_info,
    utc_now,
    write_json,
)

log = logging.getLogger(__name__)

# ============================================================================================ reading


def _read_sequences(
    data_dir: Path,
) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, dict[int, dict[str, Any]]]:
    """ids, offsets [n+1], flat input ids (int64), flat loss mask (bool) of every sequence in the shards, and the
    image records of the sequences whose prompt had images (by row: `images`, `image_text`)."""
    ids: list[str] = []
    tokens: list[list[int]] = []
    masks: list[list[int]] = []
    images: dict[int, dict[str, Any]] = {}
    for path in shard_paths(data_dir):
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if line_no == 1 or not line.strip():
                    continue
                try:
                    r = json.loads(line)
                    if "images" in r:
                        images[len(ids)] = {"images": r["images"], "image_text": r["image_text"]}
                    ids.append(r["id"])
                    tokens.append(r["input_ids"])
                    masks.append(r["loss_mask"])
                except (json.JSONDecodeError, KeyError) as e:
                    raise DataError(f"{path}:{line_no}: bad sequence record ({e})") from None
    lengths = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
    offsets = np.zeros(len(tokens) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat_ids = np.fromiter((t for seq in tokens for t in seq), dtype=np.int64, count=int(offsets[-1]))
    flat_mask = np.fromiter((m for seq in masks for m in seq), dtype=bool, count=int(offsets[-1]))
    return ids, offsets, flat_ids, flat_mask, images


# A packed data set: one compressed file any machine (or a lent GPU) can train from at once, instead of a directory
# of JSON shards (token ids as uint16 when the vocabulary allows, loss masks as bits).
PACKED_FORMAT = "flashdraft-packed-data"


def pack_data(data_dir: str | Path, out: str | Path) -> dict[str, Any]:
    """Write the sequences of a regenerated data directory, with its manifest, to one compressed `.npz` file;
    returns its summary (sequences, tokens, bytes)."""
    data = TrainingData(data_dir, features=False)
    out = Path(out)
    if out.suffix != ".npz":
        raise DataError(f"a packed data set is a .npz file, not {out}")
    vocab = int(
        data.manifest.get("target_config", {}).get("vocab_size") or int(data._ids_flat.max(initial=0)) + 1
    )
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    arrays = {
        "format": np.array(PACKED_FORMAT),
        "manifest": np.array(json.dumps(data.manifest, ensure_ascii=False)),
        "ids": np.array("\n".join(data.ids)),
        "offsets": data._offsets,
        "input_ids": data._ids_flat.astype(dtype),
        "loss_mask": np.packbits(data._mask_flat),
        "images": np.array(json.dumps({str(row): meta for row, meta in data._images.items()})),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda tmp: _save_npz(tmp, arrays))
    return {"sequences": len(data.ids), "tokens": int(data._offsets[-1]), "bytes": out.stat().st_size}


def _save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    with open(path, "wb") as f:  # a file object: numpy would append .npz to a temporary name
        np.savez_compressed(f, **arrays)


def _read_packed(
    path: Path,
) -> tuple[dict[str, Any], list[str], np.ndarray, np.ndarray, np.ndarray, dict[int, dict[str, Any]]]:
    """manifest, ids, offsets, flat input ids (int64), flat loss mask (bool) and image records (by row) of a
    packed data set."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if str(z["format"]) != PACKED_FORMAT:
                raise DataError(f"{path} is not a packed flashdraft data set")
            offsets = z["offsets"].astype(np.int64)
            n = int(offsets[-1])
            ids_flat = z["input_ids"].astype(np.int64)
            mask_flat = np.unpackbits(z["loss_mask"], count=n).astype(bool)
            manifest = json.loads(str(z["manifest"]))
            ids = str(z["ids"]).split("\n") if len(offsets) > 1 else []
            images = json.loads(str(z["images"])) if "images" in z.files else {}  # packs before images: none
    except (OSError, ValueError, KeyError, EOFError) as e:
        raise DataError(f"cannot read packed data {path}: {e}") from None
    if len(ids) != len(offsets) - 1 or len(ids_flat) != n:
        raise DataError(f"packed data {path} is inconsistent (ids, offsets and tokens disagree)")
    return manifest, ids, offsets, ids_flat, mask_flat, {int(row): meta for row, meta in images.items()}


class TrainingData(torch.utils.data.Dataset):
    """The stored sequences of a data directory (or of the data directory a features directory points at), or of a
    packed data set (`pack_data`: one `.npz` file).

    Items are ``{"input_ids": LongTensor[S], "loss_mask": BoolTensor[S]}``, plus ``"features"``
    ``Tensor[S, T*H]`` when `path` holds offline features (``features=False`` ignores them), and ``"images"``
    (files and hashes) with ``"image_text"`` for a sequence whose prompt had images (`image_inputs`).
    """

    def __init__(self, path: str | Path, *, features: bool = True) -> None:
        path = Path(path)
        self.path = path
        self.features_manifest: dict[str, Any] | None = None
        self._rows: list[int] = []
        self._feature_loc: list[tuple[str, int]] | None = None
        self._handles: dict[str, Any] = {}
        if path.is_file() and path.suffix == ".npz":
            self.data_dir = None
            self._manifest, self.ids, self._offsets, self._ids_flat, self._mask_flat, self._images = (
                _read_packed(path)
            )
            self._rows = list(range(len(self.ids)))
            return
        if not path.is_dir():
            raise DataError(f"training data directory (or packed .npz file) not found: {path}")
        fm_path = path / FEATURES_MANIFEST
        if features and fm_path.exists():
            self.features_manifest = read_json(fm_path)
        if (path / MANIFEST).exists():
            self.data_dir = path
        elif fm_path.exists():
            fm = self.features_manifest or read_json(fm_path)
            self.data_dir = (path / fm["data_dir"]).resolve()
        else:
            raise DataError(
                f"{path} holds no flashdraft training data (no {MANIFEST} or {FEATURES_MANIFEST})"
            )
        self._manifest = read_json(self.data_dir / MANIFEST)
        if self._manifest.get("format") != FORMAT:
            raise DataError(f"{self.data_dir / MANIFEST} is not a flashdraft data manifest")
        self.ids, self._offsets, self._ids_flat, self._mask_flat, self._images = _read_sequences(
            self.data_dir
        )
        self._rows = list(range(len(self.ids)))
        if self.features_manifest is not None:
            self._attach_features()

    def _attach_features(self) -> None:
        where: dict[str, tuple[str, int, int]] = {}
        for shard in _feature_shards(self.path):
            for sid, off, n in zip(shard["ids"], shard["offsets"], shard["lengths"], strict=True):
                where[sid] = (shard["file"], off, n)
        rows, locs = [], []
        for row, sid in enumerate(self.ids):
            loc = where.get(sid)
            if loc is None:
                continue
            if loc[2] != self._offsets[row + 1] - self._offsets[row]:
                raise DataError(
                    f"features of {sid!r} do not match its sequence length: recompute the features"
                )
            rows.append(row)
            locs.append((loc[0], loc[1]))
        if len(rows) < len(self.ids):
            warnings.warn(
                f"{self.path}: offline features cover {len(rows)} of {len(self.ids)} sequences; "
                "using only those (run `flashdraft data features` again to finish)",
                stacklevel=3,
            )
        self._rows, self._feature_loc = rows, locs

    @property
    def manifest(self) -> dict[str, Any]:
        return self._manifest

    @property
    def has_images(self) -> bool:
        """Whether some sequence's prompt had images (the target must then be loaded with its vision tower)."""
        return bool(self._images)

    @property
    def has_features(self) -> bool:
        return self._feature_loc is not None

    @property
    def lengths(self) -> list[int]:
        return [int(self._offsets[r + 1] - self._offsets[r]) for r in self._rows]

    def answer_token_counts(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] int64: how often each token occurs in the answers (the target's own text), what a drafter's
        vocabulary is drawn from (vocab.py)."""
        answers = self._ids_flat[self._mask_flat]
        answers = answers[(answers >= 0) & (answers < vocab_size)]
        return torch.from_numpy(np.bincount(answers, minlength=vocab_size).astype(np.int64))

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        row = self._rows[index]
        a, b = int(self._offsets[row]), int(self._offsets[row + 1])
        item: dict[str, Any] = {
            "input_ids": torch.from_numpy(self._ids_flat[a:b].copy()),
            "loss_mask": torch.from_numpy(self._mask_flat[a:b].copy()),
        }
        if self._feature_loc is not None:
            file, off = self._feature_loc[index]
            item["features"] = self._handle(file).get_slice("features")[off : off + (b - a)]
        if row in self._images:
            item.update(self._images[row])
        return item

    def _handle(self, file: str) -> Any:
        from safetensors import safe_open

        h = self._handles.get(file)
        if h is None:
            h = self._handles[file] = safe_open(str(self.path / file), framework="pt")
        return h

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen the safetensors files
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self[i]


# ============================================================================================ offline features


def image_inputs(target: Any, item: dict[str, Any], ids: torch.Tensor, sid: str) -> dict[str, Any] | None:
    """The image prefill's inputs for a sequence `item` whose prompt had images, over its ids [1, S] as trained;
    None for a text sequence. Stored sequences name their image files (`multimodal.sequence_image_inputs`; a
    missing or changed file is a `DataError`); a dataset in memory may give the processor's outputs for its prompt
    instead (`prompt_inputs`, an `ImagePrompt`'s inputs, with `prompt_length`, its tokens)."""
    from ..targets.multimodal import ImageError, covering, sequence_image_inputs

    if "prompt_inputs" in item:
        n = int(item["prompt_length"])
        if n > ids.shape[1]:
            raise DataError(
                f"sequence {sid}: its image prompt is {n} tokens, more than the {ids.shape[1]} trained on"
            )
        return covering(target, item["prompt_inputs"], n, ids.shape[1])
    if "images" not in item:
        return None
    try:
        return sequence_image_inputs(target, ids, item["images"], item["image_text"])
    except ImageError as e:
        raise DataError(f"sequence {sid}: {e}") from None


def _feature_shards(directory: Path) -> list[dict[str, Any]]:
    """What every features shard holds, read from its safetensors metadata (the source of truth)."""
    from safetensors import safe_open

    out = []
    for p in sorted(directory.glob(FEATURES_GLOB)):
        try:
            with safe_open(str(p), framework="pt") as f:
                meta = f.metadata() or {}
            ids, lengths = json.loads(meta["ids"]), json.loads(meta["lengths"])
        except Exception as e:
            raise DataError(f"{p} is not a flashdraft features shard: {e}") from None
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int).tolist() if lengths else []
        out.append({"file": p.name, "ids": ids, "lengths": lengths, "offsets": offsets})
    return out


def compute_features(
    target: Any,
    data_dir: str | Path,
    out_dir: str | Path,
    layer_ids: Sequence[int],
    dtype: torch.dtype | str = torch.float16,
    *,
    progress: bool = True,
    shard_mb: float = 256.0,
) -> dict[str, Any]:
    """Cache the target's tapped-layer outputs ([S, len(layer_ids) * H] per sequence) for offline training.

    Each stored sequence runs through the frozen decoder stack, no LM head (`Target.features(ids,
    layer_ids)`); features go to safetensors shards of about `shard_mb` MB in `dtype`. Resumable;
    refuses an `out_dir` whose features were made with other layers, dtype, target or data.
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise DataError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    dtype_name = next((k for k, v in DTYPES.items() if v == dtype), None)
    if dtype_name is None:
        raise DataError(f"unsupported features dtype {dtype}")
    layer_ids = [int(i) for i in layer_ids]
    if not layer_ids:
        raise DataError("no layer ids given")
    bad = [i for i in layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise DataError(
            f"layer ids {bad} out of range: {target.name} has {target.num_layers} decoder layers "
            f"(valid 0..{target.num_layers - 1})"
        )
    data_dir, out = Path(data_dir), Path(out_dir)
    data = TrainingData(data_dir, features=False)
    if data.data_dir is None:
        raise DataError(
            f"offline features are computed from a data directory, not a packed file ({data_dir})"
        )
    info = data.manifest.get("target_config", {})
    mine = target_info(target)
    diff = [k for k in ("num_layers", "hidden_size", "vocab_size") if k in info and info[k] != mine[k]]
    if diff:
        raise DataError(
            f"{data_dir} was made with a different target ({data.manifest.get('target')}: "
            + ", ".join(f"{k} {info[k]} vs {mine[k]}" for k in diff)
            + f") than {target.name}"
        )
    if data.manifest.get("target") != str(target.name):
        log.warning("data was made by %s, features come from %s", data.manifest.get("target"), target.name)

    out.mkdir(parents=True, exist_ok=True)
    data_ref = os.path.relpath(data.data_dir.resolve(), out.resolve())
    settings = {
        "target": str(target.name),
        "layer_ids": layer_ids,
        "dtype": dtype_name,
        "data_dir": str(data.data_dir.resolve()),
    }
    manifest_path = out / FEATURES_MANIFEST
    manifest = open_manifest(
        manifest_path, FEATURES_FORMAT, settings, "offline features",
        f"{manifest_path} is not a flashdraft features manifest",
    )  # fmt: skip
    manifest.update(
        {
            "flashdraft_version": package_version(),
            "target": str(target.name),
            "target_config": mine,
            "layer_ids": layer_ids,
            "dtype": dtype_name,
            "feature_dim": len(layer_ids) * target.hidden_size,
            "data_dir": data_ref,
            "data_target": data.manifest.get("target"),
        }
    )
    width = len(layer_ids) * target.hidden_size
    shard_tokens = max(1, int(shard_mb * 2**20 / (width * torch.finfo(dtype).bits / 8)))

    shards = _feature_shards(out)
    done = {sid for s in shards for sid in s["ids"]}
    todo = [row for row, sid in enumerate(data.ids) if sid not in done]
    wall_base = float(manifest.get("wall_time_s", 0.0))
    start = time.perf_counter()
    shard_index = next_shard_index([out / s["file"] for s in shards])

    def write_index_and_manifest(complete: bool) -> None:
        current = _feature_shards(out)
        write_json(
            out / FEATURES_INDEX,
            {"format": FEATURES_FORMAT, "feature_dim": width, "dtype": dtype_name, "shards": current},
        )
        manifest["counts"] = {
            "sequences": sum(len(s["ids"]) for s in current),
            "tokens": sum(sum(s["lengths"]) for s in current),
            "shards": len(current),
            "data_sequences": len(data.ids),
        }
        manifest["complete"] = complete
        manifest["wall_time_s"] = round(wall_base + time.perf_counter() - start, 2)
        manifest["updated"] = utc_now()
        write_json(manifest_path, manifest)

    write_index_and_manifest(not todo)
    buf: list[torch.Tensor] = []
    buf_ids: list[str] = []
    buf_tokens = 0
    tokens_done = 0

    def flush() -> None:
        nonlocal shard_index, buf, buf_ids, buf_tokens
        from safetensors.torch import save_file

        if not buf:
            return
        tensor = torch.cat(buf, dim=0).contiguous()
        meta = {
            "format": FEATURES_FORMAT,
            "ids": json.dumps(buf_ids),
            "lengths": json.dumps([int(t.shape[0]) for t in buf]),
            "layer_ids": json.dumps(layer_ids),
        }
        path = out / f"features-{shard_index:05d}.safetensors"
        atomic_write(path, lambda tmp: save_file({"features": tensor}, str(tmp), metadata=meta))
        shard_index += 1
        buf, buf_ids, buf_tokens = [], [], 0
        write_index_and_manifest(False)

    lengths = data.lengths
    with Reporter(
        progress, total=len(data.ids), completed=len(data.ids) - len(todo), label="features"
    ) as rep:
        for row in todo:
            item = data[row]
            ids = item["input_ids"].unsqueeze(0).to(target.device)
            feats = target.features(ids, layer_ids, image_inputs(target, item, ids, data.ids[row]))
            buf.append(feats[0].to(dtype).cpu())
            buf_ids.append(data.ids[row])
            buf_tokens += lengths[row]
            tokens_done += lengths[row]
            elapsed = time.perf_counter() - start
            rep.advance(1, f"{tokens_done / max(elapsed, 1e-9):.0f} tok/s")
            if buf_tokens >= shard_tokens:
                flush()
                rep.note(f"features shard {shard_index - 1:05d} written ({tokens_done} tokens this run)")
        flush()
    write_index_and_manifest(True)
    return manifest
