"""The MLX backend (flashdraft.mlx) against transformers, the torch engine, and itself: exact, on Linux CPU.

mlx is not in the default install: `make test-mlx` builds `.venv-mlx` with `flashdraft[mlx]` (mlx[cpu] on Linux)
and runs these tests; elsewhere they skip. Tiny random targets: their logits against transformers' in fp32, their
greedy tokens equal; the MLX drafter against the torch drafter on identical inputs; DFlash on MLX emitting exactly
plain decoding, greedy and sampled, with the torch engine's acceptance lengths step for step; refusals by name."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from conftest import VOCAB, byte_tokenizer, hf_greedy, hybrid_config, tiny_model
from test_serve import tiny_tokenizer

mx = pytest.importorskip("mlx.core", reason="the MLX backend: make test-mlx")
pytest.importorskip("mlx_lm", reason="the MLX backend: make test-mlx")

from flashdraft import DFlashDraftModel  # noqa: E402
from flashdraft.engine.grammar import Constraint  # noqa: E402
from flashdraft.mlx import decode, generate, generate_ar, load_pipeline  # noqa: E402
from flashdraft.mlx.drafter import DraftContext, load_drafter  # noqa: E402
from flashdraft.mlx.target import load_target  # noqa: E402
from flashdraft.targets.target import TargetError  # noqa: E402

pytestmark = pytest.mark.mlx

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
TAPS = [0, 2, 4]


def save_pair(root, arch: str, seed: int = 0, **overrides):
    """A tiny random fp32 target (with a word-level tokenizer) and an untrained block-8 drafter tapping it, on disk."""
    model = tiny_model(arch, seed=seed, **overrides)
    model.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")  # word i is token i: every text stays in the vocabulary
    torch.manual_seed(seed + 100)
    drafter = DFlashDraftModel.for_target(
        model.config, num_layers=2, block_size=8, mask_token_id=VOCAB - 1, target_layer_ids=TAPS
    )
    drafter.save_pretrained(root / "draft", dtype=torch.float32)
    return model, drafter


def prompts(count: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 14))] for _ in range(count)]


def assert_logits_match(target, model, ids: list[int]) -> None:
    """The MLX target's fp32 logits over `ids` within 1e-4 of transformers'."""
    logits, _ = target.forward(ids, target.make_cache())
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(np.array(logits) - ref).max() <= 1e-4


# ------------------------------------------------------------------------------------------------ the target
@pytest.mark.parametrize("arch", FAMILIES)
def test_target_logits_and_greedy_tokens_match_transformers(tmp_path, arch):
    model, _ = save_pair(tmp_path, arch)
    target = load_target(tmp_path / "target")
    for ids in prompts(3):
        assert_logits_match(target, model, ids)
        plain = generate_ar(target, ids, 12, stop_token_ids=[])
        assert plain.new_tokens == hf_greedy(model, torch.tensor([ids]), 12, None), arch


def test_target_taps_are_the_decoder_layers_outputs(tmp_path):
    model, _ = save_pair(tmp_path, "qwen3")
    target = load_target(tmp_path / "target")
    target.tap(TAPS)
    ids = prompts(1)[0]
    _, features = target.forward(ids, target.make_cache())
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    ref = torch.cat([hidden[i + 1][0] for i in TAPS], -1).numpy()
    assert np.abs(np.array(features) - ref).max() <= 1e-4


def test_transformers5_rope_parameters_reach_mlx_lm(tmp_path):
    """mlx-lm's llama reads `rope_theta` only; transformers 5 writes it inside `rope_parameters`. Unnormalised, the
    target decodes other text from the first tokens on (SmolLM2-135M from its 5th)."""
    model, _ = save_pair(tmp_path, "llama", rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    config = json.loads((tmp_path / "target" / "config.json").read_text())
    assert "rope_theta" not in config and config["rope_parameters"]["rope_theta"] == 500.0
    target = load_target(tmp_path / "target")
    ids = list(range(3, 40))
    assert_logits_match(target, model, ids)


def test_unmappable_config_fields_are_refused_by_name(tmp_path):
    save_pair(tmp_path, "llama", hidden_act="gelu")  # mlx-lm's llama always runs silu
    with pytest.raises(TargetError, match="hidden_act='gelu'"):
        load_target(tmp_path / "target")


def test_gemma3_sliding_window_target_is_exact(tmp_path, monkeypatch):
    """Gemma-3: per-layer-type RoPE (transformers 5) mapped onto mlx-lm's fields, its sliding layers' window (8
    tokens) wrapped many times over, drafts rejected in part at every step: plain decoding's output, greedy and
    sampled, and logits as transformers' over a prompt longer than the window."""
    model, _ = save_pair(tmp_path, "gemma3")
    target = load_target(tmp_path / "target")
    ids = list(range(3, 23))
    assert_logits_match(target, model, ids)
    pipeline = load_pipeline(tmp_path / "target", tmp_path / "draft")
    partial = 0
    for i, ids in enumerate(prompts(3, seed=8)):
        for temperature in (0.0, 0.9):
            plain = generate_ar(target, ids, 30, temperature=temperature, seed=1, stop_token_ids=[])
            assert generate(pipeline, None, ids, 30, block_size=8, temperature=temperature, seed=1,
                            stop_token_ids=[]).new_tokens == plain.new_tokens  # fmt: skip
            if temperature == 0:
                assert plain.new_tokens == hf_greedy(model, torch.tensor([ids]), 30, None)
            oracle_proposals(monkeypatch, ids + plain.new_tokens, random.Random(i))
            got = decode(
                target, None, ids, 30, temperature=temperature, seed=1, lookup=True, stop_token_ids=[]
            )
            assert got.new_tokens == plain.new_tokens
            partial += sum(0 < a < d for a, d in zip(got.accepted_drafts, got.draft_lengths, strict=True))
            monkeypatch.undo()
    assert partial > 0


