"""`--backend mlx` of the decoding commands: the options the MLX backend runs, the ones it refuses by name, and
`generate` on it (the report is the torch backend's, so scripts read either)."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated, Any

import typer

from .common import console, out

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


def generate_mlx(
    *,
    prompt: str,
    target: str,
    draft: Any,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    block_size: Any,
    seed: int | None,
    compare_ar: bool,
    as_json: bool,
    chat: bool,
    system: str | None,
    thinking: bool | None,
    dtype: str | None,
    verbose: bool,
    constraint: Any,
    streamer: Any,
    report: Any,
    summary: Any,
) -> None:
    """`flashdraft generate --backend mlx`: the same run and report as on torch, decoded by flashdraft.mlx."""
    import random

    from ..mlx import generate, generate_ar, load_pipeline
    from ..pipeline import check_pair
    from ..targets.target import encode_chat

    check_pair(target, draft)  # the configs checked (and a pack fetched) before any weight
    t0 = time.perf_counter()
    pipeline = load_pipeline(target, draft, dtype=mlx_dtype(dtype))
    load_s = time.perf_counter() - t0
    tgt = pipeline.target
    if verbose:
        console.print(f"loaded {target} and drafter {draft} on MLX in {load_s:.1f} s")
    ids = encode_chat(tgt.tokenizer, prompt, chat, thinking, system)
    if constraint is not None:  # an invalid regex or grammar is named before any decoding
        from ..engine.grammar import compile_constraint

        compile_constraint(tgt, constraint)
    if seed is None and compare_ar:  # sampling is seed-exact: one seed for both runs makes them comparable
        seed = random.randrange(2**31)
    kwargs = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, response_format=constraint)
    if block_size == "auto" and pipeline.drafter.prices is None:
        console.print("measuring this MLX device's prices for the verify policy…")
    # Warm both paths up so first-call overheads do not count against either of them.
    generate(pipeline, None, ids[-8:], 4, block_size=block_size, stop_token_ids=[])
    if compare_ar:
        generate_ar(pipeline, ids[-8:], 4, stop_token_ids=[])
    if verbose and pipeline.drafter.prices is not None:
        console.print(pipeline.drafter.prices.summary(), soft_wrap=True)
    show = streamer(tgt.tokenizer, enabled=not as_json)
    res = generate(pipeline, None, ids, max_new_tokens, block_size=block_size, on_tokens=show, **kwargs)
    if not as_json:
        sys.stdout.write("\n")
    ar = None
    if compare_ar:
        console.print(
            f"running plain decoding on the same prompt for comparison ({max_new_tokens} tokens at most)…"
        )
        ar = generate_ar(pipeline, ids, max_new_tokens, **kwargs)
    text = tgt.tokenizer.decode(res.new_tokens, skip_special_tokens=True)
    rep = report(text, target, draft, pipeline.drafter, res, ar, load_s, block_size, None)
    rep["backend"] = "mlx"
    if as_json:
        out.print_json(json.dumps(rep))
        return
    summary(rep, res, ar, temperature, seed, "match")
