"""DFlash2 drafters (z-lab's `DFlash2DraftModel`): config, the block-local convolutions, the candidate selector, exact
decoding (single, batched, served, cost-aware, sampled), training and the CLI. Conformance with z-lab's own package
is tests/test_zlab.py."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import VOCAB, tiny_model
from flashdraft import DFlashConfig, DFlashDraftModel, Target, generate, generate_ar, generate_batch
from flashdraft.drafter.config import DFlashConfigError
from flashdraft.training.loss import selector_loss
from test_train import BIGRAM_V, bigram_target, greedy_dataset, small_train_config

# z-lab/Qwen3.8-27B-DFlash2 (dflash_config and the fields the reference quotes verbatim; widths of a 27B target).
PUBLISHED_DFLASH2 = {
    "architectures": ["DFlash2DraftModel"],
    "is_causal": False,
    "dflash_config": {
        "block_size": 8, "conv_group_size": 16, "conv_kernel_size": 2, "mask_token_id": 248070,
        "selector_rank": 256, "selector_top_k": 16, "target_layer_ids": [5, 19, 33, 47, 61],
    },
    "rope_parameters": {"rope_theta": 10000000.0, "rope_type": "default"},
    "layer_types": ["sliding_attention"] * 5, "sliding_window": 2048, "use_sliding_window": True,
    "num_target_layers": 64, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 5,
    "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 248320,
    "model_type": "qwen3", "transformers_version": "5.15.0",
}  # fmt: skip


def dflash2_drafter(model, seed: int = 0, block_size: int = 6, scale: float = 0.3) -> DFlashDraftModel:
    """A DFlash2 drafter for a tiny target with every new part random (not the do-nothing init), so the
    convolutions and the selector's pairwise term change what it proposes."""
    draft = DFlashDraftModel.for_target(
        model.config, num_layers=2, block_size=block_size, mask_token_id=VOCAB - 1, arch="dflash2", seed=seed
    )
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "_conv." in name or name.startswith("candidate_selector."):
                p.add_(scale * torch.randn(p.shape, generator=g))
    return draft.eval()


def test_published_dflash2_config_loads_and_round_trips():
    cfg = DFlashConfig.from_dict(PUBLISHED_DFLASH2)
    assert cfg.is_dflash2 and cfg.architecture == "DFlash2DraftModel"
    assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (
        2,
        16,
        256,
        16,
    )
    assert cfg.block_size == 8 and cfg.causal is False and cfg.rope_theta == 1e7
    written = cfg.to_dict()
    assert written["architectures"] == ["DFlash2DraftModel"] and written["is_causal"] is False
    assert {k: written["dflash_config"][k] for k in PUBLISHED_DFLASH2["dflash_config"]} == PUBLISHED_DFLASH2[
        "dflash_config"
    ]
    assert DFlashConfig.from_dict(written) == cfg
    with torch.device("meta"):  # the published shapes: selector codebooks [V, 256], conv kernels [2, 2, H]
        model = DFlashDraftModel(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["candidate_selector.predecessor_codebook"] == (248320, 256)
    assert shapes["layers.0.attention_conv.base_kernel"] == (2, 2, 5120)
    assert shapes["layers.4.mlp_conv.kernel_projection.weight"] == (2 * 2 * 320, 5120)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["DFlashDraftModel"]}, "belongs to DFlash2 drafters"),
        (
            {"dflash_config": {**PUBLISHED_DFLASH2["dflash_config"], "selector_top_k": None}},
            "missing 'selector_top_k'",
        ),
        ({"dflash_config": {**PUBLISHED_DFLASH2["dflash_config"], "conv_group_size": 7}}, "does not divide"),
        (
            {"dflash_config": {**PUBLISHED_DFLASH2["dflash_config"], "conv_kernel_size": 0}},
            "positive integer",
        ),
    ],
)
def test_dflash2_config_errors_are_one_clear_line(change, message):
    with pytest.raises(DFlashConfigError, match=message):
        DFlashConfig.from_dict({**PUBLISHED_DFLASH2, **change})


