"""`flashdraft eval`: a drafter's held-out τ, the one measurement every drafter in drafters/README.md is ranked by."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ..errors import one_line_errors
from .common import QuantizeOption, console, out, parse_block_size
from .mlx_backend import BackendOption, mlx_dtype, parse_backend, refuse_torch_only


@one_line_errors
def eval_command(
    target: Annotated[str, typer.Option(help="target model: pack name, local path or hub id")],
    draft: Annotated[str, typer.Option(help="drafter directory (z-lab format) or hub id")],
    datasets: Annotated[str, typer.Option(help="comma-separated: gsm8k, humaneval, mt-bench, ...")] = (
        "gsm8k,humaneval,mt-bench"
    ),
    samples: Annotated[int, typer.Option(help="prompts per dataset (the first N of a fixed shuffle)")] = 20,
    max_new_tokens: Annotated[int, typer.Option(help="tokens generated per prompt")] = 128,
    block_size: Annotated[
        int | None, typer.Option(help="fixed verify length (default: the drafter's block)")
    ] = None,
    dtype: Annotated[
        str | None, typer.Option(help="the target's dtype: float32 | bfloat16 | float16")
    ] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results here")] = None,
    quantize: QuantizeOption = None,
    backend: BackendOption = "torch",
) -> None:
    """τ (tokens per target forward) at T=0 and a fixed verify length on held-out benchmark prompts."""
    import torch

    from ..drafter.checkpoint import load_drafter_config
    from ..generate import GenerationError
    from ..pipeline import load_pipeline
    from ..prompts.benchmarks import DatasetError, load_bench_dataset
    from ..training.export import evaluate_tau

    names = [n.strip() for n in datasets.split(",") if n.strip()]
    if not names:
        raise GenerationError("--datasets names no dataset")
    if samples < 1 or max_new_tokens < 1:
        raise GenerationError("--samples and --max-new-tokens must be positive")
    if threads is not None:
        if threads < 1:
            raise GenerationError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    for name in names:  # an unknown dataset fails before any model loads
        try:
            load_bench_dataset(name, max_samples=1, seed=0)
        except (DatasetError, OSError) as e:
            raise GenerationError(str(e)) from None
    draft_config = load_drafter_config(draft)
    if block_size is not None:
        parse_block_size(str(block_size), draft_config.block_size)  # the same range check as `generate`
    if parse_backend(backend) == "mlx":
        refuse_torch_only({"--quantize": quantize, "--device": device, "--threads": threads})
        from ..mlx import generate as mlx_generate
        from ..mlx import load_pipeline as load_mlx_pipeline

        tgt, drafter = (mlx := load_mlx_pipeline(target, draft, dtype=mlx_dtype(dtype))).target, mlx.drafter
        results = evaluate_tau(
            tgt, drafter, names, samples, max_new_tokens, block_size, generate=mlx_generate
        )
        precision, where = tgt.dtype, "MLX"
    else:
        pipeline = load_pipeline(target, draft, dtype=dtype, device=device, quantize=quantize)
        tgt, drafter = pipeline.target, pipeline.drafter
        with torch.no_grad():  # not set_grad_enabled: a command run in-process leaves its caller's mode alone
            results = evaluate_tau(tgt, drafter, names, samples, max_new_tokens, block_size=block_size)
        precision, where = str(tgt.dtype).removeprefix("torch."), str(tgt.device)
    verify = block_size or drafter.block_size
    for name, r in results.items():
        out.print(f"τ {name}: {r['tau']:.2f} over {r['prompts']} prompts ({r['tokens_per_s']:.1f} tok/s)")
    console.print(f"T=0, verify length {verify}, {max_new_tokens} new tokens, target {precision} on {where}")
    if json_out is not None:
        record = {
            "target": target,
            "draft": str(draft),
            "block_size": verify,
            "max_new_tokens": max_new_tokens,
            "samples": samples,
            "dtype": precision,
            "backend": backend,
            "results": results,
        }
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(record, indent=2) + "\n")
