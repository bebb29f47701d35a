"""Benchmark datasets: the prompts `flashdraft bench` runs, formatted like z-lab's DFlash benchmark.

Resolution order for `--dataset NAME_OR_FILE`:

1. an existing file: any format `prompts.py` reads (z-lab `{"turns": [...]}` jsonl, messages, question, prompt, ...);
   its turns are used exactly as written (z-lab's cached files already carry their suffixes);
2. a dataset shipped in `flashdraft/benchdata/` (offline): `gsm8k` (test split, 1319), `humaneval` (164), `mt-bench` (80,
   two turns each);
3. `$FLASHDRAFT_HOME/datasets/<name>.jsonl`: a turns-format file dropped there by hand or cached from the hub;
4. the Hugging Face hub (needs the `datasets` package and a network): `math500`, `mbpp` and the shipped ones under
   z-lab's hub ids, or any `org/name` id whose rows `prompts.py` understands. Cached to 3. after the first download.

Prompt formats (z-lab `dflash/benchmark.py`):

* gsm8k, math500: the question + "\\nPlease reason step by step, and put your final answer within \\\\boxed{}."
* humaneval: "Write a solution to the following problem and make sure that it passes the tests:" followed by the
  function stub in a ```python fence.
* mbpp (sanitized): the task text as is.
* mt-bench: both user turns; the bench conditions the second on the target's own first answer.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .files import Conversation, PromptFormatError, load_conversations, to_conversation

__all__ = [
    "BOXED_SUFFIX",
    "SHIPPED_DATASETS",
    "BenchDataset",
    "DatasetError",
    "format_humaneval",
    "format_math",
    "load_bench_dataset",
]

BOXED_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_INSTRUCTION = "Write a solution to the following problem and make sure that it passes the tests:"


class DatasetError(ValueError):
    """A benchmark dataset cannot be found or read."""


def format_math(question: str) -> str:
    return question + BOXED_SUFFIX


def format_humaneval(stub: str) -> str:
    return f"{HUMANEVAL_INSTRUCTION}\n```python\n{stub}\n```"


@dataclass
class BenchDataset:
    name: str
    source: str  # file path or hub id the prompts came from
    conversations: list[Conversation]  # user turns already formatted
    num_records: int  # records in the source before --max-samples
    sample_indices: list[int] = field(default_factory=list)  # which records were kept

    @property
    def num_turns(self) -> int:
        return sum(len(c.user_turns) for c in self.conversations)


@dataclass(frozen=True)
class _Shipped:
    filename: str
    format_turn: Callable[[Conversation], list[str]]


@dataclass(frozen=True)
class _HubSpec:
    path: str
    config: str | None
    split: str
    turns: Callable[[dict[str, Any]], list[str]]


SHIPPED_DATASETS: dict[str, _Shipped] = {
    "gsm8k": _Shipped("gsm8k_test.jsonl", lambda c: [format_math(c.user_turns[0])]),
    "humaneval": _Shipped("humaneval.jsonl.gz", lambda c: [format_humaneval(c.user_turns[0])]),
    "mt-bench": _Shipped("mt_bench_questions.jsonl", lambda c: list(c.user_turns)),
    # Structured output: each record carries the response_format it is decoded under (benchmarks/make_structured_set.py)
    "structured": _Shipped("structured.jsonl", lambda c: list(c.user_turns)),
}

_HUB_DATASETS: dict[str, _HubSpec] = {
    "gsm8k": _HubSpec("openai/gsm8k", "main", "test", lambda r: [format_math(r["question"])]),
    "math500": _HubSpec("HuggingFaceH4/MATH-500", None, "test", lambda r: [format_math(r["problem"])]),
    "humaneval": _HubSpec("openai/openai_humaneval", None, "test", lambda r: [format_humaneval(r["prompt"])]),
    "mbpp": _HubSpec("google-research-datasets/mbpp", "sanitized", "test", lambda r: [r["prompt"]]),
    "mt-bench": _HubSpec("HuggingFaceH4/mt_bench_prompts", None, "train", lambda r: list(r["prompt"])),
}

_ALIASES = {"mt_bench": "mt-bench", "mtbench": "mt-bench", "math-500": "math500", "human-eval": "humaneval"}


def _canonical(name: str) -> str:
    key = name.strip().lower()
    return _ALIASES.get(key, key)


def _cache_dir() -> Path:
    from ..models.packs import flashdraft_home

    return flashdraft_home() / "datasets"


def _file_stem(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def _read_file(path: Path) -> list[Conversation]:
    try:
        return load_conversations(path)  # image paths resolved beside the file
    except PromptFormatError as e:
        raise DatasetError(f"{path}: {e}") from None
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise DatasetError(f"cannot read dataset file {path}: {e}") from None


def _read_shipped(name: str) -> tuple[list[Conversation], str]:
    spec = SHIPPED_DATASETS[name]
    with resources.as_file(resources.files("flashdraft") / "benchdata" / spec.filename) as path:
        conversations = _read_file(path)
    for conv in conversations:
        conv.user_turns = spec.format_turn(conv)
    return conversations, f"flashdraft/benchdata/{spec.filename}"


def _download_from_hub(name: str) -> Path:
    """Fetch a hub dataset into the turns-format cache; raises DatasetError with the reason it failed."""
    spec = _HUB_DATASETS.get(name)
    if spec is None and "/" not in name:
        raise DatasetError("not a known hub dataset")
    try:
        import datasets as hf_datasets
    except ImportError:
        raise DatasetError("the `datasets` package is not installed (pip install datasets)") from None
    try:
        if spec is not None:
            rows = hf_datasets.load_dataset(spec.path, spec.config, split=spec.split)
        else:
            rows = hf_datasets.load_dataset(name, split="test")
    except Exception as e:  # offline, unknown id, gated, ... all end the same way for the user
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DatasetError(f"hub download failed: {first_line}") from None
    records = []
    for i, row in enumerate(rows):
        turns = spec.turns(row) if spec is not None else to_conversation(dict(row), i).user_turns
        records.append({"id": str(row.get("id", row.get("task_id", i))), "turns": turns})
    out = _cache_dir() / f"{name.replace('/', '__')}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    tmp.replace(out)
    return out


def _sample(conversations: list[Conversation], max_samples: int | None, seed: int) -> list[int]:
    """Indices of the records to run: all of them, or a seeded random subset kept in file order.

    A random subset rather than the first N: MT-Bench is sorted by category, so its first 10 are all "writing".
    """
    n = len(conversations)
    if max_samples is None or max_samples >= n:
        return list(range(n))
    if max_samples < 1:
        raise DatasetError(f"--max-samples must be at least 1, got {max_samples}")
    return sorted(random.Random(seed).sample(range(n), max_samples))


def load_bench_dataset(name_or_path: str, max_samples: int | None = None, seed: int = 0) -> BenchDataset:
    """The conversations of a benchmark (see the module docstring for where they come from)."""
    path = Path(name_or_path).expanduser()
    name = _canonical(name_or_path)
    cached = _cache_dir() / f"{name.replace('/', '__')}.jsonl"
    if path.is_file():
        conversations, source, label = _read_file(path), str(path), _file_stem(path)
    elif name in SHIPPED_DATASETS:
        (conversations, source), label = _read_shipped(name), name
    elif cached.is_file():
        conversations, source, label = _read_file(cached), str(cached), name
    else:
        try:
            downloaded = _download_from_hub(name)
        except DatasetError as e:
            shipped = ", ".join(SHIPPED_DATASETS)
            raise DatasetError(
                f"dataset {name_or_path!r} is not a file, not shipped ({shipped}), not cached at {cached}, and not "
                f'available from the Hugging Face hub ({e}); pass a jsonl file in z-lab\'s {{"turns": [...]}} '
                "format with --dataset PATH"
            ) from None
        conversations, source, label = _read_file(downloaded), downloaded.as_posix(), name
    if not conversations:
        raise DatasetError(f"dataset {name_or_path!r} ({source}) holds no prompts")
    for conv in conversations:
        if not conv.user_turns or any(not isinstance(t, str) or not t for t in conv.user_turns):
            raise DatasetError(f"dataset {name_or_path!r}: record {conv.id} has an empty user turn")
    indices = _sample(conversations, max_samples, seed)
    return BenchDataset(
        name=label,
        source=source,
        conversations=[conversations[i] for i in indices],
        num_records=len(conversations),
        sample_indices=indices,
    )
