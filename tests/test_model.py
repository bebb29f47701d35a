"""Drafter architecture, z-lab checkpoint format, target adapter taps and the mismatch errors."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import ARCHS, VOCAB, tiny_config
from flashdraft import (
    DFlashCheckpointError,
    DFlashConfig,
    DFlashConfigError,
    DFlashDraftModel,
    DraftContextCache,
    DraftTargetMismatchError,
    Target,
    build_target_layer_ids,
)

# z-lab Qwen3-8B-DFlash-b16 config values (SpecForge configs/qwen3-8b-dflash.json), as published.
ZLAB_QWEN3_8B = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def small_config(**overrides) -> DFlashConfig:
    base = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        num_target_layers=6,
        target_layer_ids=[1, 3, 4],
        mask_token_id=VOCAB - 1,
        block_size=8,
        rope_theta=10000.0,
    )
    base.update(overrides)
    return DFlashConfig(**base)


def test_default_layer_taps_match_reference_examples():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    assert build_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert build_target_layer_ids(24, 5) == [1, 6, 11, 16, 21]
    assert build_target_layer_ids(36, 1) == [18]


def test_zlab_config_loads_and_round_trips_field_for_field(tmp_path):
    cfg = DFlashConfig.from_dict(ZLAB_QWEN3_8B)
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (16, 151669, [1, 9, 17, 25, 33])
    assert cfg.layer_types == ["full_attention"] * 5 and cfg.rope_theta == 1e6
    written = cfg.to_dict()
    # No `auto_map`: it names a remote-code dflash.py that flashdraft does not ship (z-lab's package, vLLM and SGLang
    # load drafters without it), so transformers' trust_remote_code route would fail on it.
    assert "auto_map" not in written
    for key, value in ZLAB_QWEN3_8B.items():
        if key == "auto_map":
            continue
        if key == "dflash_config":
            assert {k: written[key][k] for k in value} == value
        else:
            assert written[key] == value, key
    cfg.save_pretrained(tmp_path)
    assert DFlashConfig.from_pretrained(tmp_path).to_dict() == written


def test_block_size_only_inside_dflash_config_and_nested_rope():
    raw = dict(ZLAB_QWEN3_8B)
    raw.pop("block_size")
    raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_theta": 1e7, "rope_type": "default"}
    raw["dflash_config"] = {**raw["dflash_config"], "block_size": 8}
    cfg = DFlashConfig.from_dict(raw)
    assert cfg.block_size == 8 and cfg.rope_theta == 1e7
    assert cfg.to_dict()["dflash_config"]["block_size"] == 8 and cfg.to_dict()["block_size"] == 8


def test_sliding_layers_config():
    raw = dict(ZLAB_QWEN3_8B)
    raw["layer_types"] = ["sliding_attention"] * 4 + ["full_attention"]
    raw["sliding_window"] = 2048
    raw["use_sliding_window"] = True
    cfg = DFlashConfig.from_dict(raw)
    assert cfg.layer_types[:4] == ["sliding_attention"] * 4 and cfg.sliding_window == 2048
    assert DFlashConfig.from_dict(cfg.to_dict()).layer_types == cfg.layer_types
    # MiMo-style: windowing switched on inside dflash_config, no layer_types.
    raw = {k: v for k, v in ZLAB_QWEN3_8B.items() if k != "layer_types"}
    raw["dflash_config"] = {**raw["dflash_config"], "use_swa": True, "swa_window_size": 1024}
    raw["max_window_layers"] = 0
    cfg = DFlashConfig.from_dict(raw)
    assert cfg.layer_types == ["sliding_attention"] * 5 and cfg.sliding_window == 1024


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attention_sink_bias": True}, "attention sinks"),
        ({"architectures": ["EagleDraftModel"]}, "not a DFlash drafter"),
        ({"architectures": ["DFlash2DraftModel"]}, "DFlash2 drafter config is missing 'conv_kernel_size'"),
        ({"dflash_config": {"mask_token_id": 1, "selector_rank": 256}}, "'selector_rank' belongs to DFlash2"),
        ({"dflash_config": {"mask_token_id": 1, "mystery": 3}}, "unknown dflash_config fields"),
        ({"dflash_config": {"mask_token_id": 151936}}, "outside the vocabulary"),
        ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 36]}}, "outside the target"),
        ({"dflash_config": {"mask_token_id": 1, "block_size": 8}}, "block_size disagrees"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "RoPE type 'dynamic'"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_config_refuses_what_it_cannot_honour(change, message):
    raw = {**ZLAB_QWEN3_8B, **change}
    if raw.get("hidden_size") is None:
        raw.pop("hidden_size")
    with pytest.raises(DFlashConfigError, match=message):
        DFlashConfig.from_dict(raw)


def test_logit_and_input_keys_read_as_zlab_reads_them():
    """output_multiplier, final_logit_softcapping and input_embedding_scale (the gemma-4 drafters' keys) load from
    dflash_config or the top level, dflash_config first (z-lab's precedence), and are written back in dflash_config;
    num_target_layers may sit inside dflash_config. Anything but a positive number is one clear error."""
    raw = {k: v for k, v in ZLAB_QWEN3_8B.items() if k != "num_target_layers"}
    raw["output_multiplier"] = 3.0  # loses against dflash_config's value
    raw["final_logit_softcapping"] = 20.0
    raw["dflash_config"] = {
        **raw["dflash_config"], "output_multiplier": 0.19611613513818404, "input_embedding_scale": 2.5,
        "num_target_layers": 36,
    }  # fmt: skip
    cfg = DFlashConfig.from_dict(raw)
    assert (cfg.output_multiplier, cfg.final_logit_softcapping) == (0.19611613513818404, 20.0)
    assert cfg.input_embedding_scale == 2.5 and cfg.num_target_layers == 36
    written = cfg.to_dict()
    assert written["dflash_config"]["output_multiplier"] == 0.19611613513818404
    assert written["dflash_config"]["final_logit_softcapping"] == 20.0
    assert written["dflash_config"]["input_embedding_scale"] == 2.5
    assert "output_multiplier" not in written and "input_embedding_scale" not in written
    assert DFlashConfig.from_dict(written) == cfg
    plain = DFlashConfig.from_dict(ZLAB_QWEN3_8B)  # neutral values are not written
    assert (plain.output_multiplier, plain.final_logit_softcapping, plain.input_embedding_scale) == (
        1.0,
        None,
        1.0,
    )
    assert set(plain.to_dict()["dflash_config"]) == {"block_size", "mask_token_id", "target_layer_ids"}
    for key, bad in [
        ("output_multiplier", -1.0),
        ("input_embedding_scale", "2"),
        ("final_logit_softcapping", -5),
    ]:
        with pytest.raises(DFlashConfigError, match=f"{key}.*must be a positive number"):
            DFlashConfig.from_dict({**ZLAB_QWEN3_8B, key: bad})


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_draft_logits_and_block_inputs_follow_the_drafter_keys(models, arch):
    """Draft logits = softcap(m * lm_head(h)) with the drafter's keys (multiplier first), the block input = the
    target's raw embedding rows * input_embedding_scale. A drafter made for a target carries that target's
    embedding scale (Gemma: sqrt(H)), so its input is what the target's own embedding gives."""
    from flashdraft.engine.proposers import DFlashProposer

    model = models[arch]
    target = Target(model)
    draft = DFlashDraftModel.for_target(
        model.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1
    ).eval()
    assert draft.config.input_embedding_scale == pytest.approx(target.input_embedding_scale)
    ids = torch.tensor([[3, 7, VOCAB - 1]])
    proposer = DFlashProposer(draft, target)
    torch.testing.assert_close(proposer.block_inputs(ids), target.embed(ids))
    hidden = torch.randn(5, model.config.hidden_size)
    raw = hidden @ model.lm_head.weight.T
    torch.testing.assert_close(proposer.head_logits(hidden), raw)
    draft.config.output_multiplier, draft.config.final_logit_softcapping = 0.5, 3.0
    draft.config.input_embedding_scale = 2.0
    torch.testing.assert_close(proposer.head_logits(hidden), torch.tanh(raw * 0.5 / 3.0) * 3.0)
    rows = model.get_input_embeddings().weight[ids]
    torch.testing.assert_close(proposer.block_inputs(ids), rows * 2.0)


def test_a_drafter_cast_to_the_proposer_s_precision_is_copied_once(models):
    """A drafter run in another precision than its own is copied once per dtype, so what is compiled for the copy
    (its block pass: seconds on a CPU) is not compiled again at every generate(); copied again once its weights
    change, and without what was cached on the drafter for its own precision (its compiled block passes)."""
    from flashdraft.engine.proposers import DFlashProposer

    target = Target(models["llama"])
    draft = DFlashDraftModel.for_target(
        target.model.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1
    )
    draft = draft.to(torch.bfloat16).eval()
    draft.__dict__["_flashdraft_block_passes"] = {"options": "a graph frozen with the bf16 weights"}
    first = DFlashProposer(draft, target, dtype=torch.float32).draft
    assert first is not draft and first.fc.weight.dtype == torch.float32
    assert DFlashProposer(draft, target, dtype=torch.float32).draft is first
    assert "_flashdraft_block_passes" not in first.__dict__ and "_flashdraft_block_passes" in draft.__dict__
    with torch.no_grad():
        draft.fc.weight.mul_(2)
    again = DFlashProposer(draft, target, dtype=torch.float32).draft
    assert again is not first and torch.equal(again.fc.weight, draft.fc.weight.float())


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 512},
        {"rope_type": "linear", "factor": 2.0},
    ],
)  # fmt: skip
def test_scaled_rope_equals_transformers_and_survives_a_checkpoint(tmp_path, rope):
    """yarn / llama3 / linear RoPE (the Kimi drafters' keys): the drafter's cos/sin equal transformers' Qwen3 rotary
    embedding (z-lab's drafter uses it) at the same positions, attention factor included, and the scaling is written
    back and read again with the weights."""
    import transformers
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    raw = small_config().to_dict()
    raw["rope_scaling"] = dict(rope)
    raw["max_position_embeddings"] = 4096
    cfg = DFlashConfig.from_dict(raw)
    assert cfg.rope_scaling == rope and cfg.to_dict()["rope_scaling"] == rope
    draft = DFlashDraftModel(cfg).eval()
    positions = torch.tensor([[0, 5, 900, 3000]])
    cos, sin = draft.rotary_emb(positions, torch.float32)
    if transformers.__version__.startswith("4."):  # the RoPE keys moved in transformers 5
        keys = {"rope_scaling": dict(rope), "rope_theta": cfg.rope_theta}
    else:
        keys = {"rope_parameters": {**rope, "rope_theta": cfg.rope_theta}}
    hf = Qwen3Config(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
        max_position_embeddings=4096, **keys,
    )  # fmt: skip
    ref_cos, ref_sin = Qwen3RotaryEmbedding(hf)(torch.zeros(1, 4, cfg.head_dim), positions)
    torch.testing.assert_close(cos[:, 0], ref_cos)
    torch.testing.assert_close(sin[:, 0], ref_sin)
    plain = DFlashDraftModel(small_config()).eval().rotary_emb(positions, torch.float32)[0]
    assert not torch.allclose(plain, cos)  # the scaling changed something
    draft.save_pretrained(tmp_path)
    loaded = DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32)
    torch.testing.assert_close(loaded.rotary_emb(positions, torch.float32)[0], cos)


