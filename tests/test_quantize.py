"""--quantize int8 / fp16: weight-only int8 linear layers (bf16 activations) and fp16 ones (fp32 activations) decode
exactly what plain decoding of the same quantized model decodes; their layers give a row the same bits whatever rows
share the call; what a scheme cannot run is refused in one line."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flashdraft.kernels.quantize as quantize_module
from conftest import (
    HYBRID_ARCHS,
    VOCAB,
    OracleProposer,
    assert_batched_dflash_is_plain_decoding,
    assert_dflash_is_plain_decoding,
    first_rows_symbolic,
    hybrid_model,
    skip_without_kernel,
    tiny_model,
)
from flashdraft import Target, generate, generate_ar
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.kernels.plan import CpuOffer, check_quantize, make_plan
from flashdraft.kernels.quantize import (
    PREFILL_GEMM_ROWS,
    Fp16Linear,
    Int8Linear,
    QuantizeError,
    _fp16_row_counts,
    fp16_available,
    prefill,
    quantize,
)

needs_fbgemm = pytest.mark.skipif(not fp16_available(), reason="fbgemm's fp16 kernel (x86 builds of torch)")
SCHEMES = ["int8", pytest.param("fp16", marks=needs_fbgemm)]


def quantized(arch: str, seed: int = 0, scheme: str = "int8") -> nn.Module:
    model = hybrid_model(arch, seed=seed) if arch in HYBRID_ARCHS else tiny_model(arch, seed=seed)
    model = model.to(torch.bfloat16 if scheme == "int8" else torch.float32)
    quantize(model, scheme)
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


@needs_fbgemm
def test_fp16_linear_is_the_linear_of_its_rounded_weights():
    torch.manual_seed(0)
    linear = nn.Linear(48, 40, bias=True)
    q = Fp16Linear(linear)
    x = torch.randn(5, 3, 48)
    expected = x @ linear.weight.detach().half().float().T + linear.bias.detach()
    torch.testing.assert_close(q(x), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(q.weight, linear.weight.detach().half().float())
    assert (
        torch.equal(q.bias, linear.bias.detach()) and Fp16Linear(nn.Linear(48, 40, bias=False)).bias is None
    )
    assert q(x).shape == (5, 3, 40) and q(x).dtype == torch.float32
    strided = torch.randn(48, 6).T
    assert torch.equal(q(strided), q(strided.contiguous()))


@needs_fbgemm
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (64, 200)])
def test_fp16_layer_gives_a_row_its_bits_at_any_row_count(shape):
    """fbgemm's 1- and 2-row kernels round otherwise than its 3- to 6-row ones: without the padding to a row count
    whose blocks are all 3-6 rows high, 1, 2, 7, 14, 31, 32, ... rows differ from a one-row call."""
    torch.manual_seed(1)
    q = Fp16Linear(nn.Linear(*shape))
    x = torch.randn(70, shape[0])
    alone = torch.cat([q(x[i : i + 1]) for i in range(len(x))])
    for m in range(1, len(x) + 1):
        assert torch.equal(q(x[:m]), alone[:m]), m
    table = _fp16_row_counts()
    # padding only ever adds rows: on avx2 one row is padded to 3 or more; on an avx512 EPYC fbgemm rounds every row
    # count alike, the probe finds nothing to pad, and the rows above keep their bits all the same
    assert all(table[m] >= m for m in range(1, len(table)))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_replaces_every_linear_and_the_head(scheme):
    model = quantized("llama", scheme=scheme)
    kind = Int8Linear if scheme == "int8" else Fp16Linear
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.get_output_embeddings(), kind)
    assert isinstance(model.get_input_embeddings(), nn.Embedding)  # the embedding keeps the model's dtype
    target = Target(model)
    assert target.quantize == scheme
    assert target.lm_head_logits(torch.randn(2, target.hidden_size)).dtype == torch.float32


# Jamba is left out: in bf16, with or without int8, one of these sampled runs parts from plain sampling (its batched
# verify rounds otherwise than a one-token step: the near-tie of bench/mismatches.py, here on a sampling threshold).
def test_only_a_prompt_s_prefill_takes_int8_layers_through_a_bf16_gemm(monkeypatch):
    """quantize.prefill: an int8 layer given PREFILL_GEMM_ROWS rows or more of a prompt multiplies them by its
    dequantized weight in one bf16 GEMM; fewer rows, and every call outside a prefill (a wide verify included),
    take the int8 kernel. After a long prompt, DFlash still emits plain decoding's tokens, greedy and seeded."""
    torch.manual_seed(2)
    layer = Int8Linear(nn.Linear(96, 64).to(torch.bfloat16))
    x = torch.randn(PREFILL_GEMM_ROWS, 96, dtype=torch.bfloat16)
    kernel = torch.ops.aten._weight_int8pack_mm(x, layer.weight_int8, layer.scales) + layer.bias
    assert torch.equal(layer(x), kernel)
    with prefill():
        wide, narrow = layer(x), layer(x[1:])
    assert torch.equal(narrow, kernel[1:])
    assert torch.equal(wide, F.linear(x, layer.weight_int8.to(torch.bfloat16)) * layer.scales + layer.bias)
    torch.testing.assert_close(wide.float(), kernel.float(), rtol=2e-2, atol=2e-2)

    calls = []  # (rows, inside a prefill) of every int8 layer call
    forward = Int8Linear.forward

    def spy(self, inputs):
        calls.append((inputs.reshape(-1, inputs.shape[-1]).shape[0], quantize_module._PREFILL.get()))
        return forward(self, inputs)

    monkeypatch.setattr(Int8Linear, "forward", spy)
    target = Target(quantized("llama", seed=2))
    draft = DFlashDraftModel.for_target(
        target.model.config, num_layers=1, block_size=6, mask_token_id=VOCAB - 1, seed=3
    ).to(torch.bfloat16)
    prompt_length = PREFILL_GEMM_ROWS + 8
    ids = torch.randint(3, VOCAB, (1, prompt_length), generator=torch.Generator().manual_seed(4))
    for temperature in (0.0, 0.9):
        plain = generate_ar(target, ids, 20, temperature=temperature, seed=1)
        got = generate(target, draft, ids, 20, temperature=temperature, seed=1, block_size=6)
        assert got.new_tokens == plain.new_tokens, temperature
    reference = ids[0].tolist() + generate_ar(target, ids, 60).new_tokens
    oracle = OracleProposer(reference, VOCAB, block_size=PREFILL_GEMM_ROWS + 4, rng=random.Random(0))
    assert generate(target, oracle, ids, 60).new_tokens == reference[prompt_length:]
    assert {rows for rows, inside in calls if inside} == {
        prompt_length,
        1,
    }  # the prompt; its last token's head
    assert any(
        rows >= PREFILL_GEMM_ROWS and not inside for rows, inside in calls
    )  # wide verifies: int8 kernel


