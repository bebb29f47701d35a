"""The memory plan for the targets people deploy, from their configs alone (drafters/targets/*/config.json).

    python benchmarks/plan_table.py            # writes benchmarks/memory-plan-targets.md

For each target: the drafter z-lab ships for it (layers, taps, MLP width, block size), the paper's recipe per rank
(micro-batch of 1 sequence of 3,072 tokens, 512 anchors), bf16 target, bf16 autocast drafter, 80 GB GPUs. The mode
is the first that fits: the whole target on one GPU, else the target sharded (FSDP2) over the fewest GPUs of a node
(2, 4, 8) or of two nodes (16), the drafter replicated (DDP) unless only sharding it too (FSDP2) fits.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig

from flashdraft.drafter.config import DFlashConfig
from flashdraft.training.memory_plan import GIB, plan_training, target_shape

ROOT = Path(__file__).resolve().parents[1]
GPU_GIB = 80.0
SEQ_LEN, ANCHORS = 3072, 512
# name: (drafter layers, taps, MLP width or None for the target's, block size): z-lab's published drafters
TARGETS = {
    "Qwen3-8B": (5, [1, 9, 17, 25, 33], None, 16),
    "Qwen3.5-27B": (6, [1, 10, 18, 27, 35, 44, 52, 61], None, 16),
    "Qwen3.6-35B-A3B": (6, [1, 6, 11, 16, 22, 27, 32, 37], 6144, 16),
    "Qwen3.5-122B-A10B": (6, [1, 7, 14, 20, 26, 32, 39, 45], 9216, 16),
    "gpt-oss-120b": (8, [1, 9, 17, 25, 33], 7680, 10),
}


def choose(name: str):
    layers, taps, width, block = TARGETS[name]
    config = AutoConfig.from_pretrained(ROOT / "drafters" / "targets" / name)
    shape = target_shape(config, name=name)
    draft = DFlashConfig.for_target(config, num_layers=layers, block_size=block, mask_token_id=0,
                                    target_layer_ids=taps, intermediate_size=width)  # fmt: skip
    common = dict(batch_size=1, seq_len=SEQ_LEN, num_anchors=ANCHORS, block_size=block, target_dtype=torch.bfloat16,
                  bf16=True, device="cuda", capacity=int(GPU_GIB * GIB))  # fmt: skip
    modes = [(1, False, False)] + [(n, True, d) for n in (2, 4, 8, 16) for d in (False, True)]
    for world, shard_target, shard_drafter in modes:
        plan = plan_training(
            shape, draft, world=world, shard_target=shard_target, shard_drafter=shard_drafter, **common
        )
        if plan.fits:
            return shape, draft, plan, (layers, taps, width, block)
    return shape, draft, plan, (layers, taps, width, block)


def command(name: str, plan, layers, taps, width, block) -> str:
    launch = (
        f"torchrun --nproc-per-node {plan.world} -m flashdraft train"
        if plan.world > 1
        else "flashdraft train"
    )
    args = f"--target <{name}> --data DATA --out OUT --num-layers {layers} --block-size {block} "
    args += f"--target-layer-ids {','.join(map(str, taps))}"
    args += f" --intermediate-size {width}" if width else ""
    args += " --padded-batches" + (" --shard-target" if plan.shard_target else "")
    args += " --shard-drafter" if plan.shard_drafter else ""
    return f"`{launch} {args}`"


def main() -> None:
    lines = [
        "# Training a drafter for the targets people deploy: the memory plan",
        "",
        "`python benchmarks/plan_table.py`: `flashdraft train --plan` for each target's config "
        "(`drafters/targets/`), the drafter z-lab ships for it, and the paper's recipe per rank: a micro-batch of one "
        f"{SEQ_LEN}-token sequence, {ANCHORS} anchors, bf16 target, bf16 autocast drafter with fp32 master weights "
        f"and AdamW, {GPU_GIB:.0f} GB GPUs (10 % kept back for the CUDA context and fragmentation).",
        "",
        "| target | params | drafter | GPUs (80 GB) | mode | per-GPU plan | target | drafter state | activations + loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    commands = []
    for name in TARGETS:
        shape, draft, plan, (layers, taps, width, block) = choose(name)
        rows = {r.what: r.bytes for r in plan.rows}
        acts = plan.total - rows["target weights"] - rows["drafter training state"]
        p_d = plan.settings["drafter_params"]
        mode = ("FSDP2" if plan.shard_target else "whole") + " target + "
        mode += "FSDP2 drafter" if plan.shard_drafter else "DDP drafter"
        fits = "" if plan.fits else " (does not fit)"
        lines.append(
            f"| {name} | {shape.params / 1e9:.1f}B | {layers} layers, {p_d / 1e9:.2f}B | {plan.world}{fits} | {mode} | "
            f"{plan.total / GIB:.1f} GiB | {rows['target weights'] / GIB:.1f} | "
            f"{rows['drafter training state'] / GIB:.1f} | {acts / GIB:.1f} |"
        )
        commands.append(f"- {name}: {command(name, plan, layers, taps, width, block)}")
    lines += [
        "",
        "Commands (add `--plan` to print the table of one rank without loading anything):",
        "",
        *commands,
    ]
    (ROOT / "benchmarks" / "memory-plan-targets.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