def test_gpt_j_style_rope_when_is_neox_style_is_false(tmp_path):
    """`is_neox_style: false` rotates channel pairs (2i, 2i + 1): the attention scores equal those of RoPE applied
    to each pair as a complex number, and differ from the neox style's; the key is written back."""
    raw = small_config().to_dict()
    raw["is_neox_style"] = False
    cfg = DFlashConfig.from_dict(raw)
    assert cfg.rope_interleaved and cfg.to_dict()["is_neox_style"] is False
    assert "is_neox_style" not in small_config().to_dict()
    torch.manual_seed(0)
    draft = DFlashDraftModel(cfg).eval()
    attn = draft.layers[0].self_attn
    x, positions = torch.randn(1, 5, cfg.hidden_size), torch.tensor([[0, 3, 7, 20, 41]])
    cos, sin = draft.rotary_emb(positions, torch.float32)
    with torch.no_grad():
        k, _ = attn.project_kv(x, cos, sin)
        raw_k = attn.k_norm(attn._heads(attn.k_proj(x), attn.num_kv_heads))  # [1, heads, 5, d]
    angles = positions[0, :, None].float() * draft.rotary_emb.inv_freq  # [5, d/2]
    pairs = torch.view_as_complex(raw_k.reshape(*raw_k.shape[:-1], -1, 2).contiguous())
    reference = torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(-2)
    torch.testing.assert_close(k @ k.transpose(-1, -2), reference @ reference.transpose(-1, -2))
    neox = DFlashDraftModel(small_config()).eval()
    neox.load_state_dict(draft.state_dict())
    with torch.no_grad():
        k_neox, _ = neox.layers[0].self_attn.project_kv(x, cos, sin)
    assert not torch.allclose(k_neox @ k_neox.transpose(-1, -2), k @ k.transpose(-1, -2))
    draft.save_pretrained(tmp_path, dtype=torch.float32)
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded.layers[0].self_attn.project_kv(x, cos, sin)[0], k)