def test_convolutions_stay_inside_each_block(models):
    """Many training blocks side by side in one forward give each block what it gets alone: the causal
    convolution restarts at every anchor (a block never mixes in the slots of the block before it)."""
    model = models["qwen3"]
    draft = dflash2_drafter(model, block_size=5)
    torch.manual_seed(0)
    feats = torch.randn(1, 20, draft.config.num_target_features * 64)
    anchors = [4, 9, 13]
    embeds = torch.randn(1, 15, 64)
    positions = torch.cat([torch.arange(a, a + 5) for a in anchors])[None]
    with torch.no_grad():
        together = draft(embeds, positions, feats, torch.arange(20)[None], num_blocks=3)
        for j, a in enumerate(anchors):
            alone = draft(
                embeds[:, 5 * j : 5 * j + 5], positions[:, 5 * j : 5 * j + 5], feats, torch.arange(20)[None]
            )
            torch.testing.assert_close(
                together[:, 5 * j : 5 * j + 5], alone, rtol=1e-5, atol=1e-5, msg=str(a)
            )
        # The convolutions matter: without them (a v1 drafter with the same other weights) the output differs.
        v1 = DFlashDraftModel(DFlashConfig.from_dict({**draft.config.to_dict(), "architectures": ["DFlashDraftModel"],
                              "dflash_config": {"mask_token_id": VOCAB - 1, "block_size": 5,
                                                "target_layer_ids": draft.config.target_layer_ids}}))  # fmt: skip
        v1.load_state_dict(draft.state_dict(), strict=False)
        assert not torch.allclose(v1.eval()(embeds[:, :5], positions[:, :5], feats, torch.arange(20)[None]),
                                  together[:, :5], atol=1e-3)  # fmt: skip


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_dflash2_decoding_is_plain_greedy_decoding(models, arch):
    """Fixed blocks and the cost-aware policy, one row and a batch of rows of different lengths (rows finishing
    early), all equal plain greedy decoding; the selector's path, not each slot's argmax, is what is proposed."""
    model = models[arch]
    target = Target(model)
    draft = dflash2_drafter(model)
    prompts = [[5, 9, 11, 20, 33, 7], [12, 3], [40, 41, 42, 43, 44, 45, 46, 47, 8]]
    limits = [24, 9, 17]
    refs = [
        generate_ar(target, torch.tensor([p]), n, stop_token_ids=[2]).new_tokens
        for p, n in zip(prompts, limits, strict=True)
    ]
    for block in (6, 3, "auto"):
        got = generate(
            target, draft, torch.tensor([prompts[0]]), limits[0], block_size=block, stop_token_ids=[2]
        )
        assert got.new_tokens == refs[0], block
    batch = generate_batch(target, draft, prompts, limits, block_size=6, stop_token_ids=[2])
    assert [r.new_tokens for r in batch] == refs
    batch = generate_batch(
        target, draft, prompts, limits, block_size="auto", stop_token_ids=[2], max_batch_size=2
    )
    assert [r.new_tokens for r in batch] == refs

    from flashdraft.engine.proposers import DFlashProposer

    proposer = DFlashProposer(draft, target)
    ids = torch.tensor([prompts[0]])
    proposer.start(target.features(ids[:, :-1], draft.config.target_layer_ids))
    hidden = proposer.draft_hidden(prompts[0][-1], len(prompts[0]) - 1, 5)
    argmax = proposer.head_logits(hidden[0]).argmax(-1)
    proposer.start(target.features(ids[:, :-1], draft.config.target_layer_ids))
    selected = proposer.propose(prompts[0][-1], len(prompts[0]) - 1, 5)
    assert not torch.equal(
        selected, argmax
    )  # the pairwise term changed the path (else the test shows nothing)


