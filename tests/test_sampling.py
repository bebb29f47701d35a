"""Sampling through speculative decoding is lossless: the joint law of the first generated tokens equals the
target's own (temperature / top-k / top-p processed) law, computed exactly by enumeration."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from conftest import tiny_model
from flashdraft import DFlashDraftModel, Proposer, SamplingParams, Target, generate, generate_ar
from flashdraft.engine.costs import CostModel
from flashdraft.sampling import inverse_cdf_sample, position_uniforms, target_probs, verify_block

V = 6  # tiny vocabulary: 6^3 = 216 joint outcomes for three tokens
PROMPT = [3, 1, 4, 1, 5]
N_SAMPLES = 20_000
# Through a DFlash drafter (a draft pass a step) the law is tested on 8,000 samples, as in the batched and served
# tests below: the expected total variation is then 0.021 at T=1 and 0.015 at T=0.9
# (against the 0.05 allowed), 0.013 and 0.010 at 20,000.
N_DFLASH_SAMPLES = 8_000


@pytest.fixture(scope="module")
def small_target():
    # initializer_range 0.5 makes the distributions peaked enough that greedy-ish drafts get accepted often.
    return tiny_model("llama", seed=3, vocab=V, layers=4, initializer_range=0.5)


def exact_joint(model, params: SamplingParams) -> dict[tuple[int, int, int], float]:
    """p(x1, x2, x3 | prompt) by enumerating every (x1, x2) prefix in one batched forward."""
    prefixes = list(itertools.product(range(V), repeat=2))
    batch = torch.tensor([PROMPT + list(p) for p in prefixes])
    with torch.no_grad():
        logits = model(batch).logits[:, -3:]  # predicts x1, x2, x3
    probs = target_probs(logits, params)
    joint = {}
    for row, (x1, x2) in enumerate(prefixes):
        p12 = probs[row, 0, x1] * probs[row, 1, x2]
        for x3 in range(V):
            joint[(x1, x2, x3)] = float(p12 * probs[row, 2, x3])
    return joint


class GreedyGuessProposer(Proposer):
    """Proposes the target's most likely continuation (often accepted), to exercise long accepted runs."""

    def __init__(self, model, block_size: int) -> None:
        self.model = model
        self.max_block_size = block_size
        self.memo: dict[tuple[int, int], torch.Tensor] = {}

    @torch.no_grad()
    def propose(self, anchor_token, anchor_position, num_tokens):
        key = (anchor_token, num_tokens)
        if key not in self.memo:
            self.memo[key] = self._guess(anchor_token, num_tokens)
        return self.memo[key]

    def _guess(self, anchor_token, num_tokens):
        seq = PROMPT + [anchor_token]  # the tests only draft right after the first token
        out = []
        for _ in range(num_tokens):
            nxt = int(self.model(torch.tensor([seq])).logits[0, -1].argmax())
            out.append(nxt)
            seq.append(nxt)
        return torch.tensor(out)


def assert_same_law(samples: Counter, joint: dict, n: int) -> None:
    impossible = [k for k, c in samples.items() if joint.get(k, 0.0) == 0.0]
    assert not impossible, f"sampled outcomes the target gives probability 0: {impossible[:5]}"
    # Pool cells with small expectations so the chi-square approximation holds.
    keys = sorted(joint, key=joint.get, reverse=True)
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for k in keys:
        e = joint[k] * n
        if e >= 10:
            obs.append(samples.get(k, 0))
            exp.append(e)
        else:
            pool_o += samples.get(k, 0)
            pool_e += e
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    scale = sum(obs) / sum(exp)
    stat, p = chisquare(obs, [e * scale for e in exp])
    tv = 0.5 * sum(abs(samples.get(k, 0) / n - joint[k]) for k in joint)
    assert p > 1e-3, f"chi-square p={p:.2e} (stat {stat:.1f}, {len(obs)} cells), TV={tv:.4f}"
    assert tv < 0.05


