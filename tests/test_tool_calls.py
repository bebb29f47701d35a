"""Tool calling: tools shown through the chat template, calls parsed into OpenAI's `tool_calls` (whole and streamed),
`required` and named functions enforced by a grammar that speculation decodes exactly as plain decoding does."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("xgrammar")

from conftest import OracleProposer, byte_tokenizer, dflash_and_plain_servers, on_disk, tiny_model  # noqa: E402
from flashdraft import DFlashDraftModel, Target, generate, generate_ar  # noqa: E402
from flashdraft.engine.tool_calls import (  # noqa: E402
    ToolCallParser,
    ToolChoice,
    ToolError,
    parse_tool_choice,
    parse_tool_output,
    parse_tools,
    template_convention,
    tool_constraint,
    tool_messages,
)

VOCAB = 320
CORPUS = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", "days": 2}}\n</tool_call>',
    '<tool_call>\n{"name": "set_alarm", "arguments": {"on": true}}\n</tool_call>',
    "<tool_response>\nsunny\n</tool_response> What is the weather in Paris?",
]
# A chat template in the Hermes / Qwen convention (as Qwen2.5's renders tools, calls and results), small.
HERMES_TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Call a tool: <tool_call>\n{json}\n</tool_call>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}\n</tool_call>{% endfor %}'
    "{%- elif m.role == 'tool' %}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- else %}{{ m.content }}{% endif %}\n{% endfor %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast.",
            "parameters": {
                "type": "object",
                "properties": {"unit": {"enum": ["c", "f"]}, "days": {"enum": [1, 2, 3]}},
                "required": ["unit", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "set_alarm",
            "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]},
        },
    },
]
NAMES = frozenset({"get_weather", "set_alarm"})


def valid_arguments(call: dict) -> bool:
    args = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        return set(args) == {"unit", "days"} and args["unit"] in ("c", "f") and args["days"] in (1, 2, 3)
    return set(args) == {"on"} and isinstance(args["on"], bool)


# ---------------------------------------------------------------------------------------------- parsing
ANSWER = (
    "  Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>\n'
    '<tool_call>\n{"name": "set_alarm", "arguments": "{\\"on\\": true}"}\n</tool_call>\n'
    "<tool_call>\n{broken\n</tool_call> done <tool_"
)


def test_parser_splits_content_and_calls_the_same_whole_or_in_any_pieces():
    """Valid calls of known tools become calls (arguments as JSON text, even when the model wrote a string), an
    unknown name, broken JSON or an unclosed tag stay content; the streamed deltas add up to the whole answer."""
    content, calls = parse_tool_output(ANSWER, NAMES)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "set_alarm"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"unit": "c", "days": 2}, {"on": True}]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert content.startswith('Let me check.\n\n<tool_call>\n{"name": "nope"')
    assert content.endswith("{broken\n</tool_call> done <tool_")
    rng = random.Random(0)
    for _ in range(60):
        cuts = sorted(rng.sample(range(1, len(ANSWER)), rng.randrange(1, 40)))
        pieces = [ANSWER[a:b] for a, b in zip([0, *cuts], [*cuts, len(ANSWER)], strict=True)]
        parser = ToolCallParser(NAMES)
        deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish()
        assert "".join(d.get("content", "") for d in deltas) == content
        streamed = {}
        for d in deltas:
            for part in d.get("tool_calls", []):
                entry = streamed.setdefault(part["index"], {"name": "", "arguments": ""})
                entry["name"] += part["function"].get("name", "")
                entry["arguments"] += part["function"]["arguments"]
        assert [streamed[i] for i in sorted(streamed)] == [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls
        ]


def test_parser_keeps_one_call_when_parallel_calls_are_off_and_none_without_calls():
    _, calls = parse_tool_output(ANSWER, NAMES, parallel=False)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert parse_tool_output("  just text \n", NAMES) == ("just text", [])
    assert parse_tool_output("", NAMES) == (None, [])


@pytest.mark.parametrize(
    ("tools", "choice", "message"),
    [
        ([{"type": "custom", "custom": {}}], None, "only function tools"),
        ([{"type": "function", "function": {}}], None, "name must be"),
        ([TOOLS[0], TOOLS[0]], None, "given twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "parameters must be"),
        (TOOLS, {"type": "function", "function": {"name": "other"}}, "not in tools"),
        (TOOLS, "sometimes", "tool_choice must be"),
        (None, "required", "needs tools"),
    ],
)
def test_bad_tools_and_tool_choices_are_one_line_naming_the_field(tools, choice, message):
    with pytest.raises(ToolError) as info:
        parse_tool_choice(choice, parse_tools(tools))
    assert message in str(info.value) and "\n" not in str(info.value)
    assert info.value.param == ("tools" if choice is None else "tool_choice")


def test_absent_tool_choice_is_auto_with_tools_and_none_without():
    assert parse_tool_choice(None, parse_tools(TOOLS)) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")
    assert parse_tool_choice("none", []) == ToolChoice("none")


# ---------------------------------------------------------------------------------------------- the prompt
HISTORY = [
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"unit": "c", "days": 1}},
            }
        ],
    },  # fmt: skip
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    {"role": "tool", "content": "warm", "tool_call_id": "call_2"},
]


def test_a_hermes_template_gets_tools_and_history_as_it_expects_them():
    tok = byte_tokenizer(CORPUS, VOCAB, HERMES_TEMPLATE)
    assert template_convention(tok) == "hermes"
    messages, tools = tool_messages(HISTORY, parse_tools(TOOLS), "hermes")
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", "days": 1}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


def test_a_template_without_tools_gets_the_convention_in_the_system_message():
    """SmolLM2's kind of template: the tools go into the system message, the calls into the assistant's text and
    the results into one user turn of <tool_response> blocks; another convention is refused."""
    tok = byte_tokenizer(CORPUS, VOCAB)
    assert template_convention(tok) == "none"
    messages, tools = tool_messages(
        [{"role": "system", "content": "Be brief."}, *HISTORY], parse_tools(TOOLS), "none"
    )
    assert tools is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert (
        messages[0]["content"].startswith("Be brief.\n\n# Tools") and '"set_alarm"' in messages[0]["content"]
    )
    assert messages[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", "days": 1}}\n</tool_call>'
    )
    assert (
        messages[3]["content"]
        == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response>"
    )
    other = byte_tokenizer(
        CORPUS, VOCAB, "{% if tools %}[TOOLS]{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    assert template_convention(other) == "other"
    with pytest.raises(ToolError, match="convention"):
        tool_messages(HISTORY, parse_tools(TOOLS), "other")
    assert tool_messages([{"role": "user", "content": "hi"}], [], "other")[0] == [
        {"role": "user", "content": "hi"}
    ]


# ---------------------------------------------------------------------------------------------- decoding
@pytest.fixture(scope="module")
def target():
    return Target(
        tiny_model("llama", seed=3, vocab=VOCAB, max_position_embeddings=1024),
        byte_tokenizer(CORPUS * 4, VOCAB, HERMES_TEMPLATE),
    )


@pytest.mark.parametrize(
    ("choice", "parallel"),
    [
        (ToolChoice("required"), True),
        (ToolChoice("required"), False),
        (ToolChoice("function", "set_alarm"), True),
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_required_and_named_calls_decode_exactly_as_plain_and_are_valid(
    target, choice, parallel, temperature
):
    """Under the tool grammar, DFlash and a half-right oracle give plain constrained decoding's tokens (greedy, and
    seed for seed); a finished answer is only valid calls (one with parallel calls off, the named one if named)."""
    tools = parse_tools(TOOLS)
    constraint = tool_constraint(tools, choice, parallel)
    messages, shown = tool_messages([{"role": "user", "content": "Weather?"}], tools, "hermes")
    ids = target.encode_prompt(messages, template_kwargs={"tools": shown})
    kw = dict(temperature=temperature, seed=5, response_format=constraint)
    plain = generate_ar(target, ids, 90, **kw)
    drafter = DFlashDraftModel.for_target(
        target.model.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1
    )
    oracle = OracleProposer(ids[0].tolist() + plain.new_tokens + [0] * 8, VOCAB, 6, random.Random(2))
    for proposer in (drafter, oracle):
        spec = generate(target, proposer, ids, 90, block_size=4 if proposer is drafter else "auto", **kw)
        assert spec.new_tokens == plain.new_tokens and spec.stop_reason == plain.stop_reason
    text = target.tokenizer.decode(plain.new_tokens, skip_special_tokens=True)
    assert text.startswith('<tool_call>\n{"name": ')
    if plain.stop_reason == "stop_token":
        content, calls = parse_tool_output(text, NAMES)
        assert content is None and calls and all(valid_arguments(c) for c in calls)
        assert len(calls) == 1 or (parallel and choice.mode == "required")
        assert choice.mode != "function" or calls[0]["function"]["name"] == "set_alarm"


# ---------------------------------------------------------------------------------------------- served
@pytest.fixture(scope="module")
def servers(target):
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    with dflash_and_plain_servers(target) as clients:
        yield clients


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CHOICES = ["required", {"type": "function", "function": {"name": "get_weather"}}, "auto", "none"]


def _streamed(stream) -> tuple[str | None, list[dict], str]:
    """What the openai client's stream gives, accumulated as OpenAI's delta format says."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = part.id or entry["id"]
            entry["name"] += (part.function.name or "") if part.function else ""
            entry["arguments"] += (part.function.arguments or "") if part.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


