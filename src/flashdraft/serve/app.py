"""The OpenAI-compatible HTTP layer: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`, `/metrics`.

Bad input is answered with a 4xx and an OpenAI-style error body, and nothing else is disturbed; a client that goes
away mid-request cancels it and frees its place.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

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


def build_app(engine: Engine, model_name: str, allow_local_images: bool = False) -> FastAPI:
    """`allow_local_images`: image parts may name files on this machine (else only data: URLs are read)."""
    app = FastAPI(title="flashdraft", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(model_name)
    created = int(time.time())
    target = engine.target

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, e: HTTPException) -> JSONResponse:
        """What the framework answers itself (an unknown path, a wrong method, a body it cannot parse, such as
        JSON nested too deep) gets the same OpenAI error body as everything else."""
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        if e.status_code >= 500:
            kind = "server_error"
        body = APIError(e.status_code, str(e.detail), kind).body()
        return JSONResponse(body, status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg", e))
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(
                ": "
            )
        return JSONResponse(APIError(400, message, param=where or None).body(), status_code=400)

    @app.get("/version")
    async def version() -> dict[str, Any]:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version

        try:
            return {"version": package_version("flashdraft")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        if body.messages is not None:
            try:
                tools = parse_tools(body.tools)
            except ToolError as e:
                raise APIError(400, str(e), param=e.param) from None
            ids = chat_prompt(body.messages, tools, body.chat_template_kwargs)
            ids = ids if isinstance(ids, list) else ids.input_ids[0].tolist()
        else:
            ids = target.encode_prompt(body.prompt or "", chat=False)[0].tolist() if body.prompt else []
        return {"count": len(ids), "max_model_len": target.max_context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        if any(not 0 <= i < target.vocab_size for i in body.tokens):
            raise APIError(400, f"token ids must lie in 0..{target.vocab_size - 1}", param="tokens")
        return {"prompt": target.tokenizer.decode(body.tokens)}

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 once the engine is ready; 503 while it warms up (`--compile`: minutes of compiling) or drains."""
        status = "ok" if engine.ready else "stopping" if engine.closing else "starting"
        body = {"status": status, "waiting": engine.waiting, "running": engine.running}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "flashdraft"}],
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(
            metrics.render(
                engine.waiting, engine.running, dict(engine.steps_by_rows), engine.decode_s, engine.grammar_s
            ),
            media_type=CONTENT_TYPE_LATEST,
        )

    def chat_prompt(
        messages: list[Any], tools: list[dict[str, Any]], template_kwargs: dict[str, Any] | None
    ) -> list[int] | ImagePrompt:
        """Token ids of the conversation, with the tools shown as the chat template expects (tool_calls.py); with
        images, the processor's `ImagePrompt` (multimodal.py)."""
        if any(m.images for m in messages):
            return image_prompt(messages, tools, template_kwargs)
        try:
            ids = encode_tool_prompt(
                target, [m.for_template() for m in messages], tools, template_kwargs=template_kwargs
            )
            return ids[0].tolist()
        except ToolError as e:
            raise APIError(400, str(e), param=e.param) from None
        except TemplateError as e:  # the template's own refusal ("roles must alternate"), not a server error
            raise APIError(400, f"the chat template refused the messages: {e}", param="messages") from None

    def image_prompt(
        messages: list[Any], tools: list[dict[str, Any]], template_kwargs: dict[str, Any] | None
    ) -> ImagePrompt:
        if not target.takes_images or target.processor is None:
            raise APIError(
                400,
                f"the model {model_name!r} takes no images: its messages may not hold image_url parts",
                param="messages",
            )
        sources = [source for m in messages for source in m.images]
        kwargs = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        try:
            images = [load_image(s, allow_local_images, name=f"{i + 1}") for i, s in enumerate(sources)]
            return encode_image_prompt(
                target, [m.for_template() for m in messages], images, template_kwargs=kwargs
            )
        except ImageError as e:
            raise APIError(400, str(e), param="messages") from None
        except TemplateError as e:
            raise APIError(400, f"the chat template refused the messages: {e}", param="messages") from None

    def check(
        body: ChatCompletionRequest | CompletionRequest,
        prompt_ids: list[int],
        call_constraint: Constraint | None = None,
        prompt_inputs: dict[str, Any] | None = None,
    ) -> EngineRequest:
        ignored = body.ignored_fields()
        if ignored:
            log.warning("ignoring request fields this server does not use: %s", ", ".join(ignored))
        if body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", "model")  # fmt: skip
        field_name = body.unsupported()
        if field_name:
            raise APIError(400, f"{field_name} is not supported by this server", param=field_name)
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if max(prompt_ids) >= target.vocab_size or min(prompt_ids) < 0:
            raise APIError(400, f"prompt token ids must lie in 0..{target.vocab_size - 1}", param="prompt")
        limit = body.limit or max(1, target.max_context - len(prompt_ids))
        if len(prompt_ids) + limit > target.max_context:
            raise APIError(
                400,
                f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({limit}) exceeds the model's context of "
                f"{target.max_context} tokens",
                param="max_tokens",
            )
        stop_strings, stop_ids = body.stop_strings_and_ids()
        if any(not 0 <= i < target.vocab_size for i in stop_ids):
            raise APIError(400, f"stop token ids must lie in 0..{target.vocab_size - 1}", param="stop")
        constraint, asked_by = body.constraint()
        if call_constraint is not None:  # tool_choice required / a named function
            if constraint is not None:
                raise APIError(400, f"tool_choice and {asked_by} both constrain the output: give one",
                               param="tool_choice")  # fmt: skip
            constraint, asked_by = call_constraint, "tools"
        if constraint is not None:
            try:  # compiled here (and cached), so a bad schema is a 400 before the request queues
                compile_constraint(target, constraint)
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
        request = check(body, prompt_ids, call_constraint, prompt_inputs)
        ignored = body.ignored_fields()
        headers = {IGNORED_HEADER: ",".join(ignored)} if ignored else None
        try:
            handle = engine.submit(request, asyncio.get_running_loop())
        except QueueFullError as e:
            metrics.observe(endpoint, 503, None, 0.0)
            raise APIError(503, str(e), "server_overloaded") from None
        t0 = time.perf_counter()
        rid = f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _sse(handle, rid, chunk, include_usage, lambda info: metrics.observe(
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
                    metrics.observe(endpoint, 500, None, 0.0)
                    raise APIError(500, value, "server_error")
                else:
                    metrics.observe(endpoint, 200, value, time.perf_counter() - t0)
                    response = final(rid, "".join(pieces), value)
                    if body.return_meta_info:
                        response["meta_info"] = _meta_info(rid, value)
                    return JSONResponse(response, headers=headers)
        finally:
            handle.cancel()  # no-op when finished; frees the place when the client went away

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest) -> Response:
        tools, choice = body.tool_plan()
        shown = tools if choice.mode != "none" else []  # tool_choice "none": the model is not shown them
        prompt = chat_prompt(body.messages, shown, body.chat_template_kwargs)
        inputs = None
        if isinstance(prompt, ImagePrompt):
            prompt, inputs = prompt.input_ids[0].tolist(), prompt.inputs
        prompt_ids = prompt
        names = frozenset(t["function"]["name"] for t in shown)
        parser = (lambda: ToolCallParser(names, body.parallel_tool_calls)) if shown else None

        def chunk(rid: str, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_name,
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
                "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None,
                             **_token_ids(body, prompt_ids, info)}],
                "usage": _usage(info), "spec_decode": info.get("spec_decode"),
            }  # fmt: skip

        constraint = tool_constraint(tools, choice, body.parallel_tool_calls)
        return await run("chat", body, prompt_ids, chunk, final, constraint, parser, inputs)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        if isinstance(body.prompt, str):
            prompt_ids = target.encode_prompt(body.prompt, chat=False)[0].tolist() if body.prompt else []
        else:
            prompt_ids = list(body.prompt)
        if body.echo:
            raise APIError(400, "echo is not supported by this server", param="echo")

        def chunk(rid: str, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                    "choices": [{"index": 0, "text": delta.get("content", ""), "finish_reason": finish,
                                 "logprobs": None}]}  # fmt: skip

        def final(rid: str, text: str, info: dict[str, Any]) -> dict[str, Any]:
            return {
                "id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": [{"index": 0, "text": text, "finish_reason": info["finish_reason"], "logprobs": None,
                             **_token_ids(body, prompt_ids, info)}],
                "usage": _usage(info), "spec_decode": info.get("spec_decode"),
            }  # fmt: skip

        return await run("completion", body, prompt_ids, chunk, final)

    app.state.engine = engine
    app.state.metrics = metrics
    return app


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


def run_server(engine: Engine, app: FastAPI, host: str, port: int) -> bool:
    """Serve `app` until SIGINT / SIGTERM, then drain: the HTTP server (uvicorn) in a thread, the engine's worker
    on this one (the main thread: see `Engine.run` for why). Returns whether the server came up."""
    import signal
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))

    def http() -> None:
        try:
            server.run()  # outside the main thread uvicorn leaves the signals to us
        finally:
            engine.close()  # stop admitting; the worker (on the main thread) answers what is left, then returns

    handlers = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=http, name="flashdraft-http", daemon=True)
    thread.start()
    try:
        engine.run()
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return server.started
