"""The frozen CPU graphs (compiled.compile_whole): every linear frozen into inductor's C++ GEMM template with the
linear's own values, a graph per model and weights (cached on disk under them), the drafter's compiled head and
context projection equal to the eager ones, and the compiled one-token step and bf16 verify decoding as plain
decoding does, a token keeping its bits at any verify length."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, compiled_plan, tiny_model
from flashdraft import DFlashDraftModel, Target, generate_ar
from flashdraft.engine.compiled import compile_verify
from flashdraft.generate import generate
from flashdraft.kernels import attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_linears_are_frozen_into_inductor_s_gemm_template_with_the_linear_s_values(dtype):
    """The CPU options: the weights frozen (constants, packed) and each linear autotuned between inductor's C++
    GEMM template and ATen. The template forced (autotuning chooses by timing, which a test cannot assert), the
    fp32 linears of one row and of several run through it; bf16 compiles too (where the CPU has no bf16 template,
    through ATen). The values are the linear's, within the rounding of another summation order."""
    from torch._dynamo.utils import counters

    from flashdraft.engine.compiled import compile_whole
    from flashdraft.kernels.plan import compile_options

    options = compile_options(torch.device("cpu"))
    assert (
        options["options"]["max_autotune_gemm"] and "CPP" in options["options"]["max_autotune_gemm_backends"]
    )
    if dtype == torch.float32:
        options["options"]["max_autotune_gemm_backends"] = "CPP"
    torch.manual_seed(0)
    up = torch.nn.Linear(48, 80).to(dtype).eval()
    head = torch.nn.Linear(80, 300, bias=False).to(dtype).eval()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        for rows in (1, 3):
            torch._dynamo.reset()
            counters.clear()
            step = compile_whole(lambda x: head(torch.relu(up(x))).float(), options, weights=[up, head])
            x = torch.randn(rows, 1, 48, dtype=dtype)
            got = step(x)
            if dtype == torch.float32:  # frozen for real (the weights are constants, packed) and templated
                assert counters["inductor"]["cpp_templated_kernel_counter"] == 2
                # packed by the template alone, no oneDNN copy (inductor_passes._no_onednn_prepack)
                assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] == 0
            hidden = torch.nn.functional.linear(x.float(), up.weight.float(), up.bias.float())
            want = torch.nn.functional.linear(torch.relu(hidden.to(dtype)).float(), head.weight.float())
            tolerance = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_two_frozen_models_of_the_same_shapes_each_run_their_own_weights():
    """Frozen graphs hold a model's weights as constants and dynamo keeps graphs per code object, and the CPU options
    skip the guards on modules: each compiled function must have code of its own, or the second model of the same
    shapes runs the first one's weights (it did, with PyTorch's `skip_guard_on_all_nn_modules_unsafe` and shared
    code). The two lambdas here share one code object, as two models' verifies share `VerifyForward._forward`."""
    from flashdraft.engine.compiled import compile_whole
    from flashdraft.kernels.plan import compile_options

    torch.manual_seed(0)
    first, second = (
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)) for _ in "ab"
    )
    x = torch.randn(3, 16)
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        steps = [
            compile_whole(lambda x, m=m: m(x), compile_options(torch.device("cpu")), weights=m)
            for m in (first, second)
        ]
        for step, model in zip(steps, (first, second), strict=True):
            torch.testing.assert_close(step(x), model(x), rtol=1e-5, atol=1e-5)