def test_a_scaled_rope_on_gemma3_sliding_layers_is_refused(tmp_path):
    model, _ = save_pair(tmp_path, "gemma3")
    config = json.loads((tmp_path / "target" / "config.json").read_text())
    config["rope_parameters"]["sliding_attention"] = {
        "rope_type": "linear",
        "factor": 2.0,
        "rope_theta": 10000.0,
    }
    (tmp_path / "target" / "config.json").write_text(json.dumps(config))
    with pytest.raises(TargetError, match="sliding layers use a scaled RoPE"):
        load_target(tmp_path / "target")


def save_qwen35(path, layer_types):
    """A tiny random Qwen3.5 (GatedDeltaNet layers beside attention), under the model type mlx-lm reads."""
    from transformers import AutoModelForCausalLM

    config = hybrid_config("qwen3_5")
    config.layer_types = layer_types
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**saved, "model_type": "qwen3_5"}))
    return model


LINEAR, FULL = "linear_attention", "full_attention"


def oracle_proposals(monkeypatch, reference: list[int], rng: random.Random) -> None:
    """The decode loop's proposals (its prompt-lookup source) replaced by an oracle that knows the output: right for
    the first k of each run, k drawn at random, then wrong (conftest.OracleProposer's rule)."""
    import flashdraft.mlx.decoder as decoder

    def propose(history, max_tokens, _max_ngram=0):
        truth = reference[len(history) : len(history) + max_tokens]
        k = rng.randint(0, len(truth))
        return [t if j < k else (t + 1 + rng.randrange(VOCAB - 1)) % VOCAB for j, t in enumerate(truth)], 1

    monkeypatch.setattr(decoder, "prompt_lookup", propose)


def test_qwen35_gated_deltanet_target_rolls_back_exactly(tmp_path, monkeypatch):
    """Qwen3.5's GatedDeltaNet layers: logits as transformers', and decoding with rejected drafts (their recurrent
    state restored, the kept tokens run again) emits exactly plain decoding, greedy and sampled, with partial accepts."""
    model = save_qwen35(tmp_path, [LINEAR, LINEAR, LINEAR, FULL])  # mlx-lm's rule: every 4th layer attention
    target = load_target(tmp_path)
    assert any("GatedDeltaNet" in type(m).__name__ for _, m in target.model.named_modules())
    ids = prompts(1)[0]
    assert_logits_match(target, model, ids)
    partial = 0
    for i, ids in enumerate(prompts(4, seed=7)):
        for temperature in (0.0, 0.9):
            plain = generate_ar(target, ids, 30, temperature=temperature, seed=2, stop_token_ids=[])
            oracle_proposals(monkeypatch, ids + plain.new_tokens, random.Random(i))
            got = decode(
                target, None, ids, 30, temperature=temperature, seed=2, lookup=True, stop_token_ids=[]
            )
            assert got.new_tokens == plain.new_tokens
            partial += sum(0 < a < d for a, d in zip(got.accepted_drafts, got.draft_lengths, strict=True))
    assert partial > 0  # some verifies kept a part of their drafts: a real rollback, not a whole reset


