"""Reading prompt files: z-lab `{"turns": [...]}`, ShareGPT-style `messages`/`conversations`, GSM8K `question`,
HumanEval `prompt`, plain `prompt`/`instruction`. Every record becomes a `Conversation`: the user turns, and the
assistant answers the file already holds (used by `--no-regenerate` and ignored otherwise)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_USER_ROLES = {"user", "human"}
_ASSISTANT_ROLES = {"assistant", "gpt", "model", "chatgpt", "bing", "bard"}


class PromptFormatError(ValueError):
    """A record whose prompt cannot be found."""


@dataclass
class Conversation:
    id: str
    user_turns: list[str]
    answers: list[str] = field(default_factory=list)  # existing assistant answers, aligned with user_turns
    system: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a .jsonl or .jsonl.gz file (a .json file holding a list works too)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        if path.name.endswith(".json"):
            data = json.load(f)
            yield from (data if isinstance(data, list) else [data])
            return
        for line_no, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptFormatError(f"{path}:{line_no}: invalid JSON ({e})") from None


def _message_parts(message: dict[str, Any]) -> tuple[str, str]:
    role = str(message.get("role", message.get("from", ""))).lower()
    content = message.get("content", message.get("value", ""))
    if isinstance(content, list):  # OpenAI content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return role, str(content)


def to_conversation(record: dict[str, Any], index: int = 0) -> Conversation:
    """Normalise one record; raises PromptFormatError when no user prompt is found."""
    rid = str(record.get("id", record.get("question_id", record.get("task_id", index))))
    # response_format, tools + tool_choice: a structured-output record (the bench decodes it under that constraint)
    meta = {
        k: record[k]
        for k in ("category", "task_id", "answer", "entry_point", "response_format", "tools", "tool_choice")
        if k in record
    }
    images = record.get("images", record.get("image"))
    if images is not None:  # an image+question record (image-text targets): files, or data: URLs
        images = [images] if isinstance(images, str) else images
        if not isinstance(images, list) or not all(isinstance(i, str) and i for i in images):
            raise PromptFormatError(f"record {rid}: 'images' must be a path or a list of paths")
        meta["images"] = list(images)
    if isinstance(record.get("turns"), list):
        turns = [str(t) for t in record["turns"]]
        return Conversation(rid, turns, meta=meta)
    messages = record.get("messages", record.get("conversations"))
    if isinstance(messages, list):
        users: list[str] = []
        answers: list[str] = []
        system = None
        for m in messages:
            role, content = _message_parts(m)
            if role == "system":
                system = content
            elif role in _USER_ROLES:
                users.append(content)
            elif role in _ASSISTANT_ROLES and len(answers) < len(users):
                answers.append(content)
        if users:
            return Conversation(rid, users, answers, system=system, meta=meta)
    for key, answer_key in (("question", "answer"), ("prompt", "completion"), ("instruction", "output")):
        if isinstance(record.get(key), str):
            answer = record.get(answer_key)
            return Conversation(rid, [record[key]], [answer] if isinstance(answer, str) else [], meta=meta)
    raise PromptFormatError(
        f"record {rid}: no prompt found (expected 'turns', 'messages'/'conversations', 'question', 'prompt' or "
        f"'instruction'; got keys {sorted(record)[:8]})"
    )


def load_conversations(path: str | Path, limit: int | None = None) -> list[Conversation]:
    out = []
    for i, record in enumerate(read_jsonl(path)):
        if limit is not None and len(out) >= limit:
            break
        conv = to_conversation(record, i)
        if "images" in conv.meta:  # relative image paths are the file's neighbours
            conv.meta["images"] = [
                im if im.startswith("data:") or Path(im).is_absolute() else str(Path(path).parent / im)
                for im in conv.meta["images"]
            ]
        out.append(conv)
    return out
