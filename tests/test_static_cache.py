"""The GPU fast path, run on the CPU: the static KV cache (capacity fixed up front, rollback by a length, attention
over the whole buffer under the engine's mask) and its verify compiled whole (fullgraph: what CUDA-graph capture
needs) give every row exactly what plain decoding gives it."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import VOCAB, OracleProposer, hybrid_model, replan, tiny_model
from flashdraft import DFlashDraftModel, Target, generate_ar
from flashdraft.engine.compiled import compile_verify, verify_forward
from flashdraft.engine.compiled_draft import draft_block_pass
from flashdraft.engine.costs import CostModel
from flashdraft.engine.decoder import BatchDecoder
from flashdraft.engine.kv_cache import (
    CAPACITY_STEP,
    MASK_STEP,
    VERIFY_BUCKETS,
    StaticColumns,
    kv_buffer_class,
    kv_layers,
    static_mask,
)
from flashdraft.engine.measure import cost_key, measure_costs
from flashdraft.engine.proposers import PerRowProposers
from flashdraft.generate import generate, generate_batch, run
from flashdraft.kernels import attention
from flashdraft.sampling import SamplingParams

STATIC_ARCHS = ["llama", "qwen2", "qwen3", "mistral"]  # capabilities.STATIC_FAMILIES, each checked here
EAGER_GRAPH = {"backend": "eager"}  # dynamo traces the whole verify (fullgraph), the kernels stay eager


def prompts_and_limits(seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(5)]
    return prompts, [33, 9, 41, 2, 25]


def decode_rows(target, model, prompts, limits, temperature, record=None, masks=None):
    """Rows joining and leaving a batch of 3, an oracle proposer accepting a random prefix of each block; returns
    (results, plain decoding's results) and the decoder. `masks`: each verify's (mask width, columns cached before
    it, capacity) appended."""
    plain = Target(model)  # growing cache, eager: the reference
    alone = [generate_ar(plain, p, m, temperature=temperature, seed=7 + i, stop_token_ids=[])
             for i, (p, m) in enumerate(zip(prompts, limits, strict=True))]  # fmt: skip
    references = iter([p + a.new_tokens + [0] * 20 for p, a in zip(prompts, alone, strict=True)])
    rng = random.Random(5)
    decoder = BatchDecoder(
        target, PerRowProposers(lambda: OracleProposer(next(references), VOCAB, 7, rng)), 3
    )
    if record is not None:
        forward = decoder.forward_block

        def recorded(block, positions, tree=None):
            record.append((tuple(block.shape), kv_layers(decoder.cache)[0].static.capacity))
            return forward(block, positions, tree)

        decoder.forward_block = recorded
    if masks is not None:
        verify = decoder.verify

        def seen(block, positions, mask, cache):
            static = kv_layers(cache)[0].static
            masks.append((mask.shape[-1], decoder.valid.shape[1], static.capacity))
            return verify(block, positions, mask, cache)

        seen.compiled = verify.compiled
        decoder.verify = seen
    got = run(
        decoder, prompts, limits, SamplingParams(temperature=temperature), [], [7 + i for i in range(5)]
    )
    return got, alone, decoder


@pytest.mark.parametrize("arch", STATIC_ARCHS)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_static_cache_decodes_what_plain_decoding_gives(models, arch, temperature):
    target = Target(models[arch])
    replan(target, static_cache=True)
    shapes = []
    got, alone, decoder = decode_rows(target, models[arch], *prompts_and_limits(11), temperature, shapes)
    assert decoder.static
    for g, a in zip(got, alone, strict=True):
        assert g.new_tokens == a.new_tokens
    assert {n for (_, n), _ in shapes} <= {*VERIFY_BUCKETS, 7}  # padded to buckets (or the block)
    assert all(capacity % CAPACITY_STEP == 0 for _, capacity in shapes)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_cpu_static_cache_attends_over_the_columns_in_use(models, temperature):
    """On a CPU the engine's mask covers the columns in use rounded up to MASK_STEP, not the whole capacity, and
    attention.py's attention reads only those: rows joining and leaving still get plain decoding's tokens."""
    target = Target(models["llama"])
    replan(target, static_cache=True)
    masks = []
    prompts = [[5 + (7 * i + j) % 90 for j in range(length)] for i, length in enumerate((70, 3, 140, 20, 64))]
    got, alone, decoder = decode_rows(
        target, models["llama"], prompts, [33, 9, 41, 2, 25], temperature, masks=masks
    )
    assert decoder.narrow_mask and models["llama"].config._attn_implementation == attention.NAME
    for g, a in zip(got, alone, strict=True):
        assert g.new_tokens == a.new_tokens
    for width, columns, capacity in masks:
        assert columns < width < capacity and (width % MASK_STEP == 0 or width == capacity - 1)
    assert len({width for width, _, _ in masks}) >= 2


def test_one_row_keeps_its_buffers_and_moves_a_length(models):
    """A request alone: its capacity is fixed when it joins (prompt + max_new_tokens + block); every verify writes
    into the same buffers and a rollback only moves the length."""
    target = Target(models["llama"])
    replan(target, static_cache=True)
    prompt = list(range(3, 40))
    reference = generate_ar(Target(models["llama"]), prompt, 60, stop_token_ids=[]).new_tokens
    decoder = BatchDecoder(
        target,
        PerRowProposers(lambda: OracleProposer(prompt + reference + [0] * 20, VOCAB, 7, random.Random(2))),
    )
    row = decoder.add(prompt, 60, SamplingParams(), stop_token_ids=[], seed=0)
    layer = kv_layers(decoder.cache)[0]
    buffers, capacity = (layer._k.data_ptr(), layer._v.data_ptr()), layer.static.capacity
    assert capacity >= len(prompt) + 60 + 7
    while not row.done:
        decoder.step()
        if not row.done:
            assert (layer._k.data_ptr(), layer._v.data_ptr()) == buffers
            assert layer.get_seq_length() == len(prompt) + len(row.tokens) - 1  # the anchor is not cached yet
    assert layer.static.capacity == capacity
    assert row.tokens == reference


def test_static_rows_join_right_aligned_and_leave_with_their_columns_no_stale_value_unwritten():
    """A static layer's rows join (`add_static_row`) right-aligned, the rows already there moved right when the new
    one holds more columns, every other column of the new buffer zero (never uninitialised memory, which the mask
    would multiply by 0 but a NaN would spoil); rows leave (`keep_static_rows`) with the columns some row still
    uses moved to the front in order, in a buffer of the same capacity."""
    buffer_class = kv_buffer_class()
    layer = buffer_class()
    first = torch.randn(1, 2, 5, 4)
    layer.update(first, first + 1)
    static = StaticColumns(16)
    layer.make_static(static)
    layer._k[:, :, 5:] = 7.0  # stale columns: finite values a verify left, hidden by the mask
    longer = torch.randn(1, 2, 8, 4)
    layer.add_static_row(longer, longer + 1, 8)  # 8 columns: the first row moves 3 to the right
    expected = torch.zeros(2, 2, 16, 4)
    expected[0, :, 3:8], expected[1, :, :8] = first[0], longer[0]
    values = torch.zeros(2, 2, 16, 4)
    values[0, :, 3:8], values[1, :, :8] = first[0] + 1, longer[0] + 1
    assert torch.equal(layer._k, expected) and torch.equal(layer._v, values)
    assert layer.get_seq_length() == 8 and layer._k.shape[2] == static.capacity
    layer._k[:, :, 8:] = 7.0
    shorter = torch.randn(1, 2, 3, 4)
    layer.add_static_row(shorter, shorter + 1, 8)  # 3 columns: right-aligned, the rows here stay
    assert torch.equal(layer._k[:2], torch.cat([expected[:, :, :8], torch.full((2, 2, 8, 4), 7.0)], 2))
    assert torch.equal(layer._k[2], torch.cat([torch.zeros(2, 5, 4), shorter[0], torch.zeros(2, 8, 4)], 1))

    before, before_values = layer._k.clone(), layer._v.clone()
    layer.keep_static_rows(torch.tensor([2, 0]), torch.tensor([3, 6, 7]))
    assert layer._k.shape == (2, 2, 16, 4) and layer.get_seq_length() == 3
    assert torch.equal(layer.keys, before[[2, 0]][:, :, [3, 6, 7]])
    assert torch.equal(layer.values, before_values[[2, 0]][:, :, [3, 6, 7]])
    layer.keep_static_rows(torch.tensor([1]), None)  # every column kept: a length unchanged
    assert (
        torch.equal(layer._k, before[[0]][:, :, [3, 6, 7] + list(range(3, 16))])
        and layer.get_seq_length() == 3
    )


def test_static_mask_sees_valid_columns_and_the_block_causally():
    valid = torch.tensor([[True, False, True], [False, True, True]])
    mask = static_mask(valid, 2, 8, torch.float32)
    sees = (mask == 0)[:, 0]
    assert sees.shape == (2, 2, 8)
    assert sees[0].tolist() == [[True, False, True, True, False, False, False, False],
                                [True, False, True, True, True, False, False, False]]  # fmt: skip
    assert sees[1, 1].tolist() == [False, True, True, True, True, False, False, False]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_compiled_verify_is_a_few_whole_graphs(models, temperature):
    """The verify compiled with fullgraph=True (any graph break fails): the tokens of plain decoding, over batches of
    many sizes, lengths and positions, from a handful of graphs (a size seen to change becomes symbolic; a position
    is never part of a graph), so the graphs a GPU captures are made once and replayed at any position."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    target = Target(models["qwen3"])
    replan(target, static_cache=True, compile_options=EAGER_GRAPH)
    before = counters["stats"]["unique_graphs"]
    shapes = []
    for seed in (3, 4, 5):
        prompts, limits = prompts_and_limits(seed)
        got, alone, decoder = decode_rows(target, models["qwen3"], prompts, limits, temperature, shapes)
        for g, a in zip(got, alone, strict=True):
            assert g.new_tokens == a.new_tokens
    graphs = counters["stats"]["unique_graphs"] - before
    assert 1 <= graphs <= 8 and len(shapes) >= 30, (graphs, len(shapes))  # each step at its own positions


def _traced_llama(models):
    """The tiny Llama with a one-layer drafter, its verify traced whole by dynamo (kernels eager), dynamo's caches
    emptied first (and the note of which graphs the engine made ahead: they went with them)."""
    torch._dynamo.reset()
    model = models["llama"]
    for verify in model.__dict__.get("_flashdraft_verify_forwards", {}).values():
        verify.compiled_ahead.clear()
    draft = DFlashDraftModel.for_target(
        model.config, num_layers=1, block_size=8, mask_token_id=VOCAB - 1
    ).eval()
    target = Target(model)
    replan(target, static_cache=True, compile_options=EAGER_GRAPH)
    return model, draft, target


def test_another_capacity_or_verify_length_is_no_new_graph(models):
    """The rows, verify length and capacity are symbolic from the first compile, on every device: after one answer,
    prompts whose caches get other capacities, and other verify lengths, reuse the graphs (a first start compiles
    once, not again mid-answer; on an H100, when a GPU's sizes were left to dynamo, a new capacity recompiled the
    verify for 20-50 s inside an answer). The verify's inputs are cut from longer tensors, as the engine's are: their
    strides must not make graphs either."""
    from torch._dynamo.utils import counters

    model, draft, target = _traced_llama(models)
    for block_size in (8, 4):
        generate(
            target, draft, list(range(5, 25)), max_new_tokens=30, stop_token_ids=[], block_size=block_size
        )
    generate_ar(target, list(range(5, 25)), 10, stop_token_ids=[])
    first = counters["stats"]["unique_graphs"]
    capacities = set()
    for length, block_size in ((100, 8), (200, 4), (150, 6)):  # capacities 256, 512, 256 (256 before)
        prompt = [5 + i % 80 for i in range(length)]
        generate(target, draft, prompt, max_new_tokens=30, stop_token_ids=[], block_size=block_size)
        plain = generate_ar(target, prompt, 10, stop_token_ids=[])
        capacities.add(-(-int(1.25 * (length + 30 + 8)) // CAPACITY_STEP) * CAPACITY_STEP)
        assert plain.new_tokens == generate_ar(Target(model), prompt, 10, stop_token_ids=[]).new_tokens
    assert capacities == {256, 512}
    assert counters["stats"]["unique_graphs"] == first


def test_a_caller_in_inference_mode_compiles_nothing_mid_answer(models, monkeypatch):
    """dynamo guards on whether a tensor was made in inference mode, so graphs made ahead under no_grad (the cost
    measurement, an earlier request) are no graphs for a caller in inference mode (the bench). The first step on
    which the policy then skipped drafting compiled the one-token verify inside the answer: 20-28 s stalls on 2-core
    CPUs, 9.5 s on an H100, each on the run's first plain step. Each mode's graphs are made before its first step."""
    from torch._dynamo.utils import counters

    import flashdraft.engine.batched_dflash as batched

    model, draft, target = _traced_llama(models)
    prompt = list(range(5, 25))
    generate(target, draft, prompt, max_new_tokens=12, stop_token_ids=[], block_size=8)  # under no_grad
    propose, steps = batched.BatchedDFlashProposer.propose, []

    def skipping(self, rows, max_drafts):  # the policy skips drafting on the answer's third and fifth steps
        steps.append(counters["stats"]["unique_graphs"])
        if len(steps) in (3, 5):
            self.policy.skip_left = 1
        return propose(self, rows, max_drafts)

    monkeypatch.setattr(batched.BatchedDFlashProposer, "propose", skipping)
    with torch.inference_mode():
        out = generate(target, draft, prompt, max_new_tokens=24, stop_token_ids=[], block_size=8)
    assert len(steps) >= 6 and 1 in out.acceptance_lengths  # the skipped steps verified one token
    assert counters["stats"]["unique_graphs"] == steps[1]  # all made by the end of the first step
    assert out.new_tokens == generate_ar(Target(model), prompt, 24, stop_token_ids=[]).new_tokens


def test_a_batch_s_last_row_drafting_alone_compiles_nothing_mid_answer(models, monkeypatch):
    """A batch whose rows first draft together, then one row drafting alone once the others have left: dynamo keeps
    a size of one apart, and the drafter's one-row graphs (block pass, context projection) compiled there, in the
    middle of that row's answer (3.4-3.7 s a process at 8 int8 rows on a Zen 4 EPYC). The several-row graphs
    take it doubled: no graph is made after the first step, and every row answers as plain decoding."""
    from torch._dynamo.utils import counters

    import flashdraft.engine.batched_dflash as batched

    model, draft, target = _traced_llama(models)
    lengths = [1, 2, 4, 8]  # a verify costs one step whatever its length: drafting always pays
    costs = CostModel(lengths, [1.0] * 4, [0.0] * 4, draft_base=0.01)
    draft_rows, propose, passes, steps = (
        batched.BatchedDFlashProposer.draft_rows,
        batched.BatchedDFlashProposer.propose,
        [],
        [],
    )

    def drafting(self, rows, slots=None):
        passes.append(len(rows))
        return draft_rows(self, rows, slots)

    def stepping(self, rows, max_drafts):
        steps.append(counters["stats"]["unique_graphs"])
        return propose(self, rows, max_drafts)

    monkeypatch.setattr(batched.BatchedDFlashProposer, "draft_rows", drafting)
    monkeypatch.setattr(batched.BatchedDFlashProposer, "propose", stepping)
    prompts = [list(range(5, 25)), list(range(30, 41)), list(range(50, 66))]
    limits = [40, 6, 6]
    got = generate_batch(target, draft, prompts, limits, stop_token_ids=[], block_size=8, costs=costs)
    assert passes[0] == 3 and passes[-1] == 1 and passes.count(1) >= 3, passes  # together first, then alone
    assert counters["stats"]["unique_graphs"] == steps[1], (
        steps
    )  # every graph made by the end of the first step
    for out, prompt, limit in zip(got, prompts, limits, strict=True):
        assert out.new_tokens == generate_ar(Target(model), prompt, limit, stop_token_ids=[]).new_tokens


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize(("temperature", "kind"), [(0.0, "v1"), (0.8, "v1"), (0.0, "dflash2")])
def test_a_drafter_beside_the_static_cache_decodes_rows_as_plain_decoding(
    models, compiled, temperature, kind
):
    """The drafter's static context (capacity-wide buffers, padding past the used columns) and its compiled block
    pass (v1, and DFlash2's convolutions), with rows of different lengths joining and leaving a batch of 3."""
    from test_dflash2 import dflash2_drafter

    model = models["qwen3"]
    if kind == "v1":
        draft = DFlashDraftModel.for_target(model.config, num_layers=2, block_size=8, mask_token_id=VOCAB - 1)
    else:
        draft = dflash2_drafter(model, block_size=8)
    draft.eval()
    prompts, limits = prompts_and_limits(7)
    plain = Target(model)
    want = [generate_ar(plain, p, m, temperature=temperature, seed=i, stop_token_ids=[]).new_tokens
            for i, (p, m) in enumerate(zip(prompts, limits, strict=True))]  # fmt: skip
    target = Target(model)
    replan(target, static_cache=True, compile_options=EAGER_GRAPH if compiled else None)
    got = generate_batch(target, draft, prompts, limits, temperature=temperature, stop_token_ids=[], block_size=8,
                         seed=list(range(5)), max_batch_size=3)  # fmt: skip
    assert [g.new_tokens for g in got] == want
    assert bool(draft.__dict__.get("_flashdraft_block_passes")) == compiled  # the block pass ran compiled


def test_dflash_generate_is_the_same_compiled(models):
    """The real drafter path (the cost-aware policy and its measured prices) through the compiled static verify."""
    model = models["llama"]
    draft = DFlashDraftModel.for_target(
        model.config, num_layers=1, block_size=8, mask_token_id=VOCAB - 1
    ).eval()
    prompt = list(range(5, 30))
    reference = generate(Target(model), draft, prompt, max_new_tokens=40, stop_token_ids=[])
    target = Target(model)
    assert compile_verify(target) is None  # on a CPU: inductor's C++ kernels, weights frozen
    assert target.plan.compile_options["options"]["freezing"] is True
    # the cost model's cache key names the options the same in every process (no function address in it)
    assert "no_module_guards" in json.dumps(cost_key(target, draft)) and "0x" not in json.dumps(
        cost_key(target, draft)
    )
    replan(target, compile_options=EAGER_GRAPH)
    for block_size in ("auto", 8):
        out = generate(target, draft, prompt, max_new_tokens=40, stop_token_ids=[], block_size=block_size)
        assert out.new_tokens == reference.new_tokens


def test_compiling_leaves_the_target_s_options_whole():
    """torch.compile pops `guard_filter_fn` out of the options dict it is given: the verify and the drafter's block
    pass are compiled from copies, so both skip the module guards and the cost model's cache key stays the same
    within a process (torch.compile is lazy: nothing is compiled here)."""
    model = tiny_model("llama")
    draft = DFlashDraftModel.for_target(model.config, num_layers=1, block_size=8, mask_token_id=VOCAB - 1)
    target = Target(model)
    assert compile_verify(target) is None
    key = json.dumps(cost_key(target, draft))
    verify_forward(target, draft.config.target_layer_ids)
    draft_block_pass(draft.eval(), target)
    assert "guard_filter_fn" in target.plan.compile_options["options"]
    assert json.dumps(cost_key(target, draft)) == key


def _priced_pair(models, compiled: bool):
    """The llama target on the static cache (its verify compiled by dynamo alone, if `compiled`) and a drafter."""
    model = models["llama"]
    draft = DFlashDraftModel.for_target(
        model.config, num_layers=1, block_size=8, mask_token_id=VOCAB - 1
    ).eval()
    target = Target(model)
    replan(target, static_cache=True)
    if compiled:
        replan(target, compile_options=EAGER_GRAPH)
    return target, draft


def test_a_compiled_target_s_first_calls_are_compiling_said_and_outside_the_price_budget(models, monkeypatch):
    """A first start compiles a graph per verify length (minutes on 2 cores): those first calls are said, one line
    each, and kept out of the budget, so the price list is complete and cached however long they take, and a second
    start reads it instead of compiling and measuring again (where each start did, 2.5 minutes a start: 2026-12-07)."""
    import time

    target, draft = _priced_pair(models, compiled=True)
    seen = set()
    forward_block = BatchDecoder.forward_block

    def compiling_first(self, tokens, positions, *args, **kwargs):
        if tokens.shape[1] not in seen:  # a length's first call: "compiling" takes 0.3 s
            seen.add(tokens.shape[1])
            time.sleep(0.3)
        return forward_block(self, tokens, positions, *args, **kwargs)

    monkeypatch.setattr(BatchDecoder, "forward_block", compiling_first)
    said = []
    costs = measure_costs(
        target, draft, repeats=1, contexts=(16, 48), batch_tokens=(), budget_s=0.5, log=said.append
    )
    assert costs.complete, said  # 4 lengths x 0.3 s of compiling, a budget of 0.5 s
    lines = [line.rsplit(" (", 1)[0].removeprefix("  prices: ") for line in said]
    assert lines[:5] == [
        f"compiling the verify of {n} tokens ({i + 1} of 4)" for i, n in enumerate((1, 2, 4, 8))
    ] + ["compiling the draft pass"]
    assert "verify of 1-8 tokens and a draft pass after 48 tokens of context" in lines


@pytest.mark.parametrize("compiled", [False, True])
def test_static_verify_prices_the_bucket_lengths_and_the_engine_s_draft_pass(models, compiled, monkeypatch):
    """Beside a static cache the verify is priced at the bucket lengths, and the draft pass through the engine's own
    proposer: its compiled block pass when the verify is compiled (the eager proposer's pass overpriced drafting
    beside CUDA graphs on an H100)."""
    target, draft = _priced_pair(models, compiled)
    from flashdraft.engine.batched_dflash import BatchedDFlashProposer
    from flashdraft.engine.proposers import DFlashProposer

    timed = {"eager proposer": 0, "engine's proposer": 0}

    def counting(cls, name, key):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            timed[key] += 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    counting(DFlashProposer, "draft_confidences", "eager proposer")
    counting(BatchedDFlashProposer, "draft_rows", "engine's proposer")
    costs = measure_costs(target, draft, repeats=1, contexts=(16, 48), batch_tokens=())
    assert costs.lengths == [1, 2, 4, 8]
    assert all(t > 0 for t in costs.verify_base)
    assert costs.draft_base + costs.draft_slope * 16 > 0
    # the engine's passes: a warm-up and one timed per context, and the row-count slope's; compiled, one more first
    # (its graph compiles outside the budget); no eager proposer
    assert timed == {"eager proposer": 0, "engine's proposer": 2 * 2 + 2 * 2 + compiled}, timed
    assert bool(draft.__dict__.get("_flashdraft_block_passes")) == compiled


@pytest.mark.parametrize("make", [lambda m: m["gemma3"], lambda m: hybrid_model("qwen3_next")])
def test_targets_the_static_cache_cannot_serve_decode_as_before(models, make):
    """Sliding windows and recurrent layers are rolled back by the growing path: the static cache is not used on
    them, even when asked, and --compile says so in one line."""
    target = Target(make(models))
    if target.unsupported_reason:  # recurrent targets decode on transformers 5.x only
        pytest.skip(target.unsupported_reason)
    replan(target, static_cache=True)
    decoder = BatchDecoder(target, PerRowProposers(lambda: OracleProposer([], VOCAB, 4, random.Random(0))))
    assert not decoder.static and decoder.verify is None
    note = compile_verify(target)
    assert note is not None and "decoding eagerly" in note and "\n" not in note


def test_a_server_decodes_through_the_compiled_verify(models):
    """`serve --compile`: the engine's worker thread runs the compiled static verify, and concurrent requests (one
    batch) get what `generate` gives each alone."""
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from flashdraft.serve import Engine, build_app
    from test_serve import MODEL

    model = models["llama"]
    draft = DFlashDraftModel.for_target(
        model.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1
    ).eval()
    reference, target = _served_targets(model)
    engine = Engine(target, draft, max_queue=8, block_size=4)
    prompts = [[{"role": "user", "content": " ".join(f"w{3 + (i * 7 + j) % 80}" for j in range(4 + 3 * i))}]
               for i in range(3)]  # fmt: skip
    try:
        with TestClient(build_app(engine, MODEL)) as client:
            ask = _asker(client, 20)
            with ThreadPoolExecutor(3) as pool:
                answers = list(pool.map(ask, prompts))
    finally:
        engine.close()
    for messages, answer in zip(prompts, answers, strict=True):
        ids = reference.encode_prompt(messages)
        want = generate(reference, draft, ids, 20, block_size=4).new_tokens
        assert answer == reference.tokenizer.decode(want, skip_special_tokens=True)


def test_the_static_draft_context_holds_what_a_growing_one_holds():
    """Rows joining and leaving, growth past the capacity, compaction: the static context's used columns are the
    growing one's, and every column past them is padding the mask hides."""
    from flashdraft.drafter.context_cache import PAD_POSITION, DraftContextCache

    torch.manual_seed(0)
    growing, static = DraftContextCache(ragged=True), DraftContextCache(ragged=True, capacity=CAPACITY_STEP)

    def absorb(n, rows, start):
        positions = torch.arange(start, start + n).repeat(rows, 1)
        kvs = [(torch.randn(rows, 2, n, 4), torch.randn(rows, 2, n, 4)) for _ in range(2)]
        for cache in (growing, static):
            for layer, (k, v) in enumerate(kvs):
                cache.append(layer, k, v, positions if layer == 0 else None)

    def same():
        n = len(growing)
        assert len(static) == n and static.positions.shape[1] == static.capacity >= n
        assert torch.equal(static.positions[:, :n], growing.positions)
        assert bool((static.positions[:, n:] == PAD_POSITION).all())
        for a, b in zip(growing.keys + growing.values, static.keys + static.values, strict=True):
            assert b.shape[2] == static.capacity and torch.equal(b[:, :, :n], a)

    absorb(5, 1, 0)
    same()
    for cache in (growing, static):
        cache.add_row()
    absorb(300, 2, 5)  # past the capacity: it grows, in CAPACITY_STEP multiples
    same()
    assert static.capacity % CAPACITY_STEP == 0 and static.capacity > CAPACITY_STEP
    for cache in (growing, static):
        cache.select_rows([1])
        cache.add_row()
    absorb(3, 2, 305)
    same()
    order = torch.stack([torch.arange(300, 308), torch.arange(8)])
    for cache in (growing, static):
        cache.keep_columns(order)
    same()
    assert len(static) == 8


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU (the device playbook's first call runs it)"
)
@pytest.mark.parametrize("block_size", [8, "auto"])
@pytest.mark.parametrize("tree", [None, 8])
def test_cuda_graphs_decode_what_the_eager_gpu_path_decodes(models, block_size, tree):
    """On a GPU: --compile (the static caches, CUDA graphs of the verify and of the block pass; draft trees in the
    graphed verify's mask) against the growing cache, eager, on the same device: the same tokens, a batch and a
    single request."""
    import copy

    model = copy.deepcopy(models["llama"]).cuda()
    draft = DFlashDraftModel.for_target(model.config, num_layers=1, block_size=8, mask_token_id=VOCAB - 1)
    draft = draft.cuda().eval()
    prompts, limits = prompts_and_limits(9)
    eager = Target(model)
    replan(eager, static_cache=False)
    want = generate_batch(
        eager, draft, prompts, limits, stop_token_ids=[], block_size=block_size, max_batch_size=3, tree=tree
    )
    target = Target(model)
    assert compile_verify(target) is None and target.plan.compile_options["options"]["triton.cudagraphs"]
    for _ in range(2):  # the second run replays the graphs the first recorded
        got = generate_batch(target, draft, prompts, limits, stop_token_ids=[], block_size=block_size,
                             max_batch_size=3, tree=tree)  # fmt: skip
        assert [g.new_tokens for g in got] == [w.new_tokens for w in want]
    one = generate(
        target, draft, prompts[0], max_new_tokens=30, stop_token_ids=[], block_size=block_size, tree=tree
    )
    assert one.new_tokens == want[0].new_tokens[:30]


def test_the_static_cache_serves_only_what_it_is_verified_on(models, monkeypatch):
    """A family not checked token for token, or attention that would not take the engine's mask (FlashAttention-2
    reads a mask as padding only), keeps the growing cache: exact, eagerly, and `--compile` says why."""
    import flashdraft.targets.capabilities as capabilities

    target = Target(models["llama"])
    assert capabilities.static_refusal(target) is None
    monkeypatch.setattr(capabilities, "STATIC_FAMILIES", ("qwen3",))
    assert "llama" in capabilities.static_refusal(target) and not capabilities.static_capable(target)
    monkeypatch.undo()
    config = type(target.model.config)
    monkeypatch.setattr(
        config, "_attn_implementation", property(lambda self: "flash_attention_2"), raising=False
    )
    assert "flash_attention_2" in compile_verify(target) and not target.plan.compiled


@pytest.mark.parametrize("drafted", [False, True])
def test_a_compiled_server_makes_its_several_row_graphs_before_the_first_request(models, drafted):
    """dynamo keeps a size of 1 apart, so a compiled server that met one request at a time compiled again at its
    first batch of several, in the middle of their answers (86 s for the plain int8 server's first batch of 8 on a
    2-core Xeon). The worker decodes two rows together before it serves: a batch after a lone request makes no
    graph, and answers as plain decoding does. With a drafter whose drafts do not pay, the policy would skip the
    draft pass of those two rows (its probes come 2+ steps apart): it drafts them anyway, the first pass of
    several rows (at 8 rows on the int8 server, 10 s answers without)."""
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient
    from torch._dynamo.utils import counters

    from flashdraft.serve import Engine, build_app
    from test_serve import MODEL

    torch._dynamo.reset()
    model = models["llama"]
    reference, target = _served_targets(model)
    draft, costs = None, None
    if drafted:  # a verify of n tokens costs about n plain steps: drafting never pays, the policy skips it
        draft = DFlashDraftModel.for_target(model.config, num_layers=1, block_size=8, mask_token_id=VOCAB - 1)
        lengths = [1, 2, 4, 8]
        costs = CostModel(lengths, [0.9 * n + 0.1 for n in lengths], [0.0] * 4, draft_base=0.2)
    engine = Engine(target, draft, max_queue=8, max_batch_size=4, costs=costs)
    prompts = [[{"role": "user", "content": " ".join(f"w{3 + (i * 5 + j) % 80}" for j in range(3 + 2 * i))}]
               for i in range(4)]  # fmt: skip
    try:
        with TestClient(build_app(engine, MODEL)) as client:
            ask = _asker(client, 12)
            answers = [ask(prompts[0])]  # alone
            if drafted:  # the warm-up's two rows were drafted together
                assert engine.decoder.proposer.passes_made == {False, True}
            graphs = counters["stats"]["unique_graphs"]
            with ThreadPoolExecutor(3) as pool:  # then together
                answers += list(pool.map(ask, prompts[1:]))
            assert max(engine.steps_by_rows) > 1  # they were decoded in one batch
            assert counters["stats"]["unique_graphs"] == graphs
    finally:
        engine.close()
    for messages, answer in zip(prompts, answers, strict=True):
        want = generate_ar(reference, reference.encode_prompt(messages), 12).new_tokens
        assert answer == reference.tokenizer.decode(want, skip_special_tokens=True)


def _served_targets(model):
    """(a plain Target for reference answers, one served through the static cache with its verify traced whole)."""
    from test_serve import MODEL, tiny_tokenizer

    target = Target(model, tiny_tokenizer(), name=MODEL)
    replan(target, static_cache=True, compile_options=EAGER_GRAPH)
    return Target(model, tiny_tokenizer(), name=MODEL), target


def _asker(client, max_tokens):
    """A function sending one greedy chat request through `client` and returning the answer's text."""
    from test_serve import MODEL

    def ask(messages):
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    return ask
