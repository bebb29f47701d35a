"""The memory plan: parameter counts from the meta device, sharding arithmetic, a bound on the measured peak, and the
`--plan` table and one-line refusal of `flashdraft train`, both before anything is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as tf
from typer.testing import CliRunner

from conftest import hybrid_model, tiny_model
from flashdraft.cli import app
from flashdraft.drafter.config import DFlashConfig
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.targets.target import Target
from flashdraft.training.memory_plan import (
    drafter_params,
    drafter_shape,
    largest_batch,
    measured_peak,
    plan_training,
    target_shape,
)
from flashdraft.training.trainer import TrainConfig, Trainer

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "qwen3_5_moe"])
def test_parameter_counts_match_the_built_models(family):
    model = tiny_model("llama") if family == "llama" else hybrid_model(family)
    shape = target_shape(model.config)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert sum(shape.layer_params) == sum(p.numel() for p in Target(model).layers.parameters())
    draft = DFlashDraftModel.for_target(model.config, num_layers=2, block_size=4, mask_token_id=3)
    assert drafter_params(draft.config) == sum(p.numel() for p in draft.parameters())


def test_sharding_divides_the_layers_and_keeps_two_whole_ones():
    model = tiny_model("llama", layers=4)
    shape = target_shape(model.config)
    draft = DFlashConfig.for_target(model.config, num_layers=1, block_size=4, mask_token_id=3)
    whole = plan_training(shape, draft, world=4, shard_target=False, target_dtype=torch.bfloat16)
    sharded = plan_training(shape, draft, world=4, shard_target=True, target_dtype=torch.bfloat16)
    layers = sum(shape.layer_params)
    assert whole.rows[0].bytes == 2 * shape.params
    assert sharded.rows[0].bytes == int(2 * (shape.whole_params + layers / 4 + 2 * max(shape.layer_params)))
    assert (
        whole.rows[1:] == sharded.rows[1:]
    )  # the drafter and the activations do not depend on the target's split


def test_sharding_the_drafter_divides_its_training_state():
    model = tiny_model("llama", layers=4)
    shape = target_shape(model.config)
    draft = DFlashConfig.for_target(model.config, num_layers=2, block_size=4, mask_token_id=3)
    p_d, p_layer = drafter_shape(draft)
    replicated = plan_training(shape, draft, world=4, shard_target=True, bf16=True, device="cuda")
    sharded = plan_training(
        shape, draft, world=4, shard_target=True, shard_drafter=True, bf16=True, device="cuda"
    )
    state = {p.what: p.bytes for p in replicated.rows}["drafter training state"]
    assert state == 18 * p_d
    assert {p.what: p.bytes for p in sharded.rows}["drafter training state"] == int(
        16 * p_d / 4 + 2 * p_d + 8 * p_layer
    )
    assert "drafter sharded (FSDP2)" in sharded.lines()[0]


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_plan_bounds_the_measured_peak_of_a_training_step(family, tmp_path):
    """On the CPU the plan is an upper bound on the peak of live tensors, and not a loose one."""
    torch.manual_seed(0)
    common = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=4, tie_word_embeddings=False)  # fmt: skip
    if family == "llama":
        config = tf.LlamaConfig(**common)
    else:
        config = tf.Qwen3_5TextConfig(head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                                      linear_key_head_dim=32, linear_value_head_dim=32,
                                      layer_types=["linear_attention", "full_attention"] * 2, **common)  # fmt: skip
    target = Target(tf.AutoModelForCausalLM.from_config(config).eval())
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(4, 2048, (256,), generator=g), "loss_mask": torch.arange(256) >= 8}
            for _ in range(4)]  # fmt: skip
    cfg = TrainConfig(out_dir=str(tmp_path), num_layers=2, block_size=8, num_anchors=64, max_steps=3, batch_size=2,
                      mask_token_id=3, progress=False, save_every=100)  # fmt: skip
    trainer = Trainer(target, data, cfg)
    trainer.train_step()
    peak = measured_peak(trainer.train_step, target.model, trainer.draft, trainer.optimizer)
    plan = plan_training(target_shape(config), trainer.draft.config, batch_size=2, seq_len=256, num_anchors=64,
                         block_size=8, target_dtype=torch.float32, bf16=False, device="cpu")  # fmt: skip
    assert peak <= plan.total <= 1.5 * peak, (peak, plan.total)


def test_measured_peak_counts_what_is_alive_at_once():
    kept = torch.zeros(1000)  # 4000 bytes, tracked from the start

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("kept", kept)

    def run():
        a = torch.ones(2000)  # 8000
        b = a * 2  # 8000, both alive
        del a, b
        c = torch.ones(3000)  # 12000 alone
        del c

    assert measured_peak(run, Holder()) == 4000 + 16000


def _config_only_target(tmp_path: Path) -> Path:
    """A target directory with a config and no weights: what --plan needs, and all a refused run may read."""
    path = tmp_path / "config-only"
    tiny_model("llama", layers=4).config.save_pretrained(path)
    return path


def test_plan_prints_the_table_without_loading_the_target(tmp_path):
    runner = CliRunner()
    target = _config_only_target(tmp_path)
    r = runner.invoke(app, ["train", "--plan", "--target", str(target), "--data", str(tmp_path / "none"),
                            "--out", str(tmp_path / "out"), "--world-size", "2", "--shard-target"])  # fmt: skip
    assert r.exit_code == 0, r.output
    for row in (
        "target weights",
        "drafter training state",
        "drafter activations",
        "LM-head loss",
        "per rank",
    ):
        assert row in r.output
    assert "sharded over 2 (FSDP2)" in r.output and not (tmp_path / "out").exists()


def test_plan_of_a_large_target_says_it_does_not_fit_one_gpu(tmp_path):
    r = CliRunner().invoke(app, ["train", "--plan", "--target", str(ROOT / "drafters/targets/Qwen3.5-122B-A10B"),
                                 "--data", str(tmp_path / "none"), "--out", str(tmp_path / "out"),
                                 "--gpu-memory", "80", "--device", "cpu"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "122.11B params" in r.output and "does not fit" in r.output


def test_a_run_that_will_not_fit_is_refused_in_one_line_before_loading(tmp_path):
    """The target has no weights: a run that got past the plan would fail loading them, with another message."""
    from test_data import make_tokenizer

    full = tmp_path / "full"
    tiny_model("llama", layers=4).save_pretrained(full)
    make_tokenizer().save_pretrained(full)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"w{i} w{i + 1}", "answer": f"w{i + 2} w{i + 3} w{i + 4}"})
                               + "\n" for i in range(3, 7)))  # fmt: skip
    runner = CliRunner()
    r = runner.invoke(app, ["data", "regenerate", "--target", str(full), "--prompts", str(prompts),
                            "--out", str(tmp_path / "data"), "--no-regenerate"])  # fmt: skip
    assert r.exit_code == 0, r.output
    target = _config_only_target(tmp_path)
    make_tokenizer().save_pretrained(target)
    args = ["train", "--target", str(target), "--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"),
            "--gpu-memory", "0.0001", "--eval-datasets", ""]  # fmt: skip
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: this run needs about"), r.output
    assert "--plan" in lines[0] and "GiB" in lines[0]
    assert not (tmp_path / "out").exists()


def test_batch_size_zero_takes_the_largest_micro_batch_the_plan_fits(tmp_path):
    shape = target_shape(tiny_model("llama", layers=4).config)
    draft = DFlashConfig.for_target(
        tiny_model("llama", layers=4).config, num_layers=1, block_size=4, mask_token_id=3
    )
    settings = dict(seq_len=512, num_anchors=64, block_size=4, device="cuda", capacity=64 * 2**20)
    b = largest_batch(shape, draft, settings)
    assert b > 1
    assert plan_training(shape, draft, batch_size=b, **settings).fits
    assert not plan_training(shape, draft, batch_size=b + 1, **settings).fits
    r = CliRunner().invoke(app, ["train", "--plan", "--target", str(_config_only_target(tmp_path)), "--data",
                                 str(tmp_path / "none"), "--out", str(tmp_path / "out"), "--batch-size", "0",
                                 "--gpu-memory", str(64 / 1024), "--max-length", "512", "--num-anchors", "64",
                                 "--block-size", "4", "--num-layers", "1"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert f"{b} seq x 512 tokens" in r.output


def test_the_deployed_targets_table_plans_the_fewest_gpus_that_fit():
    """benchmarks/plan_table.py: each target's configuration parses with this transformers, its chosen setting fits
    80 GB GPUs, and no smaller node size (1, 2, 4, 8 GPUs) does (docs/training.md's table is this computation)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_table", ROOT / "benchmarks" / "plan_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    gpus = {}
    for name in table.TARGETS:
        shape, draft, plan, _ = table.choose(name)
        assert plan.fits, name
        gpus[name] = plan.world
        settings = {k: plan.settings[k] for k in ("batch_size", "seq_len", "num_anchors", "block_size")}
        common = dict(settings, target_dtype=torch.bfloat16, bf16=True, device="cuda", capacity=plan.capacity)
        for fewer in [n for n in (1, 2, 4, 8) if n < plan.world]:
            for shard_drafter in (False, True):
                smaller = plan_training(shape, draft, world=fewer, shard_target=fewer > 1,
                                        shard_drafter=shard_drafter and fewer > 1, **common)  # fmt: skip
                assert not smaller.fits, (name, fewer)
    assert gpus["Qwen3-8B"] == 1 and gpus["Qwen3.5-122B-A10B"] > gpus["Qwen3.5-27B"] > 1
