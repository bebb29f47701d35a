"""`flashdraft init-draft` and `flashdraft train`: making a drafter."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import torch
import torch.distributed as dist
import typer

from ..drafter.model import DFlashDraftModel
from ..errors import one_line_errors
from ..training.distributed import end_distributed, init_distributed
from ..training.export import (
    data_summary,
    evaluate_tau,
    export_drafter,
    machine_description,
    write_model_card,
)
from ..training.trainer import TrainConfig, Trainer
from .common import out

# ---------------------------------------------------------------------------------------------- init-draft
ARCH_HELP = (
    "dflash (v1) | dflash2 (grouped dynamic convolutions + candidate selector, z-lab's DFlash2DraftModel); "
    "train: a v1 --init-from becomes DFlash2 with its weights kept"
)


def default_block_size(arch: str, block_size: int | None) -> int:
    """16 for v1 (the paper's), 8 for DFlash2 (z-lab's published DFlash2 drafters)."""
    if arch not in ("dflash", "dflash2"):
        raise typer.BadParameter(f"--arch must be dflash or dflash2, not {arch!r}")
    return block_size if block_size is not None else (8 if arch == "dflash2" else 16)


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
    block_size: Annotated[
        int | None, typer.Option(help="block size B (anchor + B-1 drafts; default 16, DFlash2 8)")
    ] = None,
    arch: Annotated[str, typer.Option(help=ARCH_HELP)] = "dflash",
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

    from ..drafter.config import choose_mask_token_id
    from ..drafter.model import DFlashDraftModel
    from ..models.packs import resolve_model

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
        block_size=default_block_size(arch, block_size),
        mask_token_id=mask_token_id,
        target_layer_ids=_parse_ids(target_layer_ids),
        intermediate_size=intermediate_size,
        seed=seed,
        arch=arch,
    )
    mask_token = tokenizer.convert_ids_to_tokens(mask_token_id) if tokenizer is not None else None
    draft.config.flashdraft = {"target": target, "trained": False, "mask_token": mask_token}
    draft.save_pretrained(out_dir)
    c = draft.config
    out.print(
        f"wrote an untrained {c.architecture} to {out_dir}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
        f"block {c.block_size}, mask id {c.mask_token_id} ({mask_token!r}), taps {c.target_layer_ids}, "
        f"{draft.num_parameters() / 1e6:.1f}M parameters"
    )


@one_line_errors
def train(
    target: Annotated[str, typer.Option(help="target: pack name, local path or hub id")],
    data: Annotated[
        list[Path],
        typer.Option(help="data dir from `flashdraft data regenerate`, or a packed .npz (repeatable)"),
    ],
    out: Annotated[Path, typer.Option(help="output directory (checkpoints, log, final drafter)")],
    num_layers: Annotated[int, typer.Option(help="draft layers")] = 5,
    block_size: Annotated[int | None, typer.Option(help="block size B (default 16, DFlash2 8)")] = None,
    arch: Annotated[str, typer.Option(help=ARCH_HELP)] = "dflash",
    selector_weight: Annotated[
        float, typer.Option(help="DFlash2: weight of the candidate selector's cross-entropy")
    ] = 1.0,
    num_anchors: Annotated[
        int, typer.Option(help="anchors (blocks) per sequence, re-sampled every epoch")
    ] = 512,
    gamma: Annotated[float | None, typer.Option(help="loss decay (default 7/5/4 for B=16/10/8)")] = None,
    lr: Annotated[float, typer.Option()] = 6e-4,
    warmup_ratio: Annotated[float, typer.Option()] = 0.04,
    epochs: Annotated[int, typer.Option()] = 6,
    max_steps: Annotated[int | None, typer.Option(help="stop after this many optimizer steps")] = None,
    batch_size: Annotated[
        int,
        typer.Option(help="sequences per micro-batch per process; 0: the most the memory plan fits (GPUs)"),
    ] = 1,
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
    padded_batches: Annotated[
        bool,
        typer.Option(
            "--padded-batches/--per-sequence",
            help="one padded target + drafter forward per micro-batch of --batch-size sequences (for GPUs, where a "
            "per-sequence loop waits on kernel launches), or one forward per sequence (faster on CPUs)",
        ),
    ] = False,
    shard_target: Annotated[
        bool,
        typer.Option(
            "--shard-target/--whole-target",
            help="split the frozen target over the torchrun ranks (FSDP2): for targets too large for one GPU",
        ),
    ] = False,
    shard_drafter: Annotated[
        bool,
        typer.Option(
            "--shard-drafter/--replicate-drafter",
            help="split the drafter's weights, gradients and AdamW states over the ranks (FSDP2) instead of DDP",
        ),
    ] = False,
    compile_drafter: Annotated[
        bool,
        typer.Option(
            "--compile",
            help="torch.compile the drafter's layers (GPUs with padded batches; $FLASHDRAFT_COMPILE: its options)",
        ),
    ] = False,
    plan: Annotated[
        bool,
        typer.Option(
            "--plan", help="print the per-rank memory plan from the configs and exit (loads nothing)"
        ),
    ] = False,
    world_size: Annotated[
        int | None, typer.Option(help="--plan only: plan for this many ranks (default: torchrun's, else 1)")
    ] = None,
    gpu_memory: Annotated[
        float | None,
        typer.Option(
            help="GiB per GPU to plan against (default: this GPU's; with --plan on a machine without one: 80)"
        ),
    ] = None,
) -> None:
    """Train a DFlash drafter (paper recipe); `torchrun --nproc-per-node N -m flashdraft train ...` for DDP."""
    train_command(**locals())


def _memory_plan(
    target: str,
    arch: str,
    num_layers: int,
    block_size: int | None,
    init_from: Path | None,
    target_layer_ids: str | None,
    intermediate_size: int | None,
    *,
    device: str | None,
    gpu_memory: float | None,
    plan_only: bool,
    target_dtype: str | None,
    bf16: bool | None,
    **settings,
):
    """The memory plan of this run from the configs alone; refuses (one line) a run that will not fit."""
    from transformers import AutoConfig

    from ..drafter.checkpoint import load_drafter_config
    from ..drafter.config import DFlashConfig
    from ..models.packs import resolve_model
    from ..targets.target import TargetError, default_device, parse_dtype
    from ..training.memory_plan import (
        PlanError,
        device_capacity,
        fewest_ranks,
        largest_batch,
        plan_training,
        target_shape,
    )

    path = resolve_model(target)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TargetError(f"cannot read the config of target {target!r}: {first}") from None
    if init_from is not None:
        draft_config = load_drafter_config(init_from)
    else:
        draft_config = DFlashConfig.for_target(
            config, num_layers=num_layers, block_size=default_block_size(arch, block_size), mask_token_id=0,
            target_layer_ids=_parse_ids(target_layer_ids), intermediate_size=intermediate_size, arch=arch,
        )  # fmt: skip
    # --gpu-memory plans for a GPU; so does --plan on a machine without one (80 GB), unless --device cpu says not
    kind = torch.device(device).type if device else ("cuda" if gpu_memory is not None else default_device())
    if plan_only and device is None and gpu_memory is None and not torch.cuda.is_available():
        kind, gpu_memory = "cuda", 80.0
    dtype = parse_dtype(target_dtype) or (torch.bfloat16 if kind == "cuda" else torch.float32)
    shape = target_shape(config, name=target)
    kwargs = dict(
        settings, block_size=default_block_size(arch, block_size if init_from is None else draft_config.block_size),
        target_dtype=dtype, bf16=kind == "cuda" if bf16 is None else bf16, device=kind,
        capacity=device_capacity(kind, gpu_memory),
    )  # fmt: skip
    if kwargs["batch_size"] == 0:  # the largest micro-batch the plan fits, to fill the GPU
        kwargs["batch_size"] = largest_batch(shape, draft_config, kwargs)
    planned = plan_training(shape, draft_config, **kwargs)
    refusal = planned.refusal()
    if refusal is not None and not plan_only:
        raise PlanError(refusal + fewest_ranks(shape, draft_config, kwargs))
    return planned


def train_command(
    target: str,
    data: list[Path],
    out: Path,
    num_layers: int = 5,
    block_size: int | None = None,
    arch: str = "dflash",
    selector_weight: float = 1.0,
    num_anchors: int = 512,
    gamma: float | None = None,
    lr: float = 6e-4,
    warmup_ratio: float = 0.04,
    epochs: int = 6,
    max_steps: int | None = None,
    batch_size: int = 1,
    grad_accum: int = 1,
    max_length: int = 3072,
    seed: int = 0,
    save_every: int = 200,
    intermediate_size: int | None = None,
    target_layer_ids: str | None = None,
    mask_token_id: int | None = None,
    init_from: Path | None = None,
    init_layers: str = "random",
    kl_weight: float = 0.0,
    resume: bool = False,
    eval_datasets: str = "gsm8k,humaneval,mt-bench",
    eval_samples: int = 20,
    eval_max_new_tokens: int = 128,
    eval_every: int = 0,
    export_dtype: str = "bfloat16",
    device: str | None = None,
    lm_head_chunk: int = 1024,
    target_dtype: str | None = None,
    bf16: bool | None = None,
    padded_batches: bool = False,
    shard_target: bool = False,
    shard_drafter: bool = False,
    compile_drafter: bool = False,
    plan: bool = False,
    world_size: int | None = None,
    gpu_memory: float | None = None,
) -> None:
    """Train a DFlash drafter on regenerated data (`flashdraft data regenerate`), then evaluate τ and export."""
    from torch.utils.data import ConcatDataset

    from ..drafter.config import choose_mask_token_id
    from ..drafter.model import _DTYPES
    from ..targets.target import load_target
    from ..training.dataset import TrainingData

    if target_dtype is not None and target_dtype not in _DTYPES:
        raise ValueError(f"--target-dtype must be one of {', '.join(_DTYPES)}, not {target_dtype!r}")
    parts = [TrainingData(d) for d in data] if not plan or all(Path(d).exists() for d in data) else []
    longest = max((max(p.lengths, default=0) for p in parts), default=max_length)
    planned = _memory_plan(
        target, arch, num_layers, block_size, init_from, target_layer_ids, intermediate_size,
        world=world_size or int(os.environ.get("WORLD_SIZE", "1")), shard_target=shard_target, shard_drafter=shard_drafter,
        batch_size=batch_size, seq_len=min(max_length, longest or max_length), num_anchors=num_anchors,
        lm_head_chunk=lm_head_chunk, target_dtype=target_dtype, bf16=bf16, padded_batches=padded_batches,
        kl=kl_weight > 0, device=device, gpu_memory=gpu_memory,
        plan_only=plan,
    )  # fmt: skip
    batch_size = planned.settings["batch_size"]  # `--batch-size 0` resolved
    if plan:
        for line in planned.lines():
            print(line)
        return
    rank, world, dist_device = init_distributed(single_group=shard_target or shard_drafter)
    if rank == 0:
        print("\n".join(planned.lines()))
    if shard_target:
        from ..training.sharding import load_sharded_target

        tgt = load_sharded_target(target, dtype=target_dtype, device=dist_device or device)
    else:
        images = any(p.has_images for p in parts) or None  # image prompts: the image-text checkpoint whole
        tgt = load_target(
            target, dtype=target_dtype, device=dist_device or device, images=images, pack_linears=False
        )
    dataset = ConcatDataset(parts) if len(parts) > 1 else parts[0]
    manifests = [p.manifest for p in parts]
    for d, m in zip(data, manifests, strict=True):
        if m.get("target") not in (None, target) and rank == 0:
            print(f"warning: {d} was regenerated with {m['target']}, training a drafter for {target}")
    if mask_token_id is None and init_from is None:
        mask_token_id = choose_mask_token_id(tgt.tokenizer, tgt.vocab_size)
    layer_ids = [int(x) for x in target_layer_ids.split(",")] if target_layer_ids else None
    if block_size is None and init_from is not None:  # the starting drafter's own block
        from ..drafter.checkpoint import load_drafter_config

        block_size = load_drafter_config(init_from).block_size
    block_size = default_block_size(arch, block_size)
    cfg = TrainConfig(
        out_dir=str(out),
        num_layers=num_layers,
        block_size=block_size,
        arch=arch,
        selector_weight=selector_weight,
        num_anchors=num_anchors,
        gamma=gamma,
        lr=lr,
        warmup_ratio=warmup_ratio,
        epochs=epochs,
        max_steps=max_steps,
        batch_size=batch_size,
        grad_accum=grad_accum,
        max_length=max_length,
        seed=seed,
        save_every=save_every,
        intermediate_size=intermediate_size,
        target_layer_ids=layer_ids,
        mask_token_id=mask_token_id,
        init_from=str(init_from) if init_from else None,
        init_layers=init_layers,
        kl_weight=kl_weight,
        eval_every=eval_every,
        eval_datasets=tuple(n for n in eval_datasets.split(",") if n) or ("gsm8k",),
        eval_samples=min(eval_samples, 8),
        eval_max_new_tokens=min(eval_max_new_tokens, 64),
        lm_head_chunk=lm_head_chunk,
        bf16=bf16,
        padded_batches=padded_batches,
        shard_drafter=shard_drafter,
        compile=compile_drafter,
    )
    trainer = Trainer(tgt, dataset, cfg)
    if rank == 0:
        c = trainer.draft.config
        print(
            f"training a {c.num_hidden_layers}-layer drafter ({trainer.draft.num_parameters() / 1e6:.1f}M params, "
            f"taps {c.target_layer_ids}, mask {c.mask_token_id}) on {len(trainer.indices)} sequences, "
            f"{trainer.total_steps} steps of {trainer.global_batch} sequences, {world} process(es)"
        )
    trainer.fit(resume=resume)
    trainer.unwrap()
    drafter = trainer.exportable_drafter()  # gathered from every rank when it is sharded
    if dist.is_initialized():
        dist.barrier()
    if rank != 0:
        del trainer, tgt  # the sharded modules hold the process group (distributed.py)
        end_distributed(barrier=False)
        return
    chat = manifests[0].get("chat_template")
    meta = {
        "target": target,
        "trained": True,
        "chat_template": chat,
        "steps": trainer.step,
        "global_batch": trainer.global_batch,
        "num_anchors": num_anchors,
        "block_size_trained": block_size,
        "gamma": trainer.gamma,
        "data": [str(d) for d in data],
        "data_summary": "; ".join(data_summary(m) for m in manifests),
        "hardware": machine_description(tgt.device) + (f" x{world}" if world > 1 else ""),
        "precision": f"target {str(tgt.dtype).removeprefix('torch.')}, drafter "
        + ("bf16 autocast" if trainer.use_bf16 else "fp32"),
        "wall_time_s": trainer.wall_s,
    }
    if init_from is not None:
        from ..drafter.checkpoint import read_model_card_meta

        prev = read_model_card_meta(init_from)
        meta["init_from"] = {
            "path": str(init_from),
            **{
                k: prev.get(k)
                for k in ("steps", "global_batch", "data_summary", "wall_time_s", "hardware", "init_from")
            },
        }
    if parts:  # the answers it was trained on: what its draft vocabulary is drawn from (vocab.py)
        drafter.token_counts = sum(p.answer_token_counts(tgt.vocab_size) for p in parts)
        drafter.token_counts_source = "answer tokens of " + ", ".join(str(d) for d in data)
    export_drafter(drafter, out, meta, _DTYPES[export_dtype])
    exported = DFlashDraftModel.from_pretrained(
        out, dtype=tgt.dtype, device=tgt.device
    )  # evaluate what ships
    names = [n for n in eval_datasets.split(",") if n]
    if names and eval_samples > 0 and trainer.target_sharded:
        names = []  # decoding with a sharded target would need every rank in lockstep
        print("τ evaluation skipped: the target is sharded; evaluate the exported drafter with `flashdraft eval` "
              "where the target fits, or with vLLM / SGLang")  # fmt: skip
    if names and eval_samples > 0:
        thinking = (chat or {}).get("thinking") if isinstance(chat, dict) else None
        system = (chat or {}).get("system") if isinstance(chat, dict) else None
        meta["eval"] = evaluate_tau(
            tgt, exported, names, eval_samples, eval_max_new_tokens, enable_thinking=thinking, system=system
        )
        meta["eval_max_new_tokens"] = eval_max_new_tokens
        export_drafter(exported, out, meta, _DTYPES[export_dtype])
        for name, r in meta["eval"].items():
            print(f"τ {name}: {r['tau']:.2f} over {r['prompts']} prompts")
    write_model_card(out, exported, {**meta, "global_batch": trainer.global_batch})
    print(f"drafter written to {out}")
    del trainer, tgt
    end_distributed(barrier=False)
