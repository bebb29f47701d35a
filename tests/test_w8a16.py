"""--quantize w8a16: int8 weights, each row held as 16-bit integers and multiplied in integers (w8a16_cpp.py). A layer
is that arithmetic; a row gets the same bits whatever rows share the call and whichever kernel runs it, eager and
compiled; layers of one input are one kernel call in a compiled graph; DFlash decodes what plain decoding of the
same model decodes; a CPU without the kernel is refused in one line."""

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
    needs_kernel,
    tiny_model,
)
from flashdraft import Target
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.kernels import w8a16_cpp
from flashdraft.kernels.plan import check_quantize
from flashdraft.kernels.quantize import QuantizeError, W8A16Linear, quantization_of, quantize

needs_w8a16 = needs_kernel(w8a16_cpp.prepare, "avx2 fma", "the w8a16 kernel (and a C++ compiler)")


def reference(layer: W8A16Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's arithmetic spelled out: each row scaled to 16-bit integers by its absmax, the integer product
    with the weight (exact in float64 at these sizes), the two scales, the bias."""
    rows = x.reshape(-1, x.shape[-1]).float()
    top = rows.abs().amax(dim=1, keepdim=True)
    codes = torch.round(rows * (w8a16_cpp.HALF / top))
    assert codes.abs().max() <= w8a16_cpp.HALF
    out = (
        (codes.double() @ layer.weight_int8.double().T)
        * (top.double() / w8a16_cpp.HALF)
        * layer.scales.double()
    )
    if layer.bias is not None:
        out = out + layer.bias.double()
    return out.float().reshape(*x.shape[:-1], layer.out_features)


def drafter(model: nn.Module) -> DFlashDraftModel:
    return (
        DFlashDraftModel.for_target(model.config, num_layers=1, block_size=6, mask_token_id=VOCAB - 1, seed=3)
        .eval()
        .to(torch.bfloat16)
    )


@needs_w8a16
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_w8a16_layer_is_the_integer_product_of_each_row_s_16_bit_codes(dtype):
    """Widths that fill no whole tile (100 inputs, 40 outputs), a bias; zeros, NaN and inf rows."""
    torch.manual_seed(0)
    linear = nn.Linear(100, 40, bias=True).to(dtype)
    layer = W8A16Linear(linear, compute_dtype=dtype)
    x = torch.randn(5, 3, 100, dtype=dtype)
    got = layer(x)
    assert got.shape == (5, 3, 40) and got.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), reference(layer, x), rtol=tol, atol=tol)
    # the weight as int8 wants it: per output channel, absmax / 127, each within half a step; the packing undone
    dequantized = layer.weight_int8.float() * layer.scales[:, None]
    assert ((dequantized - linear.weight.float()).abs() <= layer.scales[:, None] / 2 + 1e-6).all()
    assert torch.equal(w8a16_cpp.unpack(*w8a16_cpp.pack(layer.weight_int8)[:1], 40, 100), layer.weight_int8)
    # zeros give the bias; a NaN or inf in a row gives NaN outputs (never finite garbage the engine would take)
    zeros = layer(torch.zeros(1, 100, dtype=dtype))
    torch.testing.assert_close(zeros.float(), linear.bias[None].float(), rtol=tol, atol=tol)
    bad = torch.randn(3, 100, dtype=dtype)
    bad[1, 5], bad[2, 99] = float("nan"), float("inf")
    out = layer(bad)
    assert out[0].isfinite().all() and out[1].isnan().all() and out[2].isnan().all()


@needs_w8a16
def test_a_row_gets_its_bits_at_any_row_count_from_either_kernel():
    """Each row quantized alone and summed in integers: a row's output does not depend on the rows beside it (a
    scale over the whole call would break it: the outlier row), nor on which kernel serves the call (vpdpbusd for
    few rows, AMX's tiles for more where the CPU has them), nor on how far ahead the kernels prefetch."""
    torch.manual_seed(1)
    layer = W8A16Linear(nn.Linear(576, 1000).to(torch.bfloat16))
    x = torch.randn(21, 576, dtype=torch.bfloat16)
    x[3] *= 50
    thresholds = (4, 64, 0) if w8a16_cpp.kernels() == "avx512_vnni+amx" else (4,)
    try:
        outputs = []
        for code_rows in thresholds:
            for ahead in (0, w8a16_cpp.PREFETCH, 64, 40000):
                w8a16_cpp.set_vnni_rows(code_rows)
                w8a16_cpp.set_prefetch(ahead)
                setting = f"threshold {code_rows}, prefetch {ahead}"
                together = layer(x)
                for i in (0, 3, 7, 20):
                    assert torch.equal(together[i : i + 1], layer(x[i : i + 1])), f"row {i}, {setting}"
                for rows in (2, 3, 5, 8, 9, 16):
                    assert torch.equal(layer(x[:rows]), together[:rows]), f"{rows} rows, {setting}"
                outputs.append(together)
    finally:
        w8a16_cpp.set_vnni_rows(4)
        w8a16_cpp.set_prefetch(w8a16_cpp.PREFETCH)
    assert all(torch.equal(outputs[0], out) for out in outputs)
    torch.testing.assert_close(outputs[0].float(), reference(layer, x), rtol=1e-2, atol=1e-2)


@needs_w8a16
def test_compiled_w8a16_layers_of_one_input_are_one_call_and_keep_a_row_s_bits():
    """Compiled as the engine compiles a verify (frozen, rows symbolic): q / k / v of one input are one kernel call,
    gate / up another (the freezing pass concatenates their packed weights), a layer of another input its own; every
    row's outputs are the same bits at 1 to 17 rows and the layers' arithmetic. Two layers whose widths fill no
    whole tile stay apart (the first one's padding would shift the second one's outputs)."""
    from torch._dynamo.utils import counters

    from flashdraft.engine.compiled import compile_whole
    from flashdraft.kernels.plan import compile_options

    torch.manual_seed(0)
    q, k, v, o = (W8A16Linear(nn.Linear(576, n, bias=False).to(torch.bfloat16)) for n in (576, 192, 192, 576))
    gate, up = (W8A16Linear(nn.Linear(576, 1536, bias=False).to(torch.bfloat16)) for _ in range(2))
    odd, other = (W8A16Linear(nn.Linear(64, n, bias=False).to(torch.bfloat16)) for n in (40, 24))
    layers = nn.ModuleList([q, k, v, o, gate, up, odd, other]).eval()

    def step(inputs):
        x, h, y, z = inputs
        return [q(x), k(x), v(x), o(z), gate(h), up(h), odd(y), other(y)]

    with torch._inductor.config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        counters.clear()
        compiled = compile_whole(step, compile_options(torch.device("cpu")), weights=layers)
        x = [torch.randn(17, n, dtype=torch.bfloat16) for n in (576, 576, 64, 576)]
        with torch.no_grad():
            alone = first_rows_symbolic(compiled, x, 1)
            for rows in (2, 3, 5, 8, 17):
                together = first_rows_symbolic(compiled, x, rows)
                for i, (one, many, layer) in enumerate(zip(alone, together, layers, strict=True)):
                    t = x[0] if i < 3 else x[3] if i == 3 else x[1] if i < 6 else x[2]
                    assert torch.equal(many[:1], one), f"layer {i} at {rows} rows"
                    torch.testing.assert_close(many.float(), reference(layer, t[:rows]), rtol=1e-2, atol=1e-2)
            with torch.profiler.profile() as prof:  # the graph made: its calls
                first_rows_symbolic(compiled, x, 4)
    calls = [e.name for e in prof.events() if e.name == "flashdraft::w8a16_linear"]
    assert len(calls) == 5  # q / k / v, o, gate / up, and the two narrow ones apart


@needs_w8a16
@pytest.mark.parametrize("arch", ["llama", "qwen3", HYBRID_ARCHS[0]])
def test_dflash_on_a_w8a16_target_is_plain_decoding_of_it(arch):
    """Greedy and seeded sampling, a random drafter and an oracle, eager; a hybrid target too."""
    model = hybrid_model(arch, seed=2) if arch in HYBRID_ARCHS else tiny_model(arch, seed=2)
    model = model.to(torch.bfloat16)
    assert quantize(model, "w8a16") > 0
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.get_output_embeddings(), W8A16Linear)
    assert quantization_of(model) == "w8a16"
    target = Target(model)
    assert target.quantize == "w8a16"
    assert_dflash_is_plain_decoding(target, drafter(model))