def test_vllm_capture_ids_set_the_taps():
    """`eagle_aux_hidden_state_layer_ids` (vLLM: the input of layer i, i.e. the output of layer i - 1) wins over
    target_layer_ids and is kept on export; ids below 1 are one clear error."""
    raw = small_config().to_dict()
    raw["eagle_aux_hidden_state_layer_ids"] = [2, 4, 6]
    cfg = DFlashConfig.from_dict(raw)
    assert cfg.target_layer_ids == [1, 3, 5]
    assert cfg.to_dict()["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]
    raw["eagle_aux_hidden_state_layer_ids"] = [0, 2]
    with pytest.raises(DFlashConfigError, match="eagle_aux_hidden_state_layer_ids"):
        DFlashConfig.from_dict(raw)


def test_mask_embedding_file_replaces_the_mask_row(tmp_path):
    """A `mask_embedding.pt` beside the weights (vLLM's loader reads it) is the mask slots' input row: drafting with
    it equals drafting with a target whose mask-token embedding row is that vector; it survives save and
    `as_dflash2`; a file of the wrong size is one clear error."""
    from transformers import AutoModelForCausalLM

    from flashdraft.engine.proposers import DFlashProposer

    torch.manual_seed(0)
    target_model = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    draft = DFlashDraftModel.for_target(
        target_model.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1
    )
    draft.eval().save_pretrained(tmp_path / "plain", dtype=torch.float32)
    draft.save_pretrained(tmp_path / "masked", dtype=torch.float32)
    row = torch.randn(target_model.config.hidden_size) * 3
    torch.save(row, tmp_path / "masked" / "mask_embedding.pt")
    masked = DFlashDraftModel.from_pretrained(tmp_path / "masked", dtype=torch.float32)
    torch.testing.assert_close(masked.mask_embedding, row)
    prompt = torch.tensor([[5, 9, 11, 3, 7, 2]])

    def draft_logits(drafter, model):
        target = Target(model)
        proposer = DFlashProposer(drafter, target)
        proposer.start(target.features(prompt[:, :-1], list(drafter.target_layer_ids)))
        return proposer.draft_logits(int(prompt[0, -1]), prompt.shape[1] - 1, 3)

    plain = DFlashDraftModel.from_pretrained(tmp_path / "plain", dtype=torch.float32)
    swapped = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    swapped.load_state_dict(target_model.state_dict())
    with torch.no_grad():
        swapped.get_input_embeddings().weight[VOCAB - 1] = row
    with torch.no_grad():
        ours = draft_logits(masked, target_model)
        torch.testing.assert_close(ours, draft_logits(plain, swapped))
        assert not torch.allclose(ours, draft_logits(plain, target_model))
    masked.save_pretrained(tmp_path / "again", dtype=torch.float32)
    torch.testing.assert_close(torch.load(tmp_path / "again" / "mask_embedding.pt"), row)
    assert masked.as_dflash2().mask_embedding is masked.mask_embedding
    torch.save(torch.zeros(7), tmp_path / "masked" / "mask_embedding.pt")
    with pytest.raises(DFlashCheckpointError, match="one embedding row"):
        DFlashDraftModel.from_pretrained(tmp_path / "masked")


def test_weights_round_trip_with_zlab_names(tmp_path):
    torch.manual_seed(0)
    model = DFlashDraftModel(small_config())
    model.save_pretrained(tmp_path, dtype=torch.float32)
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.1.self_attn.k_norm.weight",
        "layers.1.mlp.down_proj.weight",
        "layers.0.post_attention_layernorm.weight",
    } <= names
    assert not any("embed" in n or "lm_head" in n or "rotary" in n for n in names)
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float32"


