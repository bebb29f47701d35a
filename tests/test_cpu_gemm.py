"""gemm_templates.py: the micro-kernels of inductor's C++ GEMM template in the frozen CPU graphs. The kernel that serves
bf16 rows (AMX on CPUs with it, else the bf16 pair kernel, `vdpbf16ps`) must run a frozen graph's bf16 and int8
linears (the one-row graph's too), give the products' values, and give a row the same bits whatever rows share the
call; where it cannot serve (an odd k), inductor's widening kernel does. On an AMX CPU each test runs both."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from conftest import skip_without_kernel
from flashdraft.engine.compiled import compile_whole
from flashdraft.kernels.gemm_templates import bf16_row_kernels, bf16_rows_kernel, serving_bf16_rows
from flashdraft.kernels.plan import compile_options

# what each kernel leaves in a graph's code, once per GEMM it serves
MARKS = {"pairs": "_mm512_dpbf16_ps(", "amx": "_tile_release()"}


def _serving(kernel: str):
    needs = {"amx": "amx_tile amx_bf16", "pairs": "avx512_bf16"}[kernel]
    skip_without_kernel(kernel in bf16_row_kernels(), needs, f"the {kernel} kernel for bf16 rows")
    return serving_bf16_rows(kernel)


def test_amx_serves_bf16_rows_where_the_cpu_has_it_else_the_pair_kernel():
    amx = torch.cpu._is_amx_tile_supported() and torch.cpu._is_avx512_bf16_supported()
    want = "amx" if amx else "pairs" if torch.cpu._is_avx512_bf16_supported() else None
    assert bf16_rows_kernel() == want
    if want is None:
        with pytest.raises(ValueError, match="cannot be served by 'pairs'"), serving_bf16_rows("pairs"):
            pass


def _frozen(fn, weights):
    return compile_whole(fn, compile_options(torch.device("cpu")), weights=weights)


def _bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within a bf16 output's rounding of the fp32 product (the kernels sum in fp32, in another order)."""
    torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("kernel", ["amx", "pairs"])
@pytest.mark.parametrize("fan_in", [48, 47])
def test_bf16_linears_run_the_bf16_kernel_with_a_row_s_bits_at_any_row_count(kernel, fan_in):
    """A frozen bf16 MLP (widths that are not multiples of the register block: its weights padded) through AMX or
    the pair kernel: each of 1 to 17 rows gets the bits it gets alone, and the linears' values. With an odd fan-in
    neither can serve the first linear (k in pairs), and inductor's widening kernel does, as exactly."""
    torch.manual_seed(0)
    up = torch.nn.Linear(fan_in, 80).bfloat16().eval()
    head = torch.nn.Linear(80, 300, bias=False).bfloat16().eval()
    x = torch.randn(1, 17, fan_in).bfloat16()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False), _serving(kernel):
        torch._dynamo.reset()
        step = _frozen(lambda x: head(torch.relu(up(x))), [up, head])
        alone = [step(x[:, i : i + 1])[0, 0] for i in range(17)]
        for rows in (2, 3, 4, 5, 8, 17):
            out, code = run_and_get_code(step, x[:, :rows])
            for i in range(rows):
                assert torch.equal(out[0, i], alone[i]), f"row {i} of {rows}"
        served = "".join(code).count(MARKS[kernel])
        assert served == (2 if fan_in % 2 == 0 else 1)  # one kernel per linear it serves
        assert not any(mark in "".join(code) for other, mark in MARKS.items() if other != kernel)
        hidden = torch.relu(torch.nn.functional.linear(x.float(), up.weight.float(), up.bias.float()))
        want = torch.nn.functional.linear(hidden.bfloat16().float(), head.weight.float())
        _bf16_close(out, want)