def test_a_prompt_s_int8_layers_keep_their_bf16_weight_within_the_model_s_room(monkeypatch):
    """`quantize` gives a bf16 model's int8 layers, in order, room to keep the bf16 weight a prompt runs on, up to
    PREFILL_WEIGHT_BYTES; a layer with room makes it at its first prefill (not at a decode step), reuses it, and gives
    a prompt's rows the product of that weight; a layer without room converts per call as before. A copy, or a
    layer over some output rows (a drafter's vocabulary), makes its own. Prefills and DFlash stay exact."""
    model = tiny_model("llama", seed=5).to(torch.bfloat16)
    sizes = [2 * m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)]
    room = sum(sizes[:3]) + 1  # the first three layers fit, the fourth does not
    monkeypatch.setattr(quantize_module, "PREFILL_WEIGHT_BYTES", room)
    quantize(model, "int8")
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    kept = [m.keeps_prefill_weight for m in layers]
    assert kept[:3] == [True] * 3 and not kept[3]
    assert sum(s for s, k in zip(sizes, kept, strict=True) if k) <= room
    assert all(m._prefill_weight is None for m in layers)

    target = Target(model)
    ids = torch.randint(3, VOCAB, (1, PREFILL_GEMM_ROWS + 5), generator=torch.Generator().manual_seed(6))
    plain = generate_ar(target, ids, 12)  # its prefill, then one-token steps
    made = [m._prefill_weight for m in layers]
    assert all((w is not None) == k for w, k in zip(made, kept, strict=True))
    again = generate_ar(target, ids, 12)
    assert again.new_tokens == plain.new_tokens
    assert all(m._prefill_weight is w for m, w in zip(layers, made, strict=True))  # made once

    layer = layers[0]
    x = torch.randn(PREFILL_GEMM_ROWS, layer.in_features, dtype=torch.bfloat16)
    weight = layer.weight_int8.to(torch.bfloat16)
    if made[0].is_mkldnn:  # the scales in the GEMM's epilogue
        product = torch.ops.mkldnn._linear_pointwise.binary(x, layer.scales[None], made[0], None, "mul")
    else:
        product = F.linear(x, weight) * layer.scales
    with prefill():
        wide = layer(x)
    assert torch.equal(wide, product + (0 if layer.bias is None else layer.bias))
    exact = (x.double() @ weight.double().T) * layer.scales.double()
    torch.testing.assert_close(product.double(), exact, rtol=1e-2, atol=1e-2)
    part = layer.select_rows(torch.tensor([0, 2, 5]))
    assert part._prefill_weight is None and layer._prefill_weight is made[0]
    with prefill():
        assert torch.equal(part(x), wide[:, [0, 2, 5]])

    draft = DFlashDraftModel.for_target(
        model.config, num_layers=1, block_size=6, mask_token_id=VOCAB - 1, seed=3
    )
    got = generate(target, draft.to(torch.bfloat16), ids, 12, block_size=6)
    assert got.new_tokens == plain.new_tokens


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
def test_dflash_on_a_quantized_target_is_plain_decoding_of_it(arch, scheme):
    """Greedy and seeded sampling: a random drafter (most drafts rejected, rollbacks) and an oracle (long accepts)
    emit exactly what plain decoding of the same quantized model emits."""
    model = quantized(arch, seed=2, scheme=scheme)
    target = Target(model)
    draft = DFlashDraftModel.for_target(
        model.config, num_layers=1, block_size=6, mask_token_id=VOCAB - 1, seed=3
    ).eval()
    if scheme == "int8":
        draft = draft.to(torch.bfloat16)
    assert_dflash_is_plain_decoding(target, draft)