@needs_w8a16
def test_compiled_dflash_on_a_w8a16_target_is_plain_decoding_of_it():
    """`--quantize w8a16 --compile`: one row and rows joining and leaving a batch."""
    from flashdraft.engine.compiled import compile_verify

    model = tiny_model("llama", seed=2).to(torch.bfloat16)
    quantize(model, "w8a16")
    target = Target(model)
    assert compile_verify(target) is None
    draft = drafter(model)
    assert_dflash_is_plain_decoding(target, draft)
    assert_batched_dflash_is_plain_decoding(target, draft, max_batch_size=3)


@needs_w8a16
def test_a_w8a16_head_over_a_drafter_s_vocabulary_keeps_each_row_s_bits():
    """select_rows (vocab.py): the head over some tokens gives those tokens' logits bit for bit."""
    torch.manual_seed(4)
    head = W8A16Linear(nn.Linear(96, 300, bias=False).to(torch.bfloat16))
    ids = torch.tensor([0, 5, 17, 64, 299, 100])
    part = head.select_rows(ids)
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    assert part.out_features == 6 and torch.equal(part(x), head(x)[:, ids])


@needs_w8a16
def test_what_w8a16_cannot_run_is_refused_in_one_line():
    cpu = torch.device("cpu")
    check_quantize("w8a16", None, cpu)
    check_quantize("w8a16", torch.float32, cpu)
    with pytest.raises(QuantizeError, match="--quantize w8a16 runs bf16 activations .* not float16"):
        check_quantize("w8a16", torch.float16, cpu)
    with pytest.raises(QuantizeError, match="for CPUs"):
        check_quantize("w8a16", None, torch.device("cuda"))


