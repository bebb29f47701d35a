"""Tool calling: OpenAI's `tools` and `tool_choice` in, `tool_calls` out.

The convention is Hermes / Qwen's, what the chat templates of Qwen2.5, Qwen3 and Hermes render and what those models
emit: each call a JSON object between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- **The prompt** (`tool_messages`): a chat template that renders `tools` in this convention gets them, and the history's
  assistant `tool_calls` and `tool` messages, as it expects them. A template that ignores `tools` (SmolLM2's, the demo
  target's) gets the same convention spelled out in the system message, calls as tagged text in the assistant turns
  and results as `<tool_response>` user turns. A template that renders tools in another convention (Llama 3's bare
  JSON, Mistral's `[TOOL_CALLS]`) is refused: flashdraft would not parse what such a model answers.
- **The output** (`ToolCallParser`): the tagged blocks naming a given tool become OpenAI tool calls, the text around
  them the message's content; streamed, each call goes out as OpenAI's `tool_calls` deltas when its block closes.
- **`required` and a named function** are enforced, not hoped for (`tool_constraint`): a structural tag (xgrammar)
  admits only tagged calls of the allowed tools whose arguments match each tool's parameter schema (exactly one call
  when `parallel_tool_calls` is false). It is a grammar like any other in the engine, so speculation stays lossless.
  `auto` is not constrained (as in vLLM): the model chooses between text and calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .grammar import Constraint

if TYPE_CHECKING:
    import torch

    from ..targets.target import Target

TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class ToolError(ValueError):
    """Bad tools, tool_choice or tool messages, in one line; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    """`mode`: none | auto | required | function (then `name` is the function's)."""

    mode: str
    name: str | None = None


def parse_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI function tools, checked: [{"type": "function", "function": {"name", "description"?, "parameters"?}}].
    A tool without `parameters` takes none (OpenAI: "an empty parameter list")."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolError("tools must be a list of function tools", "tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise ToolError(f"{where}: only function tools are supported (got {kind!r})", "tools")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolError(f"{where}.function must be an object with a name", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise ToolError(
                f"{where}.function.name must be a non-empty string of at most 64 characters", "tools"
            )
        if name in seen:
            raise ToolError(f"{where}: the function name {name!r} is given twice", "tools")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(parameters, dict):
            raise ToolError(f"{where}.function.parameters must be a JSON schema object", "tools")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolError(f"{where}.function.description must be a string", "tools")
        entry = {"name": name, "parameters": parameters}
        if description:
            entry = {"name": name, "description": description, "parameters": parameters}
        out.append({"type": "function", "function": entry})
    return out


def parse_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> ToolChoice:
    """OpenAI's tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}; absent,
    "auto" when tools are given (OpenAI's default) and "none" otherwise."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise ToolError(f'tool_choice "{choice}" needs tools', "tool_choice")
        return ToolChoice(choice)
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ToolError('tool_choice of type "function" needs function.name', "tool_choice")
        if name not in {t["function"]["name"] for t in tools}:
            raise ToolError(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
        return ToolChoice("function", name)
    raise ToolError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


# ------------------------------------------------------------------------------------------------- the grammar
def tool_constraint(
    tools: list[dict[str, Any]], choice: ToolChoice, parallel: bool = True
) -> Constraint | None:
    """For `required` and a named function, the structural tag that admits only tagged calls of the allowed tools,
    with arguments valid for their schemas; None for `auto` and `none`."""
    if choice.mode not in ("required", "function"):
        return None
    allowed = [t for t in tools if choice.mode == "required" or t["function"]["name"] == choice.name]
    tags = [
        {
            "type": "tag",
            # the whole call but its arguments is fixed text: `{"name": NAME, "arguments": ARGS}`
            "begin": f'{TOOL_CALL_BEGIN}\n{{"name": {json.dumps(t["function"]["name"])}, "arguments": ',
            # at most one space between JSON tokens: a small model cannot pad with whitespace until max_tokens
            "content": {
                "type": "json_schema",
                "json_schema": t["function"]["parameters"],
                "max_whitespace_cnt": 1,
            },
            "end": f"}}\n{TOOL_CALL_END}",
        }
        for t in allowed
    ]
    if choice.mode == "function" or not parallel:
        fmt: dict[str, Any] = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True}
    return Constraint("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))


# ------------------------------------------------------------------------------------------------- the prompt
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_7f3a", "parameters": {"type": "object"}}}


_conventions: dict[tuple[int, str], str] = {}


def _template_convention(tokenizer: Any) -> str:
    messages = [{"role": "user", "content": "hi"}]
    try:
        plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        with_tools = tokenizer.apply_chat_template(
            messages, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True
        )
    except Exception:  # noqa: BLE001 - a template that fails on tools is treated as one without them
        return "none"
    if with_tools == plain:
        return "none"
    return "hermes" if TOOL_CALL_BEGIN in with_tools and "probe_tool_7f3a" in with_tools else "other"


def template_convention(tokenizer: Any) -> str:
    """How the tokenizer's chat template takes tools: "hermes" (renders them with `<tool_call>`), "none" (ignores
    them, or there is no template), "other" (renders them in a convention flashdraft does not parse)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        return "none"
    key = (id(tokenizer), template)
    if key not in _conventions:
        _conventions[key] = _template_convention(tokenizer)
    return _conventions[key]


