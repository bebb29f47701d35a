"""The cost-aware verify length: hand-checked expectations, a synthetic cost model and scripted confidences."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB
from flashdraft import DFlashDraftModel, Target, generate, generate_ar
from flashdraft.engine.batched_dflash import BatchedDFlashProposer
from flashdraft.engine.calibration import BELOW_PRIOR, DEPTH_GROUPS, Calibration
from flashdraft.engine.costs import CostModel
from flashdraft.engine.decoder import BatchDecoder
from flashdraft.engine.kv_cache import bucket
from flashdraft.engine.lookup import LookupIndex, prompt_lookup
from flashdraft.engine.measure import measure_costs
from flashdraft.engine.policy import MAX_SKIP_STEPS, AcceptanceTable, best_verify_length, expected_tokens
from flashdraft.generate import run
from flashdraft.sampling import SamplingParams


def cpu_like_costs(block: int = 8, draft_s: float = 0.2) -> CostModel:
    """A plain step costs 1; verifying n tokens costs 1 + 0.1 (n - 1); a draft pass costs `draft_s`."""
    lengths = list(range(1, block + 1))
    return CostModel(
        lengths=lengths,
        verify_base=[1.0 + 0.1 * (n - 1) for n in lengths],
        verify_slope=[0.0] * block,
        draft_base=draft_s,
    )


def test_expected_tokens_by_hand():
    e = expected_tokens(torch.tensor([0.5, 0.5, 1.0]))
    assert e.tolist() == pytest.approx([1.0, 1.5, 1.75, 2.0])


def test_best_length_hopeless_and_perfect():
    costs = cpu_like_costs()
    step = costs.step_s(7, context=100, propose_s=costs.draft_s(100))
    assert best_verify_length(torch.full((7,), 0.01), step)[0] == 0
    assert best_verify_length(torch.ones(7), step)[0] == 7
    # confident first slots, hopeless afterwards: verify exactly the confident run
    p = torch.tensor([0.95, 0.95, 0.95, 0.02, 0.02, 0.02, 0.02])
    assert best_verify_length(p, step)[0] == 3


def test_cost_model_interpolates_and_grows_with_context():
    costs = CostModel(lengths=[1, 4, 16], verify_base=[1.0, 1.6, 2.5], verify_slope=[0.001, 0.002, 0.004])
    assert float(costs.verify_s(1, 0)) == pytest.approx(1.0)
    assert float(costs.verify_s(2, 0)) == pytest.approx(1.2)
    assert float(costs.verify_s(16, 1000)) == pytest.approx(6.5)
    assert CostModel.from_dict(costs.to_dict()) == costs


def test_acceptance_table_counts_only_trials():
    table = AcceptanceTable([0.5, 0.5, 0.5], prior_weight=2.0)
    table.update(
        torch.tensor([0, 1, 2]), num_verified=3, num_accepted=1
    )  # slot 0 hit, slot 1 miss, 2 untried
    assert table.p(torch.tensor([0, 1, 2])).tolist() == pytest.approx([2 / 3, 1 / 3, 0.5])


def test_a_run_of_keys_is_priced_from_what_the_table_knows_now():
    """`run` keeps the expected tokens of a run of keys between steps; what the table learns replaces them."""
    table = AcceptanceTable([0.5, 0.5, 0.5, 0.5], prior_weight=2.0)
    keys, before = table.run(1, 2)
    assert keys.tolist() == [1, 2] and before.tolist() == pytest.approx([1.0, 1.5, 1.75])
    table.update(torch.tensor([1, 2]), num_verified=2, num_accepted=2)
    keys, after = table.run(1, 2)
    assert after.tolist() == pytest.approx(expected_tokens(table.p(torch.tensor([1, 2]))).tolist())
    assert after[-1] > before[-1]


def test_the_drafter_s_acceptance_is_learned_per_depth_and_per_candidate_rank():
    cal = Calibration()
    sure = torch.full((6,), 0.93)  # the same confidence at every depth of a chain
    keys = cal.draft_keys(sure)
    groups = torch.bucketize(torch.arange(6), torch.tensor(DEPTH_GROUPS), right=True) - 1
    # one key per depth group, the depths of a group sharing theirs
    assert [len(set(keys[groups == g].tolist())) for g in range(len(DEPTH_GROUPS))] == [1] * len(DEPTH_GROUPS)
    assert len(set(keys.tolist())) == len(DEPTH_GROUPS)
    # a tree's slot d holds the chain's key for its own draft, another for the lower candidates (same confidence)
    tree_keys = cal.draft_keys(torch.full((6, 3), 0.93), candidates=True)
    assert tree_keys[:, 0].tolist() == keys.tolist()
    assert not set(tree_keys[:, 1:].flatten().tolist()) & set(keys.tolist())
    # and below a lower candidate of an earlier slot, keys of their own, starting at BELOW_PRIOR of the confidence
    below_keys = cal.draft_keys(torch.full((6, 3), 0.93), candidates=True, below=True)
    assert not set(below_keys.flatten().tolist()) & set(tree_keys.flatten().tolist())
    assert len(set(below_keys[:, 0].tolist())) == len(DEPTH_GROUPS)
    assert cal.draft.p(below_keys).flatten().tolist() == pytest.approx([BELOW_PRIOR * 0.925] * 18)
    assert int(torch.cat([tree_keys, below_keys]).max()) < cal.tree_lookup_key
    # first drafts rejected again and again at that confidence: only the first depth's estimate falls
    before = cal.draft.p(keys).tolist()
    for _ in range(20):
        cal.draft.update(keys, num_verified=6, num_accepted=0)
    after = cal.draft.p(keys).tolist()
    assert after[0] < 0.2 < before[0] == pytest.approx(0.925)
    assert after[1:] == pytest.approx(before[1:])


def test_prompt_lookup_takes_the_latest_longest_match():
    tokens = [5, 6, 7, 1, 2, 5, 6, 7, 3, 4, 9, 6, 7]
    assert prompt_lookup(tokens, 3) == ([3, 4, 9], 2)  # "6 7" last seen at 6..7, followed by 3 4 9
    assert prompt_lookup([1, 2, 3], 4) == ([], 0)


@pytest.mark.parametrize("window", [4096, 9, 3])
def test_the_lookup_index_answers_what_the_scan_answers_as_the_text_grows(window):
    """A row's history grows by a token or a few at a time (a step's accepted tokens); at every length the index's
    proposal and n-gram size are the scan's, within the window too, and for a list shorter than the one it indexed
    (another row's) it starts again. Past a few windows it drops the starts out of the window, and keeps answering
    alike."""
    rng = torch.Generator().manual_seed(window)
    for case in range(40):
        vocab = 2 + case % 5  # few distinct tokens: matches of every n-gram size, often many of them
        history: list[int] = []
        index = LookupIndex(history, max_ngram=3, window=window)
        while len(history) < 60 + 3 * window * (window < 100):
            grow = int(torch.randint(1, 5, (1,), generator=rng))
            history.extend(torch.randint(0, vocab, (grow,), generator=rng).tolist())
            for max_tokens in (0, 1, 4):
                assert index.lookup(max_tokens) == prompt_lookup(history, max_tokens, 3, window), case
        shorter = history[:7]
        index.tokens = shorter
        assert index.lookup(4) == prompt_lookup(shorter, 4, 3, window)
    distinct: list[int] = []  # every n-gram new: what the index holds is bounded by the window alone
    index = LookupIndex(distinct, max_ngram=3, window=window)
    for token in range(min(10 * window, 5000)):
        distinct.append(token)
        assert index.lookup(4) == ([], 0)
        assert len(index.latest) <= 3 * 2 * window  # n-grams of 3 sizes starting in the last 2 windows


@pytest.fixture
def tiny(models):
    model = models["llama"]
    draft = DFlashDraftModel.for_target(model.config, num_layers=1, block_size=8, mask_token_id=VOCAB - 1)
    return Target(model), draft.eval()


def scripted(
    target, draft, costs, confidence: float, truth: list[int] | None = None
) -> BatchedDFlashProposer:
    """The cost-aware proposer without prompt lookup and priced by `costs` alone, its drafter reporting `confidence`
    for every slot (and proposing the tokens of `truth`, the whole greedy sequence, when given)."""
    proposer = BatchedDFlashProposer(draft, target, costs, lookup=False, online_costs=False)
    real, real_more = proposer.draft_rows, proposer.draft_more_slots

    def script(rows, tokens, probs):
        n = tokens.shape[1]
        if truth is not None:
            tokens = torch.tensor([(truth[row.anchor_position + 1 :] + [0] * n)[:n] for row in rows])
        return tokens, torch.full_like(probs, confidence)

    def fake(rows, slots=None):
        proposer._scripted_rows = rows
        return script(rows, *real(rows, slots))

    def fake_more(tokens, probs):  # the head over the other slots (the lazy head): scripted the same
        return script(proposer._scripted_rows, *real_more(tokens, probs))

    proposer.draft_rows, proposer.draft_more_slots = fake, fake_more
    return proposer


def probe_steps(proposer) -> list[int]:
    """The steps (by count of propose calls) on which the proposer ran a draft pass, filled in as it decodes."""
    propose, draft_rows, steps, passes = proposer.propose, proposer.draft_rows, [], []

    def counting_propose(rows, max_drafts):
        steps.append(len(steps))
        return propose(rows, max_drafts)

    def counting_draft(rows, slots=None):
        passes.append(steps[-1])
        return draft_rows(rows, slots)

    proposer.propose, proposer.draft_rows = counting_propose, counting_draft
    return passes


@pytest.mark.parametrize("draft_s", [0.2, 3.0])
def test_policy_skips_drafting_when_hopeless_and_probes_back(tiny, draft_s):
    """Hopeless drafts: plain steps, with probes ever further apart (each gap at least twice the last), and as
    far apart as a probe's loss asks: a draft pass of 3 plain steps is lost at each probe, so probes come at most
    every 30 steps (10 % of the time); one of 0.2 steps probes after 2, 4, 8, .. steps. Output as plain."""
    target, draft = tiny
    ids = torch.arange(3, 20)[None]
    proposer = scripted(target, draft, cpu_like_costs(draft_s=draft_s), 0.001)
    probes = probe_steps(proposer)
    res = generate(target, proposer, ids, 60, stop_token_ids=[])
    assert all(n == 0 for n in res.draft_lengths)  # no probe's drafts verified
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:], strict=False)]
    assert all(g >= min(2 * f, MAX_SKIP_STEPS) for f, g in zip(gaps, gaps[1:], strict=False))
    if draft_s < 1:
        assert probes[0] == 0 and gaps[0] <= 3 and len(probes) >= 4
    else:
        assert probes[0] == 0 and gaps[0] >= 30 and len(probes) == 2
    assert res.new_tokens == generate_ar(target, ids, 60, stop_token_ids=[]).new_tokens


def test_several_rows_probe_rarer_and_again_once_the_batch_halves(tiny):
    """Four rows, hopeless drafts: a probe loses its draft pass (1.5, where the four rows' plain step costs 1.3),
    and several rows keep that to 3 % of the time (`BATCH_PROBE_SHARE`: 39 steps apart, where one row's 10 % would
    probe again after 12), so none comes while the four decode; when two rows finish, the batch has halved and
    drafting may pay again: the next step probes, and then none again. Rows decode as plain."""
    target, draft = tiny
    proposer = scripted(target, draft, cpu_like_costs(draft_s=1.5), 0.001)
    probes = probe_steps(proposer)
    rows_at, propose = [], proposer.propose

    def counting(rows, max_drafts):
        rows_at.append(len(rows))
        return propose(rows, max_drafts)

    proposer.propose = counting
    prompts = [list(range(3 + i, 20 + i)) for i in range(4)]
    lengths = [60, 20, 60, 20]
    out = run(BatchDecoder(target, proposer), prompts, lengths, SamplingParams(), [], [0] * 4)
    halved = rows_at.index(2)
    assert halved >= 18 and probes == [0, halved]
    assert [o.new_tokens for o in out] == [
        generate_ar(target, p, n, stop_token_ids=[]).new_tokens for p, n in zip(prompts, lengths, strict=True)
    ]


def test_a_paid_draft_pass_verifies_only_what_beats_plain_steps(tiny):
    """A compute-bound batched verify (n tokens cost n plain steps' worth: a 2-core CPU at many rows) behind an
    expensive draft pass: verifying 4 rows' drafts at 0.6 beats the draft pass's own price, but never the plain
    steps that come next, so once the pass is paid the policy verifies none of them. Rows decode as plain."""
    target, draft = tiny
    lengths = [1, 2, 4, 8, 16, 32, 64]
    costs = CostModel(
        lengths=lengths, verify_base=[0.25 * n for n in lengths], verify_slope=[0.0] * 7, draft_base=3.0
    )
    proposer = scripted(target, draft, costs, 0.6)
    e = [expected_tokens(torch.full((3,), 0.6))] * 4
    assert (
        proposer.policy.batch_rate(e, 3.0, 100, 3)[0] > 0
    )  # priced with its draft pass, 0.6 drafts are verified
    assert proposer.policy.batch_rate(e, 3.0, 100, 3, paid_against=4 / 1.0)[0] == 0
    probes = probe_steps(proposer)
    prompts = [list(range(3 + i, 20 + i)) for i in range(4)]
    decoder = BatchDecoder(target, proposer)
    out = run(decoder, prompts, [30] * 4, SamplingParams(), [], [0] * 4)
    assert probes and all(n == 0 for o in out for n in o.draft_lengths)
    assert [o.new_tokens for o in out] == [
        generate_ar(target, p, 30, stop_token_ids=[]).new_tokens for p in prompts
    ]


def test_policy_verifies_the_full_block_when_sure(tiny):
    target, draft = tiny
    ids = torch.arange(3, 20)[None]
    free = CostModel(lengths=[1, 8], verify_base=[1.0, 1.0], verify_slope=[0.0, 0.0], draft_base=0.01)
    reference = generate_ar(target, ids, 40, stop_token_ids=[])
    truth = ids[0].tolist() + reference.new_tokens
    res = generate(target, scripted(target, draft, free, 0.999, truth), ids, 40, stop_token_ids=[])
    remaining = [40 - 1 - sum(res.acceptance_lengths[:i]) for i in range(res.num_steps)]
    # it drafts at every step that may verify anything (the last one may add only the target's token)
    assert res.proposer_stats["steps_by_source"]["dflash"] == sum(r > 1 for r in remaining)
    assert res.draft_lengths == [min(7, r - 1) for r in remaining]
    assert res.new_tokens == reference.new_tokens and res.mean_acceptance_length > 7


@pytest.mark.parametrize("confidence", [0.5, 0.999])
def test_the_draft_head_covers_the_slots_a_verify_could_use(tiny, confidence):
    """The drafter's LM head runs first over the slots whose verify costs at most two plain steps (here 2 of 7:
    verifying 4+ tokens costs 2.5), and over the others only when, even as sure as the last slot, they could make a
    longer verify pay: never when the drafter is unsure, and then the policy verifies them. Output as plain."""
    target, draft = tiny
    ids = torch.arange(3, 20)[None]
    costs = CostModel(
        lengths=[1, 3, 4, 8], verify_base=[1.0, 1.0, 2.5, 2.5], verify_slope=[0.0] * 4, draft_base=0.01
    )
    reference = generate_ar(target, ids, 40, stop_token_ids=[])
    truth = ids[0].tolist() + reference.new_tokens
    proposer = scripted(target, draft, costs, confidence, truth if confidence > 0.9 else None)
    head, rows = proposer.head_logits, []
    proposer.head_logits = lambda hidden: rows.append(hidden.shape[0]) or head(hidden)
    res = generate(target, proposer, ids, 40, stop_token_ids=[])
    assert res.new_tokens == reference.new_tokens
    assert rows and rows[0] == 2  # the first slots alone
    if confidence == 0.5:  # a third slot could never pay: the head never ran over the others
        assert set(rows) == {2} and max(res.draft_lengths) <= 2
    else:  # sure: the other 5 slots at every pass but the last ones (2 drafts left to verify), and 7 verified
        assert rows.count(5) >= rows.count(2) - 2 >= 3 and max(res.draft_lengths) == 7


def test_the_price_list_s_measurement_is_bounded_in_time_and_says_how_far_it_is(tiny, monkeypatch, tmp_path):
    """On a machine too busy for the budget, the measurement stops at the contexts it has timed (its first, always),
    each price timed once from half the budget on; it says each step with the seconds spent, and a price list cut
    short is not cached (a quieter start measures it whole)."""
    import flashdraft.engine.measure as measure

    target, draft = tiny
    forwards = []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: forwards.append(1) or forward(*a, **k))
    kwargs = dict(lengths=(1, 2), contexts=(16, 32, 48), repeats=3, batch_tokens=())
    measure.measure_costs(target, draft, **kwargs, budget_s=1e9)
    unbounded, said = len(forwards), []
    forwards.clear()
    short = measure.measure_costs(target, draft, **kwargs, budget_s=0.0, log=said.append)
    assert not short.complete and short.verify_slope == [0.0, 0.0] and short.draft_slope == 0.0
    assert all(b > 0 for b in short.verify_base)
    # one context of three, each price timed once, not three times
    assert 0 < len(forwards) < unbounded / 3
    assert [line.split(" (")[0] for line in said] == [
        "  prices: verify of 1-2 tokens and a draft pass after 16 tokens of context",
        "  prices: budget spent: 2 of 3 contexts left unmeasured",
        "  prices: draft passes of 1 and 4 rows",
    ]
    assert all(line.endswith("of at most ~0 timing)") for line in said)
    monkeypatch.setenv("FLASHDRAFT_COST_CACHE", str(tmp_path))
    monkeypatch.setattr(measure, "_MEMORY", {})
    real = measure.measure_costs
    monkeypatch.setattr(measure, "measure_costs", lambda *a, **k: short)
    assert measure.load_or_measure_costs(target, draft) is short
    assert list(tmp_path.iterdir()) == []  # not cached
    whole = real(target, draft, lengths=(1, 2), contexts=(16, 48), repeats=1, batch_tokens=())
    assert whole.complete


def test_measured_costs_are_positive_and_cover_the_block(tiny):
    target, draft = tiny
    costs = measure_costs(target, draft, lengths=(1, 2, 8), contexts=(16, 48), repeats=1, batch_tokens=(32,))
    # the block's lengths, then the longer forwards batched decoding verifies (rows x tokens)
    assert costs.lengths == [1, 2, 8, 32] and costs.draft_dtype in ("float32", "bfloat16")
    assert all(float(costs.verify_s(n, 32)) > 0 for n in (1, 3, 8, 32, 64)) and costs.draft_s(32) > 0
    assert costs.draft_batch_s(4, 32) >= costs.draft_s(32) and costs.draft_row_s >= 0
    assert costs.draft_slot_s >= 0 and costs.draft_batch_s(1, 32, skipped_slots=3) <= costs.draft_s(32)


def test_verify_lengths_are_timed_in_interleaved_rounds(monkeypatch):
    """The cost model times its verify lengths in rounds, each length once a round after a warm-up of each, so a
    slow stretch of the machine prices them alike: here the clock runs slow for the first three calls after the
    warm-ups, and every length still gets its own median."""
    import flashdraft.engine.measure as measure

    calls, clock = [], iter(range(1000))
    slow = {"left": 3}

    def timed(i: int):
        def fn() -> None:
            calls.append(i)
            if len(calls) > 3 and slow["left"] > 0:  # one slow call of every length in the first round
                slow["left"] -= 1
                next(clock), next(clock), next(clock)  # three ticks more inside the timing

        return fn

    monkeypatch.setattr(measure.time, "perf_counter", lambda: float(next(clock)))
    medians = measure.interleaved_medians([timed(0), timed(1), timed(2)], repeats=3)
    # warm-ups down the list, then rounds up and down it: each call follows itself or a neighbour (a one-token verify
    # timed after a 128-token one was priced 1.5x plain decoding's step)
    assert calls == [2, 1, 0] + [0, 1, 2] + [2, 1, 0] + [0, 1, 2]
    assert medians == [1.0, 1.0, 1.0]  # the slow round is each length's outlier, not one length's price


def test_no_verify_length_is_priced_above_a_longer_one(tiny, monkeypatch):
    """A shorter verify timed dearer than a longer one was timed in a slow stretch: each length is capped by every
    longer one's time, at each context, and lengths already in order keep their own times."""
    import flashdraft.engine.measure as measure

    assert measure.no_dearer_than_longer([5.0, 3.0, 4.0, 2.0, 6.0]) == [2.0, 2.0, 2.0, 2.0, 6.0]
    assert measure.no_dearer_than_longer([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]

    # measure_costs prices through it: one token timed slowest of all at both contexts (as a slow stretch would)
    def medians(fns, repeats):
        times = [0.010 + 0.001 * i for i in range(len(fns))]
        times[0] = 0.050
        return times

    monkeypatch.setattr(measure, "interleaved_medians", medians)
    target, draft = tiny
    costs = measure_costs(target, draft, lengths=(1, 2, 8), contexts=(16, 48), repeats=1, batch_tokens=(32,))
    assert costs.lengths == [1, 2, 8, 32]
    for context in (16, 48):
        one, two = float(costs.verify_s(1, context)), float(costs.verify_s(2, context))
        assert one == pytest.approx(two) == pytest.approx(0.011)


def test_a_draft_pass_whose_head_skips_slots_is_priced_without_them():
    """The lazy head (the first slots only) is priced as it runs: the head's price per slot and row off for each
    slot it skipped, never below a quarter of the whole pass (the drafter's layers run whatever the head covers)."""
    costs = CostModel(
        lengths=[1],
        verify_base=[0.010],
        verify_slope=[0.0],
        draft_base=0.020,
        draft_row_s=0.004,
        draft_slot_s=0.001,
    )
    assert costs.draft_batch_s(1, 0) == pytest.approx(0.020)
    assert costs.draft_batch_s(1, 0, skipped_slots=12) == pytest.approx(0.008)
    assert costs.draft_batch_s(2, 0, skipped_slots=3) == pytest.approx(0.024 - 0.006)
    assert costs.draft_batch_s(1, 0, skipped_slots=100) == pytest.approx(0.005)
    assert CostModel.from_dict({**costs.to_dict(), "draft_slot_s": 0.002}).draft_slot_s == 0.002


def test_noisy_costs_never_extrapolate_to_cheaper_or_negative():
    """Noisy measurements (a busy machine) where 32 tokens timed faster than 8 and a negative context slope:
    within the measured lengths the prices are the measurements, extrapolation past 32 never falls below the last
    price, and nothing is priced at or below zero."""
    noisy = CostModel(lengths=[1, 8, 32], verify_base=[0.010, 0.020, 0.004], verify_slope=[0.0, 0.0, -0.001])
    assert all(float(noisy.verify_s(n, 100)) > 0 for n in (1, 4, 8, 16, 32, 64, 256))
    at_8, at_32, at_256 = (float(noisy.verify_s(n, 0)) for n in (8, 32, 256))
    assert at_8 == pytest.approx(0.020) and at_32 == pytest.approx(0.004) and at_256 >= at_32 - 1e-9
    assert float(noisy.verify_s(256, 0)) == pytest.approx(
        float(noisy.verify_s(64, 0))
    )  # the drop is not extended


def test_verify_prices_follow_the_measurements_where_longer_is_cheaper():
    """A CPU whose GEMM kernels run 5-8 rows faster than 2-4 (the measured curve below, seen in every session on
    the benchmark machine): the prices are the measurements, dip included, so the policy may verify 5 where 4 costs
    more, and interpolate in between."""
    lengths = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16]
    base = [1.00, 1.61, 1.95, 2.12, 1.61, 1.60, 1.49, 1.72, 1.61, 1.76]
    costs = CostModel(lengths=lengths, verify_base=base, verify_slope=[0.0] * len(lengths))
    assert [float(costs.verify_s(n, 0)) for n in lengths] == pytest.approx(base)
    assert float(costs.verify_s(7, 0)) == pytest.approx((1.60 + 1.49) / 2)
    assert float(costs.verify_s(5, 0)) < float(costs.verify_s(4, 0))


def test_the_drafter_is_probed_before_lookup_can_win(tiny):
    """With verification nearly free (a GPU), a lookup match always looks worth it; the drafter must still get its
    first step, or its rate would never be known."""
    target, draft = tiny
    free = CostModel(lengths=[1, 8], verify_base=[1.0, 1.0], verify_slope=[0.0, 0.0], draft_base=0.01)
    repetitive = torch.tensor([[5, 6, 7, 8] * 5])  # prompt lookup matches from the first step on
    res = generate(target, BatchedDFlashProposer(draft, target, free), repetitive, 12, stop_token_ids=[])
    assert res.proposer_stats["steps_by_source"]["dflash"] >= 1


def test_batched_verify_prices_each_shape_as_measured(tiny):
    """Online corrections at several rows keep a factor per (rows, tokens per row): when 4 rows of 2+ tokens verify
    at 3x the cost model's price and 4 rows of 1 token at its price, a per-row-count ratio alone (the old rule)
    still verifies drafts that do not pay; per shape, the policy takes plain steps."""
    target, draft = tiny
    costs = cpu_like_costs()
    proposer = BatchedDFlashProposer(draft, target, costs, lookup=False)
    probs = [expected_tokens(torch.full((3,), 0.6))] * 4
    assert proposer.policy.batch_rate(probs, 0.0, 100, 3)[0] > 0  # as priced by the cost model, drafts pay
    for _ in range(20):
        proposer.timed(4, 1, 100, float(costs.verify_s(4, 100)))
        for tokens in (2, 3, 4):
            proposer.timed(4, tokens, 100, 3 * float(costs.verify_s(4 * tokens, 100)))
    level = proposer.prices.ratio(4)
    blended = [
        (4 * float(expected_tokens(torch.full((n,), 0.6))[-1]))
        / (float(costs.verify_s(4 * (n + 1), 100)) * level)
        for n in range(4)
    ]
    assert max(range(4), key=blended.__getitem__) > 0  # one ratio for every shape would still draft
    assert proposer.policy.batch_rate(probs, 0.0, 100, 3)[0] == 0
    ratios = proposer.prices.ratios(4, torch.arange(1, 5))
    assert float(ratios[1] / ratios[0]) == pytest.approx(3.0, rel=0.25)
    assert proposer.prices.ratios(1, torch.arange(1, 4)).tolist() == [
        1.0,
        1.0,
        1.0,
    ]  # one row: priced as measured offline


def test_padded_verifies_are_priced_at_the_length_that_runs(tiny):
    """With verify buckets, n tokens cost what their bucket costs: a verify of 5 (padded to 8) is priced as 8, so
    where 4 proposals beat 3 as proposed, the policy takes 3 (4 tokens, a bucket)."""
    target, draft = tiny
    costs = cpu_like_costs()
    proposer = BatchedDFlashProposer(draft, target, costs, lookup=False)
    probs = [expected_tokens(torch.tensor([0.9, 0.9, 0.9, 0.9, 0.02, 0.02, 0.02]))]
    assert proposer.policy.batch_rate(probs, 0.0, 100, 7)[0] == 4
    decoder = BatchDecoder(target, proposer)
    assert proposer.padded_lengths is None  # no buckets on the CPU: priced as proposed
    proposer.padded_lengths = [bucket(n, decoder.block_size, (1, 2, 4, 8)) for n in range(1, 9)]
    assert proposer.padded_lengths == [1, 2, 4, 4, 8, 8, 8, 8]
    n, rate = proposer.policy.batch_rate(probs, 0.0, 100, 7)
    assert n == 3
    assert rate == pytest.approx(float(probs[0][3]) / float(costs.verify_s(4, 100)))
