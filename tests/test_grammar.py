"""Structured output under speculation: a constrained row decodes exactly as plain constrained decoding does.

Tiny random targets with a byte-level BPE tokenizer (so JSON, regexes and choices can be spelled), proposers that
are right, half right and random, single rows and batches with mixed constraints, greedy and seeded sampling, and
the sampled law against the constrained distribution computed here without xgrammar.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections import Counter

import pytest
import torch

pytest.importorskip("xgrammar")

from conftest import OracleProposer, byte_tokenizer, dflash_and_plain_servers, on_disk, replan, tiny_model  # noqa: E402
from flashdraft import (  # noqa: E402
    Constraint,
    DFlashDraftModel,
    GrammarError,
    Proposer,
    SamplingParams,
    Target,
    generate,
    generate_ar,
    generate_batch,
)
from flashdraft.engine.costs import CostModel  # noqa: E402
from flashdraft.engine.grammar import RowGrammar, compile_constraint  # noqa: E402
from flashdraft.sampling import target_probs  # noqa: E402

VOCAB = 320
CORPUS = [
    '{"name": "Ada", "age": 36, "ok": true, "color": "red"}',
    "[1, 2, 3]",
    "yes no maybe 123-4567",
    '{"a": {"b": [null, false]}}',
]
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer"},
    },
    "required": ["ok", "color", "n"],
}


@pytest.fixture(scope="module")
def targets():
    tok = byte_tokenizer(CORPUS * 4, VOCAB)
    return {
        arch: Target(tiny_model(arch, seed=i, vocab=VOCAB), tok) for i, arch in enumerate(["llama", "qwen3"])
    }


PROMPT = "name the color as JSON"
CONSTRAINTS = {
    "json_schema": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
    "json_object": {"type": "json_object"},
    "regex": Constraint("regex", r"[0-9]{3}-[0-9]{4}"),
    "choice": Constraint.choice(["yes", "no", "maybe"]),
    "ebnf": Constraint("ebnf", 'root ::= "[" item ("," item)* "]"\nitem ::= [0-9]+'),
}


def text_of(target, result) -> str:
    return target.tokenizer.decode(result.new_tokens, skip_special_tokens=True)


def check_matches(kind: str, text: str, stop_reason: str) -> None:
    """A finished answer is valid under its constraint (one cut by max_new_tokens is only a prefix of one)."""
    if stop_reason != "stop_token":
        return
    if kind == "json_schema":
        value = json.loads(text)
        assert set(value) == {"ok", "color", "n"} and value["color"] in ("red", "green", "blue")
        assert isinstance(value["ok"], bool) and isinstance(value["n"], int)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text)
    elif kind == "choice":
        assert text in ("yes", "no", "maybe")
    else:
        assert re.fullmatch(r"\[[0-9]+(,[0-9]+)*\]", text)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kind", list(CONSTRAINTS))
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_constrained_speculation_equals_plain_constrained_decoding(targets, arch, kind, temperature):
    """DFlash (a random drafter) and an oracle that knows the answer but errs at random points: the same tokens as
    plain decoding under the same constraint (greedy, and seed for seed when sampling), valid when finished."""
    target = targets[arch]
    ids = target.encode_prompt([{"role": "user", "content": PROMPT}])
    rf = CONSTRAINTS[kind]
    kw = dict(temperature=temperature, seed=7, response_format=rf)
    plain = generate_ar(target, ids, 40, **kw)
    check_matches(kind, text_of(target, plain), plain.stop_reason)
    drafter = DFlashDraftModel.for_target(
        target.model.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1
    )
    oracle = OracleProposer(ids[0].tolist() + plain.new_tokens + [0] * 8, VOCAB, 6, random.Random(1))
    for proposer in (drafter, oracle):
        spec = generate(target, proposer, ids, 40, block_size=4 if proposer is drafter else "auto", **kw)
        assert spec.new_tokens == plain.new_tokens, type(proposer).__name__
        assert spec.stop_reason == plain.stop_reason
    if len(plain.new_tokens) >= 6:  # long enough for the oracle's drafts to be accepted somewhere
        assert sum(r > 1 for r in spec.acceptance_lengths) > 0


def forced_text(targets, repeats: int):
    """(target, prompt ids, the constraint, an untrained block-8 drafter) for text the grammar forces token by token:
    `"~|" * repeats`, characters the tokenizer never merged (one spelling)."""
    target = targets["qwen3"]
    drafter = DFlashDraftModel.for_target(
        target.model.config, num_layers=1, block_size=8, mask_token_id=VOCAB - 1
    )
    ids = target.encode_prompt([{"role": "user", "content": PROMPT}])
    return target, ids, Constraint.choice(["~|" * repeats]), drafter


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_grammar_steers_the_drafts_so_forced_text_is_accepted_whole(targets, monkeypatch, temperature):
    """Text the grammar forces token by token (characters the tokenizer never merged: one spelling) is drafted as
    the grammar allows it, so every verify accepts all it drafted, at T=0 and with seeded sampling; the answer is
    still plain decoding's. Without the steering an untrained drafter gets none of it."""
    import flashdraft.engine.batched_dflash

    target, ids, forced, drafter = forced_text(targets, 12)
    kw = dict(temperature=temperature, seed=3, response_format=forced)
    plain = generate_ar(target, ids, 40, **kw)
    assert target.tokenizer.decode(plain.new_tokens, skip_special_tokens=True) == "~|" * 12
    # every verify length priced alike, so how far `auto` verifies is the drafts' confidence alone (a cost model
    # timed on tiny models made it verify 3 forced drafts, not 4, in one full CI run)
    flat = CostModel(lengths=[1, 8], verify_base=[1.0, 1.0], verify_slope=[0.0, 0.0], draft_base=0.01)
    for block_size in (8, "auto"):
        spec = generate(target, drafter, ids, 40, block_size=block_size, costs=flat, **kw)
        assert spec.new_tokens == plain.new_tokens
        steps = list(zip(spec.acceptance_lengths[:3], spec.draft_lengths[:3], strict=True))
        assert all(drafted >= 4 and accepted == drafted + 1 for accepted, drafted in steps), (
            block_size,
            steps,
        )
    monkeypatch.setattr(flashdraft.engine.batched_dflash, "steer_drafts", lambda *args: 0)
    unsteered = generate(target, drafter, ids, 40, block_size=8, **kw)
    assert unsteered.new_tokens == plain.new_tokens and max(unsteered.acceptance_lengths) < 3