@pytest.mark.parametrize(
    ("params", "proposer_kind"),
    [
        (SamplingParams(temperature=1.0), "dflash"),
        (SamplingParams(temperature=0.7, top_k=4, top_p=0.9), "greedy_guess"),
        (SamplingParams(temperature=0.9, top_p=0.95), "dflash_auto_free_verify"),
    ],
    ids=[
        "T1-plain-random-drafter",
        "T0.7-topk4-topp0.9-good-drafter",
        "T0.9-auto-policy-verifies-everything",
    ],
)
def test_sampling_is_lossless(small_target, params, proposer_kind):
    target = Target(small_target)
    costs = None
    if proposer_kind.startswith("dflash"):
        proposer = DFlashDraftModel.for_target(
            small_target.config, num_layers=1, block_size=4, mask_token_id=V - 1
        )
    else:
        proposer = GreedyGuessProposer(small_target, block_size=4)
    if proposer_kind == "dflash_auto_free_verify":
        # Verifying costs the same at any length: the cost-aware policy drafts and verifies every slot it may,
        # so the sampled law must survive its drafts and prompt lookups too.
        costs = CostModel(lengths=[1, 4], verify_base=[1.0, 1.0], verify_slope=[0.0, 0.0], draft_base=1e-3)
    joint = exact_joint(small_target, params)
    samples: Counter = Counter()
    accepted_runs = 0
    n = N_DFLASH_SAMPLES if proposer_kind.startswith("dflash") else N_SAMPLES
    for i in range(n):
        res = generate(
            target,
            proposer,
            PROMPT,
            max_new_tokens=3,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            stop_token_ids=[],
            seed=i,
            costs=costs,
        )
        samples[tuple(res.new_tokens)] += 1
        accepted_runs += res.acceptance_lengths[0] > 1
    assert_same_law(samples, joint, n)
    if proposer_kind == "greedy_guess":
        assert accepted_runs > n // 4  # the accept path was exercised, not only the residual path


def test_verify_block_rules():
    """Greedy: longest argmax-matching prefix + the target's token. Sampling: a draft with p=0 is never accepted,
    a draft with p=1 always is."""
    logits = torch.full((4, 5), -10.0)
    logits[0, 2] = logits[1, 3] = logits[2, 0] = logits[3, 4] = 10.0
    a, emitted = verify_block(logits, torch.tensor([2, 3, 1]), SamplingParams(), None)
    assert (a, emitted) == (2, [2, 3, 0])
    a, emitted = verify_block(logits, torch.tensor([2, 3, 0]), SamplingParams(), None)
    assert (a, emitted) == (3, [2, 3, 0, 4])
    hard = torch.full((2, 5), float("-inf"))
    hard[0, 1] = hard[1, 2] = 0.0  # one-hot target distributions
    for seed in range(50):
        u = position_uniforms(seed, 7, 2)
        assert verify_block(hard, torch.tensor([1]), SamplingParams(temperature=1.0), u) == (1, [1, 2])
        assert verify_block(hard, torch.tensor([3]), SamplingParams(temperature=1.0), u) == (0, [1])


def test_inverse_cdf_sampling_is_exact_and_skips_zero_probabilities():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]])
    assert inverse_cdf_sample(probs, torch.tensor([0.0])).item() == 1
    assert inverse_cdf_sample(probs, torch.tensor([0.2499])).item() == 1
    assert inverse_cdf_sample(probs, torch.tensor([0.25])).item() == 3
    assert inverse_cdf_sample(probs, torch.tensor([0.999999])).item() == 3
    u = position_uniforms(3, 0, 20000)
    counts = torch.bincount(inverse_cdf_sample(probs.expand(20000, 5), u), minlength=5)
    assert counts[0] == counts[2] == counts[4] == 0 and abs(counts[1].item() / 20000 - 0.25) < 0.015


@pytest.mark.parametrize("kind", ["random_drafter_auto", "random_drafter_b4", "good_guesser"])
def test_sampled_output_is_plain_sampling_with_the_same_seed(small_target, kind):
    """Not only the same law: the same seed gives plain decoding's very tokens, whatever was proposed."""
    target = Target(small_target)
    params = dict(temperature=0.8, top_p=0.95, stop_token_ids=[])
    if kind == "good_guesser":
        draft, block = GreedyGuessProposer(small_target, block_size=4), None
    else:
        draft = DFlashDraftModel.for_target(
            small_target.config, num_layers=1, block_size=4, mask_token_id=V - 1
        )
        block = 4 if kind == "random_drafter_b4" else "auto"
    for seed in range(6):
        plain = generate_ar(target, PROMPT, 16, seed=seed, **params).new_tokens
        assert generate(target, draft, PROMPT, 16, seed=seed, block_size=block, **params).new_tokens == plain