def _system_text(tools: list[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call functions to answer. Their signatures, one per line:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "To call a function, answer with its name and arguments as one JSON object between tags, one block per "
        f'call:\n{TOOL_CALL_BEGIN}\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n{TOOL_CALL_END}'
    )


def _call_text(call: dict[str, Any]) -> str:
    body = {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
    return f"{TOOL_CALL_BEGIN}\n{json.dumps(body, ensure_ascii=False)}\n{TOOL_CALL_END}"


def tool_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], convention: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the `tools` argument for the chat template. `messages` are OpenAI's, already checked, with
    each call's arguments parsed to an object (what templates expect). For a "hermes" template both go as they are;
    for a template without tools ("none") the convention is written into the system message and the history's
    calls and results into plain turns. tools=[] renders no tools (tool_choice "none")."""
    if convention == "hermes":
        return messages, (tools or None)
    if convention == "other" and (tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)):
        raise ToolError(
            "this model's chat template renders tools in a convention flashdraft does not parse (it parses "
            "Hermes/Qwen <tool_call> JSON)",
            "tools",
        )
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":  # the results of one round of calls go back as one user turn
            text = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if i and messages[i - 1]["role"] == "tool":
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text})
        elif m.get("tool_calls"):
            parts = [m["content"]] if m.get("content") else []
            parts += [_call_text(c) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{_system_text(tools)}"}
        else:
            out.insert(0, {"role": "system", "content": _system_text(tools)})
    return out, None


def encode_tool_prompt(
    target: Target, messages: list[dict[str, Any]], tools: list[dict[str, Any]], **encode: Any
) -> torch.Tensor:
    """Token ids [1, n] of a conversation with `tools` shown as the target's chat template expects them (`encode`:
    more arguments of `Target.encode_prompt`, such as template_kwargs)."""
    convention = template_convention(target.tokenizer) if target.tokenizer is not None else "none"
    rendered, tools_arg = tool_messages(messages, tools, convention)
    if tools_arg:
        encode["template_kwargs"] = {**(encode.get("template_kwargs") or {}), "tools": tools_arg}
    return target.encode_prompt(rendered, **encode)


# ------------------------------------------------------------------------------------------------- the output
@dataclass
class ToolCallParser:
    """Splits a model's output into content and tool calls, text piece by text piece; `feed` and `finish` return
    OpenAI chat deltas. The content is the text outside the call blocks, without leading or trailing whitespace, so
    the streamed deltas add up to the non-streamed message. A block that is not a JSON call of one of `names`, or
    one left open at the end, stays content; with `parallel` false, calls after the first are dropped."""

    names: frozenset[str]
    parallel: bool = True
    calls: list[dict[str, Any]] = field(default_factory=list)
    content: str = ""
    _buffer: str = ""
    _in_block: bool = False
    _pending_space: str = ""

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._buffer += text
        deltas: list[dict[str, Any]] = []
        while True:
            if self._in_block:
                end = self._buffer.find(TOOL_CALL_END)
                if end < 0:
                    return deltas
                inner = self._buffer[:end]
                self._buffer = self._buffer[end + len(TOOL_CALL_END) :]
                self._in_block = False
                deltas += self._block(inner)
            else:
                start = self._buffer.find(TOOL_CALL_BEGIN)
                if start < 0:
                    keep = _partial_tag(self._buffer)
                    deltas += self._text(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return deltas
                deltas += self._text(self._buffer[:start])
                self._buffer = self._buffer[start + len(TOOL_CALL_BEGIN) :]
                self._in_block = True

    def finish(self) -> list[dict[str, Any]]:
        rest = (TOOL_CALL_BEGIN if self._in_block else "") + self._buffer
        self._buffer, self._in_block = "", False
        return self._text(rest)

    def _text(self, text: str) -> list[dict[str, Any]]:
        """Content, whitespace held back until more content follows (so none leads or trails)."""
        if not text:
            return []
        if not self.content:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            if self.content:
                self._pending_space += text
            return []
        out = self._pending_space + body
        self._pending_space = text[len(body) :]
        self.content += out
        return [{"content": out}]

    def _block(self, inner: str) -> list[dict[str, Any]]:
        call = _parse_call(inner, self.names)
        if call is None:
            return self._text(f"{TOOL_CALL_BEGIN}{inner}{TOOL_CALL_END}")
        if self.calls and not self.parallel:
            return []
        index = len(self.calls)
        self.calls.append(call)
        head = {"index": index, "id": call["id"], "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""}}  # fmt: skip
        args = {"index": index, "function": {"arguments": call["function"]["arguments"]}}
        return [{"tool_calls": [head]}, {"tool_calls": [args]}]


def _partial_tag(text: str) -> int:
    """The length of the longest end of `text` that begins TOOL_CALL_BEGIN (held back: the tag may be arriving)."""
    for n in range(min(len(text), len(TOOL_CALL_BEGIN) - 1), 0, -1):
        if TOOL_CALL_BEGIN.startswith(text[-n:]):
            return n
    return 0


def _parse_call(inner: str, names: frozenset[str]) -> dict[str, Any] | None:
    try:
        value = json.loads(inner)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def parse_tool_output(
    text: str, names: frozenset[str], parallel: bool = True
) -> tuple[str | None, list[dict]]:
    """(content or None, tool calls) of a whole answer: what the parser streams, at once."""
    parser = ToolCallParser(names, parallel)
    parser.feed(text)
    parser.finish()
    return (parser.content or None), parser.calls


__all__ = [
    "TOOL_CALL_BEGIN",
    "TOOL_CALL_END",
    "ToolCallParser",
    "ToolChoice",
    "ToolError",
    "encode_tool_prompt",
    "parse_tool_choice",
    "parse_tool_output",
    "parse_tools",
    "template_convention",
    "tool_constraint",
    "tool_messages",
]
