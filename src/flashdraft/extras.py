"""Optional parts of flashdraft and the packages they need: one line naming the `pip install` when one is missing.

[serve]  fastapi, uvicorn, prometheus-client     `flashdraft serve`
[packs]  gguf, accelerate                        converting the offline model packs
[bench]  matplotlib                              benchmark plots
[structured]  xgrammar                           structured output (response_format, guided_*; grammar.py)
"""

from __future__ import annotations


class MissingExtraError(RuntimeError):
    """An optional part of flashdraft is used without the packages it needs."""


def require_extra(extra: str, *modules: str) -> None:
    """Raise one line naming the `pip install` to run when any of these modules cannot be imported."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(
            f"this needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed: "
            f"pip install 'flashdraft[{extra}]'"
        )