def test_top_k_top_p_filtering():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(p, torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7)  # 0.5 + 0.2 reaches 0.7
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert torch.allclose(p, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.01))
    assert torch.allclose(p, torch.tensor([1.0, 0, 0, 0, 0]))  # always keeps the top token


def test_same_seed_same_sample(small_target):
    target = Target(small_target)
    draft = DFlashDraftModel.for_target(small_target.config, num_layers=1, block_size=4, mask_token_id=V - 1)
    runs = [
        generate(target, draft, PROMPT, 12, temperature=1.0, seed=11, stop_token_ids=[]).new_tokens
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    rng = random.Random(0)
    assert (
        len(
            {
                tuple(
                    generate(
                        target,
                        draft,
                        PROMPT,
                        12,
                        temperature=1.0,
                        seed=rng.randrange(10**6),
                        stop_token_ids=[],
                    ).new_tokens
                )
                for _ in range(5)
            }
        )
        > 1
    )


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-6])
def test_a_vanishing_temperature_decodes_greedily(small_target, temperature):
    """logits / 1e-40 overflow float32: the probabilities were NaN and the draw picked the last id every time."""
    target = Target(small_target)
    greedy = generate_ar(target, PROMPT, 12, stop_token_ids=[]).new_tokens
    assert (
        generate_ar(target, PROMPT, 12, temperature=temperature, stop_token_ids=[], seed=1).new_tokens
        == greedy
    )
    draft = DFlashDraftModel.for_target(small_target.config, num_layers=1, block_size=4, mask_token_id=V - 1)
    got = generate(
        target, draft, PROMPT, 12, temperature=temperature, stop_token_ids=[], seed=1, block_size=4
    )
    assert got.new_tokens == greedy


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_raise_instead_of_drawing_garbage(temperature):
    from flashdraft.sampling import SamplingError

    model = tiny_model("llama", seed=3, vocab=V, layers=2)
    with torch.no_grad():
        model.lm_head.weight[2, 0] = float("nan")  # one vocabulary row: NaN logits at every position
    with pytest.raises(SamplingError, match="output position 5 are not finite"):
        generate_ar(Target(model), PROMPT, 4, temperature=temperature, seed=0)


@pytest.mark.parametrize("compiled", [False, True])
def test_rows_no_token_can_be_drawn_from_are_those_with_nan_or_inf_or_nothing_left(compiled):
    """`non_finite_rows` (one reduction over the row's maximum, which the compiled verify fuses with its argmax)
    flags a row exactly where a NaN or a +inf is in it, or every logit is -inf, eager and compiled alike."""
    from flashdraft.sampling import non_finite_rows

    gen = torch.Generator().manual_seed(0)
    values = torch.randn(400, 37, generator=gen)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf")])
    for row in range(values.shape[0]):  # 0-3 special values per row, and some rows all -inf
        picks = torch.randint(0, 3, (row % 4,), generator=gen)
        where = torch.randint(0, values.shape[1], (row % 4,), generator=gen)
        values[row, where] = specials[picks]
    values[::29] = -float("inf")
    values[7::53, 3] = 1.0  # all -inf but one
    values[7::53, :3] = -float("inf")
    expected = values.isnan().any(-1) | values.isposinf().any(-1) | values.isneginf().all(-1)
    rule = torch.compile(non_finite_rows, backend="inductor", fullgraph=True) if compiled else non_finite_rows
    got = rule(values.to(torch.bfloat16).float())
    assert 50 < int(expected.sum()) < 350  # both kinds of row, many times
    assert torch.equal(got, expected)


N_BATCHED = 8_000