def test_corrupt_or_mismatched_checkpoints_are_clear_errors(tmp_path):
    model = DFlashDraftModel(small_config())
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(DFlashCheckpointError, match="cannot read drafter weights"):
        DFlashDraftModel.from_pretrained(tmp_path)
    DFlashDraftModel(small_config(num_hidden_layers=1)).save_pretrained(tmp_path)
    small_config().save_pretrained(tmp_path)  # config says 2 layers, weights hold 1
    with pytest.raises(DFlashCheckpointError, match="missing"):
        DFlashDraftModel.from_pretrained(tmp_path)
    DFlashDraftModel(small_config(intermediate_size=32)).save_pretrained(tmp_path)
    small_config().save_pretrained(tmp_path)
    with pytest.raises(DFlashCheckpointError, match="shape"):
        DFlashDraftModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DFlashConfigError, match="not valid JSON"):
        DFlashDraftModel.from_pretrained(tmp_path)
    with pytest.raises(DFlashCheckpointError):
        DFlashDraftModel.from_pretrained(tmp_path / "does-not-exist")


def _features(config: DFlashConfig, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, n, config.num_target_features * config.hidden_size, generator=g)


@pytest.mark.parametrize(
    ("layer_types", "causal"),
    [(None, None), (["sliding_attention", "full_attention"], None), (["sliding_attention"] * 2, False)],
)
def test_incremental_context_cache_equals_recompute(layer_types, causal):
    """Growing the draft context cache chunk by chunk gives the logits of one from-scratch pass."""
    extra = {"layer_types": layer_types, "sliding_window": 5, "causal": causal} if layer_types else {}
    cfg = small_config(**extra)
    torch.manual_seed(1)
    draft = DFlashDraftModel(cfg).eval()
    feats = _features(cfg, 23)
    block = torch.randn(1, cfg.block_size, cfg.hidden_size)
    anchor = 23
    positions = torch.arange(anchor, anchor + cfg.block_size)[None]
    with torch.no_grad():
        full = draft(block, positions, feats, torch.arange(23)[None])
        cache = DraftContextCache()
        start = 0
        for chunk in (7, 1, 9, 6):  # prefill, then accepted runs of varying length
            end = start + chunk
            # intermediate draft passes with other blocks must not leave anything behind in the cache
            draft(
                torch.randn(1, 4, cfg.hidden_size),
                torch.arange(end, end + 4)[None],
                feats[:, start:end],
                torch.arange(start, end)[None],
                cache=cache,
            )
            start = end
        assert len(cache) == 23 and all(k.shape[2] == 23 for k in cache.keys)
        incremental = draft(block, positions, None, None, cache=cache)
    torch.testing.assert_close(incremental, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"]])
def test_a_bf16_cpu_draft_pass_attends_through_the_kernel_with_sdpa_s_values(monkeypatch, layer_types):
    """Inference in bf16 on a CPU: a block's attention over a static context cache (capacity-wide, its padding
    hidden by the mask) runs attention_cpp's kernel, grouped K/V heads read in place, and gives the drafter the
    values SDPA gives it (the path with gradients: the kernel has no backward), sliding layers too."""
    from flashdraft.kernels import attention_cpp

    assert attention_cpp.prepare(torch.bfloat16), "the bf16 kernel did not build"
    calls = []
    real = attention_cpp.short_attention
    monkeypatch.setattr(attention_cpp, "short_attention", lambda *a: calls.append(a[1].shape) or real(*a))
    extra = {"layer_types": layer_types, "sliding_window": 5} if layer_types else {}
    cfg = small_config(**extra)
    torch.manual_seed(1)
    draft = DFlashDraftModel(cfg).eval().to(torch.bfloat16)
    feats = _features(cfg, 23)
    block = torch.randn(1, cfg.block_size, cfg.hidden_size)
    positions = torch.arange(23, 23 + cfg.block_size)[None]
    with torch.no_grad():
        got = draft(block, positions, feats, torch.arange(23)[None], cache=DraftContextCache(capacity=64))
    # every layer, its keys the cache's 64 columns and the block's 8, two KV heads for four query heads
    assert calls == [torch.Size([1, 2, 64 + cfg.block_size, 16])] * cfg.num_hidden_layers
    want = draft(block, positions, feats, torch.arange(23)[None])
    assert len(calls) == cfg.num_hidden_layers
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)


