"""Batched speculative decoding: every row decodes exactly as it would alone, whatever the others accept."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import ARCHS, VOCAB, OracleProposer, tiny_model
from flashdraft import DFlashDraftModel, GenerationError, Target, generate, generate_ar
from flashdraft.engine.batched_dflash import BatchedDFlashProposer
from flashdraft.engine.decoder import BatchDecoder
from flashdraft.engine.proposers import DFlashProposer, PerRowProposers
from flashdraft.engine.request import BatchRow
from flashdraft.generate import generate_batch
from flashdraft.sampling import SamplingParams


def random_prompts(n: int, seed: int, vocab: int = VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))] for _ in range(n)]


def drafter(model, block_size=8, layers=2, seed=1):
    return DFlashDraftModel.for_target(
        model.config, num_layers=layers, block_size=block_size, mask_token_id=VOCAB - 1, seed=seed
    ).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_acceptance_equals_decoding_alone(models, arch):
    """Oracle proposers right for a random number of drafts per row and step: rows accept different lengths every
    step, finish at different steps (lengths, stop tokens), and each row's output is its own greedy decoding.
    gemma3 has an 8-token sliding window, far shorter than these outputs."""
    model = models[arch]
    target = Target(model)
    prompts = random_prompts(5, seed=len(arch))
    limits = [40, 7, 55, 1, 30]
    eos = [5]
    alone = [generate_ar(target, p, m, stop_token_ids=eos) for p, m in zip(prompts, limits, strict=True)]
    references = iter(
        [p + generate_ar(target, p, 80, stop_token_ids=[]).new_tokens + [0] * 20 for p in prompts]
    )
    rng = random.Random(3)
    oracles: list[OracleProposer] = []

    def oracle():
        o = OracleProposer(next(references, [0] * 200), VOCAB, 6, rng)
        oracles.append(o)
        return o

    got = generate_batch(target, oracle, prompts, max_new_tokens=limits, stop_token_ids=eos)
    for g, a in zip(got, alone, strict=True):
        assert g.new_tokens == a.new_tokens
        assert g.stop_reason == a.stop_reason
        assert 1 + sum(g.acceptance_lengths) == g.num_new_tokens
    # The acceptance really was ragged: rows accepted different numbers of drafts in the same step.
    steps = [g.accepted_drafts for g in got if len(g.accepted_drafts) > 3]
    assert len({tuple(s[:3]) for s in steps}) > 1
    assert max(a for g in got for a in g.accepted_drafts) == 5  # whole blocks accepted too


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("mode", ["auto", "fixed"])
def test_dflash_batch_greedy_equals_alone(models, arch, mode):
    model = models[arch]
    target = Target(model)
    draft = drafter(model)
    prompts = random_prompts(4, seed=11)
    block = "auto" if mode == "auto" else 5
    got = generate_batch(target, draft, prompts, 24, stop_token_ids=[], block_size=block)
    for g, p in zip(got, prompts, strict=True):
        assert g.new_tokens == generate_ar(target, p, 24, stop_token_ids=[]).new_tokens
        if mode == "fixed":  # B-1 drafts every step, fewer only where max_new_tokens is near
            done = 1 + torch.tensor([0, *g.acceptance_lengths[:-1]]).cumsum(0)
            assert g.draft_lengths == [min(4, 24 - int(n) - 1) for n in done]


def test_sampled_batch_is_plain_sampling_with_each_rows_seed():
    model = tiny_model("llama", seed=3, vocab=6, layers=4, initializer_range=0.5)
    target = Target(model)
    draft = DFlashDraftModel.for_target(model.config, num_layers=1, block_size=4, mask_token_id=5)
    prompts = [[3, 1, 4, 1, 5], [2, 7 % 6], [1, 1, 1, 1, 1, 1, 1, 1]]
    seeds = [11, 12, 13]
    params = dict(temperature=0.8, top_p=0.95, stop_token_ids=[])
    for block in ("auto", 4):
        got = generate_batch(target, draft, prompts, 20, seed=seeds, block_size=block, **params)
        for g, p, s in zip(got, prompts, seeds, strict=True):
            assert g.new_tokens == generate_ar(target, p, 20, seed=s, **params).new_tokens
    assert sum(sum(g.accepted_drafts) for g in got) > 0  # drafts were accepted along the way


def test_batched_draft_pass_equals_single_row_drafts(models):
    """The batched drafter (padded, ragged context cache) drafts each row exactly as the single-row proposer
    does, through steps that fix different numbers of tokens per row, rows leaving and a row joining."""
    model = models["qwen3"]
    target = Target(model)
    draft = drafter(model, block_size=6)
    batched = BatchedDFlashProposer(draft, target, block_size=6)
    taps = batched.tap_layer_ids
    rng = random.Random(0)
    rows, singles = [], []

    def join(prompt):
        ids = torch.tensor([prompt])
        features = target.forward(ids, None, taps).features
        row = BatchRow(ids[:, :-1], 100, SamplingParams(), set(), 0, tokens=[prompt[-1]])
        batched.add(row, features[:, :-1])
        single = DFlashProposer(draft, target)
        single.start(features[:, :-1])
        rows.append(row)
        singles.append(single)

    for p in random_prompts(3, seed=5):
        join(p + [7])
    feat_dim = len(taps) * target.hidden_size
    for step in range(12):
        tokens, probs = batched.draft_rows(rows)
        for i, (row, single) in enumerate(zip(rows, singles, strict=True)):
            t, pr = single.draft_confidences(row.tokens[-1], row.anchor_position, 5)
            assert tokens[i].tolist() == t.tolist()
            torch.testing.assert_close(probs[i], pr, rtol=1e-4, atol=1e-5)
        fixed = []
        for row in rows:  # each row fixes 1..6 tokens (anchor + accepted), with made-up features
            k = rng.randint(1, 6)
            row.tokens.extend(rng.randrange(3, VOCAB) for _ in range(k))
            fixed.append(torch.randn(1, k, feat_dim))
        batched.accept(rows, fixed)
        for single, f in zip(singles, fixed, strict=True):
            single.accept(f)
        if step == 4:  # the middle row leaves
            batched.remove([0, 2])
            del rows[1], singles[1]
        if step == 7:
            join(random_prompts(1, seed=9)[0] + [4])


def test_rows_join_and_leave_between_steps(models):
    """Continuous batching: at most two rows at a time, prompts join as rows finish; outputs stay exact."""
    target = Target(models["mistral"])
    prompts = random_prompts(5, seed=2)
    limits = [3, 30, 12, 20, 9]
    got = generate_batch(
        target, drafter(models["mistral"]), prompts, limits, stop_token_ids=[], max_batch_size=2
    )
    for g, p, m in zip(got, prompts, limits, strict=True):
        assert g.new_tokens == generate_ar(target, p, m, stop_token_ids=[]).new_tokens


def test_cancel_frees_the_row_at_once(models):
    target = Target(models["llama"])
    decoder = BatchDecoder(target, PerRowProposers(lambda: DFlashProposer(drafter(models["llama"]), target)))
    prompts = random_prompts(3, seed=4)
    rows = [decoder.add(p, 50, SamplingParams(), stop_token_ids=[]) for p in prompts]
    decoder.step()
    width = decoder.valid.shape[1]
    decoder.cancel(rows[1])
    assert len(decoder) == 2 and rows[1].done and rows[1].result.stop_reason == "cancelled"
    assert decoder.valid.shape[0] == 2 and decoder.cache.layers[0].keys.shape[0] == 2
    assert decoder.valid.shape[1] <= width
    while len(decoder):
        decoder.step()
    for row, p in zip((rows[0], rows[2]), (prompts[0], prompts[2]), strict=True):
        assert row.result.new_tokens == generate_ar(target, p, 50, stop_token_ids=[]).new_tokens


def test_stop_callback_and_first_token_stop(models):
    target = Target(models["llama"])
    prompt = random_prompts(1, seed=8)[0]
    first = generate_ar(target, prompt, 1).new_tokens[0]
    decoder = BatchDecoder(target, PerRowProposers(lambda: DFlashProposer(drafter(models["llama"]), target)))
    row = decoder.add(prompt, 10, SamplingParams(), stop_token_ids=[first])
    assert row.done and row.result.stop_reason == "stop_token" and len(decoder) == 0
    seen: list[int] = []
    row = decoder.add(
        prompt, 40, SamplingParams(), stop_token_ids=[], on_tokens=lambda t: seen.extend(t) or len(seen) >= 5
    )
    while len(decoder):
        decoder.step()
    assert row.result.stop_reason == "caller" and row.result.new_tokens == seen
    assert seen == generate_ar(target, prompt, len(seen), stop_token_ids=[]).new_tokens


def test_bad_batches_are_clear_errors(models):
    target = Target(models["llama"])
    with pytest.raises(GenerationError, match="one value or one per prompt"):
        generate_batch(target, None, [[3, 4], [5]], max_new_tokens=[4])
    with pytest.raises(GenerationError, match="exceeds the target's context"):
        generate_batch(target, None, [[3, 4], [5] * 250], max_new_tokens=10)
    with pytest.raises(GenerationError, match="block_size must be between 1"):
        generate_batch(target, drafter(models["llama"]), [[3, 4]], 4, block_size=9)
    with pytest.raises(GenerationError, match="generate_batch"):
        generate(target, drafter(models["llama"]), [[3, 4], [5, 6]])
    assert generate_batch(target, None, []) == []


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_bucketed_verify_lengths_decode_the_same_tokens(models, temperature):
    """The GPU path pads every verify to a few fixed lengths: with buckets forced on here, ragged oracle acceptance,
    rows joining and leaving, every row still gets exactly the tokens plain decoding gives it (the padding is
    verified like drafts), and the steps really ran at bucket lengths."""
    from flashdraft.generate import run

    target = Target(models["llama"])
    prompts = random_prompts(5, seed=11)
    limits = [33, 9, 41, 2, 25]
    sampling = SamplingParams(temperature=temperature)
    alone = [generate_ar(target, p, m, temperature=temperature, seed=7 + i, stop_token_ids=[])
             for i, (p, m) in enumerate(zip(prompts, limits, strict=True))]  # fmt: skip
    references = iter([p + a.new_tokens + [0] * 20 for p, a in zip(prompts, alone, strict=True)])
    rng = random.Random(5)
    proposer = PerRowProposers(lambda: OracleProposer(next(references), VOCAB, 7, rng))
    decoder = BatchDecoder(target, proposer, max_batch_size=3)
    decoder.verify_buckets = (1, 2, 4, 8)
    lengths = []
    timed = proposer.timed
    proposer.timed = lambda rows, n, *a: (lengths.append(n), timed(rows, n, *a))
    got = run(decoder, prompts, limits, sampling, [], [7 + i for i in range(5)])
    for g, a in zip(got, alone, strict=True):
        assert g.new_tokens == a.new_tokens
    assert set(lengths) <= {1, 2, 4, 7} and len(set(lengths)) > 1, lengths
