"""The fused decoder layer of w8a16 targets (decoder_layer_cpp.py): one operator per layer at decode, in bf16 and in
fp32, decoding what the model's own layers decode, with DFlash plain decoding of it bit for bit (one row, rows
joining and leaving, eager and compiled); layers it cannot run keep their own forward. The w8a16 kernel and the
attention kernel it calls build wherever avx2 and FMA are, so these run there too."""

import random

import pytest
import torch
from torch import nn

from conftest import (
    VOCAB,
    assert_batched_dflash_is_plain_decoding,
    assert_dflash_is_plain_decoding,
    needs_kernel,
    replan,
    tiny_model,
)
from flashdraft import Target, generate, generate_ar, generate_batch
from flashdraft.bench.mismatches import plain_logits_at
from flashdraft.engine.costs import CostModel
from flashdraft.kernels import attention, decoder_layer_cpp
from flashdraft.kernels.plan import make_plan
from flashdraft.kernels.quantize import quantize
from test_w8a16 import drafter

pytestmark = needs_kernel(
    lambda: decoder_layer_cpp.prepare(torch.bfloat16) and decoder_layer_cpp.prepare(torch.float32),
    "avx2 fma",
    "the fused w8a16 layer (and a C++ compiler)",
)
DTYPES = [torch.bfloat16, torch.float32]


def biased(model: nn.Module) -> nn.Module:
    """Random biases where the model has any (transformers initialises them to zero)."""
    generator = torch.Generator().manual_seed(9)
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.bias is not None:
            with torch.no_grad():
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=generator))
    return model


def w8a16_target(arch: str, fused: bool, dtype: torch.dtype = torch.bfloat16, **overrides) -> Target:
    """A tiny w8a16 target in `dtype` on its kernel plan: fused (the static cache, the attention kernel, eager), or
    the plan without the fused layers (the growing cache), as FLASHDRAFT_FUSED_LAYERS=0 makes it."""
    model = biased(tiny_model(arch, seed=2, **overrides)).to(dtype)
    quantize(model, "w8a16")
    plan = make_plan(torch.device("cpu"), dtype, "w8a16")
    assert plan.fused_layers and plan.static_cache and not plan.compiled
    if not fused:
        plan = plan.replace(fused_layers=False, static_cache=False)
    target = Target(model, plan=plan)
    fused_now = sum(hasattr(layer, "_unfused_forward") for layer in model.model.layers)
    assert fused_now == (model.config.num_hidden_layers if fused else 0)
    return target


def assert_decodes_as(target: Target, reference: Target) -> None:
    """Greedy decoding of six prompts on `target` gives `reference`'s tokens, or parts from them only where the two
    best tokens of `reference`'s own logits are within four roundings of its dtype of each other (a near-tie: the
    fused layer sums in other orders than the unfused one); a wrong norm, rotation, cache column or mask parts from
    them at clear margins."""
    rng = random.Random(11)
    for _ in range(6):
        ids = torch.tensor([[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 16))]])
        max_new = rng.randint(8, 30)
        got, want = (
            generate_ar(target, ids, max_new).new_tokens,
            generate_ar(reference, ids, max_new).new_tokens,
        )
        if got == want:
            continue
        i = next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
        step = plain_logits_at(reference, ids, want, [i])[i].float()
        margin = float(step[want[i]] - step[got[i]])
        eps = torch.finfo(reference.dtype).eps
        assert margin <= 4 * eps * float(step.abs().max()), (ids, i, margin)


def layer_calls(target: Target, ids: torch.Tensor, max_new: int) -> int:
    with torch.profiler.profile() as prof:
        generate_ar(target, ids, max_new)
    return sum(e.name == "flashdraft::decoder_layer" for e in prof.events())


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("llama", {}),
        ("qwen2", {}),  # biases on q / k / v
        ("qwen3", {}),  # q_norm / k_norm
        ("mistral", {}),
        ("llama", {"attention_bias": True, "mlp_bias": True}),  # every linear biased
        # widths off the vectors: the norms' (92) and RoPE's (14) tails longer than half a vector, avx2 or avx512
        ("llama", {"hidden_size": 92, "head_dim": 28, "num_key_value_heads": 4}),
    ],
)
def test_fused_layers_decode_what_the_model_s_layers_decode_and_dflash_is_plain_decoding(
    arch, overrides, dtype
):
    """Greedy decoding through the fused layers gives the tokens of the unfused w8a16 model but for near-ties;
    DFlash and batches on the fused layers are plain decoding of them, bit for bit."""
    target = w8a16_target(arch, fused=True, dtype=dtype, **overrides)
    ids = torch.tensor([[5, 9, 17, 3, 40]])
    # the decode steps ran through the operator
    assert layer_calls(target, ids, 4) >= 3 * target.model.config.num_hidden_layers
    assert_decodes_as(target, w8a16_target(arch, fused=False, dtype=dtype, **overrides))
    draft = drafter(target.model)
    assert_dflash_is_plain_decoding(target, draft)
    assert_batched_dflash_is_plain_decoding(target, draft, max_batch_size=3)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_compiled_fused_layers_are_one_call_each_and_dflash_is_plain_decoding(dtype):
    """`--quantize w8a16 --compile` fuses the layers (qwen3: its q / k norms too): the graph calls the operator once
    per layer, and DFlash is plain decoding on one row and in batches."""
    from flashdraft.engine.compiled import compile_verify

    model = tiny_model("qwen3", seed=2).to(dtype)
    quantize(model, "w8a16")
    target = Target(model)
    assert compile_verify(target) is None
    layers = model.config.num_hidden_layers
    assert all(hasattr(layer, "_unfused_forward") for layer in model.model.layers)
    ids = torch.tensor([[5, 9, 17, 3, 40]])
    generate_ar(target, ids, 3)  # compiled
    assert layer_calls(target, ids, 3) == 2 * layers  # the two decode steps after the first token's
    assert_decodes_as(target, w8a16_target("qwen3", fused=False, dtype=dtype))
    draft = drafter(model)
    assert_dflash_is_plain_decoding(target, draft)
    assert_batched_dflash_is_plain_decoding(target, draft, max_batch_size=3)


