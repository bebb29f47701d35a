"""cpu_gemm.py: the micro-kernels of inductor's C++ GEMM template in the frozen CPU graphs. The bf16 pair kernel
(`vdpbf16ps`) must run a frozen graph's bf16 linears and its activation x activation products, give the products'
values, and give a row the same bits whatever rows share the call; where it cannot serve (an odd k), inductor's
widening kernel does."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from flashdraft.compiled import compile_options, compile_whole

needs_pairs = pytest.mark.skipif(
    not torch.cpu._is_avx512_bf16_supported(), reason="the pair kernel needs avx512_bf16"
)


def _frozen(fn, weights):
    return compile_whole(fn, compile_options(torch.device("cpu")), weights=weights)


def _bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within a bf16 output's rounding of the fp32 product (the kernels sum in fp32, in another order)."""
    torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-2)


@needs_pairs
@pytest.mark.parametrize("fan_in", [48, 47])
def test_bf16_linears_run_the_pair_kernel_with_a_row_s_bits_at_any_row_count(fan_in):
    """A frozen bf16 MLP (widths that are not multiples of the register block: its weights padded) through the pair
    kernel: each of 1 to 17 rows gets the bits it gets alone, and the linears' values. With an odd fan-in the pair
    kernel cannot serve the first linear (k in pairs), and inductor's widening kernel does, as exactly."""
    torch.manual_seed(0)
    up = torch.nn.Linear(fan_in, 80).bfloat16().eval()
    head = torch.nn.Linear(80, 300, bias=False).bfloat16().eval()
    x = torch.randn(1, 17, fan_in).bfloat16()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        step = _frozen(lambda x: head(torch.relu(up(x))), [up, head])
        alone = [step(x[:, i : i + 1])[0, 0] for i in range(17)]
        for rows in (2, 3, 4, 5, 8, 17):
            out, code = run_and_get_code(step, x[:, :rows])
            for i in range(rows):
                assert torch.equal(out[0, i], alone[i]), f"row {i} of {rows}"
        pairs = "".join(code).count("_mm512_dpbf16_ps(")
        assert pairs == (2 if fan_in % 2 == 0 else 1)  # one kernel per linear it serves
        hidden = torch.relu(torch.nn.functional.linear(x.float(), up.weight.float(), up.bias.float()))
        want = torch.nn.functional.linear(hidden.bfloat16().float(), head.weight.float())
        _bf16_close(out, want)


@needs_pairs
@pytest.mark.parametrize("columns", [96, 80])
def test_bf16_products_of_activations_run_the_pair_kernel(columns):
    """Batched products of two activations (no frozen weight to pack at compile time): the template packs the
    right-hand side in pairs as it runs, itself (80 columns: blocked and padded) or in the kernel (96: a multiple of
    the block), and the products are right."""
    torch.manual_seed(0)
    # compile_whole names a frozen graph by its weights; this one has none of its own
    anchor = torch.nn.Linear(2, 2)
    x, y = torch.randn(3, 5, 64).bfloat16(), torch.randn(3, 64, columns).bfloat16()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        out, code = run_and_get_code(_frozen(lambda a, b: torch.bmm(a, b), anchor), x, y)
    assert "_mm512_dpbf16_ps(" in "".join(code)
    _bf16_close(out, torch.bmm(x.float(), y.float()))


@needs_pairs
def test_int8_weights_with_bf16_rows_run_the_pair_kernel_with_a_row_s_bits_at_any_row_count():
    """`--quantize int8 --dtype bfloat16` compiled: int8 weights made bf16 in the pair kernel, the scales inductor's
    epilogue. A row gets the bits it gets alone at every row count (inductor's own kernels for this case differ
    below and above 16 rows), and the layers' values as ATen's int8 kernel gives them."""
    from flashdraft.quantize import Int8Linear

    torch.manual_seed(0)
    up = Int8Linear(torch.nn.Linear(96, 160), torch.bfloat16)
    head = Int8Linear(torch.nn.Linear(160, 300, bias=False), torch.bfloat16)
    model = torch.nn.Sequential(up, torch.nn.ReLU(), head).eval()
    x = torch.randn(1, 18, 96).bfloat16()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        step = _frozen(model, model)
        alone = [step(x[:, i : i + 1])[0, 0] for i in range(18)]
        for rows in (2, 4, 5, 15, 16, 18):
            out, code = run_and_get_code(step, x[:, :rows])
            for i in range(rows):
                assert torch.equal(out[0, i], alone[i]), f"row {i} of {rows}"
        assert "".join(code).count("_mm512_dpbf16_ps(") == 2
        _bf16_close(out, model(x).float())
