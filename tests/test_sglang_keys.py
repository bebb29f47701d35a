"""What SGLang's DFlash loader reads, present in every drafter flashdraft exports (a config-level check).

SGLang runs DFlash on CUDA, NPU and XPU only (0.5.23 refuses any other device at start-up), so it cannot decode here;
this checks the export against what its loader reads, from its source (PyPI `sglang` 0.5.23):
`srt/speculative/dflash_utils.py::parse_dflash_draft_config` (the config) and `srt/models/dflash.py::load_weights`
(the weights). Its loader skips unknown tensors silently and does not report missing ones, so the weight names must
be exactly its set, not merely a superset. `target_layer_ids` are outputs of target layers, captured as the input of
layer id + 1 (so an id must be below the target's last layer), and `mask_token_id` must lie inside the target's
vocabulary (it cannot resize embeddings).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from conftest import tiny_model
from flashdraft import DFlashDraftModel
from flashdraft.training.export import export_drafter

SGLANG_ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
LAYER_WEIGHTS = [
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
]  # fmt: skip
DFLASH2_LAYER_WEIGHTS = [
    "attention_conv.base_kernel", "attention_conv.kernel_projection.weight",
    "mlp_conv.base_kernel", "mlp_conv.kernel_projection.weight",
]  # fmt: skip
DFLASH2_WEIGHTS = [
    "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
    "candidate_selector.hidden_projection.weight",
]  # fmt: skip


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_export_has_what_sglang_reads(tmp_path, arch):
    target = tiny_model("llama")
    tc = target.config
    draft = DFlashDraftModel.for_target(
        tc, num_layers=2, block_size=8, mask_token_id=tc.vocab_size - 1, arch=arch
    )
    export_drafter(draft.eval(), tmp_path, {"target": "tiny"}, torch.bfloat16)
    config = json.loads((tmp_path / "config.json").read_text())
    dflash = config["dflash_config"]

    assert config["architectures"] == [SGLANG_ARCHITECTURES[arch]]
    assert (
        config["model_type"] == "qwen3"
    )  # a config class transformers knows: SGLang registers none for DFlash
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert isinstance(config[key], int) and config[key] > 0, key
    assert config["intermediate_size"] > 0 and config["hidden_act"] == "silu"
    assert dflash["block_size"] == 8
    assert 0 <= dflash["mask_token_id"] < tc.vocab_size
    taps = dflash["target_layer_ids"]
    assert taps and all(isinstance(i, int) and 0 <= i < tc.num_hidden_layers - 1 for i in taps)
    if arch == "dflash2":
        assert config["vocab_size"] == tc.vocab_size  # SGLang needs it for the codebooks
        assert config["hidden_size"] % dflash["conv_group_size"] == 0
        for key in ("conv_kernel_size", "selector_rank", "selector_top_k"):
            assert isinstance(dflash[key], int) and dflash[key] > 0, key

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = f.keys()
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in names}
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    per_layer = LAYER_WEIGHTS + (DFLASH2_LAYER_WEIGHTS if arch == "dflash2" else [])
    expected |= {f"layers.{i}.{w}" for i in range(config["num_hidden_layers"]) for w in per_layer}
    expected |= set(DFLASH2_WEIGHTS if arch == "dflash2" else [])
    assert set(shapes) == expected
    hidden = config["hidden_size"]
    assert shapes["fc.weight"] == (hidden, len(taps) * hidden)  # SGLang: "DFLASH fc.weight shape mismatch"
    assert shapes["layers.0.self_attn.k_norm.weight"] == (config["head_dim"],)
    if arch == "dflash2":
        groups = hidden // dflash["conv_group_size"]
        taps_n = dflash["conv_kernel_size"]
        assert shapes["layers.0.attention_conv.base_kernel"] == (2, taps_n, hidden)
        assert shapes["layers.0.attention_conv.kernel_projection.weight"] == (2 * taps_n * groups, hidden)
        assert shapes["candidate_selector.predecessor_codebook"] == (tc.vocab_size, dflash["selector_rank"])