def test_qwen35_layer_patterns_pass_as_an_interval_or_are_refused(tmp_path):
    """mlx-lm builds Qwen3.5's layers from `full_attention_interval` and ignores `layer_types`: a pattern that an
    interval builds is passed as that interval (the logits then match transformers'); any other is refused."""
    model = save_qwen35(tmp_path / "a", [LINEAR, LINEAR, FULL, LINEAR])  # every 3rd layer attention
    target = load_target(tmp_path / "a")
    ids = prompts(1)[0]
    assert_logits_match(target, model, ids)
    save_qwen35(tmp_path / "b", [LINEAR, FULL, LINEAR, LINEAR])  # no interval builds this
    with pytest.raises(TargetError, match="ignores layer_types"):
        load_target(tmp_path / "b")


# ------------------------------------------------------------------------------------------------ the drafter
def random_dflash2(drafter: DFlashDraftModel) -> DFlashDraftModel:
    """A DFlash2 drafter whose convolutions and selector are not the identity (random weights everywhere)."""
    torch.manual_seed(3)
    fresh = drafter.as_dflash2(selector_top_k=4, selector_rank=8, conv_kernel_size=3, conv_group_size=16)
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            if "_conv." in name or "candidate_selector" in name:
                p.normal_(0, 0.2)
    return fresh


@pytest.mark.parametrize("kind", ["v1", "dflash2", "sliding_causal"])
def test_mlx_drafter_matches_the_torch_drafter(tmp_path, kind):
    model, drafter = save_pair(tmp_path, "qwen3")
    if kind == "dflash2":
        drafter = random_dflash2(drafter)
    if kind == "sliding_causal":  # a causal, windowed layer beside a full one: the masks
        from dataclasses import replace

        config = replace(
            drafter.config, layer_types=["sliding_attention", "full_attention"], sliding_window=5
        )
        sliding = DFlashDraftModel(config)
        sliding.load_state_dict(drafter.state_dict())
        drafter = sliding.eval()
    drafter.save_pretrained(tmp_path / kind, dtype=torch.float32)
    ours = load_drafter(tmp_path / kind)
    torch.manual_seed(1)
    features = torch.randn(11, 3 * 64)
    block = torch.randn(8, 64)
    anchor = 11
    with torch.no_grad():
        ref = drafter(
            block[None], torch.arange(anchor, anchor + 8)[None], features[None], torch.arange(11)[None]
        )[0]
    context = DraftContext()
    context.append(ours.context_kv(mx.array(features.numpy()), 0))
    got = ours.block_hidden(mx.array(block.numpy()), anchor, context)
    assert np.abs(np.array(got) - ref.numpy()).max() <= 1e-4, kind
    if kind == "dflash2":  # the selector's walk: the same path from the same logits
        logits = torch.randn(7, VOCAB)
        want, _ = drafter.candidate_selector.select(ref[None, 1:], logits[None], torch.tensor([5]))
        path = ours.propose(mx.array(ref[1:].numpy()), mx.array(logits.numpy()), 5)
        assert path == want[0].tolist()


