"""`flashdraft serve`: an OpenAI-compatible server over the speculative engine (protocol, engine, metrics, app)."""

from .app import ServeError, bind_port, bound_address, build_app, run_server
from .engine import Engine, EngineRequest

__all__ = ["Engine", "EngineRequest", "ServeError", "bind_port", "bound_address", "build_app", "run_server"]
