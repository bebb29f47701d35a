"""attention_cpp.py: one C++ kernel for a short query's attention on a CPU. It must give attention's values for every
mask form (bool, added, none: causal), grouped heads and head widths (the register paths for 64 and 128 and the
general one), and give a query row the same bits whatever the mask's width, the rows beside it in the call, and
where its columns sit among hidden ones (a draft tree's node against its path alone)."""

import pytest
import torch

from conftest import skip_without_kernel
from flashdraft.kernels import attention, attention_cpp
from flashdraft.kernels.plan import switches

DTYPES = [torch.bfloat16, torch.float32]
WIDTHS = [(64, 64), (128, 128), (80, 48)]  # (head, value head): the two register paths, the general one


@pytest.fixture(scope="module", autouse=True)
def built():
    for dtype in DTYPES:
        assert attention_cpp.prepare(dtype), f"the kernel for {dtype} did not build"


@pytest.fixture(params=["vectors", "tiles"])
def scores(request):
    """The scores' two ways (both on a CPU with AMX; elsewhere the vectors'): vector FMAs, or AMX's tiles. The
    process's default is restored after the test."""
    on = attention_cpp.set_tiles(request.param == "tiles")
    skip_without_kernel(on or request.param != "tiles", "amx_tile amx_bf16", "attention_cpp's AMX tiles")
    yield request.param
    attention_cpp.set_tiles(switches()["attention_tiles"])


def reference(q, k, v, mask, scale):
    """fp32 attention with the grouped heads repeated: q [b, h, n, d] -> [b, n, h, dv]."""
    b, h, n, _ = q.shape
    groups = h // k.shape[1]
    width = k.shape[2] if mask is None else mask.shape[-1]
    k = k[:, :, :width].float().repeat_interleave(groups, 1)
    v = v[:, :, :width].float().repeat_interleave(groups, 1)
    scores = q.float() @ k.transpose(-1, -2) * scale
    if mask is None:
        scores = scores.masked_fill(~torch.ones(n, width, dtype=torch.bool).tril(width - n), float("-inf"))
    elif mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.float()
    return (scores.softmax(-1) @ v).transpose(1, 2)


def qkv(b, h, kv_heads, n, length, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, h, d, generator=g).to(dtype).transpose(1, 2)  # as the model's layers give it
    k = torch.randn(b, kv_heads, length, d, generator=g).to(dtype)
    v = torch.randn(b, kv_heads, length, dv, generator=g).to(dtype)
    return q, k, v


def added(sees: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(sees.shape, dtype=dtype).masked_fill(~sees, torch.finfo(dtype).min)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("d", "dv"), WIDTHS)
@pytest.mark.parametrize("form", ["bool", "added", "none"])
def test_the_kernel_gives_attention_s_values(dtype, d, dv, form, scores):
    """Two rows, 8 query heads on 2 KV heads, 5 queries over 203 of 300 cached columns (a width that is no multiple
    of the 16-column blocks), a random mask with one column seen per query at least."""
    q, k, v = qkv(2, 8, 2, 5, 300, d, dv, dtype)
    sees = torch.rand(2, 1, 5, 203, generator=torch.Generator().manual_seed(1)) > 0.3
    sees[..., 7] = True
    mask = {"bool": sees, "added": added(sees, dtype), "none": None}[form]
    got = attention_cpp.short_attention(q, k, v, mask, 0.125)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-6
    torch.testing.assert_close(got.float(), reference(q, k, v, mask, 0.125), rtol=tol, atol=tol)


@pytest.mark.parametrize(("d", "dv"), WIDTHS)
def test_keys_and_values_are_read_in_place_from_wider_columns(d, dv, scores):
    """Keys and values whose columns lie further apart than their heads' widths (views of wider buffers, as a joined
    projection's output is), over 61 columns (a last block of 13): the same values as their contiguous copies."""
    q, _, _ = qkv(1, 6, 2, 4, 61, d, dv, torch.bfloat16, seed=5)
    g = torch.Generator().manual_seed(6)
    k = torch.randn(1, 2, 61, d + 48, generator=g).bfloat16()[..., 16 : 16 + d]
    v = torch.randn(1, 2, 61, dv + 32, generator=g).bfloat16()[..., :dv]
    got = attention_cpp.short_attention(q, k, v, None, 0.125)
    assert torch.equal(got, attention_cpp.short_attention(q, k.contiguous(), v.contiguous(), None, 0.125))
    torch.testing.assert_close(got.float(), reference(q, k, v, None, 0.125), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("d", "dv"), WIDTHS)
