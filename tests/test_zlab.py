"""Conformance with z-lab's own package (PyPI `dflash==0.1.0`), both directions, at T=0 and a fixed block.

z-lab's package is not in the default install: `make test-zlab` builds `.venv-zlab` with it and runs these tests
(CI does); elsewhere they are skipped. They compare decoding, not configs: the same tiny random target, the same
drafter weights, z-lab's `dflash_generate` against flashdraft's `generate`, token for token and step for step.

Random drafters rarely agree with a random target, so the first block's drafts (and their logits) are compared
directly too; for the decoding comparison the target's LM head has two large opposite rows, so target and drafter
mostly pick one of those two tokens and some drafts are accepted.
"""

from __future__ import annotations

import pytest
import torch

zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash package: make test-zlab")

from conftest import VOCAB, tiny_model  # noqa: E402
from flashdraft import DFlashDraftModel, Target, generate  # noqa: E402

pytestmark = pytest.mark.zlab

MASK = VOCAB - 1
PROMPTS = [[5, 9, 11, 20, 33, 7], [12, 3, 3, 40, 41, 42, 43, 44, 8]]


def boosted_target(seed: int = 0):
    model = tiny_model("qwen3", seed=seed, layers=6).float().eval()
    with torch.no_grad():
        model.lm_head.weight[10] *= 12.0
        model.lm_head.weight[11] = -model.lm_head.weight[10]
    return model


def zlab_config(target, **dflash_extra):
    """A z-lab drafter config (a transformers Qwen3Config) sized for the tiny target, as z-lab writes them."""
    from transformers import Qwen3Config

    extra = {k: dflash_extra.pop(k) for k in list(dflash_extra) if k not in ZLAB_DFLASH_KEYS}
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rope_theta=10000.0,
        tie_word_embeddings=False, **extra,
    )  # fmt: skip
    cfg.architectures = ["DFlashDraftModel"]
    cfg.num_target_layers = 6
    cfg.dflash_config = {"mask_token_id": MASK, "target_layer_ids": [1, 3, 4], **dflash_extra}
    return cfg


ZLAB_DFLASH_KEYS = {
    "block_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
    "output_multiplier", "final_logit_softcapping", "input_embedding_scale",
}  # fmt: skip


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights for every parameter (z-lab's post_init leaves some, e.g. DFlash2's base kernels, unset)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "base_kernel" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


@pytest.fixture(autouse=True)
def cpu_clock(monkeypatch):
    """z-lab's loop times its stats with torch.cuda.synchronize: on a CPU, the plain clock."""
    import time

    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)


def zlab_decode(
    draft, target, prompt: list[int], max_new: int, block: int
) -> tuple[list[int], list[int], list[bool]]:
    """(new tokens, per-step acceptance lengths, whether each step drafted a full block) from z-lab's loop."""
    ids = torch.tensor([prompt])
    out = zlab.dflash_generate(
        draft, target, ids, max_new_tokens=max_new, stop_token_ids=None, temperature=0.0, block_size=block,
        return_stats=True,
    )  # fmt: skip
    # z-lab shrinks the last blocks to what is left of max_new_tokens (the drafter then sees fewer mask slots, so
    # it may propose differently); flashdraft always drafts the full block. Only full blocks are comparable.
    full, start = [], len(prompt)
    for length in out.acceptance_lengths:
        full.append(min(block, len(prompt) + max_new - start) == block)
        start += length
    return out.output_ids[0, len(prompt) :].tolist(), list(out.acceptance_lengths), full


def assert_same_drafts(zlab_draft, ours: DFlashDraftModel, target, block: int) -> None:
    """The first block after each prompt: z-lab's draft pass (its forward, logits and, for DFlash2, its candidate
    selector) and flashdraft's propose the same tokens from logits equal to float tolerance."""
    from flashdraft.engine.proposers import DFlashProposer

    wrapped = Target(target)
    head = zlab._output_head(target)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = target(ids, output_hidden_states=True)
            context = zlab.extract_context_feature(out.hidden_states, zlab_draft.target_layer_ids)
            anchor = out.logits[:, -1].argmax(-1)
            block_ids = torch.full((1, block), MASK)
            block_ids[0, 0] = anchor
            scale = float(zlab._draft_value(zlab_draft.config, "input_embedding_scale", 1.0))
            hidden = zlab_draft(
                target_hidden=context, noise_embedding=zlab._raw_input_embeddings(target, block_ids, scale),
                position_ids=torch.arange(len(prompt) + block)[None],
            )[:, 1:]  # fmt: skip
            z_logits = zlab_draft.compute_logits(hidden, head)
            if isinstance(zlab_draft, zlab.DFlash2DraftModel):
                z_tokens = zlab_draft.propose(hidden, block_ids[:, 0], head, 0.0)[0][0]
            else:
                z_tokens = z_logits.argmax(-1)[0]
        proposer = DFlashProposer(ours, wrapped)
        proposer.start(wrapped.features(ids, list(ours.target_layer_ids)))
        logits = proposer.head_logits(proposer.draft_hidden(int(anchor), len(prompt), block - 1)[0])
        torch.testing.assert_close(logits, z_logits[0].float(), rtol=1e-4, atol=1e-4)
        proposer.start(wrapped.features(ids, list(ours.target_layer_ids)))
        assert proposer.propose(int(anchor), len(prompt), block - 1).tolist() == z_tokens.tolist()