def test_served_tool_calls_streamed_or_not_and_dflash_equals_plain(servers):
    """required, a named function, auto and none through the official client, with history holding calls and
    results: required/named answer valid calls with finish_reason "tool_calls"; the streamed deltas accumulate to
    the whole answer; the DFlash server answers what the plain server does at T=0."""
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "set_alarm", "arguments": '{"on": true}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"}]  # fmt: skip
    answers = {}
    for name, client in servers.items():
        got = []
        for messages in (ASK, history):
            for choice in CHOICES:
                kw = dict(
                    model="tiny",
                    messages=messages,
                    tools=TOOLS,
                    tool_choice=choice,
                    temperature=0,
                    max_tokens=80,
                )
                whole = client.chat.completions.create(**kw)
                message, finish = whole.choices[0].message, whole.choices[0].finish_reason
                calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                         for c in message.tool_calls or []]  # fmt: skip
                content, streamed_calls, streamed_finish = _streamed(
                    client.chat.completions.create(**kw, stream=True)
                )
                assert content == message.content and streamed_finish == finish
                assert [(c["name"], c["arguments"]) for c in streamed_calls] == [
                    (c["name"], c["arguments"]) for c in calls
                ]
                if choice in ("required", CHOICES[1]) and finish != "length":
                    assert finish == "tool_calls" and message.content is None and calls
                    assert all(valid_arguments({"function": c}) for c in calls)
                    assert choice == "required" or {c["name"] for c in calls} == {"get_weather"}
                if choice == "none":
                    assert not calls
                got.append((message.content, [(c["name"], c["arguments"]) for c in calls], finish))
        answers[name] = got
        assert sum(finish == "tool_calls" for *_, finish in got) >= 2  # the named calls finish, at least
    assert answers["dflash"] == answers["plain"]


