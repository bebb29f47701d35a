"""`--backend mlx` of the decoding commands (generate, serve, bench, eval): the option, and the options only the torch
backend runs, refused by name."""

from __future__ import annotations

from typing import Annotated, Any

import typer

BackendOption = Annotated[
    str,
    typer.Option(
        "--backend",
        help="torch (default) | mlx: Apple silicon through mlx-lm (pip install 'flashdraft[mlx]'; on Linux "
        "mlx[cpu]); greedy and sampled decoding, exact, one request at a time",
    ),
]

# Options of the decoding commands that the MLX backend does not run, with the value that means "not asked".
TORCH_ONLY = {
    "--compile": False,
    "--quantize": None,
    "--tree": "off",
    "--draft-vocab": "auto",
    "--device": None,
    "--threads": None,
    "--image": None,
    "--images": None,
    "--draft-sampling": "match",
}


def parse_backend(backend: str) -> str:
    from ..engine.request import GenerationError

    word = backend.strip().lower()
    if word not in ("torch", "mlx"):
        raise GenerationError(f"--backend must be torch or mlx, not {backend!r}")
    return word


def refuse_torch_only(given: dict[str, Any]) -> None:
    """One line naming the options asked of the MLX backend that only the torch backend runs."""
    from ..engine.request import GenerationError
    from ..extras import require_extra

    asked = [
        name
        for name, value in given.items()
        if name in TORCH_ONLY and value not in (TORCH_ONLY[name], [], ())
    ]
    if asked:
        raise GenerationError(
            f"{', '.join(asked)} {'is' if len(asked) == 1 else 'are'} not available with --backend mlx "
            "(the torch backend runs them; docs/mac.md says what runs where)"
        )
    require_extra("mlx", "mlx", "mlx_lm")


def mlx_dtype(dtype: str | None) -> str | None:
    """`--dtype` on MLX: the drafter's precision (the target runs in its checkpoint's)."""
    from ..engine.request import GenerationError

    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        raise GenerationError(f"--dtype must be float32, bfloat16 or float16, not {dtype!r}")
    return dtype