def test_jump_forward_spells_the_forced_text_and_leaves_the_matcher_as_it_was(targets):
    """The text a schema forces (its one key, in compile_constraint's layout) is proposed in the tokenizer's own
    spelling, cut to the tokens asked for; the matcher is where it was (the grammar still takes that text next), and
    where the grammar leaves a choice nothing is proposed."""
    target = targets["qwen3"]
    tok = target.tokenizer

    def encode(text):
        return tok.encode(text, add_special_tokens=False)

    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"]}
    grammar = RowGrammar(compile_constraint(target, Constraint.json_schema(schema)))
    forced = grammar.jump_forward(encode, 15)
    assert forced == encode('{"color": "')
    assert grammar.jump_forward(encode, 2) == forced[:2]
    grammar.advance(forced)  # raises if the matcher had moved
    assert grammar.jump_forward(encode, 15) == []  # "red" or "green": the model's choice, not forced
    grammar.advance(encode("gr"))
    assert tok.decode(grammar.jump_forward(encode, 15)) == 'een"}'


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_forced_text_is_verified_without_a_draft_pass(targets, monkeypatch, temperature):
    """Jump-forward: with the draft pass priced out (so the policy skips the drafter), the text the grammar forces
    is still verified many tokens a step, proposed for free; the answer is plain decoding's, greedy and seeded.
    Switched off, the same answer takes a step per token between the drafter's probes."""
    target, ids, forced, drafter = forced_text(targets, 30)
    kw = dict(temperature=temperature, seed=5, response_format=forced)
    plain = generate_ar(target, ids, 80, **kw)
    dear = CostModel(lengths=[1, 8], verify_base=[1.0, 1.0], verify_slope=[0.0, 0.0], draft_base=100.0)
    on = generate(target, drafter, ids, 80, block_size="auto", costs=dear, **kw)
    assert on.new_tokens == plain.new_tokens
    assert on.proposer_stats["steps_by_source"]["grammar"] >= 3
    monkeypatch.setattr(RowGrammar, "jump_forward", lambda *args: [])
    off = generate(target, drafter, ids, 80, block_size="auto", costs=dear, **kw)
    assert off.new_tokens == plain.new_tokens
    assert off.proposer_stats["steps_by_source"]["grammar"] == 0
    assert on.num_steps < off.num_steps, (on.acceptance_lengths, off.acceptance_lengths)


