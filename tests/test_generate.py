"""Greedy decoding through flashdraft is the target's own greedy decoding, token for token."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import ARCHS, VOCAB, OracleProposer, hf_greedy
from flashdraft import (
    DFlashDraftModel,
    GenerationError,
    SamplingError,
    Target,
    generate,
    generate_ar,
)


def random_drafter(model, block_size=8, mask_token_id=VOCAB - 1, seed=0, layers=2):
    return DFlashDraftModel.for_target(
        model.config, num_layers=layers, block_size=block_size, mask_token_id=mask_token_id, seed=seed
    ).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_hf_generate_random_drafter(models, arch):
    """>= 50 prompts over >= 3 families (13 per family here), random drafters, random lengths and stops."""
    model = models[arch]
    target = Target(model)
    draft = random_drafter(model, block_size=8, seed=1)
    rng = random.Random(hash(arch) % 1000)
    for _ in range(13):
        ids = torch.tensor([[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 24))]])
        max_new = rng.randint(1, 40)
        eos = [rng.randrange(3, VOCAB)] if rng.random() < 0.5 else []
        expected = hf_greedy(model, ids, max_new, eos)
        block = rng.choice([None, 2, 5, 8])
        got = generate(target, draft, ids, max_new, stop_token_ids=eos, block_size=block)
        assert got.new_tokens == expected
        assert got.sequences[0, : ids.shape[1]].tolist() == ids[0].tolist()
        # Every emitted token is accounted for: the first from prefill, the rest by verify steps.
        assert 1 + sum(got.acceptance_lengths) == got.num_new_tokens
        assert all(1 <= a <= (block or 8) for a in got.acceptance_lengths)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_oracle_proposer_long_runs_rollback_stops(models, arch):
    """A proposer right for the first k drafts (k random, including B-1) then wrong: acceptance must be exactly
    k + 1 per step, output must stay exact through rollbacks, stops and max_new_tokens landing mid-block."""
    model = models[arch]
    target = Target(model)
    rng = random.Random(7)
    block_size = 6
    full_accepts = 0
    for trial in range(12):
        ids = torch.tensor([[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 12))]])
        reference = ids[0].tolist() + hf_greedy(model, ids, 80, None)
        eos = []
        if trial % 3 == 0:  # stop on a token that does occur in the continuation, possibly mid-block
            eos = [reference[ids.shape[1] + rng.randint(5, 30)]]
        max_new = rng.randint(1, 60)
        expected = hf_greedy(model, ids, max_new, eos)
        proposer = OracleProposer(reference, VOCAB, block_size, rng)
        got = generate(target, proposer, ids, max_new, stop_token_ids=eos)
        assert got.new_tokens == expected
        # Acceptance is exactly the oracle's k + 1 except where the output was cut (stop / max_new_tokens).
        # A last step with a single token left drafts nothing, so the proposer may not have been asked.
        assert len(got.acceptance_lengths) - len(proposer.chosen_k) in (0, 1)
        for step, (k, a) in enumerate(zip(proposer.chosen_k, got.acceptance_lengths, strict=False)):
            if step < got.num_steps - 1:
                assert a == k + 1
            else:
                assert a <= k + 1
        full_accepts += sum(k == block_size - 1 for k in proposer.chosen_k)
    assert full_accepts > 0  # whole blocks accepted at least once


def test_mask_token_in_output_is_kept(models):
    """Output tokens equal to the mask id are real tokens; nothing filters by value."""
    model = models["llama"]
    ids = torch.tensor([[5, 17, 33, 2 + 40]])
    expected = hf_greedy(model, ids, 30, None)
    mask_id = max(set(expected), key=expected.count)  # a token the target really produces
    draft = random_drafter(model, block_size=4, mask_token_id=mask_id)
    got = generate(Target(model), draft, ids, 30, stop_token_ids=[])
    assert mask_id in got.new_tokens
    assert got.new_tokens == expected


def test_generate_ar_matches_and_reports(models):
    model = models["qwen2"]
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    res = generate_ar(Target(model), ids, 25, stop_token_ids=[])
    assert res.new_tokens == hf_greedy(model, ids, 25, None)
    assert res.acceptance_lengths == [1] * 24 and res.mean_acceptance_length == 1.0
    assert res.prefill_s > 0 and res.decode_s > 0 and res.stop_reason == "max_new_tokens"


def test_streaming_callback_sees_every_token(models):
    model = models["llama"]
    seen: list[int] = []
    res = generate(model, random_drafter(model), [3, 9, 27], 20, stop_token_ids=[], on_tokens=seen.extend)
    assert seen == res.new_tokens and len(seen) == 20


def test_stop_token_reason(models):
    model = models["llama"]
    ids = torch.tensor([[3, 9, 27, 81]])
    cont = hf_greedy(model, ids, 20, None)
    stop = cont[6]
    res = generate(model, random_drafter(model), ids, 20, stop_token_ids=[stop])
    assert res.new_tokens[-1] == stop and res.stop_reason == "stop_token"
    assert res.new_tokens == cont[: cont.index(stop) + 1]


def test_bad_requests_are_clear_errors(models):
    model = models["llama"]
    draft = random_drafter(model, block_size=8)
    target = Target(model)
    with pytest.raises(GenerationError, match="batch size 2"):
        generate(target, draft, torch.ones(2, 4, dtype=torch.long), 5)
    with pytest.raises(GenerationError, match="exceeds the target's context"):
        generate(target, draft, torch.ones(1, 250, dtype=torch.long), 10)
    with pytest.raises(GenerationError, match="block_size"):
        generate(target, draft, [1, 2, 3], 5, block_size=9)
    with pytest.raises(GenerationError, match="empty"):
        generate(target, draft, torch.ones(1, 0, dtype=torch.long), 5)
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        generate(target, draft, [1, VOCAB + 5], 5)
    with pytest.raises(GenerationError, match="max_new_tokens"):
        generate(target, draft, [1, 2], 0)
    with pytest.raises(SamplingError, match="temperature"):
        generate(target, draft, [1, 2], 5, temperature=-1)
    with pytest.raises(SamplingError, match="top_p"):
        generate(target, draft, [1, 2], 5, temperature=1.0, top_p=0)
    with pytest.raises(SamplingError, match="top_k"):
        generate(target, draft, [1, 2], 5, temperature=1.0, top_k=-3)
