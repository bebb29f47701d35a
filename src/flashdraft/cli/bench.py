"""`flashdraft bench`: the command over the benchmark package (flashdraft.bench)."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from ..bench import (
    BenchConfig,
    BenchError,
    ServerBenchConfig,
    check_readme,
    parse_concurrency,
    parse_methods,
    print_summary,
    run_bench,
    run_server_bench,
    split_datasets,
    update_readme,
)
from .common import CompileOption, DraftVocabOption, QuantizeOption, parse_draft_vocab, parse_tree


def _redacted_command(argv: Sequence[str]) -> str:
    """The command line as typed, for the report, without the API key."""
    args = list(argv)
    for i, arg in enumerate(args):
        if arg == "--api-key" and i + 1 < len(args):
            args[i + 1] = "***"
        elif arg.startswith("--api-key="):
            args[i] = "--api-key=***"
    return shlex.join(["flashdraft", *args])


def _is_untrained(draft: str) -> bool:
    from ..drafter.checkpoint import read_model_card_meta

    return read_model_card_meta(draft).get("trained") is False


def bench_command(
    dataset: Annotated[
        str,
        typer.Option(
            "--dataset",
            "-d",
            help="gsm8k, humaneval, mt-bench, math500, mbpp, a jsonl file; comma-separated for several",
        ),
    ] = "gsm8k",
    target: Annotated[
        str | None, typer.Option(help="target: pack name, local path or hub id (local backend)")
    ] = None,
    draft: Annotated[str | None, typer.Option(help="DFlash drafter directory (method dflash)")] = None,
    methods: Annotated[
        str,
        typer.Option(
            help="comma-separated: ar, hf, dflash, dflash-fixed, dflash-pq, dflash-tree, sd, pld, llamacpp, "
            "llamacpp-lookup, llamacpp-dflash (ar is always run)"
        ),
    ] = "ar,hf,dflash",
    assistant: Annotated[
        str | None, typer.Option(help="small draft model for sd, same tokenizer as the target")
    ] = None,
    max_samples: Annotated[
        int | None, typer.Option(help="prompts per dataset (seeded random subset)")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(help="z-lab uses 2048")] = 256,
    temperature: Annotated[float, typer.Option(help="0 = greedy, outputs compared with ar")] = 0.0,
    block_size: Annotated[
        int | None,
        typer.Option(
            help="fixed verify length for method dflash (<= the drafter's block); default: cost-aware (auto). "
            "Method dflash-fixed always verifies the drafter's full trained block."
        ),
    ] = None,
    tree: Annotated[
        str,
        typer.Option(help="method dflash-tree's node budget: N nodes at most, or auto (the default budget)"),
    ] = "auto",
    draft_vocab: DraftVocabOption = "auto",
    pld_tokens: Annotated[int, typer.Option(help="prompt_lookup_num_tokens for pld")] = 10,
    seed: Annotated[int, typer.Option(help="sample selection and sampling seed")] = 0,
    out: Annotated[
        Path | None, typer.Option("--out", help="output directory (default bench-results/<name>-<time>)")
    ] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda")] = None,
    dtype: Annotated[str | None, typer.Option(help="float32 | bfloat16 | float16")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    compile_verify: CompileOption = False,
    quantize: QuantizeOption = None,
    thinking: Annotated[
        bool | None,
        typer.Option("--thinking/--no-thinking", help="template thinking mode (default: template's)"),
    ] = None,
    chat: Annotated[bool, typer.Option(help="apply the chat template")] = True,
    save_outputs: Annotated[
        bool, typer.Option(help="store every output text and token ids in results.json")
    ] = False,
    plots: Annotated[bool, typer.Option(help="write PNG plots")] = True,
    readme: Annotated[
        Path | None, typer.Option(help="also write the summary table into this README's marked block")
    ] = None,
    backend: Annotated[
        str,
        typer.Option(
            help="local (this process, torch) | mlx (this process, the MLX backend: methods ar, dflash, "
            "dflash-fixed) | openai (a server)"
        ),
    ] = "local",
    base_url: Annotated[
        str | None, typer.Option(help="openai backend: server URL, e.g. http://127.0.0.1:8000")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="openai backend: model name (default: first of /v1/models)")
    ] = None,
    concurrency: Annotated[str, typer.Option(help="openai backend: levels, e.g. 1,4,8")] = "1",
    api: Annotated[str, typer.Option(help="openai backend: chat | completion")] = "chat",
    stream: Annotated[bool, typer.Option(help="openai backend: stream (needed for TTFT)")] = True,
    timeout: Annotated[float, typer.Option(help="openai backend: per-request timeout, seconds")] = 600.0,
    api_key: Annotated[
        str | None, typer.Option(help="openai backend: API key sent as a Bearer token")
    ] = None,
    llamacpp: Annotated[
        str | None, typer.Option(help="llamacpp methods: llama-server (file or directory; default: on PATH)")
    ] = None,
    llamacpp_model: Annotated[
        str | None,
        typer.Option(help="llamacpp methods: the target's weights as a GGUF (benchmarks/README.md)"),
    ] = None,
    llamacpp_draft: Annotated[
        str | None, typer.Option(help="llamacpp-dflash: the drafter as a GGUF from llama.cpp's converter")
    ] = None,
    llamacpp_draft_max: Annotated[
        int | None, typer.Option(help="llamacpp-dflash: tokens drafted per step (llama-server's default: 3)")
    ] = None,
    llamacpp_args: Annotated[
        str,
        typer.Option(
            help="llamacpp methods: more llama-server options, e.g. '-fa off --no-repack' (its fastest on some "
            "CPUs: benchmarks/README.md)"
        ),
    ] = "",
) -> None:
    """Measure acceptance length τ and speedup of ar / hf / dflash / sd / pld side by side, or benchmark a server."""
    from ..errors import print_error, user_errors

    command = _redacted_command(sys.argv[1:])
    try:
        datasets = split_datasets(dataset)
        if backend in ("local", "mlx"):
            if readme is not None:
                check_readme(readme)
                if draft and _is_untrained(draft):
                    raise BenchError(
                        f"{draft} is an untrained drafter (init-draft): its numbers are for development runs only "
                        "and are not written into a README"
                    )
            if not target:
                raise BenchError(
                    "--target is required for the local backend (or use --backend openai --base-url URL)"
                )
            if backend == "mlx" and methods == "ar,hf,dflash":  # the default, less transformers' generate
                methods = "ar,dflash"
            cfg = BenchConfig(
                target=target, datasets=datasets, methods=parse_methods(methods), draft=draft, assistant=assistant,
                max_samples=max_samples, max_new_tokens=max_new_tokens, temperature=temperature,
                block_size=block_size, tree=parse_tree(tree), draft_vocab=parse_draft_vocab(draft_vocab), pld_tokens=pld_tokens, seed=seed, out_dir=out, device=device, dtype=dtype,
                threads=threads, compile_verify=compile_verify, thinking=thinking, chat=chat, save_outputs=save_outputs, plots=plots,
                command=command, quantize=quantize, llamacpp=llamacpp, llamacpp_model=llamacpp_model,
                llamacpp_draft=llamacpp_draft, llamacpp_draft_max=llamacpp_draft_max, llamacpp_args=llamacpp_args,
                engine="mlx" if backend == "mlx" else "torch",
            )  # fmt: skip
            results = run_bench(cfg)
            if readme is not None:
                update_readme(readme, results)
        elif backend == "openai":
            scfg = ServerBenchConfig(
                base_url=base_url or "", datasets=datasets, model=model, concurrency=parse_concurrency(concurrency),
                api=api, stream=stream, max_samples=max_samples, max_new_tokens=max_new_tokens,
                temperature=temperature, seed=seed, timeout_s=timeout, thinking=thinking, api_key=api_key, out_dir=out,
                save_outputs=save_outputs, plots=plots, command=command,
            )  # fmt: skip
            results = run_server_bench(scfg)
        else:
            raise BenchError(f"--backend must be local or openai, got {backend!r}")
    except user_errors() as e:
        print_error(e)
        raise typer.Exit(2) from None
    print_summary(results)
