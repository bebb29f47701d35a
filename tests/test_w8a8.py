"""--quantize w8a8: int8 weights and int8 activations, each row quantized alone. A layer is the integer product of
its codes, scaled; a row gets the same bits whatever rows share the call, eager and compiled; DFlash decodes what
plain decoding of the same model decodes; what cannot run it is refused or decodes eagerly, in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import (
    HYBRID_ARCHS,
    VOCAB,
    assert_batched_dflash_is_plain_decoding,
    assert_dflash_is_plain_decoding,
    first_rows_symbolic,
    hybrid_model,
    tiny_model,
)
from flashdraft import Target
from flashdraft.model import DFlashDraftModel
from flashdraft.quantize import (
    W8A8_ZERO_POINT,
    QuantizeError,
    W8A8Linear,
    check_quantize,
    quantize,
    w8a8_available,
    w8a8_compiles,
)

pytestmark = pytest.mark.skipif(not w8a8_available(), reason="oneDNN's int8 linear (x86 builds of torch)")
needs_template = pytest.mark.skipif(
    not w8a8_compiles(), reason="inductor's int8 micro-kernels (avx512_vnni, AMX)"
)


def reference(layer: W8A8Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's arithmetic spelled out: each row's codes, their integer product with the weight (exact in
    float64 at these sizes), the two scales, the bias."""
    rows = x.reshape(-1, x.shape[-1]).float()
    scale = rows.abs().amax(dim=1, keepdim=True) / 127
    codes = torch.round(rows / scale).clamp(-127, 127)
    product = codes.double() @ layer.weight_int8.double().T
    out = product.float() * scale * layer.scales
    if layer.bias is not None:
        out = out + layer.bias
    return out.reshape(*x.shape[:-1], layer.out_features)


def test_a_w8a8_layer_is_the_integer_product_of_each_row_s_codes():
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=True).to(torch.bfloat16)
    layer = W8A8Linear(linear)
    x = torch.randn(5, 3, 96, dtype=torch.bfloat16)
    got = layer(x)
    assert got.shape == (5, 3, 40) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference(layer, x), rtol=1e-2, atol=1e-2)
    # per output channel, absmax / 127 (fp32 scales: the epilogue is fp32): each weight within half a step
    dequantized = layer.weight_int8.float() * layer.scales[:, None]
    assert ((dequantized - linear.weight.float()).abs() <= layer.scales[:, None] / 2 + 1e-6).all()
    assert layer.weight_kn.shape == (96, 40) and layer.weight_kn.is_contiguous()
    # a row of zeros is zeros (plus the bias), not a division by zero
    assert torch.equal(layer(torch.zeros(1, 96, dtype=torch.bfloat16)), linear.bias[None].to(torch.bfloat16))
    # the activation codes sit one zero point above signed bytes: -127..127 -> 1..255
    assert W8A8_ZERO_POINT == 128


def test_a_w8a8_layer_gives_a_row_its_bits_at_any_row_count_eager():
    """Quantized per row, multiplied in integers: a row's output does not depend on the rows beside it (a scale over
    the whole call, as oneDNN's dynamic quantization takes, would break this)."""
    torch.manual_seed(1)
    layer = W8A8Linear(nn.Linear(576, 1536).to(torch.bfloat16))
    x = torch.randn(16, 576, dtype=torch.bfloat16)
    x[3] *= 50  # an outlier row: with a shared scale every other row would lose its bits
    together = layer(x)
    for i in (0, 3, 7, 15):
        assert torch.equal(together[i : i + 1], layer(x[i : i + 1]))


