"""A target sharded with FSDP2 over two gloo processes (torchrun) computes what the whole target computes in one:
the tapped features, the losses, the gradient norms and the drafter after its optimiser steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import hybrid_model, tiny_model, workers_stderr
from flashdraft.targets.target import Target
from flashdraft.training.trainer import TrainConfig, Trainer


def _dataset(model, n: int = 4, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Sequences of different lengths: a random prompt, then a supervised answer."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    out = []
    for i in range(n):
        prompt, answer = 3 + i % 3, 10 + 3 * i
        ids = torch.randint(4, vocab, (prompt + answer,), generator=g)
        mask = torch.zeros(prompt + answer, dtype=torch.bool)
        mask[prompt:] = True
        out.append({"input_ids": ids, "loss_mask": mask})
    return out


@pytest.mark.parametrize(
    "family,drafter,arch",
    [
        ("llama", "ddp", "dflash"),
        ("qwen3_5", "ddp", "dflash"),
        ("llama", "fsdp", "dflash"),
        ("qwen3_5", "fsdp", "dflash2"),
        ("qwen3_5_moe", "ddp", "dflash"),  # MoE: fused expert tensors sharded on their first dim
    ],
)
def test_two_process_sharded_target_matches_one_process(tmp_path, family, drafter, arch):
    """Target sharded, drafter replicated (DDP) or sharded (FSDP2; a DFlash2 drafter keeps its selector whole)."""
    from test_data import make_tokenizer

    model = tiny_model("llama", seed=4, layers=4) if family == "llama" else hybrid_model(family, seed=4)
    model_dir = tmp_path / "target"
    model.save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    data = _dataset(model)
    torch.save(data, tmp_path / "data.pt")
    worker = Path(__file__).with_name("sharded_worker.py")
    # the worker's folder before the caller's path (flashdraft may come from PYTHONPATH rather than an install)
    path = os.pathsep.join(p for p in (str(worker.parent), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(worker),
           str(model_dir), str(tmp_path / "data.pt"), str(tmp_path / "sharded.pt"), drafter, arch]  # fmt: skip
    done = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, workers_stderr(done.stderr)
    sharded = torch.load(tmp_path / "sharded.pt", weights_only=False)
    assert sharded["rows"] and all(here == -(-rows // 2) for here, rows in sharded["rows"]), sharded["rows"]

    target = Target(model)  # the whole target, one process, the same global batch of 2 sequences
    taps = [0, target.num_layers - 2, target.num_layers - 1]
    with torch.no_grad():
        for item, feats in zip(data, sharded["features"], strict=True):
            torch.testing.assert_close(feats, target.features(item["input_ids"][None], taps)[0])
    cfg = TrainConfig(out_dir=str(tmp_path / "one"), num_layers=1, block_size=4, num_anchors=6, max_steps=2,
                      batch_size=2, grad_accum=1, mask_token_id=3, target_layer_ids=taps[:2], progress=False,
                      save_every=100, lr=1e-2, warmup_ratio=0.0, arch=arch)  # fmt: skip
    trainer = Trainer(target, data, cfg)
    history = trainer.fit()
    for one, two in zip(history, sharded["history"], strict=True):
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
        assert two["blocks"] == one["blocks"]
    assert history[1]["loss"] != history[0]["loss"]  # the first step changed the drafter
    for name, p in trainer.draft.state_dict().items():
        torch.testing.assert_close(sharded["draft"][name], p, rtol=1e-4, atol=1e-5, msg=name)
    # the sharded run's checkpoint reads like a one-process run's: same drafter, same AdamW moments, same step
    resumed = Trainer(target, data, cfg)
    assert resumed.load_checkpoint(tmp_path / "sharded.pt.run" / "checkpoints" / "last.pt")
    assert resumed.step == trainer.step == 2
    ours, theirs = trainer.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert ours.keys() == theirs.keys()
    for i in ours:
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(theirs[i][key], ours[i][key], rtol=1e-4, atol=1e-6)


def test_end_distributed_frees_the_process_group_of_a_sharded_run(tmp_path, monkeypatch):
    """After a sharded target and drafter trained (FSDP2, one process), `end_distributed` frees the gloo group
    while the interpreter lives: DTensor's dispatch caches would otherwise keep it until interpreter exit, where
    gloo's threads can abort a finished torchrun job (SIGABRT; CI saw it in test_torchrun_cli_...)."""
    import gc
    import weakref

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from flashdraft.training.distributed import end_distributed, init_distributed
    from flashdraft.training.sharding import is_sharded, shard_decoder

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(name, "")  # remembers the value before the test, which is restored after it
        monkeypatch.delenv(name)  # init_distributed picks a free port and sets them
    model = tiny_model("llama", seed=4, layers=2)
    data = _dataset(model, n=2)
    assert init_distributed(single_group=True) == (0, 1, "cpu")
    try:
        group = weakref.ref(dist.group.WORLD)
        shard_decoder(model, init_device_mesh("cpu", (1,)))
        target = Target(model)
        cfg = TrainConfig(out_dir=str(tmp_path / "run"), num_layers=1, block_size=4, num_anchors=4, max_steps=1,
                          batch_size=1, grad_accum=1, mask_token_id=3, target_layer_ids=[0, 1], progress=False,
                          save_every=100, shard_drafter=True)  # fmt: skip
        trainer = Trainer(target, data, cfg)
        assert is_sharded(target.model) and is_sharded(trainer.draft)
        trainer.fit()
        # what the caller drops; DTensor's caches still hold the mesh and its group
        del trainer, target, model
        end_distributed()
        assert not dist.is_initialized()
        gc.collect()
        assert group() is None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
