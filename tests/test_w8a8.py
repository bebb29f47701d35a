"""--quantize w8a8: int8 weights and int8 activations, each row quantized alone. A layer is the integer product of
its codes, scaled; a row gets the same bits whatever rows share the call, eager and compiled; DFlash decodes what
plain decoding of the same model decodes; what cannot run it is refused or decodes eagerly, in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import (
    HYBRID_ARCHS,
    VOCAB,
    assert_batched_dflash_is_plain_decoding,
    assert_dflash_is_plain_decoding,
    cpu_flags,
    first_rows_symbolic,
    hybrid_model,
    needs_kernel,
    tiny_model,
)
from flashdraft import Target
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.kernels.plan import check_quantize
from flashdraft.kernels.quantize import (
    W8A8_ZERO_POINT,
    QuantizeError,
    W8A8Linear,
    quantize,
    w8a8_available,
    w8a8_compiles,
    w8a8_exact,
)

needs_onednn = pytest.mark.skipif(not w8a8_available(), reason="oneDNN's int8 linear (x86 builds of torch)")
# without VNNI w8a8 is refused (oneDNN's int8 products saturate); the test that it is refused runs everywhere
needs_exact = needs_kernel(w8a8_exact, "avx512_vnni|avx_vnni|amx_int8", "w8a8's exact int8 products (VNNI)")
needs_template = needs_kernel(w8a8_compiles, "avx512_vnni|amx_int8", "inductor's int8 micro-kernels")


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


@needs_exact
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


@needs_exact
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


@needs_exact
@needs_template
def test_compiled_w8a8_layers_are_the_template_s_and_give_a_row_its_bits_at_any_row_count():
    """Compiled at SmolLM2's shapes with the rows symbolic, as the engine compiles a verify: every layer is one
    kernel of inductor's C++ GEMM template (the codes, the integer product and the scales fused), a row's outputs
    are the same bits at 1 to 17 rows, and they are the layer's arithmetic."""
    from torch._dynamo.utils import counters

    from flashdraft.engine.compiled import compile_whole
    from flashdraft.kernels.plan import compile_options

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


@needs_exact
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


@needs_exact
@needs_template
def test_compiled_dflash_on_a_w8a8_target_is_plain_decoding_of_it():
    """`--quantize w8a8 --compile`: one row and rows joining and leaving a batch."""
    from flashdraft.engine.compiled import compile_verify

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


@needs_exact
def test_what_w8a8_cannot_run_is_refused_or_decodes_eagerly(monkeypatch):
    import flashdraft.kernels.quantize as quantize_module
    from flashdraft.engine.compiled import compile_verify

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
    assert not target.plan.static_cache
    # options that would not freeze the weights or take the template: the same, named
    monkeypatch.setattr(quantize_module, "w8a8_compiles", lambda: True)
    monkeypatch.setenv("FLASHDRAFT_COMPILE", '{"options": {"max_autotune_gemm": true}}')
    note = compile_verify(target)
    assert note is not None and "C++ GEMM template" in note and "FLASHDRAFT_COMPILE" in note
    assert not target.plan.static_cache
    assert_dflash_is_plain_decoding(
        target,
        DFlashDraftModel.for_target(model.config, num_layers=1, block_size=6, mask_token_id=VOCAB - 1, seed=3)
        .eval()
        .to(torch.bfloat16),
    )


# Run in a process of its own with oneDNN capped at an ISA (ONEDNN_MAX_CPU_ISA is read once, when oneDNN starts):
# the layer at the codes' extremes against its integer product, what the gate says, and what is refused.
_BOUNDARY = """
import json, sys, torch
from torch import nn
sys.path.insert(0, sys.argv[1])
from test_w8a8 import reference
from flashdraft.kernels.quantize import QuantizeError, W8A8Linear, _onednn_int8_product, w8a8_exact
from flashdraft.kernels.plan import check_quantize

torch.manual_seed(0)
worst = 0.0
for k, n in ((512, 40), (96, 40), (320, 24)):  # unsigned sums below 2^24: exact in the op's fp32
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    weight[0], weight[1] = 127, -127                      # whole columns at the extremes
    for rows in (1, 3, 17):
        codes = torch.randint(-127, 128, (rows, k), dtype=torch.int8)
        codes[0] = 127                                    # x 127: every pair sums to 32258 before the zero point
        codes[-1] = torch.where(torch.arange(k) % 2 == 0, 127, -127).to(torch.int8)
        got = _onednn_int8_product(codes, weight).double()
        worst = max(worst, (got - (codes.double() @ weight.double().T)).abs().max().item())
linear = nn.Linear(96, 40, bias=True).to(torch.bfloat16)
x = torch.randn(5, 3, 96, dtype=torch.bfloat16)
try:
    layer = W8A8Linear(linear)
    layer_error = (layer(x).float() - reference(layer, x)).abs().max().item()
    refusals = []
except QuantizeError as e:
    layer_error, refusals = None, [str(e)]
try:
    check_quantize("w8a8", None, torch.device("cpu"))
except QuantizeError as e:
    refusals.append(str(e))
print(json.dumps({"worst": worst, "exact": w8a8_exact(), "layer_error": layer_error, "refusals": refusals}))
"""


