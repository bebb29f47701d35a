"""--quantize int8: weight-only int8 linear layers (bf16 activations) decode exactly what plain decoding of the
same quantized model decodes; the kernel is batch-invariant; what int8 cannot run is refused in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import HYBRID_ARCHS, VOCAB, assert_dflash_is_plain_decoding, hybrid_model, tiny_model
from flashdraft import Target
from flashdraft.model import DFlashDraftModel
from flashdraft.quantize import Int8Linear, QuantizeError, check_quantize, quantize_int8


def quantized(arch: str, seed: int = 0) -> nn.Module:
    model = (hybrid_model(arch, seed=seed) if arch in HYBRID_ARCHS else tiny_model(arch, seed=seed)).to(
        torch.bfloat16
    )
    quantize_int8(model)
    return model


def test_int8_linear_is_the_linear_of_its_rounded_weights():
    torch.manual_seed(0)
    linear = nn.Linear(48, 40, bias=True).to(torch.bfloat16)
    q = Int8Linear(linear)
    x = torch.randn(5, 3, 48, dtype=torch.bfloat16)
    # the layer is exactly its dequantized weight (int8 x bf16 scale) applied in float, up to bf16 output rounding
    expected = x.float() @ (q.weight_int8.float() * q.scales.float()[:, None]).T + q.bias.float()
    torch.testing.assert_close(q(x).float(), expected, rtol=2e-2, atol=2e-2)
    # and close to the original layer: per-channel absmax / 127 moves each weight by at most half a step
    step = q.scales.float()[:, None] / 2
    assert ((q.weight.float() - linear.weight.float()).abs() <= step + 1e-3).all()
    assert q(x).shape == (5, 3, 40) and q(x).dtype == torch.bfloat16
    # a view whose rows are not contiguous (as some mixers hand their projections) gives the same rows
    strided = torch.randn(48, 6, dtype=torch.bfloat16).T
    assert torch.equal(q(strided), q(strided.contiguous()))


def test_int8_kernel_is_batch_invariant():
    """A row's output has the same bits whatever other rows share the call: a verify's projections are a one-token
    step's (the bf16 dense matmul on some CPUs is too, fp32 is not; attention still rounds by query length)."""
    torch.manual_seed(1)
    q = Int8Linear(nn.Linear(576, 1536).to(torch.bfloat16))
    x = torch.randn(16, 576, dtype=torch.bfloat16)
    together = q(x)
    for i in (0, 7, 15):
        assert torch.equal(together[i : i + 1], q(x[i : i + 1]))


def test_quantize_replaces_every_linear_and_the_head():
    model = quantized("llama")
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.get_output_embeddings(), Int8Linear)
    assert isinstance(model.get_input_embeddings(), nn.Embedding)  # the embedding stays bf16
    target = Target(model)
    assert target.lm_head_logits(torch.randn(2, target.hidden_size)).dtype == torch.float32


# Jamba is left out: in bf16, with or without int8, one of these sampled runs parts from plain sampling (its batched
# verify rounds otherwise than a one-token step: the near-tie of bench/mismatches.py, here on a sampling threshold).
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
def test_dflash_on_an_int8_target_is_plain_decoding_of_it(arch):
    """Greedy and seeded sampling: a random drafter (most drafts rejected, rollbacks) and an oracle (long accepts)
    emit exactly what plain decoding of the same int8 model emits."""
    model = quantized(arch, seed=2)
    target = Target(model)
    draft = DFlashDraftModel.for_target(
        model.config, num_layers=1, block_size=6, mask_token_id=VOCAB - 1, seed=3
    ).eval()
    draft = draft.to(torch.bfloat16)
    assert_dflash_is_plain_decoding(target, draft)


def test_what_int8_cannot_run_is_refused():
    cpu = torch.device("cpu")
    check_quantize(None, torch.float32, cpu)
    check_quantize("int8", None, cpu)
    check_quantize("int8", torch.bfloat16, cpu)
    with pytest.raises(QuantizeError, match="must be one of int8, got 'int4'"):
        check_quantize("int4", None, cpu)
    with pytest.raises(QuantizeError, match="runs bf16 activations .* not float32"):
        check_quantize("int8", torch.float32, cpu)
    with pytest.raises(QuantizeError, match="for CPUs"):
        check_quantize("int8", None, torch.device("cuda"))


def test_an_int8_target_is_priced_apart():
    """The cost model is cached per model, dtype and threads: int8 weights get a price list of their own."""
    from flashdraft.measure import cost_key

    plain = Target(tiny_model("llama").to(torch.bfloat16))
    int8 = Target(quantized("llama"))
    draft = DFlashDraftModel.for_target(
        plain.model.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1
    )
    assert plain.quantize is None and int8.quantize == "int8"
    assert cost_key(int8, draft) == {**cost_key(plain, draft), "quantize": "int8"}
