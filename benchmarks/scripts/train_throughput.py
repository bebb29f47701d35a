"""Drafter training throughput: blocks per second of the training step under different settings.

    python benchmarks/scripts/train_throughput.py --data runs/data/smollm2-gsm8k --threads 2
    python benchmarks/scripts/train_throughput.py --data DIR --device cuda --only batch   # the batch-shape rows

Times `Trainer.train_step` (target features, the drafter's multi-block forward, the fused frozen-head loss,
backward, AdamW) on the same sequences for each setting, after one warm-up step, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from flashdraft.engine.measure import cpu_name
from flashdraft.drafter.config import choose_mask_token_id
from flashdraft.targets.target import load_target
from flashdraft.training.trainer import TrainConfig, Trainer
from flashdraft.training.dataset import TrainingData


def measure(target, data, steps: int, **overrides) -> dict[str, float]:
    cfg = TrainConfig(
        out_dir=tempfile.mkdtemp(prefix="tput-"),
        num_layers=overrides.pop("num_layers", 2),
        block_size=16,
        mask_token_id=choose_mask_token_id(target.tokenizer, target.vocab_size),
        max_length=640,
        progress=False,
        max_steps=steps + 1,
        **overrides,
    )
    trainer = Trainer(target, data, cfg)
    trainer.train_step()  # warm-up
    blocks, t0 = 0, time.perf_counter()
    for _ in range(steps):
        stats = trainer.train_step()
        blocks += stats["blocks"]
    dt = time.perf_counter() - t0
    return {"blocks_per_s": blocks / dt, "step_s": dt / steps, "blocks_per_step": blocks / steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--data", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", default="", help="run only the settings whose name contains this text")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = TrainingData(args.data)
    rows = []
    settings = [
        ("fp32 target, fp32 drafter, 64 anchors", "float32", dict(bf16=False, num_anchors=64, grad_accum=4)),
        ("bf16 target, bf16 autocast, 64 anchors", "bfloat16", dict(bf16=True, num_anchors=64, grad_accum=4)),
        ("bf16, 256 anchors (1 sequence/step)", "bfloat16", dict(bf16=True, num_anchors=256, grad_accum=1)),
        (
            "bf16, 512 anchors (paper; 1 sequence/step)",
            "bfloat16",
            dict(bf16=True, num_anchors=512, grad_accum=1),
        ),
        (
            "bf16, 64 anchors, batch 4 x 1, one forward per sequence",
            "bfloat16",
            dict(bf16=True, num_anchors=64, batch_size=4, padded_batches=False),
        ),
        (
            "bf16, 64 anchors, batch 4 x 1, one padded forward",
            "bfloat16",
            dict(bf16=True, num_anchors=64, batch_size=4, padded_batches=True),
        ),
        (
            "bf16, 512 anchors, batch 8 x 2, one forward per sequence",
            "bfloat16",
            dict(bf16=True, num_anchors=512, batch_size=8, grad_accum=2, padded_batches=False),
        ),
        (
            "bf16, 512 anchors, batch 8 x 2, one padded forward",
            "bfloat16",
            dict(bf16=True, num_anchors=512, batch_size=8, grad_accum=2, padded_batches=True),
        ),
        (
            "bf16, 64 anchors, + KL term",
            "bfloat16",
            dict(bf16=True, num_anchors=64, grad_accum=4, kl_weight=1.0),
        ),
        (
            "bf16, 64 anchors, 5 layers",
            "bfloat16",
            dict(bf16=True, num_anchors=64, grad_accum=4, num_layers=5),
        ),
    ]
    targets = {}
    for name, dtype, kw in settings:
        if args.only not in name:
            continue
        if dtype not in targets:
            targets[dtype] = load_target(args.target, dtype=dtype, device=args.device)
        r = measure(targets[dtype], data, args.steps, **kw)
        rows.append((name, r))
        print(f"{name}: {r['blocks_per_s']:.1f} blocks/s ({r['step_s']:.2f} s/step)", flush=True)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{args.threads} threads"
    print(f"\nmachine: {cpu_name()}, {where}, torch {torch.__version__}\n")
    print("| setting | blocks/s | s per step | blocks per step |\n|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['blocks_per_s']:.1f} | {r['step_s']:.2f} | {r['blocks_per_step']:.0f} |")


if __name__ == "__main__":
    main()