@needs_template
def test_compiled_w8a8_layers_are_the_template_s_and_give_a_row_its_bits_at_any_row_count():
    """Compiled at SmolLM2's shapes with the rows symbolic, as the engine compiles a verify: every layer is one
    kernel of inductor's C++ GEMM template (the codes, the integer product and the scales fused), a row's outputs
    are the same bits at 1 to 17 rows, and they are the layer's arithmetic."""
    from torch._dynamo.utils import counters

    from flashdraft.compiled import compile_options, compile_whole

    torch.manual_seed(0)
    shapes = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 4000)]
    layers = nn.ModuleList(
        W8A8Linear(nn.Linear(i, o, bias=o == 192).to(torch.bfloat16)) for i, o in shapes
    ).eval()
    with torch._inductor.config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        counters.clear()
        step = compile_whole(
            lambda inputs: [layer(x) for layer, x in zip(layers, inputs, strict=True)],
            compile_options(torch.device("cpu")),
            weights=layers,
        )
        x = [torch.randn(17, i, dtype=torch.bfloat16) for i, _ in shapes]
        with torch.no_grad():
            alone = first_rows_symbolic(step, x, 1)
            assert counters["inductor"]["cpp_templated_kernel_counter"] == len(shapes)
            for rows in (2, 3, 5, 8, 16, 17):
                together = first_rows_symbolic(step, x, rows)
                for (i, o), one, many, layer, t in zip(shapes, alone, together, layers, x, strict=True):
                    assert torch.equal(many[:1], one), f"{i} -> {o} at {rows} rows"
                    want = reference(layer, t[:rows])
                    torch.testing.assert_close(many.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
def test_dflash_on_a_w8a8_target_is_plain_decoding_of_it(arch):
    """Greedy and seeded sampling, a random drafter and an oracle, eager; a hybrid target too."""
    model = hybrid_model(arch, seed=2) if arch in HYBRID_ARCHS else tiny_model(arch, seed=2)
    model = model.to(torch.bfloat16)
    assert quantize(model, "w8a8") > 0
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.get_output_embeddings(), W8A8Linear)
    target = Target(model)
    assert target.quantize == "w8a8"
    draft = (
        DFlashDraftModel.for_target(model.config, num_layers=1, block_size=6, mask_token_id=VOCAB - 1, seed=3)
        .eval()
        .to(torch.bfloat16)
    )
    assert_dflash_is_plain_decoding(target, draft)


@needs_template
def test_compiled_dflash_on_a_w8a8_target_is_plain_decoding_of_it():
    """`--quantize w8a8 --compile`: one row and rows joining and leaving a batch."""
    from flashdraft.compiled import compile_verify

    model = tiny_model("llama", seed=2).to(torch.bfloat16)
    quantize(model, "w8a8")
    target = Target(model)
    assert compile_verify(target) is None
    draft = (
        DFlashDraftModel.for_target(model.config, num_layers=1, block_size=6, mask_token_id=VOCAB - 1, seed=3)
        .eval()
        .to(torch.bfloat16)
    )
    assert_dflash_is_plain_decoding(target, draft)
    assert_batched_dflash_is_plain_decoding(target, draft, max_batch_size=3)


def test_what_w8a8_cannot_run_is_refused_or_decodes_eagerly(monkeypatch):
    import flashdraft.quantize as quantize_module
    from flashdraft.compiled import compile_verify

    cpu = torch.device("cpu")
    check_quantize("w8a8", None, cpu)
    check_quantize("w8a8", torch.bfloat16, cpu)
    with pytest.raises(QuantizeError, match="--quantize w8a8 runs bf16 activations .* not float16"):
        check_quantize("w8a8", torch.float16, cpu)
    with pytest.raises(QuantizeError, match="for CPUs"):
        check_quantize("w8a8", None, torch.device("cuda"))
    # a CPU without inductor's int8 micro-kernels: --compile says so and decodes eagerly (exactly)
    monkeypatch.setattr(quantize_module, "w8a8_compiles", lambda: False)
    model = tiny_model("llama").to(torch.bfloat16)
    quantize(model, "w8a8")
    target = Target(model)
    note = compile_verify(target)
    assert note is not None and "avx512_vnni or AMX" in note and "decoding eagerly" in note
    assert not target.static_cache
    # options that would not freeze the weights or take the template: the same, named
    monkeypatch.setattr(quantize_module, "w8a8_compiles", lambda: True)
    monkeypatch.setenv("FLASHDRAFT_COMPILE", '{"options": {"max_autotune_gemm": true}}')
    note = compile_verify(target)
    assert note is not None and "C++ GEMM template" in note and "FLASHDRAFT_COMPILE" in note
    assert not target.static_cache
    assert_dflash_is_plain_decoding(
        target,
        DFlashDraftModel.for_target(model.config, num_layers=1, block_size=6, mask_token_id=VOCAB - 1, seed=3)
        .eval()
        .to(torch.bfloat16),
    )