@pytest.mark.parametrize(
    ("features", "lacks"),
    [
        ("aarch64 asimd asimddp bf16 i8mm sve", "avx2 and fma"),  # a Graviton 3: NEON's sdot and i8mm, no x86
        ("x86_64 avx f16c sse4_2", "avx2 and fma"),  # a Sandy Bridge
        ("x86_64 avx avx2 sse4_2", "fma"),  # avx2 without FMA (a few VIA / Zhaoxin CPUs)
    ],
)
def test_a_cpu_without_w8a16_s_features_is_refused_naming_them_before_any_build(monkeypatch, features, lacks):
    """On any machine, the CPU's features faked (cpu_info's line, as an Arm CPU's /proc/cpuinfo gives it): refused
    in one line naming what it lacks, nothing built (no x86 intrinsics reach an Arm compiler), no layer made."""
    from flashdraft.kernels import cpp_build, cpu_info

    monkeypatch.setattr(cpu_info, "cpu_features", lambda: features)
    monkeypatch.setattr(w8a16_cpp, "_isa", None)  # not prepared yet in this (faked) process
    builds = []
    monkeypatch.setattr(cpp_build, "load", lambda *args: builds.append(args))
    assert " and ".join(w8a16_cpp.missing_features()) == lacks
    arm = " \\(an Arm kernel would multiply with NEON's sdot or i8mm's smmla: none is written\\)"
    want = f"^--quantize w8a16 needs a CPU with avx2 and FMA .*which this one lacks {lacks}"
    want += (arm if features.startswith("aarch64") else "") + ": "
    with pytest.raises(QuantizeError, match=want + "use --quantize int8$"):
        check_quantize("w8a16", None, torch.device("cpu"))
    # quantize() called directly: refused, not layers whose operator has no kernel
    with pytest.raises(QuantizeError, match=want):
        quantize(tiny_model("llama").to(torch.bfloat16), "w8a16")
    assert builds == [] and w8a16_cpp.kernels() is None