@pytest.mark.parametrize("kind", ["json_schema", "regex", "ebnf"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_dflash2_drafter_under_a_constraint_decodes_as_plain_decoding(targets, kind, temperature):
    """DFlash2 (block-local convolutions, the candidate selector choosing the drafts, so they are not steered):
    masked at the verify like any proposal, the same tokens as plain constrained decoding, alone and batched."""
    from test_dflash2 import dflash2_drafter

    target = targets["llama"]
    drafter = dflash2_drafter(target.model, seed=2, block_size=6)
    prompts = [target.encode_prompt([{"role": "user", "content": f"{PROMPT} {i}"}]) for i in range(3)]
    rf = CONSTRAINTS[kind]
    kw = dict(temperature=temperature, response_format=rf)
    alone = [generate_ar(target, p, 30, seed=20 + i, **kw).new_tokens for i, p in enumerate(prompts)]
    spec = generate(target, drafter, prompts[0], 30, seed=20, **kw)
    assert spec.new_tokens == alone[0]
    batch = generate_batch(target, drafter, prompts, 30, seed=[20, 21, 22], max_batch_size=2, **kw)
    assert [r.new_tokens for r in batch] == alone


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_lookup_proposals_under_a_constraint_decode_as_plain_decoding(targets, monkeypatch, temperature):
    """Prompt lookup's proposals (the drafter priced out, jump-forward off: lookup alone between the drafter's
    probes) on text a grammar constrains: verified under the mask, plain decoding's tokens."""
    target, ids, forced, drafter = forced_text(targets, 12)
    kw = dict(temperature=temperature, seed=9, response_format=forced)
    plain = generate_ar(target, ids, 40, **kw)
    monkeypatch.setattr(RowGrammar, "jump_forward", lambda *args: [])
    dear = CostModel(lengths=[1, 8], verify_base=[1.0, 1.0], verify_slope=[0.0, 0.0], draft_base=100.0)
    spec = generate(target, drafter, ids, 40, block_size="auto", costs=dear, **kw)
    assert spec.new_tokens == plain.new_tokens
    assert spec.proposer_stats["steps_by_source"]["lookup"] >= 1


def test_free_rows_are_untouched_and_free_answers_break_the_constraint(targets):
    """Without a constraint nothing changes; the constraint really steers (the free answer is not JSON)."""
    target = targets["llama"]
    ids = target.encode_prompt([{"role": "user", "content": PROMPT}])
    free = generate_ar(target, ids, 20)
    assert generate_ar(target, ids, 20, response_format={"type": "text"}).new_tokens == free.new_tokens
    constrained = generate_ar(target, ids, 20, response_format=CONSTRAINTS["choice"])
    assert free.new_tokens != constrained.new_tokens
    assert text_of(target, constrained) in ("yes", "no", "maybe")


@pytest.mark.parametrize(("temperature", "static"), [(0.0, False), (0.8, False), (0.0, True)])
def test_batch_with_mixed_constraints_equals_each_row_alone(targets, temperature, static):
    """Rows with different grammars and free rows share one batch; rows join as others leave (max 3 rows); also
    through the static cache with the verify compiled whole (dynamo, eager kernels)."""
    reference = targets["qwen3"]
    target = Target(reference.model, reference.tokenizer) if static else reference
    if static:
        replan(target, static_cache=True, compile_options={"backend": "eager"})
    prompts = [target.encode_prompt([{"role": "user", "content": f"{PROMPT} {i}"}]) for i in range(6)]
    formats = [CONSTRAINTS["json_schema"], None, CONSTRAINTS["regex"], CONSTRAINTS["choice"], None,
               CONSTRAINTS["ebnf"]]  # fmt: skip
    limits = [40, 12, 30, 20, 25, 30]
    seeds = list(range(10, 16))
    drafter = DFlashDraftModel.for_target(
        target.model.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1
    )
    batch = generate_batch(
        target, drafter, prompts, limits, temperature=temperature, block_size=4, seed=seeds,
        max_batch_size=3, response_format=formats,
    )  # fmt: skip
    for i, res in enumerate(batch):
        alone = generate_ar(
            reference,
            prompts[i],
            limits[i],
            temperature=temperature,
            seed=seeds[i],
            response_format=formats[i],
        )
        assert res.new_tokens == alone.new_tokens, i


def test_a_grammar_with_no_allowed_token_ends_the_row_cleanly():
    """A regex the vocabulary cannot finish: the row stops with reason no_allowed_token where plain decoding stops,
    with drafts accepted up to that point (never NaN logits or a crash)."""
    from test_serve import tiny_tokenizer  # word-level: token i is the literal word w{i}

    target = Target(tiny_model("llama", seed=5), tiny_tokenizer())
    ids = target.encode_prompt([{"role": "user", "content": "w7 w9"}])
    rf = Constraint("regex", "w4w5w6x")  # no token spells "x"
    plain = generate_ar(target, ids, 10, response_format=rf)
    assert plain.new_tokens == [4, 5, 6] and plain.stop_reason == "no_allowed_token"

    class Fixed(Proposer):
        max_block_size = 4

        def propose(self, anchor_token, anchor_position, num_tokens):
            return torch.tensor([5, 6, 7][:num_tokens])  # right, right, then past the dead end

    spec = generate(target, Fixed(), ids, 10, response_format=rf)
    assert spec.new_tokens == [4, 5, 6] and spec.stop_reason == "no_allowed_token"
    assert spec.acceptance_lengths == [2]  # one step settled w5 w6 and found the end
    first = generate_ar(target, ids, 10, response_format=Constraint("regex", "[0-9]+"))
    assert first.new_tokens == [] and first.stop_reason == "no_allowed_token"


@pytest.mark.parametrize(
    ("response_format", "message"),
    [
        ({"type": "json_schema", "json_schema": {"schema": {"type": "objec"}}}, "invalid json schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs a 'schema'"),
        ({"type": "yaml"}, "not supported"),
        (Constraint("regex", "a(b"), "invalid regex"),
        (Constraint("ebnf", "root ::= foo"), "invalid ebnf"),
        ("json", "must be an object"),
    ],
)
def test_invalid_constraints_are_refused_before_decoding(targets, response_format, message):
    target = targets["llama"]
    with pytest.raises(GrammarError, match=message) as info:
        generate_ar(target, [5, 6, 7], 8, response_format=response_format)
    assert "\n" not in str(info.value) and "/project/" not in str(info.value)


# ---------------------------------------------------------------------------------------------- sampled law
V = 6
LAW_PROMPT = [3, 1, 4, 1, 5]
# Three tokens; what may follow depends on everything before it.
LAW_REGEX = "ab[cd]|ac[ae]|cd[ab]|ce[bc]|ba[de]|be[ac]"


def letter_tokenizer():
    """Six tokens: the letters a-e and </s> (id 2), each its own literal word."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"a": 0, "b": 1, "</s>": 2, "c": 3, "d": 4, "e": 5}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="a")), eos_token="</s>"
    )


def constrained_joint(model, params: SamplingParams) -> dict[tuple[int, int, int], float]:
    """The law of three constrained tokens, computed without xgrammar: the allowed next letters after each prefix
    are read off the strings the regex matches; logits are masked, then temperature / top-k / top-p apply."""
    letters = {0: "a", 1: "b", 3: "c", 4: "d", 5: "e"}
    words = ["".join(w) for w in itertools.product("abcde", repeat=3) if re.fullmatch(LAW_REGEX, "".join(w))]

    def allowed(prefix: str) -> torch.Tensor:
        ok = {w[len(prefix)] for w in words if w.startswith(prefix)}
        return torch.tensor([letters.get(t) in ok for t in range(V)])

    joint = {}
    with torch.no_grad():
        for x1 in letters:
            for x2 in letters:
                logits = model(torch.tensor([LAW_PROMPT + [x1, x2]])).logits[0, -3:]
                masks = [allowed(""), allowed(letters[x1]), allowed(letters[x1] + letters[x2])]
                probs = target_probs(torch.stack([lg.masked_fill(~m, float("-inf")) for lg, m in zip(logits, masks, strict=True)]), params)  # fmt: skip
                for x3 in letters:
                    p = float(probs[0, x1] * probs[1, x2] * probs[2, x3])
                    if p > 0:
                        joint[(x1, x2, x3)] = p
    return joint


class AllowedGuessProposer(Proposer):
    """Drafts the target's most likely letter among those the regex allows after the first one: often accepted, so
    the bonus token after an accepted draft (masked by the grammar's state after that draft) is drawn often."""

    max_block_size = 2

    def __init__(self, model) -> None:
        self.model = model
        self.allowed = {0: [1, 3], 3: [4, 5], 1: [0, 5]}  # a -> b|c, c -> d|e, b -> a|e

    @torch.no_grad()
    def propose(self, anchor_token, anchor_position, num_tokens):
        options = self.allowed.get(anchor_token, [0])
        logits = self.model(torch.tensor([LAW_PROMPT + [anchor_token]])).logits[0, -1]
        return torch.tensor([max(options, key=lambda t: float(logits[t]))][:num_tokens])


def test_constrained_sampling_draws_the_constrained_law():
    """Seeded constrained sampling with a drafter that is often right: the χ² test of test_sampling against the
    masked distribution (a mask applied after top-p, or a draft's successor drawn unmasked, fails it)."""
    from test_sampling import assert_same_law

    model = tiny_model("llama", seed=3, vocab=V, layers=4, initializer_range=0.5)
    target = Target(model, letter_tokenizer())
    params = SamplingParams(temperature=0.8, top_p=0.95)
    joint = constrained_joint(model, params)
    proposer = AllowedGuessProposer(model)
    n = 3000
    samples: Counter = Counter()
    accepted = 0
    rf = Constraint("regex", LAW_REGEX)
    for i in range(n):
        res = generate(
            target, proposer, LAW_PROMPT, 3, temperature=0.8, top_p=0.95, seed=i, response_format=rf
        )
        samples[tuple(res.new_tokens)] += 1
        accepted += res.acceptance_lengths[0] > 1
    assert_same_law(samples, joint, n)
    assert accepted > n // 4  # the accepted path (and the bonus token after it) was exercised


@pytest.mark.parametrize("draft_sampling", ["match", "pq"])
def test_batched_rows_with_mixed_grammars_draw_the_constrained_law(draft_sampling):
    """Rows of one batch under different grammars and none, a DFlash drafter drafting for all of them, seeded: the
    rows under the law's regex draw the masked distribution (χ²), with greedy drafts matched against the seed's draw
    and with drafts sampled from the drafter and verified by speculative sampling (pq). A row masked by another
    row's grammar, or a draft's successor drawn unmasked, fails it."""
    from test_sampling import assert_same_law

    model = tiny_model("llama", seed=3, vocab=V, layers=4, initializer_range=0.5)
    target = Target(model, letter_tokenizer())
    params = SamplingParams(temperature=0.8, top_p=0.95)
    joint = constrained_joint(model, params)
    drafter = DFlashDraftModel.for_target(
        model.config, num_layers=1, block_size=4, mask_token_id=V - 1, seed=1
    )
    n = 1600
    law, other = Constraint("regex", LAW_REGEX), Constraint("regex", "[a-e]e[a-e]")
    formats = [law, other, law, None] * (n // 2)  # n rows under the law's regex
    results = generate_batch(
        target, drafter, [LAW_PROMPT] * len(formats), 3, temperature=0.8, top_p=0.95,
        seed=list(range(len(formats))), block_size=4, max_batch_size=8, draft_sampling=draft_sampling,
        response_format=formats,
    )  # fmt: skip
    samples = Counter(tuple(r.new_tokens) for r, f in zip(results, formats, strict=True) if f is law)
    assert_same_law(samples, joint, n)
    spelled = [
        "".join("ab?cde"[t] for t in r.new_tokens)
        for r, f in zip(results, formats, strict=True)
        if f is other
    ]
    assert all(re.fullmatch("[a-e]e[a-e]", s) for s in spelled), spelled[:5]
    accepted = sum(a > 1 for r in results for a in r.acceptance_lengths)
    assert accepted > n // 8  # drafts were accepted (the verify's accepted path and bonus token exercised)


# ---------------------------------------------------------------------------------------------- served
@pytest.fixture(scope="module")
def servers(targets):
    """The same target served twice: with a DFlash drafter and plain."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    with dflash_and_plain_servers(targets["llama"]) as clients:
        yield clients


MESSAGES = [{"role": "user", "content": "What color is the sky? Answer in JSON."}]


def test_served_metrics_give_the_grammar_s_share_of_the_decode_steps(servers):
    """/metrics carries the decode steps' seconds and the grammar's part of them, which the served bench reads per
    level: a constrained request's share lies in (0, 1); a free request adds decode time and no grammar time."""
    import httpx

    from flashdraft.bench.prometheus import grammar_share, parse_prometheus

    client = servers["dflash"]
    root = str(client.base_url).rstrip("/").removesuffix("/v1")

    def scrape():
        return parse_prometheus(httpx.get(f"{root}/metrics", timeout=10).text)

    before = scrape()
    kw = dict(model="tiny", messages=MESSAGES, temperature=0, max_tokens=30)
    client.chat.completions.create(response_format={"type": "json_object"}, **kw)
    middle = scrape()
    share = grammar_share(before, middle)
    assert share is not None and 0 < share < 1, share
    client.chat.completions.create(**kw)
    assert grammar_share(middle, scrape()) == 0.0


def test_served_parse_json_object_and_guided_fields_equal_plain_server(servers):
    """The official client's parse() with a pydantic model, json_object, vLLM's guided_* and structured_outputs,
    streamed and not: valid output, and the DFlash server answers what the plain server answers at T=0."""
    from typing import Literal

    from pydantic import BaseModel

    class Sky(BaseModel):
        ok: bool
        color: Literal["red", "green", "blue"]

    answers = {}
    for name, client in servers.items():
        parsed = client.chat.completions.parse(
            model="tiny", messages=MESSAGES, response_format=Sky, temperature=0, max_tokens=80
        )
        assert isinstance(parsed.choices[0].message.parsed, Sky)
        assert parsed.choices[0].finish_reason == "stop"
        got = [parsed.choices[0].message.content]
        for extra in (
            {"response_format": {"type": "json_object"}},
            {"extra_body": {"guided_choice": ["yes", "no", "maybe"]}},
            {"extra_body": {"guided_regex": "[0-9]{3}-[0-9]{4}"}},
            {"extra_body": {"structured_outputs": {"json": SCHEMA}}},
        ):
            out = client.chat.completions.create(
                model="tiny", messages=MESSAGES, temperature=0, max_tokens=40, **extra
            )
            stream = client.chat.completions.create(
                model="tiny", messages=MESSAGES, temperature=0, max_tokens=40, stream=True, **extra
            )
            streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            text = out.choices[0].message.content
            assert streamed == text
            kind = {"response_format": "json_object"}.get(next(iter(extra))) or next(
                iter(extra["extra_body"])
            )
            kind = {
                "guided_choice": "choice",
                "guided_regex": "regex",
                "structured_outputs": "json_schema",
            }.get(kind, kind)
            check_matches(kind, text, "stop_token" if out.choices[0].finish_reason == "stop" else "length")
            got.append(text)
        answers[name] = got
    assert answers["dflash"] == answers["plain"]


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objec"}},
                }
            },
            "response_format",
            "invalid json schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", "not supported"),
        ({"extra_body": {"guided_regex": "a("}}, "guided_regex", "invalid regex"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice", "non-empty list"),
        ({"extra_body": {"guided_json": {"type": "object"}, "guided_regex": "a"}}, "guided_json", "give one"),
        ({"extra_body": {"structured_outputs": {"xml": "<a/>"}}}, "structured_outputs", "not supported"),
        ({"extra_body": {"guided_grammar": "root ::= foo"}}, "guided_grammar", "invalid ebnf"),
    ],
)
def test_served_bad_constraints_are_one_400_and_the_server_keeps_serving(servers, extra, param, message):
    import openai

    client = servers["dflash"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, **extra)
    error = info.value.body
    assert error["param"] == param and message in error["message"] and "\n" not in error["message"]
    ok = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