def test_the_joined_weights_are_the_layers_own_memory():
    """q / k / v (and gate / up) become views of one packed weight: no copy, and each linear's output unchanged."""
    model = biased(tiny_model("qwen2", seed=1)).to(torch.bfloat16)
    quantize(model, "w8a16")
    layer = model.model.layers[0]
    x = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16)
    linears = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.mlp.up_proj]
    before = [m(x) for m in linears]
    decoder_layer_cpp.fuse(model)
    joined = layer.fused_qkv_packed.untyped_storage().data_ptr()
    for m in linears[:3]:
        assert m.packed.untyped_storage().data_ptr() == joined
    assert (
        layer.mlp.up_proj.packed.untyped_storage().data_ptr()
        == layer.fused_gu_packed.untyped_storage().data_ptr()
    )
    for m, out in zip(linears, before, strict=True):
        assert torch.equal(m(x), out)


def test_layers_the_operator_cannot_run_keep_their_own_forward():
    """Another activation (gelu), another family (gemma3), a head norm in fp32: not fused, and decoding stays plain
    decoding."""
    model = tiny_model("llama", seed=2, hidden_act="gelu").to(torch.bfloat16)
    quantize(model, "w8a16")
    assert decoder_layer_cpp.refusal(model.model.layers[0]) == "the activation GELUActivation"
    assert decoder_layer_cpp.fuse(model) == 0
    gemma = tiny_model("gemma3", seed=2).to(torch.bfloat16)
    quantize(gemma, "w8a16")
    assert decoder_layer_cpp.refusal(gemma.model.layers[0]) == "a Gemma3DecoderLayer"
    qwen3 = tiny_model("qwen3", seed=2).to(torch.bfloat16)
    quantize(qwen3, "w8a16")
    assert decoder_layer_cpp.refusal(qwen3.model.layers[0]) is None
    qwen3.model.layers[0].self_attn.k_norm.float()
    assert decoder_layer_cpp.refusal(qwen3.model.layers[0]) == "norms without bf16 weights"
    assert decoder_layer_cpp.refusal(qwen3.model.layers[1], torch.float32) == "norms without fp32 weights"
    target = Target(model)
    replan(target, static_cache=True)
    attention.use(model, torch.bfloat16)
    ids = torch.tensor([[5, 9, 17, 3, 40]])
    assert layer_calls(target, ids, 3) == 0
    assert_dflash_is_plain_decoding(target, drafter(model))


@pytest.mark.parametrize(
    "arch, dtype", [("llama", torch.bfloat16), ("qwen3", torch.float32)], ids=["llama-bf16", "qwen3-fp32"]
)
def test_draft_trees_on_fused_layers_decode_as_plain(arch, dtype):
    """Trees (the policy with a free verify, so it takes big trees): each node's query attends its ancestors' columns
    at its depth's position through the operator, and the outputs equal plain decoding, one row and batched."""
    target = w8a16_target(arch, fused=True, dtype=dtype)
    draft = drafter(target.model)
    rng = random.Random(4)
    prompts = [torch.tensor([[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 12))]]) for _ in range(3)]
    costs = CostModel(lengths=[1, 16], verify_base=[1.0, 1.0], verify_slope=[0.0, 0.0], draft_base=1e-3)
    kw = dict(stop_token_ids=[], block_size="auto", costs=costs, tree=8)
    one = generate(target, draft, prompts[0], 30, **kw)
    assert one.new_tokens == generate_ar(target, prompts[0], 30, stop_token_ids=[]).new_tokens
    assert one.proposer_stats["tree_steps"] > 0
    for got, ids in zip(generate_batch(target, draft, prompts, 30, **kw), prompts, strict=True):
        assert got.new_tokens == generate_ar(target, ids, 30, stop_token_ids=[]).new_tokens
