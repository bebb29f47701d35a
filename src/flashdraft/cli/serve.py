"""`flashdraft serve`: the OpenAI-compatible server."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import one_line_errors
from .common import (
    CompileOption,
    DraftVocabOption,
    QuantizeOption,
    TreeOption,
    console,
    load_noting,
    parse_block_size,
    parse_draft_vocab,
    parse_tree,
    tree_note,
)
from .mlx_backend import BackendOption, mlx_dtype, parse_backend, refuse_torch_only


@one_line_errors
def serve_command(
    target: Annotated[str, typer.Option(help="target: pack name, local path or hub id")],
    draft: Annotated[
        Path | None, typer.Option(help="DFlash drafter directory (without it: plain decoding, the baseline)")
    ] = None,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="0: a free port (the 'serving ... on' line says which)")] = 8000,
    served_model_name: Annotated[
        str | None, typer.Option(help="model id clients use (default: --target)")
    ] = None,
    max_queue: Annotated[int, typer.Option(help="requests that may wait; more get HTTP 503")] = 64,
    max_batch_size: Annotated[
        int, typer.Option(help="requests decoded together (continuous batching); 1 = one at a time")
    ] = 8,
    block_size: Annotated[str, typer.Option(help="auto (cost-aware) or a fixed verify length")] = "auto",
    dtype: Annotated[str | None, typer.Option(help="float32 | bfloat16 | float16")] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    compile_verify: CompileOption = False,
    quantize: QuantizeOption = None,
    tree: TreeOption = "off",
    draft_vocab: DraftVocabOption = "auto",
    images: Annotated[
        bool | None,
        typer.Option(
            "--images/--no-images",
            help="load an image-text target whole, so requests may carry images (default: only where the "
            "checkpoint has no text-only class, e.g. Qwen3-VL; a Qwen3.5 composite needs --images)",
        ),
    ] = None,
    allow_local_images: Annotated[
        bool, typer.Option(help="image parts may name files on this machine (else data: URLs only)")
    ] = False,
    backend: BackendOption = "torch",
) -> None:
    """Serve the target (with DFlash when --draft is given) behind an OpenAI-compatible API: up to
    --max-batch-size requests decode together (continuous batching), the others wait in a bounded queue."""
    import torch

    from ..extras import require_extra

    require_extra("serve", "fastapi", "uvicorn", "prometheus_client")
    from ..drafter.checkpoint import load_drafter_config
    from ..errors import print_error
    from ..generate import GenerationError
    from ..kernels.plan import check_quantize
    from ..serve import Engine, ServeError, bind_port, bound_address, build_app, run_server
    from ..targets.target import parse_device, parse_dtype

    dev, torch_dtype = parse_device(device), parse_dtype(dtype)
    check_quantize(quantize, torch_dtype, dev)
    verify = parse_block_size(
        block_size, load_drafter_config(draft).block_size if draft is not None else None
    )
    nodes = parse_tree(tree)
    vocab_size = parse_draft_vocab(draft_vocab)
    if max_queue < 1:
        raise GenerationError(f"--max-queue must be >= 1, got {max_queue}")
    if max_batch_size < 1:
        raise GenerationError(f"--max-batch-size must be >= 1, got {max_batch_size}")
    if threads:
        torch.set_num_threads(threads)
    mlx = parse_backend(backend) == "mlx"
    if mlx:
        refuse_torch_only(
            {"--compile": compile_verify, "--quantize": quantize, "--tree": tree, "--draft-vocab": draft_vocab,
             "--device": device, "--threads": threads, "--images": images}
        )  # fmt: skip
    try:
        sock = bind_port(host, port)  # before loading: a taken port is said at once
    except ServeError as e:
        print_error(e)
        raise typer.Exit(2) from None
    if mlx:  # one request decodes at a time on MLX; the others wait in the queue
        from ..mlx import MlxDecoder
        from ..mlx import load_pipeline as load_mlx_pipeline

        mlx_pipeline = load_mlx_pipeline(target, draft, dtype=mlx_dtype(dtype))
        decoder = MlxDecoder(mlx_pipeline.target, mlx_pipeline.drafter, verify)
        engine = Engine(
            mlx_pipeline.target, mlx_pipeline.drafter, max_queue=max_queue, decoder=decoder, start=False
        )
    else:
        pipeline = load_noting(
            target,
            draft,
            dtype=torch_dtype,
            device=dev,
            quantize=quantize,
            images=images,
            compile=compile_verify,
            draft_vocab=vocab_size,
            costs=draft is not None and verify == "auto",
            log=lambda m: console.print(m, soft_wrap=True),
        )
        tgt, drafter, costs = pipeline.target, pipeline.drafter, pipeline.costs
        if drafter is not None and (note := tree_note(tgt, nodes)):
            console.print(f"[yellow]note:[/] {note}")
        engine = Engine(
            tgt,
            drafter,
            max_queue=max_queue,
            block_size=verify,
            max_batch_size=max_batch_size,
            costs=costs,
            tree=nodes if drafter is not None else None,
            start=False,
        )
    name = served_model_name or target
    how = ("DFlash " + str(draft) if draft else "plain decoding") + (", MLX backend" if mlx else "")
    console.print(f"serving {name!r} ({how}) on {bound_address(sock)}/v1", soft_wrap=True)
    if not run_server(engine, build_app(engine, name, allow_local_images), sock):
        raise typer.Exit(1)  # uvicorn has said why