def test_every_drafter_setting_drafts_as_the_torch_drafter(tmp_path):
    """Scaled RoPE (transformers' frequencies), GPT-J-style RoPE pairs, the input embedding scale, the output
    multiplier, the logit soft-cap and a shipped mask row (`mask_embedding.pt`), all at once: the MLX drafter's
    logits and drafts from a real target's features are the torch drafter's."""
    from dataclasses import replace

    from flashdraft.drafter.model import block_inputs, draft_logits

    model, drafter = save_pair(tmp_path, "qwen3")
    config = replace(
        drafter.config,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        rope_interleaved=True,
        input_embedding_scale=2.0,
        output_multiplier=0.5,
        final_logit_softcapping=3.0,
    )
    every = DFlashDraftModel(config)
    every.load_state_dict(drafter.state_dict())
    every.mask_embedding = torch.randn(64)
    every.eval().save_pretrained(tmp_path / "every", dtype=torch.float32)
    pipeline = load_pipeline(tmp_path / "target", tmp_path / "every")
    ids, anchor = prompts(1, seed=9)[0], 7
    block = torch.tensor([[anchor] + [VOCAB - 1] * 7])
    with torch.no_grad():
        hidden_states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        features = torch.cat([hidden_states[i + 1] for i in TAPS], -1)
        embeds = block_inputs(config, model.get_input_embeddings().weight, block, every.mask_embedding)
        hidden = every(
            embeds, torch.arange(len(ids), len(ids) + 8)[None], features, torch.arange(len(ids))[None]
        )
        want = draft_logits(config, hidden[0, 1:], model.lm_head.weight, None)
    context = DraftContext()
    _, mlx_features = pipeline.target.forward(ids, pipeline.target.make_cache())
    context.append(pipeline.drafter.context_kv(mlx_features, 0))
    got, _ = pipeline.drafter.draft(pipeline.target, context, anchor, len(ids))
    assert got == want.argmax(-1).tolist()
    embeds = pipeline.target.embed(mx.array(block[0].numpy()))
    embeds = (
        mx.where((mx.array(block[0].numpy()) == VOCAB - 1)[:, None], pipeline.drafter.mask_row, embeds) * 2.0
    )
    mlx_logits = pipeline.drafter.logits(
        pipeline.drafter.block_hidden(embeds, len(ids), context)[1:], pipeline.target.head
    )
    assert np.abs(np.array(mlx_logits) - want.numpy()).max() <= 1e-4


def test_a_checkpoint_that_does_not_match_its_config_is_refused(tmp_path):
    from flashdraft.drafter.checkpoint import DFlashCheckpointError

    save_pair(tmp_path, "llama")
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    config["num_hidden_layers"] = 3
    config["layer_types"] = ["full_attention"] * 3
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashCheckpointError, match="missing"):
        load_drafter(tmp_path / "draft")


# ------------------------------------------------------------------------------------------------ the loop
def torch_acceptance(model, drafter, ids, max_new: int, block: int) -> tuple[list[int], list[int]]:
    from flashdraft import generate as torch_generate

    res = torch_generate(model, drafter, torch.tensor([ids]), max_new, block_size=block, stop_token_ids=[])
    return res.new_tokens, res.acceptance_lengths


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dflash_is_plain_decoding_with_the_torch_engines_acceptance(tmp_path, arch):
    model, drafter = save_pair(tmp_path, arch)
    pipeline = load_pipeline(tmp_path / "target", tmp_path / "draft")
    for i, ids in enumerate(prompts(4, seed=1)):
        for block in (8, 3):
            got = generate(pipeline, None, ids, 20, block_size=block, stop_token_ids=[])
            plain = generate_ar(pipeline, ids, 20, stop_token_ids=[])
            assert got.new_tokens == plain.new_tokens, (i, block)
            tokens, lengths = torch_acceptance(model, drafter, ids, 20, block)
            assert got.new_tokens == tokens and got.acceptance_lengths == lengths, (i, block)


def test_prompt_lookup_decoding_is_plain_decoding_with_long_accepts(tmp_path):
    """Tiny random targets fall into loops: prompt lookup then proposes whole runs, accepted several at a time, and
    partly rejected where the loop breaks (the target's cache trimmed by what was rejected)."""
    save_pair(tmp_path, "llama")
    target = load_target(tmp_path / "target")
    long_accepts = partial = 0
    for ids in prompts(6, seed=2):
        for temperature in (0.0, 0.9):
            plain = generate_ar(target, ids, 40, temperature=temperature, seed=4, stop_token_ids=[])
            got = decode(
                target, None, ids, 40, temperature=temperature, seed=4, lookup=True, stop_token_ids=[]
            )
            assert got.new_tokens == plain.new_tokens
            long_accepts += sum(a > 1 for a in got.acceptance_lengths)
            partial += sum(0 < a < d for a, d in zip(got.accepted_drafts, got.draft_lengths, strict=True))
    assert long_accepts > 0 and partial > 0


