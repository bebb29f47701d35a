"""The kernel plan (kernels/plan.py): every kernel choice made in one place, from the device, dtype, quantization,
`--compile`, what the CPU and torch offer and the environment switches; a frozen value the target is prepared by
and the engine reads. Planned here for CPUs this machine is not (a faked offer), so the avx2 rows of the table are
checked on an avx512 machine and the other way round."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import tiny_model
from flashdraft import Target
from flashdraft.engine.compiled import compile_verify
from flashdraft.kernels import plan as plan_module
from flashdraft.kernels.packed_linear import is_packed
from flashdraft.kernels.plan import SHORT_QUERY, CpuOffer, KernelPlan, KernelPlanError, make_plan
from flashdraft.kernels.quantize import QuantizeError

CPU = torch.device("cpu")
# A Zen 3 EPYC: avx2 and fma, no VNNI, no bf16 instructions; its C++ kernels build (g++ is there)
AVX2 = dict(
    bf16_math=False,
    w8a8_exact=False,
    w8a8_compiles=False,
    w8a16=True,
    w8a16_kernels=("avx2",),
    bf16_rows=None,
)
# An Arm CPU (Graviton, Apple silicon under Linux): none of the x86 kernels
ARM = dict(bf16_math=False, w8a8_exact=False, w8a8_compiles=False, w8a16=False, bf16_rows=None)
# A Sapphire Rapids Xeon: AMX
AMX = dict(
    bf16_math=True,
    w8a8_exact=True,
    w8a8_compiles=True,
    w8a16=True,
    bf16_rows="amx",
    w8a16_kernels=("avx2", "avx_vnni", "avx512_vnni", "avx512_vnni+amx"),
)
SWITCHES = (
    "FLASHDRAFT_COMPILE",
    "FLASHDRAFT_FUSED_LAYERS",
    "FLASHDRAFT_ATTENTION",
    "FLASHDRAFT_ATTENTION_TILES",
    "FLASHDRAFT_PACKED_LINEAR",
    "FLASHDRAFT_W8A16_KERNEL",
)


@pytest.fixture(autouse=True)
def no_switches(monkeypatch):
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)


def offer(cpu: dict, **more) -> CpuOffer:
    known = dict(untested_torch=None, attention_kernel=True, attention_tiles=cpu["bf16_rows"] == "amx")
    return CpuOffer(onednn_fp32=True, fp16=True, **{**known, **cpu, **more})


def test_an_avx2_cpu_is_refused_the_schemes_it_cannot_run_exactly_and_compiles_int8_in_fp32():
    avx2 = offer(AVX2)
    with pytest.raises(QuantizeError, match="w8a8 needs VNNI"):
        make_plan(CPU, None, "w8a8", offer=avx2)
    for compile in (False, True):  # w8a16's integer kernel in fp32 rows, eager and compiled
        w8a16 = make_plan(CPU, None, "w8a16", compile=compile, offer=avx2)
        assert w8a16.dtype == torch.float32 and w8a16.attention_kernel and w8a16.row_invariant
        # its layers fused (fp32 too), eager on the static cache as compiled
        assert w8a16.fused_layers and w8a16.static_cache and w8a16.compiled == compile
    no_kernel = make_plan(CPU, None, "w8a16", offer=offer(AVX2, attention_kernel=False))
    assert (
        not no_kernel.fused_layers and not no_kernel.static_cache
    )  # the fused layer calls the attention kernel
    eager = make_plan(CPU, None, "int8", offer=avx2)
    assert eager.dtype == torch.bfloat16 and not eager.compiled and not eager.static_cache
    compiled = make_plan(CPU, None, "int8", compile=True, offer=avx2)
    assert compiled.dtype == torch.float32 and compiled.compiled and compiled.static_cache  # fp32 rows x int8
    assert compiled.bf16_rows is None and compiled.trees_exact  # fp32: no reduced-precision rows to hold
    bf16 = make_plan(CPU, torch.bfloat16, compile=True, offer=avx2)
    assert bf16.compiled and bf16.compiled_cpu_reduced and not bf16.trees_exact  # inductor's own bf16 rows
    fp32 = make_plan(CPU, offer=avx2)
    assert fp32.dtype == torch.float32 and fp32.packed_linears and fp32.attention == SHORT_QUERY
    assert not fp32.attention_kernel and not fp32.attention_tiles  # the C++ kernel serves bf16 only


def test_an_arm_cpu_is_refused_the_x86_schemes_in_one_line_and_runs_the_rest():
    arm = offer(ARM, attention_kernel=False)
    with pytest.raises(QuantizeError, match="^--quantize w8a16 needs a CPU with avx2 and FMA"):
        make_plan(CPU, None, "w8a16", offer=arm)
    with pytest.raises(QuantizeError, match="w8a8 needs VNNI"):
        make_plan(CPU, None, "w8a8", offer=arm)
    plan = make_plan(CPU, offer=arm)
    assert plan.dtype == torch.float32 and not plan.attention_kernel and not plan.row_invariant


def test_an_amx_cpu_runs_every_scheme_and_fuses_a_w8a16_target_s_layers():
    amx = offer(AMX)
    for scheme in ("int8", "w8a8", "w8a16"):
        plan = make_plan(CPU, None, scheme, compile=True, offer=amx)
        assert plan.dtype == torch.bfloat16 and plan.compiled and plan.compile_note is None
        assert plan.fused_layers == (scheme == "w8a16") and plan.trees_exact
        assert plan.attention_kernel and plan.attention_tiles and plan.bf16_rows == "amx"
    eager = make_plan(CPU, None, "w8a16", offer=amx)  # eager: the fused layers on the static cache
    assert eager.fused_layers and eager.static_cache and not eager.compiled


def test_what_compile_cannot_take_decodes_eagerly_with_one_line_saying_why():
    untested = offer(AMX, untested_torch="flashdraft's CPU GEMM kernels are tested with torch 2.13, not 9.9")
    for dtype, scheme in ((torch.bfloat16, None), (None, "int8")):
        plan = make_plan(CPU, dtype, scheme, compile=True, offer=untested)
        assert not plan.compiled and not plan.static_cache and plan.compile_asked
        assert plan.compile_note == (
            "--compile: flashdraft's CPU GEMM kernels are tested with torch 2.13, not 9.9; decoding eagerly"
        )
    assert make_plan(CPU, torch.float32, compile=True, offer=untested).compiled  # fp32 needs no row kernel
    fp16 = make_plan(CPU, None, "fp16", compile=True, offer=offer(AVX2))
    assert not fp16.compiled and "fbgemm's own kernel" in fp16.compile_note
    no_template = offer(AMX, w8a8_compiles=False)
    assert "avx512_vnni or AMX" in make_plan(CPU, None, "w8a8", compile=True, offer=no_template).compile_note


def test_the_six_switches_are_read_by_the_plan(monkeypatch):
    amx = offer(AMX)
    plan = make_plan(CPU, offer=amx)
    assert plan.packed_linears and plan.attention == SHORT_QUERY
    monkeypatch.setenv("FLASHDRAFT_PACKED_LINEAR", "0")
    monkeypatch.setenv("FLASHDRAFT_ATTENTION", "sdpa")
    plan = make_plan(CPU, offer=amx)
    assert not plan.packed_linears and plan.attention == "sdpa" and not plan.attention_kernel
    assert not make_plan(
        CPU, None, "w8a16", offer=amx
    ).fused_layers  # the fused layer calls the attention kernel
    monkeypatch.delenv("FLASHDRAFT_ATTENTION")
    assert make_plan(CPU, None, "w8a16", compile=True, offer=amx).fused_layers
    monkeypatch.setenv("FLASHDRAFT_FUSED_LAYERS", "off")
    assert not make_plan(CPU, None, "w8a16", compile=True, offer=amx).fused_layers
    eager = make_plan(CPU, None, "w8a16", offer=amx)
    assert not eager.fused_layers and not eager.static_cache  # eager without them: the growing cache
    monkeypatch.setenv("FLASHDRAFT_COMPILE", '{"backend": "eager"}')
    assert make_plan(CPU, compile=True, offer=amx).compile_options == {"backend": "eager"}
    monkeypatch.setenv("FLASHDRAFT_COMPILE", "reduce-overhead")
    with pytest.raises(KernelPlanError, match="FLASHDRAFT_COMPILE must be a JSON object"):
        make_plan(CPU, compile=True, offer=amx)
    assert plan_module.switches()["attention_tiles"]
    monkeypatch.setenv("FLASHDRAFT_ATTENTION_TILES", "0")
    assert not plan_module.switches()["attention_tiles"]
    # the w8a16 kernel: the best this CPU runs, or the one asked where it runs
    assert make_plan(CPU, None, "w8a16", offer=amx).w8a16_kernel == "avx512_vnni+amx"
    monkeypatch.setenv("FLASHDRAFT_W8A16_KERNEL", "avx2")
    plan = make_plan(CPU, None, "w8a16", offer=amx)
    assert plan.w8a16_kernel == "avx2" and "w8a16 by avx2" in plan.describe()
    assert make_plan(CPU, None, "int8", offer=amx).w8a16_kernel is None
    monkeypatch.setenv("FLASHDRAFT_W8A16_KERNEL", "avx512_vnni")
    with pytest.raises(
        KernelPlanError,
        match="^FLASHDRAFT_W8A16_KERNEL=avx512_vnni does not run on this CPU .these do: avx2.",
    ):
        make_plan(CPU, None, "w8a16", offer=offer(AVX2))


def test_the_plan_is_a_value():
    plan = make_plan(CPU, offer=offer(AMX))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.static_cache = True  # type: ignore[misc]
    static = plan.replace(static_cache=True)
    assert static.static_cache and not plan.static_cache and isinstance(static, KernelPlan)
    assert make_plan(CPU, offer=offer(AMX)) == plan  # made from the same inputs: the same plan
    assert "oneDNN packed linears" in plan.describe() and "short-query attention" in plan.describe()


def test_a_scheme_the_cpu_cannot_run_is_refused_before_the_target_is_looked_for(monkeypatch, tmp_path):
    from flashdraft import load_pipeline, load_target

    monkeypatch.setattr(plan_module, "_THIS_CPU", offer(ARM))
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(QuantizeError, match="w8a16"):
        load_target(missing, quantize="w8a16")
    with pytest.raises(QuantizeError, match="w8a8"):
        load_pipeline(missing, quantize="w8a8")


def test_a_target_is_prepared_by_its_plan_and_keeps_it():
    """`Target(model)` plans for the model as given (eager, its linears as they are); the plan `--compile` makes
    takes oneDNN's packed linears back to plain ones (inductor packs its own); a plan the target's family cannot
    take is declined, in one line."""
    model = tiny_model("llama")
    target = Target(model)
    assert not target.plan.compiled and not target.plan.packed_linears and not is_packed(model)
    if not target.use_plan(make_plan(CPU, torch.float32)).packed_linears:
        pytest.skip("no oneDNN here")
    assert is_packed(model) and target.lm_head is model.get_output_embeddings()
    assert compile_verify(target) is None
    assert target.plan.compiled and target.plan.static_cache and not is_packed(model)
    assert target.lm_head is model.get_output_embeddings() and isinstance(target.lm_head, torch.nn.Linear)
    sliding = Target(tiny_model("gemma3"))
    note = compile_verify(sliding)
    assert note is not None and note.startswith("--compile:") and note.endswith("; decoding eagerly")
    assert "\n" not in note and not sliding.plan.static_cache and sliding.plan.compile_note == note


def test_a_kernel_test_skips_where_the_cpu_lacks_its_features_and_fails_where_it_has_them(monkeypatch):
    """FLASHDRAFT_REQUIRE_KERNELS=1 (CI) turns a kernel test's skip into a failure on a CPU that has what it needs."""
    import conftest

    monkeypatch.setattr(conftest, "cpu_flags", lambda: {"avx2", "avx512_vnni", "avx512_bf16"})
    assert conftest.has_features("avx512_vnni avx512_bf16") and conftest.has_features("amx_bf16|avx512_bf16")
    assert not conftest.has_features("amx_tile amx_bf16")
    conftest.skip_without_kernel(True, "amx_tile", "served")  # available: nothing happens
    for require in (False, True):
        monkeypatch.setattr(conftest, "REQUIRE_KERNELS", require)
        with pytest.raises(pytest.skip.Exception, match="the AMX kernel needs amx_tile"):
            conftest.skip_without_kernel(False, "amx_tile", "the AMX kernel")
    with pytest.raises(pytest.fail.Exception, match="this CPU has avx512_vnni avx512_bf16, yet"):
        conftest.skip_without_kernel(False, "avx512_vnni avx512_bf16", "the w8a16 kernel")
    monkeypatch.setattr(conftest, "REQUIRE_KERNELS", False)
    with pytest.raises(pytest.skip.Exception):
        conftest.skip_without_kernel(False, "avx512_vnni avx512_bf16", "the w8a16 kernel")
