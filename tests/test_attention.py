"""attention.py: the short-query attention bf16 targets run on a CPU.

It must be transformers' attention (the same result as SDPA up to rounding, for every mask form the engine and
transformers hand it), leave what it cannot honour to SDPA, and give a query row the same bits whatever the number
of rows beside it: what makes an int8 verify batch-invariant, so DFlash equals plain decoding bit for bit there."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from conftest import OracleProposer
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.generate import generate, generate_ar
from flashdraft.kernels import attention
from flashdraft.kernels.quantize import quantize_int8
from flashdraft.targets.target import Target

VOCAB = 96


class _Module(torch.nn.Module):
    def __init__(self, heads: int, kv_heads: int, causal: bool = True) -> None:
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.is_causal = causal


def _qkv(b, heads, kv_heads, n, length, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, n, d, generator=g).to(dtype)
    k = torch.randn(b, kv_heads, length, d, generator=g).to(dtype)
    v = torch.randn(b, kv_heads, length, d, generator=g).to(dtype)
    return q, k, v


def _causal_after_cache(b, n, length):
    """bool [b, 1, n, L]: query i is position L - n + i; row 1 also hides its first 3 columns (a hole)."""
    keys = torch.arange(length)
    sees = (keys <= torch.arange(length - n, length)[:, None]).expand(b, 1, n, length).clone()
    if b > 1:
        sees[1, :, :, :3] = False
    return sees


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("compiled", [False, True])  # eager fp32: SDPA's kernel; compiled: the two products
def test_it_is_sdpa_up_to_rounding(heads, kv_heads, n, mask_kind, compiled, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiled)
    b, length = 2, 11
    q, k, v = _qkv(b, heads, kv_heads, n, length)
    module = _Module(heads, kv_heads)
    sees = _causal_after_cache(b, n, length)
    mask = {"none": None, "bool": sees, "additive": torch.zeros(sees.shape).masked_fill(~sees, -1e30)}[
        mask_kind
    ]
    if mask_kind == "none":  # transformers' meaning of no mask: causal after the cache, no holes
        sees = _causal_after_cache(1, n, length).expand(b, -1, -1, -1)
    got, _ = attention.short_query_attention(module, q, k, v, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(module, q, k, v, sees, scaling=0.3)
    assert got.shape == (b, n, heads, 16)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)


def test_long_queries_and_unsupported_options_go_to_sdpa(monkeypatch):
    calls = []
    monkeypatch.setattr(
        "transformers.integrations.sdpa_attention.sdpa_attention_forward",
        lambda *a, **kw: calls.append(kw) or ("sdpa", None),
    )
    q, k, v = _qkv(1, 4, 2, attention.SHORT_QUERY + 1, attention.SHORT_QUERY + 1)
    module = _Module(4, 2)
    assert attention.short_query_attention(module, q, k, v, None)[0] == "sdpa"
    q, k, v = _qkv(1, 4, 2, 2, 9)
    assert attention.short_query_attention(module, q, k, v, None, softcap=30.0)[0] == "sdpa"
    assert calls[-1]["softcap"] == 30.0
    assert attention.short_query_attention(module, q, k, v, None)[0] != "sdpa"
    assert len(calls) == 2


def test_a_row_gets_the_same_bits_alone_or_among_others():
    """bf16: each query row of a 16-query call equals the same query asked alone, over the same columns or over
    only those it sees (a verify against the one-token steps of plain decoding, static or growing cache)."""
    heads, kv_heads, n, cached = 6, 2, 16, 40
    q, k, v = _qkv(1, heads, kv_heads, n, cached + n, d=64, dtype=torch.bfloat16, seed=3)
    module = _Module(heads, kv_heads)
    sees = _causal_after_cache(1, n, cached + n)
    together, _ = attention.short_query_attention(module, q, k, v, sees)
    for i in range(n):
        same_columns, _ = attention.short_query_attention(
            module, q[:, :, i : i + 1], k, v, sees[:, :, i : i + 1]
        )
        seen = cached + i + 1
        alone, _ = attention.short_query_attention(
            module, q[:, :, i : i + 1], k[:, :, :seen], v[:, :, :seen], None
        )
        assert torch.equal(same_columns[:, 0], together[:, i]), i
        assert torch.equal(alone[:, 0], together[:, i]), i


def _llama(seed=0):
    torch.manual_seed(seed)
    # head_dim 64 and a prompt of 100: at toy sizes SDPA happens to be batch-invariant too
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_a_bf16_or_fp32_cpu_target_runs_it_and_an_opt_out_does_not(monkeypatch):
    assert Target(_llama().to(torch.bfloat16)).model.config._attn_implementation == attention.NAME
    assert Target(_llama()).model.config._attn_implementation == attention.NAME
    assert Target(_llama().to(torch.float16)).model.config._attn_implementation == "sdpa"
    monkeypatch.setenv("FLASHDRAFT_ATTENTION", "sdpa")
    assert Target(_llama().to(torch.bfloat16)).model.config._attn_implementation == "sdpa"


def test_eager_fp32_reads_grouped_heads_in_place(monkeypatch):
    """With a mask, eager fp32 short queries call SDPA's kernel on the KV heads as they are (no repeat_kv copy),
    and give what transformers' SDPA function gives."""
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda q, k, *a, **kw: seen.append(k.shape) or real(q, k, *a, **kw),
    )
    q, k, v = _qkv(3, 6, 2, 4, 20)
    sees = _causal_after_cache(3, 4, 20)
    got, _ = attention.short_query_attention(_Module(6, 2), q, k, v, sees)
    assert seen == [k.shape]  # 2 KV heads, not 6
    want, _ = sdpa_attention_forward(_Module(6, 2), q, k, v, sees)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)


