"""Sampled drafts verified by speculative sampling (`draft_sampling="pq"`): exact samples of the target, batched,
with the cost-aware policy and with fixed blocks, for v1 and DFlash2 drafters; greedy decoding unchanged."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from flashdraft import DFlashDraftModel, SamplingParams, Target, generate, generate_ar, generate_batch
from flashdraft.engine.costs import CostModel
from flashdraft.sampling import verify_block_pq
from test_sampling import PROMPT, V, assert_same_law, exact_joint, small_target  # noqa: F401 - fixture

N_PQ = 8_000


def test_verify_block_pq_rules():
    """Accepted while u q(x) < p(x); on a rejection the residual max(0, p - q); after all drafts, a draw from p."""
    logits = torch.log(torch.tensor([[0.5, 0.5, 0.0], [0.1, 0.1, 0.8], [0.2, 0.3, 0.5]]) + 1e-30)
    params = SamplingParams(temperature=1.0)
    q = torch.tensor([[0.9, 0.1, 0.0], [0.0, 0.0, 1.0]])
    drafts = torch.tensor([0, 2])
    # x1 = 0: p 0.5, q 0.9 -> accepted iff u < 0.556; x2 = 2: p 0.8, q 1 -> iff u < 0.8; then a draw from p[2]
    a, out = verify_block_pq(
        logits, drafts, q, params, torch.tensor([0.5, 0.79]), torch.tensor([0.1, 0.2, 0.99])
    )
    assert (a, out) == (2, [0, 2, 2])
    # x1 rejected (u 0.6): the residual max(0, p - q) = [0, 0.4, 0] -> token 1 whatever the uniform
    a, out = verify_block_pq(
        logits, drafts, q, params, torch.tensor([0.6, 0.0]), torch.tensor([0.99, 0.5, 0.5])
    )
    assert (a, out) == (0, [1])
    # a deterministic (one-hot) draft: accepted iff u < p(x); rejected, p without x
    a, out = verify_block_pq(
        logits, drafts, None, params, torch.tensor([0.49, 0.9]), torch.tensor([0.0, 0.01, 0.5])
    )
    assert (a, out) == (1, [0, 0])  # x2 = 2 rejected (u 0.9 > 0.8): p[1] without token 2 -> [0.5, 0.5, 0]


@pytest.mark.parametrize("kind", ["v1-fixed", "v1-auto", "dflash2-fixed", "v1-fixed-draft-vocab"])
def test_sampled_drafts_give_the_target_s_law(small_target, kind, monkeypatch):  # noqa: F811
    """The joint law of the first three tokens under speculative sampling, over 8,000 rows decoded in batches among
    rows of other lengths, rows joining and leaving (continuous batching, at most 12): chi-square p > 1e-3 and
    total variation < 0.05, as the seed-exact path's tests. Drafts are accepted and rejected both, the cost-aware
    policy's included: it prices by the hand-written cost model alone here (not corrected by the step times this
    machine measures, which on a fast one could talk it out of drafting), and mixes sampled drafts, lookup drafts
    and plain steps. With a draft vocabulary (vocab.py), the drafts' distributions are 0 outside half of the
    tokens."""
    from flashdraft.engine import batched_dflash

    by_hand = batched_dflash.ObservedCosts
    monkeypatch.setattr(
        batched_dflash, "ObservedCosts", lambda costs, online=True: by_hand(costs, online=False)
    )
    target = Target(small_target)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    arch = "dflash2" if kind.startswith("dflash2") else "dflash"
    torch.manual_seed(0)
    draft = DFlashDraftModel.for_target(
        small_target.config, num_layers=1, block_size=4, mask_token_id=V - 1, arch=arch
    ).eval()
    with torch.no_grad():  # near-uniform draft distributions: drafts accepted about half the time
        draft.norm.weight.fill_(0.05)
    if kind.endswith("draft-vocab"):
        draft.token_counts = torch.arange(V).flip(0)  # the lower half of the ids
        draft.draft_vocab_size = V // 2
    if arch == "dflash2":
        draft.candidate_selector.top_k = 4
        with torch.no_grad():
            draft.candidate_selector.successor_codebook.normal_(std=1.0)  # the pairwise term matters
    costs = CostModel(lengths=[1, 4], verify_base=[1.0, 1.0], verify_slope=[0.0, 0.0], draft_base=1e-3)
    block = "auto" if kind.endswith("auto") else 4
    fillers = [[2, 3], [1, 1, 2, 1, 1, 2, 1, 1], [4]]
    samples: Counter = Counter()
    accepted = rejected = 0
    chunk = 200
    for start in range(0, N_PQ, chunk):
        prompts, limits, seeds, ours = [], [], [], []
        for j in range(chunk):
            if j % 5 == 0:
                prompts.append(fillers[j % 3])
                limits.append(2 + j % 7)
                seeds.append(-1 - start - j)
            ours.append(len(prompts))
            prompts.append(PROMPT)
            limits.append(3)
            seeds.append(start + j)
        results = generate_batch(
            target, draft, prompts, limits, params.temperature, params.top_p, stop_token_ids=[], block_size=block,
            seed=seeds, costs=costs, max_batch_size=12, draft_sampling="pq",
        )  # fmt: skip
        for i in ours:
            samples[tuple(results[i].new_tokens)] += 1
            accepted += sum(results[i].accepted_drafts)
            rejected += sum(
                d - a for d, a in zip(results[i].draft_lengths, results[i].accepted_drafts, strict=True)
            )
    assert accepted > N_PQ // 4 and rejected > N_PQ // 4, (accepted, rejected)  # both paths were exercised
    assert_same_law(samples, exact_joint(small_target, params), N_PQ)


def test_sampled_drafts_change_nothing_at_temperature_zero(small_target):  # noqa: F811
    """Greedy requests keep greedy drafts and exact greedy output; the same seed gives the same sample."""
    target = Target(small_target)
    draft = DFlashDraftModel.for_target(small_target.config, num_layers=1, block_size=4, mask_token_id=V - 1)
    ids = torch.tensor([PROMPT])
    greedy = generate(target, draft, ids, 12, block_size=4, stop_token_ids=[], draft_sampling="pq").new_tokens
    assert greedy == generate_ar(target, ids, 12, stop_token_ids=[]).new_tokens
    kw = dict(temperature=1.0, block_size=4, stop_token_ids=[], draft_sampling="pq", seed=5)
    assert (
        generate(target, draft, ids, 12, **kw).new_tokens == generate(target, draft, ids, 12, **kw).new_tokens
    )
    with pytest.raises(ValueError, match="draft_sampling"):
        generate(target, draft, ids, 4, draft_sampling="maybe")