def test_served_parallel_tool_calls_off_gives_one_call(servers):
    client = servers["dflash"]
    out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, temperature=0, max_tokens=80)  # fmt: skip
    if out.choices[0].finish_reason == "tool_calls":
        assert len(out.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),  # fmt: skip
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "give one",
        ),  # fmt: skip
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
                "tool_choice": "required",
            },
            "tools",
            "invalid",
        ),  # fmt: skip
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    }
                ]
            },
            "messages.0.tool_calls.0.function.arguments",
            "not valid JSON",
        ),  # fmt: skip
        ({"messages": [{"role": "tool", "tool_call_id": "c"}]}, "messages.0", "needs content"),
    ],
)
def test_served_bad_tool_requests_are_one_400_and_the_server_keeps_serving(servers, body, param, message):
    import httpx

    base = str(servers["dflash"].base_url)
    response = httpx.post(
        f"{base}chat/completions", json={"model": "tiny", "messages": ASK, "max_tokens": 4, **body}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"] and "\n" not in error["message"]
    ok = servers["dflash"].chat.completions.create(model="tiny", messages=ASK, max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_chat_template_refusing_the_messages_is_a_400(servers, target):
    """A template's own raise_exception (such as "roles must alternate") is the client's error, not the server's."""
    import httpx

    saved = target.tokenizer.chat_template
    target.tokenizer.chat_template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('start with a user') }}{% endif %}x"
    )
    try:
        body = {"model": "tiny", "messages": [{"role": "assistant", "content": "r"}], "max_tokens": 2}
        response = httpx.post(f"{servers['dflash'].base_url}chat/completions", json=body)
        assert response.status_code == 400 and "start with a user" in response.json()["error"]["message"]
    finally:
        target.tokenizer.chat_template = saved