def test_sampled_dflash_is_plain_sampling_with_the_same_seed(tmp_path):
    save_pair(tmp_path, "qwen3")
    pipeline = load_pipeline(tmp_path / "target", tmp_path / "draft")
    for seed, ids in enumerate(prompts(4, seed=3)):
        kwargs = dict(temperature=0.8, top_k=20, top_p=0.9, seed=seed, stop_token_ids=[])
        got = generate(pipeline, None, ids, 16, block_size=8, **kwargs)
        assert got.new_tokens == generate_ar(pipeline, ids, 16, **kwargs).new_tokens


def test_sampling_follows_the_targets_law(tmp_path):
    """The first token over 3000 seeds against the target's processed distribution (χ², torch's `target_probs`
    on transformers' logits as the reference)."""
    from scipy.stats import chisquare

    from flashdraft.sampling import SamplingParams, target_probs

    model, _ = save_pair(tmp_path, "llama")
    target = load_target(tmp_path / "target")
    ids = [5, 9, 14]
    params = SamplingParams(1.3, top_p=0.95, top_k=30)
    with torch.no_grad():
        p = target_probs(model(torch.tensor([ids])).logits[0, -1:], params)[0].double().numpy()
    draws = 3000
    counts = np.zeros(VOCAB)
    logits, _ = target.forward(ids, target.make_cache())
    from flashdraft.mlx.sampling import target_tokens

    last = np.array(logits[-1:])
    for seed in range(draws):
        counts[target_tokens(last, params, seed, len(ids))[0]] += 1
    assert counts[p == 0].sum() == 0  # nothing outside top-k / top-p
    keep = p > 0
    assert chisquare(counts[keep], p[keep] / p[keep].sum() * draws).pvalue > 1e-3


def test_auto_verify_length_is_plain_decoding(tmp_path):
    save_pair(tmp_path, "llama")
    pipeline = load_pipeline(tmp_path / "target", tmp_path / "draft")
    for ids in prompts(3, seed=4):
        got = generate(pipeline, None, ids, 24, stop_token_ids=[])
        assert got.new_tokens == generate_ar(pipeline, ids, 24, stop_token_ids=[]).new_tokens
    prices = pipeline.drafter.prices
    assert prices.lengths[0] == 1 and all(s > 0 for s in prices.verify_s) and prices.draft_s > 0


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_mlx_target_dflash_is_its_own_plain_decoding(tmp_path, bits):
    """An MLX-converted target, quantized by mlx-lm (group size 32), loaded from its directory."""
    from mlx_lm.convert import convert

    save_pair(tmp_path, "qwen3")
    convert(str(tmp_path / "target"), str(tmp_path / "q"), quantize=True, q_bits=bits, q_group_size=32)
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]["bits"] == bits
    pipeline = load_pipeline(tmp_path / "q", tmp_path / "draft")
    assert "Quantized" in type(pipeline.target.layers[0].mlp.gate_proj).__name__
    for ids in prompts(3, seed=5):
        got = generate(pipeline, None, ids, 16, block_size=8, stop_token_ids=[])
        assert got.new_tokens == generate_ar(pipeline, ids, 16, stop_token_ids=[]).new_tokens


def test_bad_requests_get_one_clear_error(tmp_path):
    from flashdraft.engine.request import GenerationError
    from flashdraft.sampling import SamplingError

    save_pair(tmp_path, "llama")
    pipeline = load_pipeline(tmp_path / "target", tmp_path / "draft")
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        generate(pipeline, None, [5, VOCAB + 3], 4)
    with pytest.raises(GenerationError, match="block_size"):
        generate(pipeline, None, [5, 6], 4, block_size=9)
    with pytest.raises(SamplingError, match="top_p"):
        generate(pipeline, None, [5, 6], 4, temperature=1.0, top_p=float("nan"))
    with pytest.raises(GenerationError, match="empty"):
        generate_ar(pipeline, [], 4)


