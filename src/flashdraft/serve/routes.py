"""The OpenAI-compatible routes: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/tokenize`, `/detokenize`,
`/version`, `/health`, `/metrics` (app.py builds the app around them: its error handlers, the server's run)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST

from ..engine.grammar import Constraint, GrammarError, compile_constraint
from ..engine.tool_calls import (
    ToolCallParser,
    ToolError,
    encode_tool_prompt,
    parse_tool_output,
    parse_tools,
    tool_constraint,
)
from ..extras import MissingExtraError
from ..targets.multimodal import ImageError, ImagePrompt, encode_image_prompt, load_image
from .engine import Engine, EngineRequest, QueueFullError, RequestHandle
from .metrics import ServerMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

log = logging.getLogger(__name__)
IGNORED_HEADER = "x-flashdraft-ignored-fields"


ROUTES = [  # (path, method of OpenAIRoutes, HTTP method)
    ("/version", "version", "GET"),
    ("/tokenize", "tokenize", "POST"),
    ("/detokenize", "detokenize", "POST"),
    ("/health", "health", "GET"),
    ("/v1/models", "models", "GET"),
    ("/metrics", "prometheus", "GET"),
    ("/v1/chat/completions", "chat", "POST"),
    ("/v1/completions", "completions", "POST"),
]


class OpenAIRoutes:
    """The routes of the OpenAI-compatible surface over one engine (`build_app` mounts them): tokenizer endpoints,
    health, models, metrics, and chat and text completions, with the checks every request gets first."""

    def __init__(self, engine: Engine, model_name: str, allow_local_images: bool = False) -> None:
        self.engine = engine
        self.model_name = model_name
        self.allow_local_images = allow_local_images
        self.metrics = ServerMetrics(model_name)
        self.created = int(time.time())
        self.target = engine.target

    def mount(self, app: FastAPI) -> None:
        for path, endpoint, method in ROUTES:
            app.add_api_route(path, getattr(self, endpoint), methods=[method])

    async def version(self) -> dict[str, Any]:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version

        try:
            return {"version": package_version("flashdraft")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        if body.messages is not None:
            try:
                tools = parse_tools(body.tools)
            except ToolError as e:
                raise APIError(400, str(e), param=e.param) from None
            ids = self.chat_prompt(body.messages, tools, body.chat_template_kwargs)
            ids = ids if isinstance(ids, list) else ids.input_ids[0].tolist()
        else:
            ids = self.target.encode_prompt(body.prompt or "", chat=False)[0].tolist() if body.prompt else []
        return {"count": len(ids), "max_model_len": self.target.max_context, "tokens": ids}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        if any(not 0 <= i < self.target.vocab_size for i in body.tokens):
            raise APIError(400, f"token ids must lie in 0..{self.target.vocab_size - 1}", param="tokens")
        return {"prompt": self.target.tokenizer.decode(body.tokens)}

    async def health(self) -> JSONResponse:
        """200 once the engine is ready; 503 while it warms up (`--compile`: minutes of compiling) or drains."""
        status = "ok" if self.engine.ready else "stopping" if self.engine.closing else "starting"
        body = {"status": status, "waiting": self.engine.waiting, "running": self.engine.running}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "flashdraft"}
            ],
        }

    async def prometheus(self) -> Response:
        return Response(
            self.metrics.render(
                self.engine.waiting,
                self.engine.running,
                dict(self.engine.steps_by_rows),
                self.engine.decode_s,
                self.engine.grammar_s,
            ),
            media_type=CONTENT_TYPE_LATEST,
        )

    def chat_prompt(
        self, messages: list[Any], tools: list[dict[str, Any]], template_kwargs: dict[str, Any] | None
    ) -> list[int] | ImagePrompt:
        """Token ids of the conversation, with the tools shown as the chat template expects (tool_calls.py); with
        images, the processor's `ImagePrompt` (multimodal.py)."""
        if any(m.images for m in messages):
            return self.image_prompt(messages, tools, template_kwargs)
        try:
            ids = encode_tool_prompt(
                self.target, [m.for_template() for m in messages], tools, template_kwargs=template_kwargs
            )
            return ids[0].tolist()
        except ToolError as e:
            raise APIError(400, str(e), param=e.param) from None
        except TemplateError as e:  # the template's own refusal ("roles must alternate"), not a server error
            raise APIError(400, f"the chat template refused the messages: {e}", param="messages") from None

    def image_prompt(
        self, messages: list[Any], tools: list[dict[str, Any]], template_kwargs: dict[str, Any] | None
    ) -> ImagePrompt:
        if not self.target.takes_images or self.target.processor is None:
            raise APIError(
                400,
                f"the model {self.model_name!r} takes no images: its messages may not hold image_url parts",
                param="messages",
            )
        sources = [source for m in messages for source in m.images]
        kwargs = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        try:
            images = [load_image(s, self.allow_local_images, name=f"{i + 1}") for i, s in enumerate(sources)]
            return encode_image_prompt(
                self.target, [m.for_template() for m in messages], images, template_kwargs=kwargs
            )
        except ImageError as e:
            raise APIError(400, str(e), param="messages") from None
        except TemplateError as e:
            raise APIError(400, f"the chat template refused the messages: {e}", param="messages") from None

    def check(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        prompt_ids: list[int],
        call_constraint: Constraint | None = None,
        prompt_inputs: dict[str, Any] | None = None,
    ) -> EngineRequest:
        ignored = body.ignored_fields()
        if ignored:
            log.warning("ignoring request fields this server does not use: %s", ", ".join(ignored))
        if body.model != self.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", "model")  # fmt: skip
        field_name = body.unsupported()
        if field_name:
            raise APIError(400, f"{field_name} is not supported by this server", param=field_name)
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if max(prompt_ids) >= self.target.vocab_size or min(prompt_ids) < 0:
            raise APIError(
                400, f"prompt token ids must lie in 0..{self.target.vocab_size - 1}", param="prompt"
            )
        limit = body.limit or max(1, self.target.max_context - len(prompt_ids))
        if len(prompt_ids) + limit > self.target.max_context:
            raise APIError(
                400,
                f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({limit}) exceeds the model's context of "
                f"{self.target.max_context} tokens",
                param="max_tokens",
            )
        stop_strings, stop_ids = body.stop_strings_and_ids()
        if any(not 0 <= i < self.target.vocab_size for i in stop_ids):
            raise APIError(400, f"stop token ids must lie in 0..{self.target.vocab_size - 1}", param="stop")
        constraint, asked_by = body.constraint()
        if call_constraint is not None:  # tool_choice required / a named function
            if constraint is not None:
                raise APIError(400, f"tool_choice and {asked_by} both constrain the output: give one",
                               param="tool_choice")  # fmt: skip
            constraint, asked_by = call_constraint, "tools"
        if constraint is not None:
            try:  # compiled here (and cached), so a bad schema is a 400 before the request queues
                compile_constraint(self.target, constraint)
            except (GrammarError, MissingExtraError) as e:
                raise APIError(400, f"{asked_by}: {e}", param=asked_by) from None
        return EngineRequest(
            prompt_ids=prompt_ids,
            max_tokens=limit,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop_strings=stop_strings,
            stop_ids=stop_ids,
            constraint=constraint,
            prompt_inputs=prompt_inputs,
        )

    async def run(
        self,
        endpoint: str,
        body: ChatCompletionRequest | CompletionRequest,
        prompt_ids: list[int],
        chunk: Any,
        final: Any,
        call_constraint: Constraint | None = None,
        parser: Any = None,
        prompt_inputs: dict[str, Any] | None = None,
    ) -> Response:
        """Queue the request and answer it, streamed or whole. `parser`: makes a ToolCallParser when the answer may
        hold tool calls (a stream's deltas are its; `final` parses a whole answer the same way). `prompt_inputs`:
        an image prompt's pixels and grids for the prefill."""
        request = self.check(body, prompt_ids, call_constraint, prompt_inputs)
        ignored = body.ignored_fields()
        headers = {IGNORED_HEADER: ",".join(ignored)} if ignored else None
        try:
            handle = self.engine.submit(request, asyncio.get_running_loop())
        except QueueFullError as e:
            self.metrics.observe(endpoint, 503, None, 0.0)
            raise APIError(503, str(e), "server_overloaded") from None
        t0 = time.perf_counter()
        rid = f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _sse(handle, rid, chunk, include_usage, lambda info: self.metrics.observe(
                    endpoint, 200, info, time.perf_counter() - t0), parser() if parser else None),
                media_type="text/event-stream", headers=headers,
            )  # fmt: skip
        pieces: list[str] = []
        try:
            while True:
                kind, value = await handle.events.get()
                if kind == "text":
                    pieces.append(value)
                elif kind == "error":
                    self.metrics.observe(endpoint, 500, None, 0.0)
                    raise APIError(500, value, "server_error")
                else:
                    self.metrics.observe(endpoint, 200, value, time.perf_counter() - t0)
                    response = final(rid, "".join(pieces), value)
                    if body.return_meta_info:
                        response["meta_info"] = _meta_info(rid, value)
                    return JSONResponse(response, headers=headers)
        finally:
            handle.cancel()  # no-op when finished; frees the place when the client went away

    async def chat(self, body: ChatCompletionRequest) -> Response:
        tools, choice = body.tool_plan()
        shown = tools if choice.mode != "none" else []  # tool_choice "none": the model is not shown them
        prompt = self.chat_prompt(body.messages, shown, body.chat_template_kwargs)
        inputs = None
        if isinstance(prompt, ImagePrompt):
            prompt, inputs = prompt.input_ids[0].tolist(), prompt.inputs
        prompt_ids = prompt
        names = frozenset(t["function"]["name"] for t in shown)
        parser = (lambda: ToolCallParser(names, body.parallel_tool_calls)) if shown else None

        def chunk(rid: str, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model_name,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}  # fmt: skip

        def final(rid: str, text: str, info: dict[str, Any]) -> dict[str, Any]:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = info["finish_reason"]
            if parser is not None:
                message["content"], calls = parse_tool_output(text, names, body.parallel_tool_calls)
                if calls:
                    message["tool_calls"] = calls
                    finish = "tool_calls" if finish == "stop" else finish
            return {
                "id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None,
                             **_token_ids(body, prompt_ids, info)}],
                "usage": _usage(info), "spec_decode": info.get("spec_decode"),
            }  # fmt: skip

        constraint = tool_constraint(tools, choice, body.parallel_tool_calls)
        return await self.run("chat", body, prompt_ids, chunk, final, constraint, parser, inputs)

    async def completions(self, body: CompletionRequest) -> Response:
        if isinstance(body.prompt, str):
            prompt_ids = self.target.encode_prompt(body.prompt, chat=False)[0].tolist() if body.prompt else []
        else:
            prompt_ids = list(body.prompt)
        if body.echo:
            raise APIError(400, "echo is not supported by this server", param="echo")

        def chunk(rid: str, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                    "choices": [{"index": 0, "text": delta.get("content", ""), "finish_reason": finish,
                                 "logprobs": None}]}  # fmt: skip

        def final(rid: str, text: str, info: dict[str, Any]) -> dict[str, Any]:
            return {
                "id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": 0, "text": text, "finish_reason": info["finish_reason"], "logprobs": None,
                             **_token_ids(body, prompt_ids, info)}],
                "usage": _usage(info), "spec_decode": info.get("spec_decode"),
            }  # fmt: skip

        return await self.run("completion", body, prompt_ids, chunk, final)