def test_bench_decodes_tool_records_under_their_tool_choice(target, tmp_path):
    """Tool-call records (tools + tool_choice) in a bench dataset: ar and dflash decode them under the tool grammar
    and agree; bad tools are refused before anything loads."""
    from flashdraft.bench import BenchConfig, BenchError, run_bench

    saved = on_disk(target, tmp_path)
    rows = [{"id": "req", "turns": ["Weather?"], "tools": TOOLS, "tool_choice": "required"},
            {"id": "named", "turns": ["Alarm!"], "tools": TOOLS,
             "tool_choice": {"type": "function", "function": {"name": "set_alarm"}}}]  # fmt: skip
    (tmp_path / "set.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = dict(target=saved["target"], draft=saved["draft"], datasets=[str(tmp_path / "set.jsonl")],
               max_new_tokens=40, block_size=4, plots=False, threads=1, show_progress=False, save_outputs=True)  # fmt: skip
    results = run_bench(BenchConfig(methods=["ar", "dflash"], out_dir=tmp_path / "out", **cfg))
    assert results["equality"]["compared"] == 2 and results["equality"]["mismatches"] == 0
    assert all(0 < results["summary"]["set"][m]["grammar_share"] < 1 for m in ("ar", "dflash"))
    samples = json.loads((tmp_path / "out" / "results.json").read_text())["samples"]
    assert len(samples) == 4 and all(s["output_text"].startswith("<tool_call>") for s in samples)
    (tmp_path / "bad.jsonl").write_text(json.dumps({**rows[0], "tool_choice": "sometimes"}) + "\n")
    with pytest.raises(BenchError, match="bad, record req: tool_choice must be"):
        run_bench(
            BenchConfig(
                methods=["ar", "dflash"],
                out_dir=tmp_path / "out2",
                **{**cfg, "datasets": [str(tmp_path / "bad.jsonl")]},
            )
        )


def test_served_bench_counts_tool_calls_as_output_streamed_or_not(servers, tmp_path):
    """`flashdraft bench --backend openai` on tool records sends their tools and tool_choice, and records the calls
    as output (the same text streamed or not), so served answers can be compared."""
    from flashdraft.bench import ServerBenchConfig, run_server_bench

    rows = [{"id": "named", "turns": ["Alarm!"], "tools": TOOLS,
             "tool_choice": {"type": "function", "function": {"name": "set_alarm"}}}]  # fmt: skip
    (tmp_path / "set.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts = []
    for stream in (True, False):
        cfg = ServerBenchConfig(base_url=str(servers["dflash"].base_url), datasets=[str(tmp_path / "set.jsonl")],
                                concurrency=[1], max_new_tokens=60, stream=stream, out_dir=tmp_path / str(stream),
                                show_progress=False, save_outputs=True, plots=False, warmup=False)  # fmt: skip
        results = run_server_bench(cfg)
        texts.append(results["requests"][0]["text"])
        assert results["levels"][0]["ok"] == 1 and results["requests"][0]["output_tokens"] > 0
    assert texts[0] == texts[1] and texts[0].startswith("\n[tool_call set_alarm] {")