# ------------------------------------------------------------------------------------------------ the CLI
def run_cli(*args: str):
    from typer.testing import CliRunner

    from flashdraft.cli import app

    return CliRunner().invoke(app, list(args))


def test_generate_backend_mlx_reports_plain_decodings_output_and_the_torch_acceptance(tmp_path):
    """`flashdraft generate --backend mlx` on a tiny random Qwen3 target with a drafter from `flashdraft
    init-draft`: output identical to plain decoding, acceptance lengths those of `--backend torch`."""
    tiny_model("qwen3", vocab_size=320).save_pretrained(tmp_path / "target")
    byte_tokenizer(["the cat sat on the mat"] * 20, 320).save_pretrained(tmp_path / "target")
    made = run_cli("init-draft", "--target", str(tmp_path / "target"), "--out", str(tmp_path / "draft"),
                   "--num-layers", "1", "--block-size", "8")  # fmt: skip
    assert made.exit_code == 0, made.output
    reports = {}
    for backend in ("mlx", "torch"):
        res = run_cli("generate", "--backend", backend, "--target", str(tmp_path / "target"), "--draft",
                      str(tmp_path / "draft"), "--block-size", "8", "--compare-ar", "--json", "--max-new-tokens",
                      "16", "--dtype", "float32", "the cat")  # fmt: skip
        assert res.exit_code == 0, res.output
        reports[backend] = json.loads(res.stdout[res.stdout.index("{") :])
    assert reports["mlx"]["identical_to_ar"] is True and reports["mlx"]["backend"] == "mlx"
    assert reports["mlx"]["text"] == reports["torch"]["text"]
    assert reports["mlx"]["dflash"]["acceptance_lengths"] == reports["torch"]["dflash"]["acceptance_lengths"]


def test_generate_backend_mlx_refuses_torch_only_options_by_name(tmp_path):
    save_pair(tmp_path, "llama")
    res = run_cli("generate", "--backend", "mlx", "--target", str(tmp_path / "target"), "--draft",
                  str(tmp_path / "draft"), "--tree", "4", "--compile", "hi")  # fmt: skip
    assert res.exit_code == 2
    assert "--compile, --tree are not available with --backend mlx" in " ".join(res.output.split())
    res = run_cli("generate", "--backend", "metal", "--target", str(tmp_path / "target"), "--draft",
                  str(tmp_path / "draft"), "hi")  # fmt: skip
    assert res.exit_code == 2 and "--backend must be torch or mlx" in res.output


# ------------------------------------------------------------------------------------------------ z-lab's MLX code
def test_zlab_model_mlx_drafts_and_accepts_as_we_do(tmp_path, monkeypatch):
    """z-lab's `dflash.model_mlx` (PyPI dflash==0.1.0, installed by `make test-mlx`) as a second oracle: on the same
    target and checkpoint, the same first drafts, the same tokens and the same acceptance lengths step by step (its
    last step drafts a shorter block where ours drafts the whole one and verifies a prefix: not compared)."""
    zlab = pytest.importorskip("dflash.model_mlx", reason="z-lab's dflash package: make test-mlx installs it")
    save_pair(
        tmp_path, "qwen3"
    )  # mlx-lm's qwen3 reads rope_parameters itself: z-lab's load decodes as transformers
    monkeypatch.setattr(zlab, "snapshot_download", lambda repo, **_: repo)  # a local directory, no hub
    model, tokenizer = zlab.load(str(tmp_path / "target"))
    draft = zlab.load_draft(str(tmp_path / "draft"))
    pipeline = load_pipeline(tmp_path / "target", tmp_path / "draft")

    zlab._patch_model(model, draft.config.target_layer_ids)
    draft.bind(model)
    for ids in prompts(3, seed=6):
        cache = zlab.make_prompt_cache(model)
        model(mx.array([ids]), cache)
        hidden = mx.concatenate(model._hidden_states, axis=-1)
        block = mx.array([[ids[-1]] + [VOCAB - 1] * 7])
        theirs = mx.argmax(draft(block, hidden, draft.make_cache(), logits_start=1), axis=-1)[0].tolist()
        ours_context = DraftContext()
        _, features = pipeline.target.forward(ids, pipeline.target.make_cache())
        ours_context.append(pipeline.drafter.context_kv(features, 0))
        ours, _ = pipeline.drafter.draft(pipeline.target, ours_context, ids[-1], len(ids))
        assert ours == theirs

        steps = list(zlab.stream_generate(model, draft, tokenizer, ids, block_size=8, max_tokens=24))
        got = generate(pipeline, None, ids, 24, block_size=8, stop_token_ids=sorted(tokenizer.eos_token_ids))
        assert got.new_tokens == [t for step in steps for t in step.tokens]
        lengths = [step.accepted for step in steps if step.accepted is not None]
        assert got.acceptance_lengths[:-1] == lengths[: len(got.acceptance_lengths) - 1]