@pytest.mark.parametrize("kernel", ["amx", "pairs"])
@pytest.mark.parametrize("columns", [96, 80])
def test_bf16_products_of_activations_run_the_bf16_kernel(kernel, columns):
    """Batched products of two activations (no frozen weight to pack at compile time): the template packs the
    right-hand side in pairs as it runs, itself (80 columns: blocked and padded) or in the pair kernel (96: a
    multiple of its block), and the products are right."""
    torch.manual_seed(0)
    # compile_whole names a frozen graph by its weights; this one has none of its own
    anchor = torch.nn.Linear(2, 2)
    x, y = torch.randn(3, 5, 64).bfloat16(), torch.randn(3, 64, columns).bfloat16()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False), _serving(kernel):
        torch._dynamo.reset()
        out, code = run_and_get_code(_frozen(lambda a, b: torch.bmm(a, b), anchor), x, y)
    assert MARKS[kernel] in "".join(code)
    _bf16_close(out, torch.bmm(x.float(), y.float()))


@pytest.mark.parametrize("kernel", ["amx", "pairs"])
def test_int8_weights_with_bf16_rows_run_the_bf16_kernel_with_a_row_s_bits_at_any_row_count(kernel):
    """`--quantize int8 --dtype bfloat16` compiled: int8 weights made bf16 in AMX's or the pair kernel, the scales
    inductor's epilogue. The graph of one row (static: inductor would skip AMX below 5 rows) runs the same kernel as
    the graph of any row count, a row gets the bits it gets alone at every row count (inductor's own avx512 kernels
    for this case differ below and above 16 rows), and the layers' values are ATen's int8 kernel's."""
    from flashdraft.kernels.quantize import Int8Linear

    torch.manual_seed(0)
    up = Int8Linear(torch.nn.Linear(96, 160), torch.bfloat16)
    head = Int8Linear(torch.nn.Linear(160, 300, bias=False), torch.bfloat16)
    model = torch.nn.Sequential(up, torch.nn.ReLU(), head).eval()
    x = torch.randn(1, 18, 96).bfloat16()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False), _serving(kernel):
        torch._dynamo.reset()
        step = _frozen(model, model)
        first, one_row = run_and_get_code(step, x[:, :1])
        assert "".join(one_row).count(MARKS[kernel]) == 2  # the static one-row graph
        alone = [first[0, 0]] + [step(x[:, i : i + 1])[0, 0] for i in range(1, 18)]
        for rows in (2, 4, 5, 15, 16, 18):
            out, code = run_and_get_code(step, x[:, :rows])
            for i in range(rows):
                assert torch.equal(out[0, i], alone[i]), f"row {i} of {rows}"
        assert "".join(code).count(MARKS[kernel]) == 2
        _bf16_close(out, model(x).float())


def test_the_one_row_int8_graph_blocks_k_by_the_int8_weights_the_pair_kernel_reads():
    """inductor sizes a static row count's k blocks for bf16 x int8 as if each weight took two bytes in L1 (AMX's
    bf16 copy); the pair kernel converts in registers, so the one-token step's blocks are what L1 holds of the int8
    weights (the whole of k here where L1 has room), as the verify's run-time blocks are. A row's bits are the same
    either way (the kernel reads its sums back across k blocks); only a second pass over the accumulators goes."""
    import re

    from flashdraft.kernels.quantize import Int8Linear

    skip_without_kernel("pairs" in bf16_row_kernels(), "avx512_bf16", "the pairs kernel for bf16 rows")
    torch.manual_seed(0)
    layer = Int8Linear(torch.nn.Linear(576, 96, bias=False), torch.bfloat16).eval()
    x = torch.randn(1, 576).bfloat16()
    l1 = torch.cpu.get_capabilities().get("l1d_cache_size", 0) * 0.8
    want = min(576 // 2, int(l1 // (2 * 48)))  # k in pairs, 48 columns of int8 bytes
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False), _serving("pairs"):
        torch._dynamo.reset()
        out, code = run_and_get_code(_frozen(layer, layer), x)
    blocks = re.findall(r"constexpr int64_t Kc_blocks = (\d+);", "".join(code))
    assert blocks == [str(want)]
    assert want > int(l1 // (2 * 48 * 2))  # more than inductor's own rule gives
    _bf16_close(out, layer(x).float())