def test_an_int8_verify_is_batch_invariant_and_dflash_equals_plain_bit_for_bit():
    """int8 weights (their kernel reduces each row alike at any row count) and this attention: the verify's logits
    for a token are the one-token step's, bit for bit, so speculative outputs are plain decoding's: an oracle
    proposer's long accepts (greedy) and a drafter's (greedy and seeded sampling)."""
    model = _llama(1).to(torch.bfloat16)
    quantize_int8(model)
    target = Target(model)
    prompt = torch.randint(4, VOCAB, (1, 100), generator=torch.Generator().manual_seed(0))
    block = torch.randint(4, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = target.new_cache()
        target.forward(prompt, cache)
        together = target.forward(block, cache).logits
        target.crop(cache, prompt.shape[1])
        one_by_one = torch.cat([target.forward(block[:, i : i + 1], cache).logits for i in range(8)], 1)
    assert torch.equal(together, one_by_one)

    plain = generate_ar(target, prompt, 40, stop_token_ids=[])
    reference = prompt[0].tolist() + plain.new_tokens
    oracle = OracleProposer(reference, VOCAB, block_size=8, rng=random.Random(0))
    assert generate(target, oracle, prompt, 40, stop_token_ids=[]).new_tokens == plain.new_tokens
    assert max(oracle.chosen_k) >= 4  # tokens deep in the block were accepted
    draft = DFlashDraftModel.for_target(model.config, num_layers=1, block_size=8, mask_token_id=VOCAB - 1)
    draft = draft.to(torch.bfloat16).eval()
    for temperature in (0.0, 0.9):
        plain = generate_ar(target, prompt, 40, temperature=temperature, seed=5, stop_token_ids=[])
        for block_size in ("auto", 8):
            got = generate(target, draft, prompt, 40, temperature=temperature, seed=5, stop_token_ids=[],
                           block_size=block_size)  # fmt: skip
            assert got.new_tokens == plain.new_tokens, (temperature, block_size)


def test_values_narrower_than_keys():
    """Multi-head latent attention (DeepSeek) has value heads of another width than query/key heads."""
    q, k, _ = _qkv(1, 4, 2, 3, 9)
    v = torch.randn(1, 2, 9, 8)
    module = _Module(4, 2)
    got, _ = attention.short_query_attention(module, q, k, v, None, scaling=0.25)
    sees = _causal_after_cache(1, 3, 9)
    want, _ = sdpa_attention_forward(module, q, k, v, sees, scaling=0.25)
    assert got.shape == (1, 3, 4, 8)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)


def test_a_switched_config_still_builds_a_model():
    """transformers takes any implementation named with "flash" for flash attention and refuses to build a model
    from such a config without a flash kernel: a config the switch touched must still build one (memory_plan.py
    builds targets from their configs on the meta device)."""
    from transformers import AutoModelForCausalLM

    model = Target(_llama()).model
    assert model.config._attn_implementation == attention.NAME
    with torch.device("meta"):
        again = AutoModelForCausalLM.from_config(model.config)
    assert again.config._attn_implementation == attention.NAME