def test_batched_sampling_is_lossless_with_rows_joining_and_leaving(small_target):
    """The joint law of the first three tokens, sampled in batches: rows of this prompt share every step with rows
    of other lengths (which finish at other times), and rows join as others leave (continuous batching, at most 12
    at once). Significance level: p > 1e-3 (as above) over 8,000 samples, and total variation < 0.05."""
    from flashdraft.generate import generate_batch

    target = Target(small_target)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    draft = DFlashDraftModel.for_target(small_target.config, num_layers=1, block_size=4, mask_token_id=V - 1)
    costs = CostModel(lengths=[1, 4], verify_base=[1.0, 1.0], verify_slope=[0.0, 0.0], draft_base=1e-3)
    fillers = [[2, 3], [1, 1, 2, 1, 1, 2, 1, 1], [4]]
    samples: Counter = Counter()
    chunk = 200
    for start in range(0, N_BATCHED, chunk):
        prompts, limits, seeds, ours = [], [], [], []
        for j in range(chunk):
            if j % 5 == 0:  # a row of another length and budget between the counted ones
                prompts.append(fillers[j % 3])
                limits.append(2 + j % 7)
                seeds.append(-1 - start - j)
            ours.append(len(prompts))
            prompts.append(PROMPT)
            limits.append(3)
            seeds.append(start + j)
        results = generate_batch(
            target, draft, prompts, limits, params.temperature, params.top_p, params.top_k, stop_token_ids=[],
            block_size="auto", seed=seeds, costs=costs, max_batch_size=12,
        )  # fmt: skip
        for i in ours:
            samples[tuple(results[i].new_tokens)] += 1
    assert_same_law(samples, exact_joint(small_target, params), N_BATCHED)


def test_served_sampling_is_lossless(small_target):
    """The same law through the server's engine: requests with their own seeds arrive concurrently, share steps
    with requests of other lengths and leave as they finish (continuous batching, at most 12 rows).
    Significance level as above: p > 1e-3 over 8,000 samples, and total variation < 0.05."""
    import asyncio

    from flashdraft.serve import Engine
    from flashdraft.serve.engine import EngineRequest, QueueFullError
    from test_serve import tiny_tokenizer

    class NoStops(Target):  # the joint law is of three tokens, whatever they are
        eos_token_ids = property(lambda self: [])

    target = NoStops(small_target, tiny_tokenizer())
    params = SamplingParams(temperature=0.9, top_p=0.95)
    draft = DFlashDraftModel.for_target(small_target.config, num_layers=1, block_size=4, mask_token_id=V - 1)
    costs = CostModel(lengths=[1, 4], verify_base=[1.0, 1.0], verify_slope=[0.0, 0.0], draft_base=1e-3)
    engine = Engine(target, draft, max_queue=32, max_batch_size=12, costs=costs)
    fillers = [[2, 3], [1, 1, 2, 1, 1, 2, 1, 1], [4]]

    async def ask(request: EngineRequest) -> list[int]:
        loop = asyncio.get_running_loop()
        while True:
            try:
                handle = engine.submit(request, loop)
                break
            except QueueFullError:
                await asyncio.sleep(0.005)
        while True:
            kind, value = await handle.events.get()
            if kind == "done":
                return value["result"].new_tokens
            assert kind != "error", value

    async def run_all() -> list[list[int]]:
        gate = asyncio.Semaphore(24)

        async def one(i: int):
            async with gate:
                if i % 5 == 4:  # another length and budget between the counted ones
                    await ask(
                        EngineRequest(fillers[i % 3], 2 + i % 7, params.temperature, params.top_p, seed=-i)
                    )
                    return None
                return await ask(EngineRequest(list(PROMPT), 3, params.temperature, params.top_p, seed=i))

        return await asyncio.gather(*(one(i) for i in range(N_BATCHED * 5 // 4)))

    try:
        outputs = asyncio.run(run_all())
    finally:
        engine.close()
    samples = Counter(tuple(o) for o in outputs if o is not None)
    assert sum(samples.values()) == N_BATCHED
    assert_same_law(samples, exact_joint(small_target, params), N_BATCHED)


def test_greedy_rows_are_verified_at_once_as_row_by_row():
    """The engine's one-transfer accept decision for greedy rows equals `verify_block` on each row; a row with
    non-finite logits sends the step back row by row (where the error names its position)."""
    from flashdraft.sampling import SamplingParams, verify_block, verify_greedy_rows

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, 11, generator=g)
    drafts = logits[:, :4].argmax(-1)  # the target's own tokens ...
    for i in range(6):  # ... made wrong from slot i (row 5: never, all four drafts right)
        if i < 4:
            drafts[i, i] = (drafts[i, i] + 1) % 11
    params = SamplingParams(temperature=0.0)
    expected = [verify_block(logits[i], drafts[i], params, None) for i in range(6)]
    assert verify_greedy_rows(logits, drafts) == expected
    assert [a for a, _ in expected] == [0, 1, 2, 3, 4, 4]
    logits[3, 2, 0] = float("nan")
    assert verify_greedy_rows(logits, drafts) is None
