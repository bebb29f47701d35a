"""Hybrid and recurrent targets: exact where the rollback covers them, refused by one clear line where not."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from conftest import HYBRID_ARCHS, VOCAB, hybrid_config, hybrid_model
from flashdraft import DFlashDraftModel, Target, TargetError, generate, generate_ar
from flashdraft.batch import generate_batch
from flashdraft.cli import app

# Families the engine cannot roll back exactly yet: refused before any decoding.
REFUSED = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "jamba", "falcon_h1", "mamba2"]


@pytest.fixture(scope="module")
def hybrids():
    return {arch: hybrid_model(arch, seed=i) for i, arch in enumerate(HYBRID_ARCHS)}


def drafter(model, block_size=6, seed=1):
    return DFlashDraftModel.for_target(
        model.config, num_layers=1, block_size=block_size, mask_token_id=VOCAB - 1, seed=seed
    ).eval()


@pytest.mark.parametrize("arch", REFUSED)
def test_refused_before_any_decoding(hybrids, arch, monkeypatch):
    model = hybrids[arch]
    target = Target(model)
    calls = []
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1))
    prompt = [5, 6, 7, 8]
    for run in (
        lambda: generate_ar(target, prompt, 8),
        lambda: generate(target, drafter(model), prompt, 8, block_size=4),
        lambda: generate_batch(target, None, [prompt, prompt], 8),
    ):
        with pytest.raises(TargetError, match=type(model).__name__):
            run()
    assert not calls  # refused before the target ran at all


@pytest.mark.parametrize("arch", ["qwen3_5", "jamba"])
def test_cli_refuses_with_one_line_before_loading(tmp_path, arch, monkeypatch):
    config = hybrid_config(arch)
    config.save_pretrained(tmp_path / "target")
    DFlashDraftModel.for_target(config, num_layers=1, block_size=8, mask_token_id=VOCAB - 1).save_pretrained(
        tmp_path / "draft"
    )

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the target was checked")

    monkeypatch.setattr("flashdraft.target.load_target", refuse)
    args = ["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft")]
    for command in (["generate", *args, "hi"], ["eval", *args]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2, (command, result.output)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), result.output
        assert "Traceback" not in result.output and "ForCausalLM" in lines[0]


def test_conv_only_state_is_exact(hybrids):
    """LFM2 keeps only a conv window, which the cache crop rolls back: greedy speculative = plain greedy."""
    model = hybrids["lfm2"]
    target = Target(model)
    prompt = torch.randint(3, VOCAB - 1, (1, 9), generator=torch.Generator().manual_seed(0))
    plain = generate_ar(target, prompt, 30, stop_token_ids=[]).new_tokens
    with torch.no_grad():  # the oracle: full forwards without any cache
        ids = prompt
        for _ in range(30):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], 1)
    assert plain == ids[0, 9:].tolist()
    got = generate(target, drafter(model), prompt, 30, block_size=6, stop_token_ids=[])
    assert got.new_tokens == plain


@pytest.mark.parametrize("arch", ["qwen3_5", "jamba"])
def test_training_on_a_hybrid_target_runs(hybrids, arch, tmp_path):
    """Training keeps no cache: a hybrid target's layers are tapped like any other and the loss goes down."""
    from flashdraft.train import TrainConfig, Trainer

    model = hybrids[arch]
    target = Target(model)
    gen = torch.Generator().manual_seed(0)
    data = []
    for _ in range(4):
        ids = torch.randint(3, VOCAB - 1, (40,), generator=gen)
        mask = torch.zeros(40, dtype=torch.bool)
        mask[10:] = True
        data.append({"input_ids": ids, "loss_mask": mask})
    cfg = TrainConfig(
        out_dir=str(tmp_path),
        num_layers=1,
        block_size=6,
        num_anchors=8,
        lr=3e-3,
        epochs=3,
        batch_size=2,
        mask_token_id=VOCAB - 1,
        progress=False,
        save_every=10**9,
    )
    history = Trainer(target, data, cfg).fit()
    assert history[-1]["loss"] < history[0]["loss"]