def test_a_row_keeps_its_bits_at_any_width_with_any_rows_beside_it(d, dv, scores):
    """bf16, 9 query heads on 3 KV heads: each of 16 causal queries alone (one query, the mask as narrow as the
    columns in use, rounded up as the engine rounds it) gets the bits it gets among all 16 under a mask twice as
    wide, and in a batch of two rows; with the scores on AMX's tiles too (16 query rows a block there)."""
    dtype = torch.bfloat16
    q, k, v = qkv(1, 9, 3, 16, 512, d, dv, dtype, seed=2)
    cached = 133
    sees = torch.zeros(1, 1, 16, 384, dtype=torch.bool)
    for i in range(16):
        sees[0, 0, i, : cached + i + 1] = True
    together = attention_cpp.short_attention(q, k, v, added(sees, dtype), 0.125)
    other_q, other_k, other_v = qkv(1, 9, 3, 16, 512, d, dv, dtype, seed=3)
    batch = attention_cpp.short_attention(
        torch.cat([other_q, q]),
        torch.cat([other_k, k]),
        torch.cat([other_v, v]),
        added(sees, dtype).expand(2, -1, -1, -1),
        0.125,
    )
    for i in range(16):
        width = -(-(cached + i + 1) // 64) * 64
        alone = attention_cpp.short_attention(
            q[:, :, i : i + 1], k, v, added(sees[..., i : i + 1, :width], dtype), 0.125
        )
        assert torch.equal(alone[0, 0], together[0, i]), f"query {i}"
        assert torch.equal(alone[0, 0], batch[1, i]), f"query {i} in a batch"


def test_a_tree_node_gets_the_bits_of_its_path_alone(scores):
    """A draft tree's block: nodes at columns after the cache, each seeing the cache, its ancestors and itself, its
    siblings' columns (other values) hidden in between. Every node's result equals the one-query result over the
    cache and its path laid out contiguously: hidden columns add nothing, wherever they fall."""
    dtype, d = torch.bfloat16, 64
    parents = [-1, 0, 0, 1, 1, 2, 3, 5, 6, 6]  # node 0 the anchor
    cached, n = 70, len(parents)
    q, k, v = qkv(1, 6, 2, n, cached + n, d, d, dtype, seed=4)
    sees = torch.zeros(1, 1, n, cached + n, dtype=torch.bool)
    sees[..., :cached] = True
    paths = []
    for node in range(n):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
        sees[0, 0, node, [cached + p for p in path]] = True
    tree = attention_cpp.short_attention(q, k, v, added(sees, dtype), 0.125)
    for node, path in enumerate(paths):
        columns = list(range(cached)) + [cached + p for p in path]
        alone = attention_cpp.short_attention(
            q[:, :, node : node + 1], k[:, :, columns], v[:, :, columns], None, 0.125
        )
        assert torch.equal(alone[0, 0], tree[0, node]), f"node {node} (path {path})"


def test_short_query_attention_runs_the_kernel_where_it_is_built(monkeypatch):
    """attention.py sends bf16 short queries to the kernel once it is built for bf16 (fp32 keeps SDPA's kernel or
    the two products), with the mask cut to the keys; prefill-length queries go to SDPA."""
    calls = []
    real = attention_cpp.short_attention
    monkeypatch.setattr(attention_cpp, "short_attention", lambda *a: calls.append(a[0].dtype) or real(*a))

    class Module(torch.nn.Module):
        is_causal = True

    q, k, v = qkv(1, 4, 2, 3, 40, 64, 64, torch.bfloat16)
    sees = torch.ones(1, 1, 3, 48, dtype=torch.bool).tril(37)  # wider than the keys: cut
    out, _ = attention.short_query_attention(Module(), q, k, v, sees, scaling=0.125)
    assert calls == [torch.bfloat16]
    torch.testing.assert_close(out.float(), reference(q, k, v, sees[..., :40], 0.125), rtol=2e-2, atol=2e-2)
    attention.short_query_attention(Module(), q.float(), k.float(), v.float(), sees[..., :40])
    long_q, long_k, long_v = qkv(1, 4, 4, attention.SHORT_QUERY + 1, 80, 64, 64, torch.bfloat16)
    attention.short_query_attention(Module(), long_q, long_k, long_v, None)
    assert calls == [torch.bfloat16]
    assert attention.narrow_mask(_Named(attention.NAME), torch.device("cpu"), torch.bfloat16)
    assert not attention.narrow_mask(_Named(attention.NAME), torch.device("cpu"), torch.float16)


class _Named(torch.nn.Module):
    def __init__(self, implementation: str) -> None:
        super().__init__()
        self.config = type("Config", (), {"_attn_implementation": implementation})()


def test_the_operator_s_cpu_kernel_is_the_library_s_own_and_names_bad_input():
    """The library registers the operator's CPU kernel itself (C++: a compiled graph's call goes from the dispatcher
    to the kernel, no Python in between), and input it cannot take is refused with a line that says why."""
    dump = torch._C._dispatch_dump("flashdraft::short_attention")
    cpu = [line for line in dump.splitlines() if line.startswith("CPU:")]
    assert len(cpu) == 1 and ".cpp:" in cpu[0], dump
    q, k, v = qkv(1, 4, 2, 2, 16, 64, 64, torch.bfloat16)
    with pytest.raises(RuntimeError, match="must share a dtype"):
        attention_cpp.short_attention(q.float(), k, v, None, 0.125)
    with pytest.raises(RuntimeError, match="wider than the keys"):
        attention_cpp.short_attention(q, k, v, torch.ones(1, 1, 2, 17, dtype=torch.bool), 0.125)
    with pytest.raises(RuntimeError, match="do not fit"):
        attention_cpp.short_attention(q, k[:, :, :, :32], v, None, 0.125)
    with pytest.raises(RuntimeError, match="value's rows or heads"):
        attention_cpp.short_attention(q, k, v[:, :1], None, 0.125)
    with pytest.raises(RuntimeError, match="mask's rows, heads or queries"):
        attention_cpp.short_attention(q, k, v, torch.ones(1, 1, 3, 16, dtype=torch.bool), 0.125)
