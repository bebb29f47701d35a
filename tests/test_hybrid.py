"""Hybrid and recurrent targets: exact where the rollback covers them, refused by one clear line where not."""

from __future__ import annotations

import random

import pytest
import torch
from typer.testing import CliRunner

from conftest import HYBRID_ARCHS, VOCAB, OracleProposer, hybrid_model
from flashdraft import DFlashDraftModel, Target, TargetError, generate, generate_ar
from flashdraft.cli import app
from flashdraft.generate import generate_batch
from flashdraft.targets.recurrent import causal_lm_class

EXACT = HYBRID_ARCHS


def refused_config(arch: str):
    """Families the rollback does not cover: RWKV keeps its state outside transformers' cache layers; Falcon-Mamba
    is not verified (refused until a test says it is exact); GPT-1 takes no cache at all."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    if arch == "rwkv":
        return tf.RwkvConfig(attention_hidden_size=64, intermediate_size=128, context_length=256, **common)
    if arch == "falcon_mamba":
        return tf.FalconMambaConfig(state_size=8, expand=2, **common)
    if arch == "openai-gpt":
        return tf.OpenAIGPTConfig(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    raise ValueError(arch)


REFUSED = ["rwkv", "falcon_mamba", "openai-gpt"]


class _Hybrids(dict):
    """The tiny hybrid models this transformers knows; a test of one it does not know (lfm3 came in 5.23) skips
    instead of erroring every test of the module."""

    def __missing__(self, arch: str):
        import transformers

        pytest.skip(f"transformers {transformers.__version__} has no {arch} model")


@pytest.fixture(scope="module")
def hybrids():
    from transformers import CONFIG_MAPPING

    known = (arch for arch in enumerate(HYBRID_ARCHS) if arch[1] in CONFIG_MAPPING)
    return _Hybrids({arch: hybrid_model(arch, seed=i) for i, arch in known})


@pytest.fixture(scope="module")
def refused():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return {arch: AutoModelForCausalLM.from_config(refused_config(arch)).eval() for arch in REFUSED}


def drafter(model, block_size=6, seed=1):
    return DFlashDraftModel.for_target(
        model.config, num_layers=1, block_size=block_size, mask_token_id=VOCAB - 1, seed=seed
    ).eval()


@pytest.mark.parametrize("arch", REFUSED)
def test_refused_before_any_decoding(refused, arch, monkeypatch):
    model = refused[arch]
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


@pytest.mark.parametrize("arch", REFUSED)
def test_cli_refuses_with_one_line_before_loading(tmp_path, arch, monkeypatch):
    config = refused_config(arch)
    config.save_pretrained(tmp_path / "target")
    DFlashDraftModel.for_target(config, num_layers=1, block_size=8, mask_token_id=VOCAB - 1).save_pretrained(
        tmp_path / "draft"
    )

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the target was checked")

    monkeypatch.setattr("flashdraft.targets.target.load_target", refuse)
    args = ["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft")]
    for command in (["generate", *args, "hi"], ["eval", *args]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2, (command, result.output)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), result.output
        assert "Traceback" not in result.output and causal_lm_class(config).__name__ in lines[0]


def test_a_cache_layer_a_model_defines_for_itself_is_refused():
    """DeepSeek-V4's compressor caches derive from the sliding-window layer, which the engine would swap for a
    plain KV layer: their state is not what a crop rolls back."""
    import transformers as tf

    from flashdraft.targets.recurrent import decoding_support

    if not hasattr(tf, "DeepseekV4Config"):
        pytest.skip(f"transformers {tf.__version__} has no DeepSeek-V4")
    why = decoding_support(tf.DeepseekV4Config(num_hidden_layers=2))
    assert why is not None and "DeepseekV4ForCausalLM" in why


@pytest.mark.parametrize("arch", ["qwen3_5", "jamba"])
def test_training_on_a_hybrid_target_runs(hybrids, arch, tmp_path):
    """Training keeps no cache: a hybrid target's layers are tapped like any other and the loss goes down."""
    from flashdraft.training.trainer import Trainer
    from test_train import small_train_config

    model = hybrids[arch]
    target = Target(model)
    gen = torch.Generator().manual_seed(0)
    data = []
    for _ in range(4):
        ids = torch.randint(3, VOCAB - 1, (40,), generator=gen)
        mask = torch.zeros(40, dtype=torch.bool)
        mask[10:] = True
        data.append({"input_ids": ids, "loss_mask": mask})
    cfg = small_train_config(
        tmp_path, num_layers=1, block_size=6, num_anchors=8, epochs=3, batch_size=2, mask_token_id=VOCAB - 1
    )
    history = Trainer(target, data, cfg).fit()
    assert history[-1]["loss"] < history[0]["loss"]


def oracle_greedy(model, prompt: list[int], new: int, eos: list[int] = ()) -> list[int]:
    """Plain greedy decoding computed without any cache: a full forward over the whole sequence per token."""
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(new):
            tok = int(model(ids).logits[0, -1].argmax())
            out.append(tok)
            if tok in eos:
                break
            ids = torch.cat([ids, torch.tensor([[tok]])], 1)
    return out