def test_what_int8_cannot_run_is_refused():
    cpu = torch.device("cpu")
    check_quantize(None, torch.float32, cpu)
    check_quantize("int8", None, cpu)
    check_quantize("int8", torch.bfloat16, cpu)
    with pytest.raises(QuantizeError, match="must be one of int8, w8a8, w8a16, fp16, got 'int4'"):
        check_quantize("int4", None, cpu)
    check_quantize("int8", torch.float32, cpu)  # fp32 activations: the compiled path's int8
    # int8 runs bf16 activations, and fp32 ones compiled where the CPU has no bf16 instructions (the plan's choice)
    for bf16_cpu in (True, False):
        offer = CpuOffer(bf16_math=bf16_cpu, untested_torch=None)
        assert make_plan(cpu, None, "int8", offer=offer).dtype == torch.bfloat16
        assert make_plan(cpu, None, "fp16", compile=True, offer=offer).dtype == torch.float32
        want = torch.bfloat16 if bf16_cpu else torch.float32
        assert make_plan(cpu, None, "int8", compile=True, offer=offer).dtype == want
    with pytest.raises(QuantizeError, match="runs bf16 activations .* not float16"):
        check_quantize("int8", torch.float16, cpu)
    with pytest.raises(QuantizeError, match="for CPUs"):
        check_quantize("int8", None, torch.device("cuda"))
    with pytest.raises(QuantizeError, match="for CPUs"):
        check_quantize("fp16", None, torch.device("cuda"))
    if fp16_available():
        check_quantize("fp16", None, cpu)
        check_quantize("fp16", torch.float32, cpu)
        with pytest.raises(QuantizeError, match="runs fp32 activations .* not bfloat16"):
            check_quantize("fp16", torch.bfloat16, cpu)