def _token_ids(body: Any, prompt_ids: list[int], info: dict[str, Any]) -> dict[str, Any]:
    """`return_token_ids`: every generated id (a stop token included; text cut by a stop string is not re-cut)."""
    if not body.return_token_ids:
        return {}
    return {"prompt_token_ids": prompt_ids, "token_ids": info["result"].new_tokens}


def _meta_info(rid: str, info: dict[str, Any]) -> dict[str, Any]:
    """SGLang's `meta_info` (what z-lab's benchmark harness reads τ from): verify forwards of the decode phase and
    tokens per verify forward, bonus token included, with the histogram of tokens per step."""
    result = info["result"]
    steps = result.num_steps
    return {
        "id": rid,
        "prompt_tokens": info["prompt_tokens"],
        "completion_tokens": info["completion_tokens"],
        "spec_verify_ct": steps,
        "spec_accept_length": result.mean_acceptance_length if steps else 1.0,
        "spec_accept_histogram": [
            result.acceptance_lengths.count(n) for n in range(max(result.acceptance_lengths, default=0) + 1)
        ],
    }


def _usage(info: dict[str, Any]) -> dict[str, int]:
    p, c = info["prompt_tokens"], info["completion_tokens"]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def _sse(
    handle: RequestHandle,
    rid: str,
    chunk: Any,
    include_usage: bool,
    on_done: Any,
    parser: ToolCallParser | None = None,
) -> AsyncIterator[str]:
    def event(obj: Any) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    try:
        yield event(chunk(rid, {"role": "assistant", "content": ""}, None))
        while True:
            kind, value = await handle.events.get()
            if kind == "text":
                for delta in parser.feed(value) if parser else [{"content": value}]:
                    yield event(chunk(rid, delta, None))
            elif kind == "error":
                yield event(APIError(500, value, "server_error").body())
                break
            else:
                on_done(value)
                finish = value["finish_reason"]
                if parser is not None:
                    for delta in parser.finish():
                        yield event(chunk(rid, delta, None))
                    finish = "tool_calls" if parser.calls and finish == "stop" else finish
                last = chunk(rid, {}, finish)
                last["spec_decode"] = value.get("spec_decode")
                yield event(last)
                if include_usage:
                    usage = chunk(rid, {}, None)
                    usage["choices"], usage["usage"] = [], _usage(value)
                    yield event(usage)
                break
        yield "data: [DONE]\n\n"
    finally:
        handle.cancel()  # the client went away mid-stream (or we are done): free the place at once