def test_sliding_layers_are_windowed_and_causal_in_block():
    cfg = small_config(num_hidden_layers=1, layer_types=["sliding_attention"], sliding_window=4)
    torch.manual_seed(2)
    draft = DFlashDraftModel(cfg).eval()
    feats = _features(cfg, 12)
    block = torch.randn(1, 8, cfg.hidden_size)
    pos = torch.arange(12, 20)[None]
    with torch.no_grad():
        ref = draft(block, pos, feats, torch.arange(12)[None])
        old_changed = feats.clone()
        old_changed[:, :5] += 1.0  # context far outside every query's window (slot 0 sees positions 9..12)
        assert torch.allclose(draft(block, pos, old_changed, torch.arange(12)[None]), ref, atol=1e-6)
        later_changed = block.clone()
        later_changed[:, 5:] += 1.0  # causal in block: slots 0..4 cannot see slots 5..7
        out = draft(later_changed, pos, feats, torch.arange(12)[None])
        assert torch.allclose(out[:, :5], ref[:, :5], atol=1e-6) and not torch.allclose(
            out[:, 5:], ref[:, 5:]
        )
    # a full-attention drafter, by contrast, is bidirectional inside the block
    full = DFlashDraftModel(small_config(num_hidden_layers=1)).eval()
    with torch.no_grad():
        a = full(block, pos, feats, torch.arange(12)[None])
        b = full(later_changed, pos, feats, torch.arange(12)[None])
    assert not torch.allclose(a[:, :5], b[:, :5])


