"""fp32 linear layers through oneDNN with packed weights (packed_linear.py): the same layer, packed only where the
engine decodes eagerly on a CPU, put back for --compile and for training, decoding exactly what plain decoding of the
same target decodes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import (
    HYBRID_ARCHS,
    VOCAB,
    assert_batched_dflash_is_plain_decoding,
    assert_dflash_is_plain_decoding,
    byte_tokenizer,
    hybrid_model,
    on_disk,
    tiny_model,
)
from flashdraft import Target, load_target
from flashdraft.drafter.model import DFlashDraftModel, draft_logits
from flashdraft.engine.proposers import DFlashProposer
from flashdraft.kernels import packed_linear as pl
from flashdraft.kernels.plan import make_plan

pytestmark = pytest.mark.skipif(not pl.available(), reason="this torch has no oneDNN fp32 linear")


def packed(arch: str, seed: int = 0, **overrides) -> nn.Module:
    model = (
        hybrid_model(arch, seed=seed) if arch in HYBRID_ARCHS else tiny_model(arch, seed=seed, **overrides)
    )
    assert pl.pack_linears(model) > 0
    return model


def test_a_packed_linear_is_the_dense_linear():
    torch.manual_seed(0)
    linear = nn.Linear(96, 80, bias=True)
    p = pl.PackedLinear(linear)
    for x in (
        torch.randn(5, 96),
        torch.randn(2, 3, 96),
        torch.randn(96, 4).T,
    ):  # rows, a batch, a strided view
        torch.testing.assert_close(p(x), linear(x), rtol=1e-5, atol=1e-5)
        assert p(x).shape == linear(x).shape and p(x).dtype == torch.float32
    assert torch.equal(p.weight, linear.weight) and torch.equal(p.bias, linear.bias)
    # gradients (training never packs, but a layer must not silently drop one): through the dense product
    x = torch.randn(3, 96, requires_grad=True)
    p(x).square().sum().backward()
    expected = torch.autograd.grad(linear(x).square().sum(), x)[0]
    torch.testing.assert_close(x.grad, expected)


def test_pack_and_unpack_keep_a_tied_head_tied():
    model = tiny_model("llama", tie_word_embeddings=True)
    before = {n: p.clone() for n, p in model.named_parameters()}
    embedding = model.get_input_embeddings().weight
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert pl.pack_linears(model) == linears
    assert not any(type(m) is nn.Linear for m in model.modules()) and pl.is_packed(model)
    head = model.get_output_embeddings()
    assert isinstance(head, pl.PackedLinear) and head.weight is embedding  # the tied weight, not a copy
    assert pl.unpack_linears(model) == linears and not pl.is_packed(model)
    assert model.get_output_embeddings().weight is embedding
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in before.items())


def test_what_is_packed():
    cpu = torch.device("cpu")
    assert make_plan(cpu, torch.float32).packed_linears
    assert not make_plan(
        cpu, torch.bfloat16
    ).packed_linears  # bf16 already runs oneDNN's kernel through nn.Linear
    assert not make_plan(torch.device("meta"), torch.float32).packed_linears
    assert not make_plan(cpu, torch.float32, pack_linears=False).packed_linears  # training
    assert not make_plan(cpu, torch.float32, compile=True).packed_linears  # inductor packs its own


def test_the_environment_turns_packing_off(monkeypatch):
    monkeypatch.setenv("FLASHDRAFT_PACKED_LINEAR", "0")
    assert not make_plan(torch.device("cpu"), torch.float32).packed_linears
    model = packed("llama")  # a model handed in packed is unpacked by a plan that does not pack
    assert not Target(model).plan.packed_linears and not pl.is_packed(model)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5", "jamba"])  # hybrids: their mixers' linears too
def test_dflash_on_a_packed_target_is_plain_decoding(arch):
    """Greedy and seeded sampling: a random drafter (rollbacks) and an oracle (long accepts) emit what plain
    decoding of the packed target emits, which is what the dense target decodes (tiny models' logits are far apart)."""
    dense = Target(hybrid_model(arch, seed=2) if arch in HYBRID_ARCHS else tiny_model(arch, seed=2))
    target = Target(packed(arch, seed=2))
    draft = DFlashDraftModel.for_target(
        target.model.config, num_layers=1, block_size=6, mask_token_id=VOCAB - 1, seed=3
    ).eval()
    assert_dflash_is_plain_decoding(target, draft, dense=dense)


def test_batched_rows_joining_and_leaving_on_a_packed_target():
    target = Target(packed("qwen3", seed=4))
    draft = DFlashDraftModel.for_target(
        target.model.config, num_layers=1, block_size=5, mask_token_id=VOCAB - 1, seed=6
    ).eval()
    assert_batched_dflash_is_plain_decoding(target, draft)


def test_the_draft_head_runs_the_packed_head():
    dense = Target(tiny_model("llama", seed=1))
    target = Target(packed("llama", seed=1))
    draft = DFlashDraftModel.for_target(
        target.model.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1
    )
    proposer = DFlashProposer(draft, target)
    assert proposer.packed_head is target.lm_head and proposer.head_weight is None
    hidden = torch.randn(3, target.hidden_size)
    expected = draft_logits(draft.config, hidden, dense.lm_head.weight, None)
    torch.testing.assert_close(proposer.head_logits(hidden), expected, rtol=1e-5, atol=1e-5)
    # in another precision the head is cast from the dense weight, as before
    assert DFlashProposer(draft, target, dtype=torch.bfloat16).head_weight.dtype == torch.bfloat16


def test_load_target_packs_and_compile_puts_the_layers_back(tmp_path):
    from flashdraft.engine.compiled import compile_verify
    from flashdraft.engine.measure import cost_key

    tok = byte_tokenizer(["a packed target", "and its tokenizer"] * 4, VOCAB)
    saved = on_disk(Target(tiny_model("llama"), tok), tmp_path)
    target = load_target(saved["target"])
    assert pl.is_packed(target.model) and isinstance(target.lm_head, pl.PackedLinear)
    dense = load_target(saved["target"], pack_linears=False)
    assert not pl.is_packed(dense.model)
    draft = DFlashDraftModel.from_pretrained(saved["draft"])
    # priced apart: oneDNN's layers cost what MKL's do not
    assert cost_key(target, draft) == {**cost_key(dense, draft), "linear": "onednn-packed"}
    assert compile_verify(target) is None
    assert not pl.is_packed(target.model) and type(target.lm_head) is nn.Linear
    assert cost_key(target, draft)["verify"]["static_cache"] and "linear" not in cost_key(target, draft)