def test_dflash2_seeded_sampling_equals_plain_sampling(models):
    """At T > 0 the drafts stay deterministic (the selector's greedy path) and the target's seed-keyed sample
    decides: the same tokens as plain sampling with the same seed, one row and batched."""
    model = models["llama"]
    target = Target(model)
    draft = dflash2_drafter(model, seed=3)
    kw = dict(temperature=0.9, top_p=0.95, stop_token_ids=[])
    for seed in (0, 7):
        plain = generate_ar(target, torch.tensor([[5, 6, 7, 8]]), 20, seed=seed, **kw).new_tokens
        assert (
            generate(
                target, draft, torch.tensor([[5, 6, 7, 8]]), 20, seed=seed, block_size=6, **kw
            ).new_tokens
            == plain
        )
    rows = generate_batch(target, draft, [[5, 6, 7, 8], [9, 10]], 16, seed=[1, 2], block_size="auto", **kw)
    assert [r.new_tokens for r in rows] == [
        generate_ar(target, torch.tensor([p]), 16, seed=s, **kw).new_tokens
        for p, s in [([5, 6, 7, 8], 1), ([9, 10], 2)]
    ]


def test_dflash2_served_requests(models):
    from fastapi.testclient import TestClient

    from flashdraft.serve import Engine, build_app
    from test_serve import tiny_tokenizer

    model = models["qwen3"]
    target = Target(model, tiny_tokenizer(), name="tiny")
    engine = Engine(target, dflash2_drafter(model), block_size=None, max_batch_size=4)
    prompts = [[5, 9, 14, 3, 22, 7, 40], [11, 4]]
    try:
        with TestClient(build_app(engine, "tiny")) as client:
            got = []
            for p in prompts:
                r = client.post("/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 12,
                                                         "temperature": 0, "return_token_ids": True})  # fmt: skip
                assert r.status_code == 200, r.text
                got.append(r.json()["choices"][0]["token_ids"])
    finally:
        engine.close()
    assert got == [generate_ar(target, torch.tensor([p]), 12).new_tokens for p in prompts]


def test_a_v1_drafter_becomes_a_dflash2_drafter_that_proposes_the_same(models, tmp_path):
    """`as_dflash2` keeps the v1 weights and initialises the new parts to change nothing (identity convolutions,
    zero successor codes): the same proposals, exactly; saved and loaded, it is a DFlash2 checkpoint."""
    from flashdraft.engine.proposers import DFlashProposer

    model = models["qwen3"]
    target = Target(model)
    v1 = DFlashDraftModel.for_target(
        model.config, num_layers=2, block_size=6, mask_token_id=VOCAB - 1, seed=2
    ).eval()
    v2 = v1.as_dflash2().eval()
    assert v2.config.is_dflash2 and not v1.config.is_dflash2
    ids = torch.tensor([[5, 9, 11, 20, 33, 7, 8, 9]])
    for d in (v1, v2):
        p = DFlashProposer(d, target)
        p.start(target.features(ids[:, :-1], d.config.target_layer_ids))
        d.last = (p.draft_logits(8, 7, 5), None)
        p.start(target.features(ids[:, :-1], d.config.target_layer_ids))
        d.last = (d.last[0], p.propose(8, 7, 5))
    torch.testing.assert_close(v1.last[0], v2.last[0], rtol=0, atol=0)
    assert torch.equal(v1.last[1], v2.last[1])
    v2.save_pretrained(tmp_path, dtype=torch.float32)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    assert DFlashDraftModel.from_pretrained(tmp_path).config == v2.config