def test_explicit_is_causal_applies_to_every_layer():
    """z-lab's rule: `is_causal` unset makes sliding layers causal; an explicit false makes none causal (the DFlash2
    configs: sliding window, bidirectional block), an explicit true makes full layers causal too. Kept on export."""
    feats = _features(small_config(), 12)
    pos = torch.arange(12, 20)[None]
    block = torch.randn(1, 8, 64)
    later_changed = block.clone()
    later_changed[:, 5:] += 1.0
    for layer_type, causal, sees_later in [
        ("sliding_attention", None, False),
        ("sliding_attention", False, True),
        ("full_attention", True, False),
        ("full_attention", None, True),
    ]:
        cfg = small_config(num_hidden_layers=1, layer_types=[layer_type], sliding_window=6, causal=causal)
        torch.manual_seed(3)
        draft = DFlashDraftModel(cfg).eval()
        with torch.no_grad():
            a = draft(block, pos, feats, torch.arange(12)[None])
            b = draft(later_changed, pos, feats, torch.arange(12)[None])
        assert torch.allclose(a[:, :5], b[:, :5], atol=1e-6) != sees_later, (layer_type, causal)
    raw = {**ZLAB_QWEN3_8B, "layer_types": ["sliding_attention"] * 5, "use_sliding_window": True}
    raw["sliding_window"] = 2048
    for value in (None, False, True):
        cfg = DFlashConfig.from_dict({**raw, **({} if value is None else {"is_causal": value})})
        assert cfg.causal is value
        assert cfg.to_dict().get("is_causal") is value
        assert cfg.layer_is_causal("sliding_attention") == (value is not False)