def test_an_int8_target_is_priced_apart():
    """The cost model is cached per model, dtype and threads: int8 weights get a price list of their own."""
    from flashdraft.engine.measure import cost_key

    plain = Target(tiny_model("llama").to(torch.bfloat16))
    int8 = Target(quantized("llama"))
    draft = DFlashDraftModel.for_target(
        plain.model.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1
    )
    assert plain.quantize is None and int8.quantize == "int8"
    assert cost_key(int8, draft) == {**cost_key(plain, draft), "quantize": "int8"}


def test_an_fp32_int8_layer_is_the_kernel_s_product_eager_and_compiled():
    """With fp32 activations an int8 layer is (x @ int8 weight) x scale in fp32: eager it dequantizes, compiled
    (`--quantize int8 --dtype float32 --compile`) inductor's C++ GEMM template runs it from the int8 weights (the
    fp32 x int8 micro-kernel compiled.py registers), and both agree with ATen's int8 kernel to fp32 rounding."""
    from torch._dynamo.utils import counters

    from flashdraft.engine.compiled import compile_whole
    from flashdraft.kernels.plan import compile_options

    torch.manual_seed(0)
    q = Int8Linear(nn.Linear(96, 200, bias=True), compute_dtype=torch.float32).eval()
    assert q.scales.dtype == torch.float32 and q.weight.dtype == torch.float32
    x = torch.randn(5, 96)
    want = torch.ops.aten._weight_int8pack_mm(x, q.weight_int8, q.scales) + q.bias
    torch.testing.assert_close(q(x), want, rtol=1e-5, atol=1e-5)
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        counters.clear()
        step = compile_whole(lambda rows: q(rows), compile_options(torch.device("cpu")), weights=q)
        got = step(x)
        assert counters["inductor"]["cpp_templated_kernel_counter"] == 1  # the template, not ATen's kernel
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compiled_fp32_int8_layers_give_a_row_its_bits_at_any_row_count():
    """Row invariance of the compiled int8 layers with fp32 activations at SmolLM2's shapes, the rows symbolic as the
    engine compiles them: a row's outputs are the same bits whether 1 or up to 17 rows share the call (the template
    sums each row alone, in one order). The verify as a whole is not batch-invariant in fp32: its attention products
    go to ATen's GEMMs (benchmarks/README.md)."""
    from flashdraft.engine.compiled import compile_whole
    from flashdraft.kernels.plan import compile_options

    torch.manual_seed(0)
    # each layer its own input, so none is fused with another (`_register_int8_concat_linear`); q / k / v as one
    # (768) and gate / up as one (3072) are what the engine's graphs run
    shapes = [(576, 576), (576, 192), (576, 768), (576, 1536), (576, 3072), (1536, 576), (576, 4000)]
    layers = nn.ModuleList(
        Int8Linear(nn.Linear(i, o, bias=False), compute_dtype=torch.float32) for i, o in shapes
    ).eval()
    step = compile_whole(
        lambda inputs: [layer(x) for layer, x in zip(layers, inputs, strict=True)],
        compile_options(torch.device("cpu")),
        weights=layers,
    )
    x = [torch.randn(17, i) for i, _ in shapes]
    with torch.no_grad():
        alone = first_rows_symbolic(step, x, 1)
        for rows in (2, 3, 4, 5, 8, 16, 17):
            together = first_rows_symbolic(step, x, rows)
            for (i, o), one, many in zip(shapes, alone, together, strict=True):
                assert torch.equal(many[:1], one), f"{i} -> {o} at {rows} rows"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_int8_layers_reading_one_input_are_one_gemm_with_their_values(dtype):
    """Frozen, the int8 layers that read the same rows (q / k / v, gate / up) are one GEMM over their weights
    concatenated (`_register_int8_concat_linear`): 2 template kernels for 5 layers, each output its layer's product
    (ATen's int8 kernel, to the rows' rounding), a row the same bits at any row count. bf16 rows where AMX or the
    pair kernel serves them (cpu_gemm.bf16_rows_kernel)."""
    from torch._dynamo.utils import counters

    from flashdraft.engine.compiled import compile_whole
    from flashdraft.kernels.inductor_passes import int8_concat_row_dtypes
    from flashdraft.kernels.plan import compile_options
    from flashdraft.kernels.static_buffers import symbolic_sizes

    skip_without_kernel(
        dtype in int8_concat_row_dtypes(), "avx512_bf16|amx_bf16", f"one GEMM of {dtype} rows"
    )
    torch.manual_seed(1)
    outs = (96, 32, 32, 160, 160)  # q, k, v; gate, up
    layers = nn.ModuleList(Int8Linear(nn.Linear(96, o, bias=False), compute_dtype=dtype) for o in outs).eval()

    def block(x: torch.Tensor) -> list[torch.Tensor]:
        q, k, v = (layer(x) for layer in layers[:3])
        gate, up = (layer(x + 1) for layer in layers[3:])
        return [q, k, v, gate, up]

    x = torch.randn(9, 96).to(dtype)
    want = [
        torch.ops.aten._weight_int8pack_mm(rows, layer.weight_int8, layer.scales)
        for rows, layer in zip([x] * 3 + [x + 1] * 2, layers, strict=True)
    ]
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        counters.clear()
        step = compile_whole(block, compile_options(torch.device("cpu")), weights=layers)

        def run(rows: int) -> list[torch.Tensor]:
            part = x[:rows].clone()
            symbolic_sizes(part, 0)
            return step(part)

        alone = run(1)
        assert counters["inductor"]["cpp_templated_kernel_counter"] == 2  # q/k/v and gate/up, one GEMM each
        together = run(9)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for got, expected in zip(together, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    for one, many in zip(alone, together, strict=True):
        assert torch.equal(many[:1], one)


def test_compiled_dflash_on_an_fp32_int8_target_is_plain_decoding_of_it():
    """`--quantize int8 --dtype float32 --compile`: greedy and seeded sampling, a random drafter and an oracle,
    one row and rows joining and leaving a batch, all emit plain decoding of the same compiled int8 model."""
    from flashdraft.engine.compiled import compile_verify

    model = tiny_model("llama", seed=2)
    quantize(model, "int8")
    target = Target(model)
    assert compile_verify(target) is None
    draft = DFlashDraftModel.for_target(
        model.config, num_layers=1, block_size=6, mask_token_id=VOCAB - 1, seed=3
    ).eval()
    assert_dflash_is_plain_decoding(target, draft)
    assert_batched_dflash_is_plain_decoding(target, draft, max_batch_size=3)


@needs_fbgemm
def test_batched_dflash_on_an_fp16_target_is_plain_decoding_of_each_row():
    """Rows of different lengths, joining as others finish: each row's tokens are plain decoding of that row alone
    on the same fp16 model, greedy and seeded sampling."""
    model = quantized("llama", seed=4, scheme="fp16")
    draft = DFlashDraftModel.for_target(
        model.config, num_layers=1, block_size=5, mask_token_id=VOCAB - 1, seed=6
    ).eval()
    assert_batched_dflash_is_plain_decoding(Target(model), draft, max_batch_size=3)


@needs_fbgemm
def test_compile_leaves_an_fp16_target_eager():
    from flashdraft.engine.compiled import compile_verify

    target = Target(quantized("llama", scheme="fp16"))
    note = compile_verify(target)
    assert note is not None and "fp16" in note and "eagerly" in note
    assert not target.plan.compiled and not target.plan.static_cache


@needs_fbgemm
def test_cli_generate_with_fp16_weights_equals_plain_decoding_of_them(tmp_path):
    """`generate --quantize fp16 --compare-ar` on a checkpoint on disk: the fp16 target's DFlash output is its own
    plain decoding's, token for token."""
    import json

    from typer.testing import CliRunner

    from conftest import byte_tokenizer, on_disk
    from flashdraft.cli import app

    vocab = 320  # room for the byte-level tokenizer's 256 bytes and its merges
    tokenizer = byte_tokenizer(["the quick brown fox jumps over the lazy dog."] * 8, vocab)
    saved = on_disk(Target(tiny_model("llama", seed=5, vocab=vocab), tokenizer), tmp_path)
    args = ["generate", "--target", saved["target"], "--draft", saved["draft"], "--quantize", "fp16",
            "--device", "cpu", "--block-size", "4", "--max-new-tokens", "24", "--compare-ar", "--json", "the fox"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{") :])
    assert report["identical_to_ar"] and report["dflash"]["num_new_tokens"] > 0