def test_selector_loss_equals_a_row_by_row_reference():
    """The selector's loss, with its teacher-forced predecessors (the previous slot's label, the anchor for slot 1)
    and only slots whose label is a candidate, equals a plain per-row computation, gradients included."""
    model = tiny_model("llama")
    target = Target(model)
    draft = dflash2_drafter(model, block_size=4)
    draft.config.output_multiplier, draft.config.final_logit_softcapping = 0.8, 6.0
    sel = draft.candidate_selector
    sel.top_k = 5
    torch.manual_seed(0)
    hidden = torch.randn(12, 64, requires_grad=True)  # 3 blocks of 4
    head = model.lm_head.weight
    logits = torch.tanh(hidden.detach() @ head.T * 0.8 / 6.0) * 6.0
    labels = torch.randint(0, VOCAB, (12,))
    for r in (1, 2, 6, 9):  # some labels among the candidates
        labels[r] = logits[r].topk(5).indices[r % 5]
    weights = torch.tensor([0, 1, 0.7, 0.5] * 3)
    total, present = selector_loss(
        sel, target, draft.config, hidden, labels, weights, block_size=4, chunk_size=5
    )
    total.backward()
    grad = hidden.grad.clone()
    hidden.grad = None
    ref, count = 0.0, 0
    for r in range(12):
        if r % 4 == 0:
            continue
        row_logits = torch.tanh(hidden[r] @ head.T * 0.8 / 6.0) * 6.0
        unary, cands = row_logits.topk(5)
        if labels[r] not in cands:
            continue
        pred = labels[r - 1]  # slot 1's predecessor is slot 0's label: the anchor token
        pair = sel.successor_codebook[cands] @ (
            sel.predecessor_codebook[pred] * sel.hidden_projection(hidden[r])
        )
        scores = unary + pair
        ref = ref + weights[r] * torch.nn.functional.cross_entropy(
            scores[None], (cands == labels[r]).nonzero()[0]
        )
        count += 1
    assert int(present) == count >= 4
    torch.testing.assert_close(total, ref, rtol=1e-5, atol=1e-5)
    ref.backward()
    torch.testing.assert_close(grad, hidden.grad, rtol=1e-4, atol=1e-5)


def test_dflash2_training_learns_and_exports(tmp_path):
    """A DFlash2 drafter trained on a learnable target: the loss falls, the selector and convolutions learn, the
    exported checkpoint is a DFlash2 one that decodes exactly."""
    from flashdraft.training.trainer import Trainer

    model = bigram_target()
    target = Target(model)
    data = greedy_dataset(model, 16, new=24)
    cfg = small_train_config(
        tmp_path, max_steps=12, arch="dflash2", num_anchors=16, mask_token_id=BIGRAM_V - 1
    )
    trainer = Trainer(target, data, cfg)
    assert trainer.draft.config.is_dflash2
    before = {k: v.clone() for k, v in trainer.draft.state_dict().items()}
    logs = [trainer.train_step() for _ in range(12)]
    assert logs[-1]["loss"] < 0.8 * logs[0]["loss"]
    after = trainer.draft.state_dict()
    for name in ("candidate_selector.successor_codebook", "layers.0.attention_conv.kernel_projection.weight",
                 "layers.1.mlp_conv.base_kernel"):  # fmt: skip
        assert not torch.equal(before[name], after[name]), name
    trainer.draft.eval().save_pretrained(tmp_path / "d2", dtype=torch.float32)
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "d2")
    prompt = torch.tensor([[7, 8, 9, 10]])
    assert (
        generate(target, loaded, prompt, 20, block_size=8, stop_token_ids=[]).new_tokens
        == generate_ar(target, prompt, 20, stop_token_ids=[]).new_tokens
    )


def test_cli_init_draft_dflash2(tmp_path):
    from typer.testing import CliRunner

    from flashdraft.cli import app
    from test_data import make_tokenizer

    model_dir = tmp_path / "tiny-target"
    tiny_model("llama", seed=3, layers=4).save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    r = CliRunner().invoke(app, ["init-draft", "--target", str(model_dir), "--out", str(tmp_path / "d"),
                                 "--num-layers", "1", "--arch", "dflash2"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "DFlash2DraftModel" in r.output
    cfg = DFlashConfig.from_pretrained(tmp_path / "d")
    assert cfg.is_dflash2 and cfg.block_size == 8
    r = CliRunner().invoke(app, ["init-draft", "--target", str(model_dir), "--out", str(tmp_path / "e"),
                                 "--arch", "dflash3"])  # fmt: skip
    assert r.exit_code != 0 and "dflash3" in r.output
