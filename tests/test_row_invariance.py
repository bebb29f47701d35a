"""Row invariance, the property DFlash's exactness rests on: where the kernel plan says a verify of n tokens gives
each token the bits of its one-token step (`KernelPlan.row_invariant`), it does, bit for bit, on every precision path
that claims it; and on a target with real near-ties, DFlash's output is then plain decoding's, where a path that
does not hold rows parts from it."""

from __future__ import annotations

import pytest
import torch

from conftest import (
    VOCAB,
    assert_verify_keeps_one_token_bits,
    path_name,
    path_needs,
    path_target,
    skip_without_kernel,
)
from flashdraft import DFlashDraftModel, Target, generate, generate_ar
from flashdraft.kernels.plan import CpuOffer, make_plan

# fake CPUs (tests/test_kernel_plan.py's): an avx2 one (bf16 emulated, no VNNI) and an AMX one
AVX2 = dict(bf16_math=False, w8a8_exact=False, w8a8_compiles=False, w8a16=True, w8a16_kernels=("avx2",), bf16_rows=None,
            attention_kernel=True, attention_tiles=False, untested_torch=None, onednn_fp32=True, fp16=True)  # fmt: skip
AMX = dict(bf16_math=True, w8a8_exact=True, w8a8_compiles=True, w8a16=True, w8a16_kernels=("avx2", "avx512_vnni+amx"),
           bf16_rows="amx", attention_kernel=True,
           attention_tiles=True, untested_torch=None, onednn_fp32=True, fp16=True)  # fmt: skip
CPU = torch.device("cpu")

# (dtype, quantization, compiled): every path the plan says holds rows on a CPU that offers its kernels
CLAIMED = [
    ("bfloat16", "int8", False),
    ("bfloat16", "w8a8", False),
    ("bfloat16", "w8a16", False),
    # bf16 eager and oneDNN's GEMM in a compiled graph give a token other bits in a longer verify at these widths,
    # and inductor choosing kernels by timing gave two graphs different ones (inductor_passes.one_gemm_choice)
    ("bfloat16", None, True),
    ("bfloat16", "int8", True),
    ("bfloat16", "w8a8", True),
    ("bfloat16", "w8a16", True),
    # the avx2 CPUs' w8a16: fp32 rows, the attention kernel in fp32
    ("float32", "w8a16", False),
    ("float32", "w8a16", True),
]
# eager fp32 / bf16 / fp16: oneDNN's, MKL's and fbgemm's reductions; fp32 compiled: its attention's ATen GEMMs
NOT_CLAIMED = [
    ("float32", None, False),
    ("bfloat16", None, False),
    ("float32", "fp16", False),
    ("float32", None, True),
    ("float32", "int8", True),
]


_name = path_name


def _target(path, near_ties: bool = False) -> Target:
    """A target on the path's plan, skipped where this CPU's plan does not claim rows held for it."""
    target = path_target(path, prepare=_near_ties if near_ties else None)
    plan = target.plan
    skip_without_kernel(plan.row_invariant, path_needs(path), f"{_name(path)}, rows held ({plan.describe()})")
    return target


@pytest.mark.parametrize("path", CLAIMED, ids=_name)
def test_the_plan_claims_rows_held_on_a_cpu_with_the_kernels_and_not_on_an_avx2_one(path):
    dtype, scheme, compiled = path
    amx = make_plan(CPU, getattr(torch, dtype), scheme, compiled, offer=CpuOffer(**AMX))
    assert amx.row_invariant, amx.describe()
    assert "row-invariant" in amx.describe()
    if scheme in (None, "int8"):  # bf16 emulated: no bf16 row kernel, int8's bf16 rows not held
        avx2 = make_plan(CPU, getattr(torch, dtype), scheme, compiled, offer=CpuOffer(**AVX2))
        assert not avx2.row_invariant and "rows within rounding" in avx2.describe(), avx2.describe()
    if scheme == "w8a16":  # integer products on any avx2 CPU, in bf16 or fp32 rows
        avx2 = make_plan(CPU, getattr(torch, dtype), scheme, compiled, offer=CpuOffer(**AVX2))
        assert avx2.row_invariant and avx2.attention_kernel, avx2.describe()


@pytest.mark.parametrize("path", NOT_CLAIMED, ids=_name)
def test_eager_dense_and_fp16_paths_claim_no_row_invariance(path):
    dtype, scheme, compiled = path
    assert not make_plan(CPU, getattr(torch, dtype), scheme, compiled, offer=CpuOffer(**AMX)).row_invariant


def test_a_gpu_or_a_compile_setting_without_the_gemm_template_claims_none(monkeypatch):
    amx = CpuOffer(**AMX)
    assert not make_plan(torch.device("cuda"), torch.bfloat16, None, False, offer=amx).row_invariant
    assert make_plan(CPU, torch.bfloat16, None, True, offer=amx).row_invariant
    monkeypatch.setenv("FLASHDRAFT_COMPILE", '{"options": {"freezing": false}}')
    plan = make_plan(CPU, torch.bfloat16, None, True, offer=amx)
    assert plan.compile_options == {"options": {"freezing": False}} and not plan.row_invariant


@pytest.mark.parametrize("path", CLAIMED, ids=_name)
def test_a_claimed_path_keeps_each_token_s_bits_in_a_verify_of_any_length(path):
    assert_verify_keeps_one_token_bits(_target(path))


def _near_ties(model: torch.nn.Module, pairs: int = 40) -> None:
    """`pairs` LM-head rows made copies of others but for one weight moved by a step or two of its dtype: those
    tokens' logits then differ in their last bits, so a verify that rounds a token otherwise than its one-token
    step can pick the other of the two."""
    head = model.get_output_embeddings().weight
    generator = torch.Generator().manual_seed(1)
    step = 1 + torch.finfo(head.dtype).eps
    with torch.no_grad():
        ids = torch.randperm(VOCAB - 4, generator=generator)[: 2 * pairs] + 3
        for a, b in ids.view(-1, 2).tolist():
            head[b] = head[a]
            k = int(torch.randint(head.shape[1], (1,), generator=generator))
            head[b, k] = (head[a, k].double() * step).to(head.dtype)
        assert not torch.equal(head[ids[1::2]], head[ids[0::2]])


@pytest.mark.parametrize("path", [("bfloat16", None, True)], ids=_name)
def test_with_near_ties_dflash_is_plain_decoding_on_a_path_that_holds_rows(path):
    target = _target(path, near_ties=True)
    draft = DFlashDraftModel.for_target(
        target.model.config, num_layers=1, block_size=8, mask_token_id=VOCAB - 1
    )
    for seed in range(4):
        ids = torch.randint(3, VOCAB - 1, (1, 12), generator=torch.Generator().manual_seed(seed))
        plain = generate_ar(target, ids, 24, stop_token_ids=[])
        assert (
            generate(target, draft.eval(), ids, 24, stop_token_ids=[], block_size=8).new_tokens
            == plain.new_tokens
        )