# ------------------------------------------------------------------------------------------------ SmolLM2-135M
@pytest.mark.slow
def test_smollm2_with_the_shipped_drafter_on_mlx(tmp_path):
    """The real target through mlx-lm (transformers 5's rope_parameters: its rope_theta is 100000, mlx-lm's llama
    default 10000) and the shipped drafter: logits as transformers', DFlash = plain decoding with the torch engine's
    acceptance lengths step for step at the trained block, and a drafter that really accepts (τ > 1.3)."""
    from pathlib import Path

    from flashdraft import DFlashDraftModel
    from flashdraft import generate as torch_generate
    from flashdraft import load_target as load_torch_target

    shipped = Path(__file__).resolve().parents[1] / "drafters" / "smollm2-135m-instruct"
    pipeline = load_pipeline("smollm2-135m-instruct", shipped)
    reference = load_torch_target("smollm2-135m-instruct", dtype=torch.float32)
    ids = reference.encode_prompt(
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
        "clips did Natalia sell altogether in April and May?\nPlease reason step by step, and put your final "
        "answer within \\boxed{}."
    )[0].tolist()
    logits, _ = pipeline.target.forward(ids, pipeline.target.make_cache())
    with torch.no_grad():
        want = reference.model(torch.tensor([ids])).logits[0].float().numpy()
    assert np.abs(np.array(logits) - want).max() <= 5e-4
    got = generate(pipeline, None, ids, 40, block_size=16)
    assert got.new_tokens == generate_ar(pipeline, ids, 40).new_tokens
    draft = DFlashDraftModel.from_pretrained(shipped, dtype=torch.float32)
    theirs = torch_generate(reference, draft, torch.tensor([ids]), 40, block_size=16)
    assert got.new_tokens == theirs.new_tokens
    assert got.acceptance_lengths == theirs.acceptance_lengths
    assert got.mean_acceptance_length > 1.3


def test_structured_output_on_mlx_is_plain_constrained_decoding(tmp_path, monkeypatch):
    """A grammar on the MLX loop (xgrammar's masks, engine/grammar.py's rule: position j masked by the state after
    the first j drafts): DFlash and proposals accepted several at a time emit exactly what plain constrained
    decoding emits, greedy and sampled, and only what the grammar allows."""
    pattern = "(w[3-9])+"
    save_pair(tmp_path, "llama")
    pipeline = load_pipeline(tmp_path / "target", tmp_path / "draft")
    target, constraint = pipeline.target, Constraint("regex", pattern)
    long_accepts = 0
    for i, ids in enumerate(prompts(3, seed=10)):
        for temperature in (0.0, 0.9):
            kwargs = dict(temperature=temperature, seed=3, response_format=constraint)
            plain = generate_ar(target, ids, 12, **kwargs)
            body = [t for t in plain.new_tokens if t != 2]  # </s> may end it where the regex is complete
            assert body and all(3 <= t <= 9 for t in body)
            assert generate(pipeline, None, ids, 12, block_size=8, **kwargs).new_tokens == plain.new_tokens
            oracle_proposals(monkeypatch, ids + plain.new_tokens, random.Random(i))
            got = decode(target, None, ids, 12, lookup=True, **kwargs)
            monkeypatch.undo()
            assert got.new_tokens == plain.new_tokens
            long_accepts += sum(a > 1 for a in got.acceptance_lengths)
    assert long_accepts > 0


