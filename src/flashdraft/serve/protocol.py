"""OpenAI API request models (the subset flashdraft serves) and the error body every 4xx/5xx carries."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..engine.grammar import Constraint, GrammarError, constraint_from_response_format
from ..engine.tool_calls import ToolChoice, ToolError, parse_tool_choice, parse_tools


class APIError(Exception):
    """An error answered as OpenAI does: HTTP status + {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": None}}


def clean_text(value: Any) -> Any:
    """Valid JSON may carry lone UTF-16 surrogates ("\\ud800") that no tokenizer can encode: each becomes U+FFFD,
    as a UTF-8 decoder would make of them. Lists of strings are cleaned element by element."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [clean_text(v) for v in value]
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


# Fields other servers take that would change the answer, refused (400) unless at their no-op value; any other field
# this server does not know cannot change the answer and is ignored with a warning (logged and named in the
# `x-flashdraft-ignored-fields` response header), as vLLM does.
REFUSED_UNLESS = {
    "functions": lambda v: not v,  # the deprecated forms of tools / tool_choice
    "function_call": lambda v: v in (None, "none"),
    "top_logprobs": lambda v: not v,
    "prompt_logprobs": lambda v: not v,
    "best_of": lambda v: v in (None, 1),
    "repetition_penalty": lambda v: v in (None, 1, 1.0),
    "min_p": lambda v: not v,
    "min_tokens": lambda v: not v,
    "ignore_eos": lambda v: not v,
    "logits_processors": lambda v: not v,
    "suffix": lambda v: not v,
}
# vLLM's structured-output fields (its older `guided_*` names and its `structured_outputs` object), beside OpenAI's
# `response_format`: each names one kind of constraint (grammar.py).
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


class _Sampling(BaseModel):
    """Fields shared by both endpoints. Unknown fields are kept in `model_extra`: refused when they would change the
    answer (`REFUSED_UNLESS`), else ignored with a warning (`ignored_fields`)."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # extension (vLLM has it too); 0 = off
    n: int = 1
    stop: str | list[str] | list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extension (vLLM's name): the prompt's and the answer's token ids in each choice, so a client that trains on
    # the answers (`flashdraft data regenerate --backend openai`) never re-tokenises text.
    return_token_ids: bool = False
    # SGLang's flag (z-lab's benchmark harness sends it): a `meta_info` object with the speculative statistics.
    return_meta_info: bool = False
    # Passed to the chat template (e.g. {"enable_thinking": false} for templates that have it).
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted only at their no-op values (clients send them by default); anything else is refused.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None
    logit_bias: dict[str, float] | None = None
    # Structured output: OpenAI's field; vLLM's (GUIDED_FIELDS) arrive in model_extra.
    response_format: dict[str, Any] | None = None

    _clean_stop = field_validator("stop")(classmethod(lambda cls, v: clean_text(v)))

    def ignored_fields(self) -> list[str]:
        """Fields this server does not know and that cannot change the answer."""
        return sorted(
            k for k in (self.model_extra or {}) if k not in REFUSED_UNLESS and k not in GUIDED_FIELDS
        )

    def constraint(self) -> tuple[Constraint | None, str | None]:
        """The structured-output constraint asked for, and the field that asked; at most one field may (else a
        400 naming the field)."""
        extra = self.model_extra or {}
        asked = [name for name in GUIDED_FIELDS if extra.get(name) is not None]
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            asked.insert(0, "response_format")
        if not asked:
            return None, None
        if len(asked) > 1:
            raise APIError(400, f"{' and '.join(asked)} both constrain the output: give one", param=asked[0])
        name = asked[0]
        try:
            if name == "response_format":
                return constraint_from_response_format(self.response_format), name
            if name == "structured_outputs":
                return structured_outputs(extra[name]), name
            return guided(name.removeprefix("guided_"), extra[name]), name
        except GrammarError as e:
            raise APIError(400, f"{name}: {e}", param=name) from None

    def unsupported(self) -> str | None:
        for name, value in (self.model_extra or {}).items():
            if name in REFUSED_UNLESS and not REFUSED_UNLESS[name](value):
                return name
        if self.n != 1:
            return "n"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty" if self.presence_penalty else "frequency_penalty"
        if self.logprobs:
            return "logprobs"
        if self.logit_bias:
            return "logit_bias"
        if self.return_token_ids and self.stream:
            return "return_token_ids with stream"
        return None

    def stop_strings_and_ids(self) -> tuple[list[str], list[int]]:
        stop = self.stop
        if stop is None:
            return [], []
        if isinstance(stop, str):
            return [stop], []
        if all(isinstance(s, int) for s in stop):
            return [], [int(s) for s in stop]
        return [str(s) for s in stop], []


def guided(kind: str, value: Any) -> Constraint | None:
    """One of vLLM's constraint kinds: json (a schema, or its JSON text), regex, choice (strings), grammar (EBNF,
    or Lark when it has no `::=`), json_object (true)."""
    if kind == "json":
        return Constraint.json_schema(value)
    if kind == "json_object":
        return Constraint("json_object") if value else None
    if kind == "choice":
        return Constraint.choice(value)
    if not isinstance(value, str) or not value:
        raise GrammarError(f"{kind} must be a non-empty string")
    if kind == "regex":
        return Constraint("regex", value)
    if kind == "grammar":
        return Constraint.grammar(value)
    raise GrammarError(f"unknown constraint {kind!r}")


def structured_outputs(value: Any) -> Constraint | None:
    """vLLM's `structured_outputs` object: exactly one of json, regex, choice, grammar, json_object."""
    if not isinstance(value, dict):
        raise GrammarError('structured_outputs must be an object such as {"json": {...}}')
    kinds = ("json", "regex", "choice", "grammar", "json_object")
    other = sorted(k for k in value if k not in kinds and value[k] not in (None, False))
    if other:
        raise GrammarError(f"structured_outputs.{other[0]} is not supported ({', '.join(kinds)})")
    given = [k for k in kinds if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise GrammarError(f"structured_outputs needs exactly one of {', '.join(kinds)}")
    return guided(given[0], value[given[0]])


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    image_url: ImageURL | str | None = (
        None  # an image part: a data: URL (or a local file, where the server allows)
    )

    @property
    def image_source(self) -> str:
        url = self.image_url.url if isinstance(self.image_url, ImageURL) else self.image_url
        if not url:
            raise ValueError("an image_url part needs image_url.url")
        return url


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any]

    @field_validator("arguments")
    @classmethod
    def _object(cls, value: str | dict[str, Any]) -> dict[str, Any]:
        """OpenAI sends a call's arguments as JSON text; chat templates want the object."""
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"the arguments are not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError("the arguments must be a JSON object")
        return value


class ToolCall(BaseModel):
    """A call in an assistant message of the history."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message answers this call
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text(cls, value: str | list[ContentPart] | None) -> str | list[ContentPart] | None:
        """A string, or an array of content parts (OpenAI's other form): text parts alone are joined; with image
        parts the array stays, for an image-text target (multimodal.py); other kinds (audio, files) are refused."""
        if isinstance(value, list):
            other = sorted({p.type for p in value if p.type not in ("text", "image_url")})
            if other:
                raise ValueError(
                    f"content parts of type {', '.join(other)} are not supported (text and images)"
                )
            for p in value:
                if p.type == "image_url":
                    p.image_source  # noqa: B018 - a part without its URL is refused here
                else:
                    p.text = clean_text(p.text or "")
            if all(p.type == "text" for p in value):
                return "".join(p.text or "" for p in value)
            return value
        return clean_text(value)

    @property
    def images(self) -> list[str]:
        """The sources of this message's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [p.image_source for p in self.content if p.type == "image_url"]

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (developer is system; a call's arguments an object)."""
        content: Any = self.content
        if isinstance(content, list):  # with images: the processors' parts, an image's place marked
            content = [
                {"type": "image"} if p.type == "image_url" else {"type": "text", "text": p.text or ""}
                for p in content
            ]
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": content,
        }
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in self.tool_calls
            ]
            out["content"] = self.content or ""
        if self.role == "tool":
            out.update({k: v for k, v in (("tool_call_id", self.tool_call_id), ("name", self.name)) if v})
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    def tool_plan(self) -> tuple[list[dict[str, Any]], ToolChoice]:
        """The checked tools and tool choice (a 400 naming the field if bad)."""
        try:
            tools = parse_tools(self.tools)
            return tools, parse_tool_choice(self.tool_choice, tools)
        except ToolError as e:
            raise APIError(400, str(e), param=e.param) from None

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    echo: bool = False

    _clean_prompt = field_validator("prompt")(classmethod(lambda cls, v: clean_text(v)))

    @property
    def limit(self) -> int | None:
        return self.max_tokens or 16  # OpenAI's default for completions


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt (plain text) or chat messages (through the chat template)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    _clean_prompt = field_validator("prompt")(classmethod(lambda cls, v: clean_text(v)))


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids to text."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]