def assert_same_decoding(zlab_draft, ours: DFlashDraftModel, target, block: int, max_new: int = 40) -> None:
    """Outputs and full-block acceptance lengths equal on every prompt, some drafts accepted along the way."""
    wrapped = Target(target)
    lengths = []
    for prompt in PROMPTS:
        z_tokens, z_lengths, full = zlab_decode(zlab_draft, target, prompt, max_new, block)
        res = generate(wrapped, ours, torch.tensor([prompt]), max_new_tokens=max_new, block_size=block,
                       stop_token_ids=[])  # fmt: skip
        assert res.new_tokens == z_tokens
        n = sum(full)
        assert res.acceptance_lengths[:n] == z_lengths[:n], (res.acceptance_lengths, z_lengths)
        lengths += z_lengths[:n]
    assert max(lengths) > 1, "no draft was ever accepted: the comparison says nothing about the drafts"


ZLAB_DRAFTERS = {
    "dflash2": dict(
        arch="DFlash2DraftModel", block_size=8, conv_kernel_size=2, conv_group_size=16, selector_rank=16,
        selector_top_k=8, layer_types=["sliding_attention"] * 2, sliding_window=6, use_sliding_window=True,
        is_causal=False,
    ),
    "yarn": dict(arch="DFlashDraftModel", block_size=6,
                 rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                  "rope_theta": 10000.0}),
    "softcap": dict(arch="DFlashDraftModel", block_size=6, final_logit_softcapping=3.0, output_multiplier=0.7),
    "sliding-noncausal": dict(arch="DFlashDraftModel", block_size=6, layer_types=["sliding_attention"] * 2,
                              sliding_window=4, use_sliding_window=True, is_causal=False),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(ZLAB_DRAFTERS))
def test_zlab_built_drafters_decode_the_same_in_flashdraft(tmp_path, kind):
    """A drafter z-lab's package builds and saves loads in flashdraft and decodes as in z-lab's own loop."""
    spec = dict(ZLAB_DRAFTERS[kind])
    arch = spec.pop("arch")
    block = spec["block_size"]
    target = boosted_target()
    config = zlab_config(target, **spec)
    cls = zlab.DFlash2DraftModel if arch == "DFlash2DraftModel" else zlab.DFlashDraftModel
    config.architectures = [arch]
    torch.manual_seed(0)
    z = cls(config).float().eval()
    randomize(z, seed=1)
    z.save_pretrained(tmp_path)
    ours = DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert ours.config.is_dflash2 == (arch == "DFlash2DraftModel")
    assert_same_drafts(z, ours, target, block)
    assert_same_decoding(z, ours, target, block)


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_flashdraft_written_drafters_load_and_decode_the_same_in_zlab(tmp_path, arch):
    """A drafter flashdraft writes (v1 and DFlash2) loads in z-lab's package, weights and config as they are, and
    z-lab's loop decodes with it as flashdraft does."""
    target = boosted_target()
    ours = DFlashDraftModel.for_target(
        target.config, num_layers=2, block_size=8, mask_token_id=MASK, arch=arch
    )
    randomize(ours, seed=2)
    ours.eval().save_pretrained(tmp_path, dtype=torch.float32)
    cls = zlab.DFlash2DraftModel if arch == "dflash2" else zlab.DFlashDraftModel
    z = cls.from_pretrained(tmp_path, dtype=torch.float32).eval()
    zs, os_ = z.state_dict(), ours.state_dict()
    assert len(zs) == len(os_)
    for name, tensor in os_.items():
        key = name if name in zs else f"{name}.weight"  # z-lab keeps the codebooks as embeddings
        torch.testing.assert_close(zs[key], tensor, rtol=0, atol=0)
    assert_same_drafts(z, ours, target, block=8)
    assert_same_decoding(z, ours, target, block=8)