@pytest.mark.parametrize("arch", ARCHS)
def test_target_taps_equal_hf_hidden_states(models, arch):
    model = models[arch]
    target = Target(model)
    layer_ids = [0, 2, target.num_layers - 1]  # the last layer includes the final norm, as in HF
    ids = torch.randint(3, VOCAB, (1, 11))
    out = target.forward(ids, target.new_cache(), layer_ids)
    with torch.no_grad():
        hf = model(ids, output_hidden_states=True)
    expected = torch.cat([hf.hidden_states[i + 1] for i in layer_ids], dim=-1)
    torch.testing.assert_close(out.features, expected)
    torch.testing.assert_close(out.logits, hf.logits.float())
    # the training path stops after the deepest tap and must give the same features
    torch.testing.assert_close(target.features(ids, layer_ids), expected)
    torch.testing.assert_close(
        target.features(ids, [1, 0]), torch.cat([hf.hidden_states[2], hf.hidden_states[1]], -1)
    )
    # the block embedding is what the first layer receives (Gemma3 scales it inside its embedding module)
    torch.testing.assert_close(target.embed(ids), model.get_input_embeddings()(ids))


def test_target_cache_rollback(models):
    target = Target(models["gemma3"])  # sliding-window layers (window 8): rollback must still be exact
    ids = torch.randint(3, VOCAB, (1, 20))
    cache = target.new_cache()
    target.forward(ids[:, :14], cache)
    target.forward(ids[:, 14:], cache)  # 6 more, then roll back 4 of them
    target.crop(cache, 16)
    assert Target.cache_length(cache) == 16
    got = target.forward(ids[:, 16:18], cache).logits
    fresh = target.forward(ids[:, :18], target.new_cache()).logits[:, 16:18]
    torch.testing.assert_close(got, fresh, rtol=1e-4, atol=1e-4)


def test_drafter_target_mismatch_errors(models):
    model = models["llama"]
    target = Target(model)
    good = DFlashConfig.for_target(model.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1)
    target.check_drafter(good)
    cases = [
        ({"hidden_size": 128, "head_dim": 32}, "hidden size 128"),
        ({"target_layer_ids": [1, 6]}, "only 6 decoder layers"),
        ({"mask_token_id": VOCAB + 3, "vocab_size": VOCAB + 10}, "mask_token_id"),
        ({"vocab_size": VOCAB + 10}, "vocabulary mismatch"),
    ]
    for change, message in cases:
        cfg = small_config(
            **{
                **{k: getattr(good, k) for k in ("num_target_layers", "target_layer_ids")},
                "num_target_layers": 12,
                **change,
            }
        )
        with pytest.raises(DraftTargetMismatchError, match=message):
            target.check_drafter(cfg)
    with pytest.warns(UserWarning, match="12-layer target"):
        target.check_drafter(small_config(num_target_layers=12, target_layer_ids=[0, 1]))


def test_for_target_sizes_from_target():
    cfg = tiny_config("qwen3", layers=8)
    draft = DFlashDraftModel.for_target(
        cfg, num_layers=3, block_size=16, mask_token_id=5, intermediate_size=100
    )
    c = draft.config
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (64, 4, 2, 16)
    assert (
        c.intermediate_size == 100
        and c.num_target_layers == 8
        and c.target_layer_ids == build_target_layer_ids(8, 5)
    )
    assert draft.fc.weight.shape == (64, 64 * 5)
