"""`flashdraft init-draft` and `flashdraft train`: making a drafter."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import one_line_errors
from .common import out


# ---------------------------------------------------------------------------------------------- init-draft
def _parse_ids(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None


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

    from ..model import DFlashDraftModel
    from ..packs import resolve_model
    from ..target import choose_mask_token_id

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
    init_layers: Annotated[
        str,
        typer.Option(help="a new drafter's layers: random | target-top (copies of the target's top layers)"),
    ] = "random",
    kl_weight: Annotated[
        float,
        typer.Option(
            help="add this weight x KL(target || draft) per slot: distils the target's distribution"
        ),
    ] = 0.0,
    resume: Annotated[bool, typer.Option(help="continue from OUT/checkpoints/last.pt")] = False,
    eval_datasets: Annotated[str, typer.Option(help="held-out τ evaluation at the end ('' to skip)")] = (
        "gsm8k,humaneval,mt-bench"
    ),
    eval_samples: Annotated[int, typer.Option(help="prompts per evaluation dataset")] = 20,
    eval_max_new_tokens: Annotated[int, typer.Option()] = 128,
    eval_every: Annotated[
        int,
        typer.Option(
            help="every N steps, τ on the eval datasets (at most 8 prompts, 64 tokens each) into OUT/eval_log.jsonl: "
            "the learning curve (0 = only at the end)"
        ),
    ] = 0,
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
    from ..train import train_command

    train_command(**{k: v for k, v in locals().items() if k != "train_command"})