@needs_w8a16
def test_every_kernel_the_cpu_has_serves_and_all_give_the_same_bits():
    """avx2's vpmaddwd on 16-bit codes, AVX-VNNI's and avx512_vnni's vpdpbusd and AMX's tiles on split codes: each
    kernel this CPU has gives every row the bits of the others and of the layer's arithmetic spelled out in float64
    (the integer product exact, rounded once), at any row count, in bf16 and fp32 rows; widths that fill no whole
    tile, inputs past one int32 chunk of avx2's sums (8960: Qwen2.5-1.5B's down projection), a bias, an outlier row.
    A kernel the CPU's features promise is among them (a wrong gate would leave a CPU on a lesser one)."""
    import conftest

    wanted = {"avx2": "avx2 fma", "avx_vnni": "avx_vnni", "avx512_vnni": "avx512_vnni avx512_bf16",
              "avx512_vnni+amx": "amx_int8 avx512_vnni avx512_bf16"}  # fmt: skip
    have = w8a16_cpp.available_kernels()
    for name, needs in wanted.items():
        if name != "avx512_vnni+amx" or torch.cpu._init_amx():  # AMX: also granted by the kernel
            assert (name in have) == conftest.has_features(needs), (name, have)
    assert w8a16_cpp.kernels() == have[-1]  # the best serves
    torch.manual_seed(2)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for k, n in ((100, 40), (576, 200), (8960, 48)):
                layer = W8A16Linear(nn.Linear(k, n).to(dtype), compute_dtype=dtype)
                x = torch.randn(19, k, dtype=dtype)
                x[3] *= 50
                exact = exact_product(layer, x)
                for name in have:
                    assert w8a16_cpp.set_kernel(name) == name
                    together = layer(x)
                    assert torch.equal(together, exact), f"{name}, {dtype}, {k} x {n}"
                    for rows in (1, 2, 3, 5, 9):
                        assert torch.equal(layer(x[:rows]), together[:rows]), f"{name}, {rows} rows"
    finally:
        w8a16_cpp.set_kernel(None)
    with pytest.raises(ValueError, match="does not run here"):
        w8a16_cpp.set_kernel("neon")


def exact_product(layer: W8A16Linear, x: torch.Tensor) -> torch.Tensor:
    """The kernels' arithmetic to the bit: each row's codes as the kernel rounds them (x * (32639 / absmax), to
    nearest even), the integer product S exact in float64, rounded once to fp32, times the row's scale and the
    column's, plus the bias, rounded to the row's dtype."""
    rows = x.reshape(-1, x.shape[-1]).float()
    top = rows.abs().amax(dim=1, keepdim=True)
    codes = torch.round(rows * (torch.tensor(float(w8a16_cpp.HALF)) / top)).double()
    whole = (codes @ layer.weight_int8.double().T).float()
    out = whole * (top / w8a16_cpp.HALF) * layer.scales
    if layer.bias is not None:
        out = out + layer.bias
    return out.to(x.dtype)


@needs_w8a16
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_dflash_on_an_fp32_w8a16_target_is_plain_decoding_with_each_kernel(compiled):
    """The avx2 CPUs' w8a16 (fp32 rows, the plan's default there, around the attention kernel in fp32), with each
    kernel this CPU has serving in turn: greedy and sampled DFlash, one row and a batch, emit plain decoding's
    tokens."""
    from flashdraft.engine.compiled import compile_verify
    from flashdraft.kernels.plan import make_plan

    model = tiny_model("qwen3", seed=2)
    quantize(model, "w8a16")  # an fp32 model: fp32 rows
    plan = make_plan(torch.device("cpu"), torch.float32, "w8a16", compiled)
    target = Target(model, plan=plan)
    assert target.plan.row_invariant and target.plan.attention_kernel, target.plan.describe()
    if compiled:
        assert compile_verify(target) is None
    draft = drafter(model).float()
    try:
        for name in w8a16_cpp.available_kernels():
            w8a16_cpp.set_kernel(name)
            assert_dflash_is_plain_decoding(target, draft)
        assert_batched_dflash_is_plain_decoding(target, draft, max_batch_size=3)
    finally:
        w8a16_cpp.set_kernel(None)


@needs_w8a16
def test_a_process_without_w8a16_layers_compiles_frozen_graphs():
    """The freezing pass that joins w8a16 layers is registered only once the kernel is built (tracing its patterns
    runs the operator): a fresh process compiling another model's graph never needs the kernel (an int8 bench
    failed there when the patterns were registered at every first compile)."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from torch import nn\n"
        "from flashdraft.kernels import w8a16_cpp\n"
        "from flashdraft.engine.compiled import compile_whole\n"
        "from flashdraft.kernels.plan import compile_options\n"
        "layer = nn.Linear(64, 32).to(torch.bfloat16).eval()\n"
        "step = compile_whole(lambda x: layer(x), compile_options(torch.device('cpu')), weights=layer)\n"
        "with torch.no_grad():\n"
        "    out = step(torch.randn(3, 64, dtype=torch.bfloat16))\n"
        "assert out.shape == (3, 32) and w8a16_cpp.kernels() is None\n"
        "print('compiled')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-2000:]