def oracle_proposers(target, prompts, seed=3, block=6):
    """Per-row proposers right for a random number of drafts per step (ragged, partial acceptance)."""
    references = iter(
        [p + generate_ar(target, p, 60, stop_token_ids=[]).new_tokens + [0] * 20 for p in prompts]
    )
    rng = random.Random(seed)
    return lambda: OracleProposer(next(references, [0] * 200), VOCAB, block, rng)


@pytest.mark.parametrize("arch", EXACT)
def test_greedy_single_and_batched_equal_plain_greedy_without_cache(hybrids, arch):
    model = hybrids[arch]
    target = Target(model)
    prompts = [[5, 9, 14, 3, 22, 7, 40], [11, 4], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 12], [8, 8, 9]]
    limits = [24, 9, 20, 3]
    eos = [2]
    truth = [oracle_greedy(model, p, m, eos) for p, m in zip(prompts, limits, strict=True)]
    assert [
        generate_ar(target, p, m, stop_token_ids=eos).new_tokens for p, m in zip(prompts, limits, strict=True)
    ] == truth

    # One row: an oracle proposer with partial acceptance every step; and the DFlash drafter (random: rejections).
    rng = random.Random(0)
    ref = prompts[0] + truth[0] + [0] * 20
    single = generate(target, OracleProposer(ref, VOCAB, 6, rng), prompts[0], limits[0], stop_token_ids=eos)
    assert single.new_tokens == truth[0]
    assert len(set(single.accepted_drafts)) >= 3  # rejections at several slots, and whole blocks
    assert (
        generate(target, drafter(model), prompts[0], limits[0], block_size=6, stop_token_ids=eos).new_tokens
        == truth[0]
    )

    # A batch: rows of different lengths, ragged acceptance, rows finishing early; and continuous batching.
    for max_batch in (None, 2):
        got = generate_batch(
            target,
            oracle_proposers(target, prompts),
            prompts,
            limits,
            stop_token_ids=eos,
            max_batch_size=max_batch,
        )
        assert [g.new_tokens for g in got] == truth
    got = generate_batch(target, drafter(model), prompts, limits, stop_token_ids=eos, block_size=5)
    assert [g.new_tokens for g in got] == truth


@pytest.mark.parametrize("arch", EXACT)
def test_seeded_sampling_equals_plain_sampling(hybrids, arch):
    model = hybrids[arch]
    target = Target(model)
    prompts = [[5, 9, 14, 3], [11, 4, 60, 61, 62, 63]]
    kw = dict(temperature=0.9, top_p=0.95, stop_token_ids=[])
    plain = [generate_ar(target, p, 20, seed=7 + i, **kw).new_tokens for i, p in enumerate(prompts)]
    spec = [
        generate(target, drafter(model), p, 20, block_size=6, seed=7 + i, **kw).new_tokens
        for i, p in enumerate(prompts)
    ]
    assert spec == plain
    batch = generate_batch(target, drafter(model), prompts, 20, block_size=6, seed=[7, 8], **kw)
    assert [b.new_tokens for b in batch] == plain


@pytest.mark.parametrize("arch", ["qwen3_5", "jamba", "mamba2", "lfm2"])
def test_rollback_is_what_makes_it_exact(hybrids, arch, monkeypatch):
    """Without the replay (the state keeps the rejected drafts), the same decode diverges: the test models'
    recurrent state matters."""
    model = hybrids[arch]
    target = Target(model)
    prompt = [5, 9, 14, 3, 22, 7, 40]
    truth = oracle_greedy(model, prompt, 24)
    monkeypatch.setattr(target.recurrent, "keep", lambda cache, keep: None)
    rng = random.Random(0)
    got = generate(
        target, OracleProposer(prompt + truth + [0] * 20, VOCAB, 6, rng), prompt, 24, stop_token_ids=[]
    )
    assert got.new_tokens != truth


@pytest.mark.parametrize("arch", ["qwen3_next", "jamba"])
def test_served_requests_on_a_hybrid_target(hybrids, arch):
    """Concurrent requests through the server's continuous batching: each answer is plain greedy decoding."""
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from flashdraft.serve import Engine, build_app
    from test_serve import tiny_tokenizer

    model = hybrids[arch]
    target = Target(model, tiny_tokenizer(), name="tiny")
    prompts = [[5, 9, 14, 3, 22, 7, 40], [11, 4], [30, 31, 32, 33, 34, 35]]
    engine = Engine(target, drafter(model), block_size=5, max_batch_size=4)
    try:
        with TestClient(build_app(engine, "tiny")) as client:

            def ask(prompt):
                body = {
                    "model": "tiny",
                    "prompt": prompt,
                    "max_tokens": 16,
                    "temperature": 0,
                    "return_token_ids": True,
                }
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"]

            with ThreadPoolExecutor(3) as pool:
                got = list(pool.map(ask, prompts))
    finally:
        engine.close()
    assert got == [oracle_greedy(model, p, 16, eos=[2]) for p in prompts]