# ------------------------------------------------------------------------------------------------ serve
def test_served_on_mlx_answers_are_plain_decodings(tmp_path):
    """`flashdraft serve --backend mlx`'s engine: the OpenAI surface over the MLX decoder (one request decoding at a
    time, the others queued): each answer is plain decoding's, streamed or not, under a grammar too."""
    openai = pytest.importorskip("openai")
    from concurrent.futures import ThreadPoolExecutor

    from conftest import running_server
    from flashdraft.mlx import MlxDecoder
    from flashdraft.serve import Engine, build_app

    save_pair(tmp_path, "llama")
    pipeline = load_pipeline(tmp_path / "target", tmp_path / "draft")
    target = pipeline.target
    engine = Engine(target, pipeline.drafter, decoder=MlxDecoder(target, pipeline.drafter, 4))
    conversations = [
        [{"role": "user", "content": f"w{a} w{b} w{c}"}] for a, b, c in ((7, 9, 11), (30, 4, 5), (8, 8, 60))
    ]
    try:
        with running_server(build_app(engine, "tiny")) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)

            def ask(messages):
                return client.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=12, temperature=0
                )

            with ThreadPoolExecutor(3) as pool:
                answers = list(pool.map(ask, conversations))
            for messages, answer in zip(conversations, answers, strict=True):
                plain = generate_ar(target, target.encode_prompt(messages), 12)
                assert answer.choices[0].message.content == target.tokenizer.decode(
                    plain.new_tokens, skip_special_tokens=True
                )
                assert answer.usage.completion_tokens == plain.num_new_tokens
            stream = client.chat.completions.create(
                model="tiny", messages=conversations[0], max_tokens=12, temperature=0, stream=True
            )
            text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
            assert text == answers[0].choices[0].message.content
            regex = {
                "guided_regex": "(w[3-9])+"
            }  # structured output: the grammar's masks on the MLX loop's logits
            constrained = client.chat.completions.create(
                model="tiny", messages=conversations[2], max_tokens=10, temperature=0, extra_body=regex
            )
            plain = generate_ar(
                target,
                target.encode_prompt(conversations[2]),
                10,
                response_format=Constraint("regex", "(w[3-9])+"),
            )
            assert constrained.choices[0].message.content == target.tokenizer.decode(
                plain.new_tokens, skip_special_tokens=True
            )
            assert ask(conversations[1]).choices[0].message.content == answers[1].choices[0].message.content
    finally:
        engine.close()


def test_eval_and_bench_backend_mlx(tmp_path):
    """`flashdraft eval --backend mlx` measures τ with the MLX loop; `flashdraft bench --backend mlx` writes the
    torch backend's report (ar and dflash, outputs compared) and refuses what it does not run, by name."""
    save_pair(tmp_path, "llama")
    target, draft = str(tmp_path / "target"), str(tmp_path / "draft")
    res = run_cli("eval", "--backend", "mlx", "--target", target, "--draft", draft, "--datasets", "gsm8k",
                  "--samples", "2", "--max-new-tokens", "8", "--json", str(tmp_path / "eval.json"))  # fmt: skip
    assert res.exit_code == 0, res.output
    record = json.loads((tmp_path / "eval.json").read_text())
    assert record["backend"] == "mlx" and record["results"]["gsm8k"]["prompts"] == 2
    assert record["results"]["gsm8k"]["tau"] >= 1.0
    res = run_cli("bench", "--backend", "mlx", "--target", target, "--draft", draft, "-d", "gsm8k",
                  "--max-samples", "2", "--max-new-tokens", "8", "--block-size", "4", "--out", str(tmp_path / "b"),
                  "--no-plots")  # fmt: skip
    assert res.exit_code == 0, res.output
    results = json.loads((tmp_path / "b" / "results.json").read_text())
    assert results["settings"]["backend"] == "mlx" and results["settings"]["methods"] == ["ar", "dflash"]
    assert results["equality"]["compared"] == 2 and results["equality"]["mismatches"] == 0
    res = run_cli("bench", "--backend", "mlx", "--target", target, "--draft", draft, "--methods", "ar,sd",
                  "--max-samples", "1")  # fmt: skip
    assert res.exit_code == 2 and "methods sd do not run with --backend mlx" in " ".join(res.output.split())