def test_frozen_graphs_are_cached_on_disk_under_their_weights(tmp_path, monkeypatch):
    """A frozen graph is written to inductor's FX graph cache and found there by the next process (a oneDNN-packed
    weight kept every one out of it: each start compiled for minutes), under a name made of its weights: inductor
    keys a frozen parameter by shape and dtype alone but stores the GEMM template's packed copy by value, so a model
    of the same shapes with other weights must miss, or it runs the first model's weights. Neither the written nor the
    read entry stays in memory (torch records every entry's bytes for `save_cache_artifacts`). dynamo's in-memory
    graphs are dropped between runs, as a new process has none."""
    from torch._dynamo.utils import counters
    from torch.compiler._cache import CacheArtifactManager

    from flashdraft.engine.compiled import compile_whole
    from flashdraft.kernels.plan import compile_options

    def recorded() -> int:  # the cache entries torch keeps in memory for `save_cache_artifacts`
        return sum(len(artifacts) for artifacts in CacheArtifactManager._new_cache_artifacts.values())

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x = torch.randn(3, 48)
    seen, held = [], recorded()
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(48, 80), torch.nn.ReLU(), torch.nn.Linear(80, 300, bias=False)
        ).eval()
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=True):
            step = compile_whole(lambda x, m=model: m(x), compile_options(torch.device("cpu")), weights=model)
            torch.testing.assert_close(step(x), model(x), rtol=1e-5, atol=1e-5)
        seen.append({k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("miss", "hit", "bypass")})
        # written or read, the entry (the template's packed weights) is not also held in memory
        assert recorded() == held
    assert seen == [
        {"miss": 1, "hit": 0, "bypass": 0},  # compiled and written
        {"miss": 0, "hit": 1, "bypass": 0},  # the same weights: read back
        {"miss": 1, "hit": 0, "bypass": 0},  # other weights of the same shapes: compiled anew
    ]


def test_a_frozen_graph_names_the_weights_it_freezes():
    """compile_whole refuses a frozen graph without its weights: its cache entry would have no name of them."""
    from flashdraft.engine.compiled import compile_whole
    from flashdraft.kernels.plan import compile_options

    with pytest.raises(ValueError, match="weights"):
        compile_whole(lambda x: x, compile_options(torch.device("cpu")))


def test_the_compiled_draft_head_gives_the_eager_head_s_logits_for_any_number_of_rows():
    """The drafter's LM head, compiled as the verify is (frozen, through the GEMM template), is `draft_logits`:
    the drafter's output multiplier and soft-capping included, one graph for every number of rows; the greedy drafts
    and confidences it reduces in the same graph are `propose_tokens`' (each row's argmax and its probability)."""
    from types import SimpleNamespace

    from torch._dynamo.utils import counters

    from flashdraft.drafter.model import draft_logits
    from flashdraft.engine.compiled_draft import draft_head
    from flashdraft.engine.tree import top_candidates
    from flashdraft.kernels.plan import compile_options

    torch.manual_seed(0)
    options = compile_options(torch.device("cpu"))
    target = SimpleNamespace(plan=compiled_plan(options), model=torch.nn.Module())
    config = SimpleNamespace(output_multiplier=0.5, final_logit_softcapping=3.0)
    weight, bias = torch.randn(300, 48), torch.randn(300)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        head = draft_head(config, weight, bias, target)
        assert draft_head(config, weight, bias, target) is head  # made once per target, precision and scaling
        # cut from longer tensors at offsets, as the engine's slots are (`hidden[:, 1:]` of one row starts one
        # state in): an offset must not make a graph (on an H100 each new one compiled mid-answer)
        for rows, offset in (
            (15, 1),
            (7, 0),
            (30, 2),
            (15, 0),
            (1, 1),
            (1, 0),
        ):  # one row: doubled, same graph
            hidden = torch.randn(rows + offset, 48)[offset:]
            want = draft_logits(config, hidden, weight, bias)
            logits, tokens, confidence = head(hidden)
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(tokens, logits.argmax(-1))
            torch.testing.assert_close(confidence, want.softmax(-1).max(-1).values, rtol=1e-5, atol=1e-6)
            # the drafts alone (a greedy chain's pass), from a graph that never writes the logits
            none, alone, sure = head(hidden, logits=False)
            assert none is None and torch.equal(alone, tokens)
            torch.testing.assert_close(sure, confidence, rtol=1e-5, atol=1e-6)
            # a draft tree's candidates: each row's 3 most likely tokens and their probabilities, in the graph
            none, alone, sure, top_tokens, top_p = head(hidden, logits=False, top=3)
            want_tokens, want_p = top_candidates(want, 3)
            assert none is None and torch.equal(alone, tokens) and torch.equal(top_tokens, want_tokens)
            torch.testing.assert_close(top_p, want_p, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(sure, top_p[:, 0], rtol=1e-5, atol=1e-6)
    assert (
        counters["stats"]["unique_graphs"] == 3
    )  # with the logits, the drafts alone, the drafts and candidates
    assert counters["inductor"]["cpp_templated_kernel_counter"] == 3
    # the template takes constant weights only (frozen), and packs them itself: no oneDNN copy
    assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] == 0
    assert counters["inductor"]["select_algorithm_autotune"] == 0  # the template, not a timing's choice
    target.plan = target.plan.replace(compile_options=None)
    assert draft_head(config, weight, bias, target) is None  # an eager verify: the eager head


