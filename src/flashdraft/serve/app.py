"""The OpenAI-compatible HTTP layer: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`, `/metrics`.

Bad input is answered with a 4xx and an OpenAI-style error body, and nothing else is disturbed; a client that goes
away mid-request cancels it and frees its place.
"""

from __future__ import annotations

import logging
import socket

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .engine import Engine
from .protocol import APIError
from .routes import OpenAIRoutes

log = logging.getLogger(__name__)


class ServeError(ValueError):
    """The server cannot start where it was asked to (a taken port, an unknown host): one line."""


def build_app(engine: Engine, model_name: str, allow_local_images: bool = False) -> FastAPI:
    """`allow_local_images`: image parts may name files on this machine (else only data: URLs are read)."""
    app = FastAPI(title="flashdraft", docs_url=None, redoc_url=None)

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

    routes = OpenAIRoutes(engine, model_name, allow_local_images)
    routes.mount(app)
    app.state.engine = engine
    app.state.metrics = routes.metrics
    return app


def bind_port(host: str, port: int) -> socket.socket:
    """The server's socket, bound to (host, port) before anything is loaded, so a taken port is said at once rather
    than after the model has loaded; port 0 takes a free one (`bound_address` says which). It listens only once the
    server runs (until then a client is refused, not left waiting)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as e:
        raise ServeError(f"cannot serve on {host}:{port}: {e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None
    return sock


def bound_address(sock: socket.socket) -> str:
    """`http://host:port` of a bound socket (the port it got, where 0 was asked)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_server(engine: Engine, app: FastAPI, sock: socket.socket) -> bool:
    """Serve `app` on `sock` (`bind_port`) until SIGINT / SIGTERM, then drain: the HTTP server (uvicorn) in a thread,
    the engine's worker on this one (the main thread: see `Engine.run` for why). Returns whether the server came
    up."""
    import signal
    import threading

    import uvicorn

    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))

    def http() -> None:
        try:
            server.run(sockets=[sock])  # outside the main thread uvicorn leaves the signals to us
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
        sock.close()
    return server.started