# ---------------------------------------------------------------------------------------------- command line
def test_cli_generate_with_a_schema_equals_plain_and_a_bad_regex_is_one_line(targets, tmp_path):
    from typer.testing import CliRunner

    from flashdraft.cli import app

    saved = on_disk(targets["llama"], tmp_path)
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    base = ["generate", "--target", saved["target"], "--draft", saved["draft"],
            "--block-size", "4", "--max-new-tokens", "40"]  # fmt: skip
    result = CliRunner().invoke(app, [*base, "--json-schema", str(tmp_path / "schema.json"), "--compare-ar",
                                      "--json", PROMPT])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{") :])
    assert report["identical_to_ar"]
    check_matches("json_schema", report["text"], report["dflash"]["stop_reason"])
    result = CliRunner().invoke(app, [*base, "--regex", "a(", PROMPT])
    assert result.exit_code == 2
    # the one line of the error, beside the warning a busy machine adds (the load of whatever runs beside the test)
    lines = [line for line in result.output.strip().splitlines() if "the machine is busy" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: invalid regex"), result.output


# ---------------------------------------------------------------------------------------------- bench
def test_bench_decodes_structured_records_under_their_response_format(targets, tmp_path):
    """A dataset whose records carry a response_format: ar and dflash decode under it, agree, and the summary gives
    the grammar's share of the decode phase; methods that cannot take a constraint are refused before any load."""
    from flashdraft.bench import BenchConfig, BenchError, run_bench

    saved = on_disk(targets["llama"], tmp_path)
    rows = [{"id": "schema", "turns": [PROMPT], "response_format": CONSTRAINTS["json_schema"]},
            {"id": "object", "turns": ["any JSON"], "response_format": {"type": "json_object"}}]  # fmt: skip
    (tmp_path / "set.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = dict(target=saved["target"], draft=saved["draft"], datasets=[str(tmp_path / "set.jsonl")],
               max_new_tokens=30, block_size=4, plots=False, threads=1, show_progress=False, save_outputs=True)  # fmt: skip
    results = run_bench(BenchConfig(methods=["ar", "dflash"], out_dir=tmp_path / "out", **cfg))
    assert results["equality"]["compared"] == 2 and results["equality"]["mismatches"] == 0
    summary = results["summary"]["set"]
    assert all(0 < summary[m]["grammar_share"] < 1 for m in ("ar", "dflash"))
    with pytest.raises(BenchError, match="pld cannot decode under a response_format"):
        run_bench(BenchConfig(methods=["ar", "pld"], out_dir=tmp_path / "out2", **cfg))