@needs_onednn
@pytest.mark.skipif(
    not Path("/proc/cpuinfo").exists(), reason="reads the CPU's flags from /proc/cpuinfo (Linux)"
)
@pytest.mark.parametrize("cap", [None, "AVX2", "AVX512_CORE", "AVX2_VNNI", "AVX512_CORE_VNNI"])
def test_w8a8_is_offered_exactly_where_its_layers_are_the_integer_product(cap):
    """The boundary, on every x86 machine: with oneDNN capped at each ISA (the avx2 path runs on an avx512 CPU too),
    a layer at the codes' extremes (127 x 127 in every pair: 64770 with the zero point, past vpmaddubsw's 16-bit
    sums) is the integer product of its codes, and w8a8 is offered; or it is not, and w8a8 is refused in one line
    naming VNNI, by the CLI's check and by the layer. Without VNNI it must be refused: that is where a Zen 3 EPYC
    gave 53% of a layer's outputs off by up to 0.52 while decoding without a word."""
    env = dict(os.environ)
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    if cap is not None:
        env["ONEDNN_MAX_CPU_ISA"] = cap
    tests = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-c", _BOUNDARY, tests],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    flags = cpu_flags()
    vnni = {
        None: {"avx512_vnni", "avx_vnni", "amx_int8"},
        "AVX2": set(),
        "AVX512_CORE": set(),
        "AVX2_VNNI": {"avx_vnni"},
        "AVX512_CORE_VNNI": {"avx512_vnni", "avx_vnni"},
    }[cap]
    # oneDNN with VNNI multiplies exactly; without it, it saturates at the extremes, and the gate sees which
    assert (seen["worst"] == 0.0) == bool(vnni & flags), seen
    assert seen["exact"] == (seen["worst"] == 0.0), seen
    assert seen["worst"] == 0.0 or seen["worst"] > 30000, seen  # a clipped pair: 64770 - 32767 at the least
    if seen["exact"]:
        assert seen["refusals"] == [] and seen["layer_error"] < 1e-2, seen
    else:
        assert len(seen["refusals"]) == 2 and seen["layer_error"] is None, seen
        for refusal in seen["refusals"]:
            assert "\n" not in refusal and "needs VNNI (avx512_vnni, avx_vnni or AMX)" in refusal, refusal
            assert "use --quantize int8" in refusal, refusal


def test_w8a8_where_it_is_not_exact_is_refused_before_any_layer_is_made(monkeypatch):
    """The gate's refusal, faked on any machine: the CLI's check, the Python API's `quantize`, and a layer."""
    import flashdraft.kernels.quantize as quantize_module

    monkeypatch.setattr(quantize_module, "w8a8_exact", lambda: False)
    monkeypatch.setattr(quantize_module, "w8a8_available", lambda: True)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    with pytest.raises(
        QuantizeError, match=r"^--quantize w8a8 needs VNNI .*which this CPU lacks: .*saturate"
    ):
        check_quantize("w8a8", torch.bfloat16, torch.device("cpu"))
    model = tiny_model("llama").to(torch.bfloat16)
    with pytest.raises(QuantizeError, match="needs VNNI"):
        quantize(model, "w8a8")
    with pytest.raises(QuantizeError, match="needs VNNI"):
        W8A8Linear(nn.Linear(8, 4))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    with pytest.raises(QuantizeError, match="this CPU lacks or ONEDNN_MAX_CPU_ISA=AVX2 hides from oneDNN"):
        check_quantize("w8a8", None, torch.device("cpu"))
    # int8 weight-only is what the refusal points to: it never multiplies bytes by bytes, so it stays offered
    check_quantize("int8", None, torch.device("cpu"))