def test_the_compiled_context_projection_is_the_eager_one_in_one_graph():
    """The drafter's context projection compiled (`draft_context_pass`: fc, norm, each layer's K/V with RoPE) gives
    the eager `context_kv`'s K/V at every width and row count, a width of one included, from one graph; it is
    eager beside an eager verify."""
    from types import SimpleNamespace

    from torch._dynamo.utils import counters

    from flashdraft.engine.compiled_draft import draft_context_pass
    from flashdraft.kernels.plan import compile_options

    torch.manual_seed(0)
    model = tiny_model("llama", layers=4)
    draft = DFlashDraftModel.for_target(
        model.config, num_layers=2, block_size=8, mask_token_id=VOCAB - 1
    ).eval()
    target = SimpleNamespace(
        plan=compiled_plan(compile_options(torch.device("cpu"))), device=torch.device("cpu")
    )
    feat = len(draft.config.target_layer_ids) * model.config.hidden_size
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        run = draft_context_pass(draft, target)
        assert draft_context_pass(draft, target) is run  # made once per drafter and target
        for rows, width, start in ((1, 9, 0), (1, 1, 9), (1, 3, 10), (2, 1, 40), (3, 5, 7)):
            features = torch.randn(rows, width, feat)
            positions = torch.arange(start, start + width).repeat(rows, 1)
            got, want = run(features, positions), draft.context_kv(features, positions)
            assert len(got) == len(want) == 2
            for (k, v), (k_want, v_want) in zip(got, want, strict=True):
                assert k.shape == k_want.shape and v.shape == v_want.shape
                torch.testing.assert_close(k, k_want, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(v, v_want, rtol=1e-4, atol=1e-4)
    # rows of one are specialised apart from more rows (dynamo), widths of one are not
    assert counters["stats"]["unique_graphs"] == 2
    target.plan = target.plan.replace(compile_options=None)
    assert draft_context_pass(draft, target) is None


def test_inductor_s_one_token_step_decodes_as_plain_decoding(monkeypatch):
    """The real CPU compile (inductor's C++ kernels, frozen weights, its GEMM template), not dynamo alone: greedy
    and seeded sampling through the compiled one-token step, and DFlash through the frozen verify, the compiled
    block pass and the compiled draft head, give plain decoding's tokens. (Transformers' SDPA attention here: the
    template alone has no kernel for every product of the short-query attention; the test below compiles that.)"""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("FLASHDRAFT_ATTENTION", "sdpa")
    model = tiny_model("llama", max_position_embeddings=1024)  # room for two capacities
    prompt = list(range(5, 30))
    target = Target(model)
    assert compile_verify(target) is None
    counters.clear()
    draft = DFlashDraftModel.for_target(model.config, num_layers=1, block_size=8, mask_token_id=VOCAB - 1)
    with torch._inductor.config.patch(fx_graph_cache=False):  # compiled here, so the counters see it
        for temperature in (0.0, 0.9):
            want = generate_ar(Target(model), prompt, 12, temperature=temperature, seed=3, stop_token_ids=[])
            got = generate_ar(target, prompt, 12, temperature=temperature, seed=3, stop_token_ids=[])
            assert got.new_tokens == want.new_tokens
        # the frozen verify of several tokens and the drafter's compiled block pass, at two capacities (the
        # cache's buffers are inputs of the frozen graphs, not constants)
        for ids in (prompt, [5 + i % 80 for i in range(300)]):
            got = generate(target, draft.eval(), ids, 12, stop_token_ids=[], block_size=8)
            assert got.new_tokens == generate_ar(Target(model), ids, 12, stop_token_ids=[]).new_tokens
    # the one-token and the several-token verify (7 linears a layer and the LM head) and the block pass, templated
    assert (
        counters["inductor"]["cpp_templated_kernel_counter"]
        >= 2 * (7 * model.config.num_hidden_layers + 1) + 8
    )
    assert (
        counters["inductor"]["select_algorithm_autotune"] == 0
    )  # one kernel per GEMM, never a timing's choice
    assert len(model._flashdraft_draft_heads) == 1  # the draft head the engine compiled beside them


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_fp32_short_query_attention_decodes_as_plain_decoding(arch):
    """Compiled on a CPU, an fp32 target's attention for short queries is attention.py's (two products, no K/V
    copies), with the CPU options as users get them (template or ATen by timing): greedy, seeded sampling and DFlash
    give plain eager decoding's tokens."""
    model = tiny_model(arch, max_position_embeddings=1024)
    prompt = list(range(5, 30))
    target = Target(model)
    assert compile_verify(target) is None
    assert model.config._attn_implementation == attention.NAME  # switched before anything was traced
    # the same weights, eager: SDPA's kernel
    reference = Target(tiny_model(arch, max_position_embeddings=1024))
    assert not reference.plan.static_cache and not reference.plan.compiled
    draft = DFlashDraftModel.for_target(model.config, num_layers=1, block_size=8, mask_token_id=VOCAB - 1)
    for temperature in (0.0, 0.9):
        want = generate_ar(reference, prompt, 12, temperature=temperature, seed=3, stop_token_ids=[])
        got = generate_ar(target, prompt, 12, temperature=temperature, seed=3, stop_token_ids=[])
        assert got.new_tokens == want.new_tokens
    ids = [5 + i % 80 for i in range(100)]
    got = generate(target, draft.eval(), ids, 12, stop_token_ids=[], block_size=8)
    assert got.new_tokens == generate_ar(reference, ids, 12, stop_token_ids=[]).new_tokens


def test_on_a_torch_the_gemm_kernels_are_not_made_for_bf16_and_int8_targets_decode_eagerly(monkeypatch):
    """gemm_templates.py edits torch-private inductor tables, made for one torch release: on another, a bf16 or int8
    target's `--compile` says so in one line and decodes eagerly (its rows would no longer keep one summation order);
    an fp32 target, which does not rely on them, still compiles."""
    from flashdraft.kernels import gemm_templates
    from flashdraft.kernels.quantize import quantize

    monkeypatch.setattr(gemm_templates, "TESTED_TORCH", ("2.0",))
    for dtype, scheme in ((torch.bfloat16, None), (torch.bfloat16, "int8"), (torch.float32, "int8")):
        model = tiny_model("llama").to(dtype)
        if scheme:
            quantize(model, scheme)
        target = Target(model)
        note = compile_verify(target)
        assert note is not None and note.startswith(
            "--compile: flashdraft's CPU GEMM kernels are tested with torch"
        )
        assert note.endswith("; decoding eagerly") and "\n" not in note and not target.plan.static_cache
    fp32 = Target(tiny_model("llama"))
    assert compile_verify(fp32) is None and fp32.plan.static_cache
    monkeypatch.setattr(gemm_templates, "TESTED_TORCH", (".".join(torch.__version__.split(".")[:2]),))
    assert gemm_templates.untested_torch() is None  # this torch: the edits serve


def test_an_operator_whose_fake_kernel_lies_about_its_output_is_an_error_not_a_silent_write():
    """The compiled CPU graphs keep inductor's `size_asserts`: flashdraft's C++ operators are opaque to inductor, which
    plans its buffers from their fake kernels; one that lies (here three columns out where the kernel writes four) is
    an assertion in the graph's wrapper, not memory written past a buffer."""
    from flashdraft.engine.compiled import compile_whole
    from flashdraft.kernels.plan import compile_options

    library = torch.library.Library("flashdraft_test_fake", "DEF")
    library.define("widen(Tensor x) -> Tensor")
    library.impl("widen", lambda x: torch.cat([x, x[:, :1]], dim=1), "CPU")
    torch.library.register_fake(
        "flashdraft_test_fake::widen", lambda x: x.new_empty(x.shape[0], x.shape[1]), lib=library
    )
    weights = torch.nn.Linear(3, 3).eval()
    step = compile_whole(
        lambda x: torch.ops.flashdraft_test_fake.widen(weights(x)) * 2,
        compile_options(torch.device("cpu")),
        weights=weights,
    )
    with torch.no_grad(), pytest.raises(AssertionError, match="size"):
        step(torch.randn(5, 3))
    library._destroy()
