"""Property-based tests (Hypothesis): whatever the sampling parameters, seeds, prompts or request bodies, the answer
is either one clear error or exactly what plain decoding gives, and the server never answers with a 5xx.

Bounded (a few dozen examples each, no deadline) so the suite stays within a few minutes on 2 cores.
"""

from __future__ import annotations

import json

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import VOCAB, tiny_model  # noqa: E402
from flashdraft import DFlashDraftModel, GenerationError, Target, generate, generate_ar  # noqa: E402
from flashdraft.sampling import SamplingError, SamplingParams, target_probs  # noqa: E402

# derandomize: the same examples on every run, so CI never meets a new one by chance.
SETTINGS = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def pair():
    model = tiny_model("llama", seed=5, layers=2)
    draft = DFlashDraftModel.for_target(
        model.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1
    ).eval()
    return model, Target(model), draft


temperatures = st.one_of(
    st.just(0.0),
    st.floats(min_value=0.0, max_value=1e-30, allow_subnormal=True),  # subnormals and vanishing temperatures
    st.floats(min_value=0.0, max_value=2.0),
)
top_ps = st.one_of(
    st.floats(min_value=1e-9, max_value=1e-3), st.floats(min_value=0.999, max_value=1.0), st.floats(0.01, 1.0)
)
top_ks = st.one_of(st.integers(0, 3), st.integers(0, 10**12))
seeds = st.integers(-(2**70), 2**70)
prompts = st.lists(st.integers(3, VOCAB - 2), min_size=1, max_size=12)


@SETTINGS
@given(temperature=temperatures, top_p=top_ps, top_k=top_ks, seed=seeds, prompt=prompts)
def test_any_sampling_parameters_give_plain_decoding_with_that_seed(
    pair, temperature, top_p, top_k, seed, prompt
):
    model, target, draft = pair
    kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop_token_ids=[])
    plain = generate_ar(target, prompt, 6, **kw).new_tokens
    assert generate(target, draft, prompt, 6, block_size=4, **kw).new_tokens == plain
    # Every token had nonzero probability under the processed target distribution (greedy: it is the argmax).
    with torch.no_grad():
        logits = model(torch.tensor([prompt + plain])).logits[0, len(prompt) - 1 : -1]
    params = SamplingParams(temperature, top_p, top_k)
    if params.greedy:
        assert plain == logits.argmax(-1).tolist()
    else:
        probs = target_probs(logits, params)
        assert all(float(probs[i, t]) > 0 for i, t in enumerate(plain))


@SETTINGS
@given(
    prompt=st.lists(st.integers(-5, VOCAB + 5), min_size=0, max_size=6),
    temperature=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just(-1.0)),
    top_p=st.floats(allow_nan=True, allow_infinity=True),
    top_k=st.integers(-3, 3),
    max_new=st.integers(-2, 4),
)
def test_bad_requests_are_one_clear_error(pair, prompt, temperature, top_p, top_k, max_new):
    _, target, draft = pair
    try:
        out = generate(target, draft, prompt, max_new, temperature, top_p, top_k, block_size=4, seed=0)
    except (GenerationError, SamplingError) as e:
        assert str(e) and "\n" not in str(e)
        return
    assert len(out.new_tokens) <= max_new and all(0 <= t < target.vocab_size for t in out.new_tokens)


def test_a_prompt_at_the_context_limit(pair):
    _, target, draft = pair
    limit = target.max_context
    prompt = [5] * (limit - 2)
    assert generate(target, draft, prompt, 2, block_size=4).num_new_tokens <= 2
    with pytest.raises(GenerationError, match="exceeds the target's context"):
        generate(target, draft, prompt, 3, block_size=4)


# ------------------------------------------------------------------------------------------------ request bodies
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream",
          "stream_options", "presence_penalty", "logprobs", "logit_bias", "return_token_ids", "chat_template_kwargs",
          "return_meta_info", "tools", "response_format", "echo", "guided_json", "guided_regex", "guided_choice",
          "guided_grammar", "structured_outputs", "tool_choice", "parallel_tool_calls"]  # fmt: skip
# Structured-output fields shaped like what clients send, with random parts: schemas, regexes and grammars that may
# or may not compile. Never a 5xx, never a crash of the grammar compiler.
schema_like = st.recursive(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "objec"])}
    )
    | st.fixed_dictionaries({"enum": st.lists(json_values, max_size=3)})
    | st.fixed_dictionaries({"type": st.just("string"), "pattern": st.text(max_size=6)}),
    lambda inner: (
        st.fixed_dictionaries(
            {
                "type": st.just("object"),
                "properties": st.dictionaries(st.text(max_size=4), inner, max_size=3),
            },
            optional={"required": st.lists(st.text(max_size=4), max_size=2)},
        )
        | st.fixed_dictionaries(
            {"type": st.just("array"), "items": inner}, optional={"minItems": st.integers(-2, 3)}
        )
    ),
    max_leaves=5,
)
structured = st.one_of(
    st.fixed_dictionaries({"response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"])},
        optional={"json_schema": st.fixed_dictionaries({"name": st.text(max_size=4)},
                                                       optional={"schema": schema_like | json_values})})}),
    st.fixed_dictionaries({"guided_json": schema_like | json_values}),
    st.fixed_dictionaries({"guided_regex": st.text(alphabet="ab()[]*+?|{}\\.^$0-9w", max_size=8) | json_values}),
    st.fixed_dictionaries({"guided_choice": st.lists(st.text(max_size=4), max_size=3) | json_values}),
    st.fixed_dictionaries({"guided_grammar": st.sampled_from(["root ::= \"w5\"", "root ::= foo", "start: \"w5\"",
                                                              "root ::= [", ""]) | json_values}),
    st.fixed_dictionaries({"structured_outputs": st.dictionaries(
        st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "xml"]), json_values | schema_like,
        max_size=2)}),
)  # fmt: skip


# Tool fields shaped like what agents send, with random parts: tools with random schemas, choices that may or may not
# name one, histories holding calls (arguments as JSON text or not) and tool results.
tool_like = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["function", "function", "custom"]),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "g", "", "f"])}, optional={"parameters": schema_like | json_values}
        ),
    }
)
call_like = st.fixed_dictionaries(
    {
        "id": st.text(max_size=4),
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {
                "name": st.sampled_from(["f", "g"]),
                "arguments": st.sampled_from(['{"a": 1}', "{oops", "", "[1]"]) | json_values,
            }
        ),
    }
)
tools_fields = st.fixed_dictionaries(
    {"tools": st.lists(tool_like, max_size=3) | json_values},
    optional={
        "tool_choice": st.sampled_from(["none", "auto", "required", "any"])
        | st.fixed_dictionaries({"type": st.just("function"),
                                 "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "h"])})})
        | json_values,
        "parallel_tool_calls": st.booleans() | json_values,
        "messages": st.lists(st.one_of(
            st.just({"role": "user", "content": "w7"}),
            st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none() | st.just("w5"),
                                   "tool_calls": st.lists(call_like, max_size=2)}),
            st.fixed_dictionaries({"role": st.just("tool"), "content": st.text(max_size=4) | st.none()},
                                  optional={"tool_call_id": st.text(max_size=3)}),
        ), min_size=1, max_size=4),
    },
)  # fmt: skip


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from flashdraft.serve import Engine, build_app
    from test_serve import tiny_tokenizer

    model = tiny_model("llama", seed=5, layers=2)
    target = Target(model, tiny_tokenizer(), name="tiny")
    draft = DFlashDraftModel.for_target(
        model.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1
    ).eval()
    engine = Engine(target, draft, block_size=4, max_queue=8)
    with TestClient(build_app(engine, "tiny"), raise_server_exceptions=False) as c:
        yield c
    engine.close()


GOOD = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "w7 w9"}],
    "max_tokens": 6,
    "temperature": 0,
}


@SETTINGS
@given(
    endpoint=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
    body=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6),
    keep=st.sets(st.sampled_from(["model", "messages", "prompt"])),
)
def test_random_request_bodies_never_get_a_5xx(client, endpoint, body, keep):
    base = {"model": "tiny", "messages": [{"role": "user", "content": "w7"}], "prompt": "w7", "max_tokens": 4}
    body = {**{k: base[k] for k in keep}, **body}
    r = client.post(endpoint, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["message"] and error["type"]


@SETTINGS
@given(endpoint=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), fields=structured)
def test_random_structured_output_fields_never_get_a_5xx(client, endpoint, fields):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w7"}], "prompt": "w7", "max_tokens": 4}
    r = client.post(
        endpoint, content=json.dumps({**body, **fields}), headers={"content-type": "application/json"}
    )
    assert r.status_code < 500, (fields, r.text)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["message"] and "\n" not in error["message"]
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@SETTINGS
@given(fields=tools_fields, stream=st.booleans())
def test_random_tool_fields_never_get_a_5xx(client, fields, stream):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "w7"}],
        "max_tokens": 4,
        "stream": stream,
    }
    r = client.post(
        "/v1/chat/completions",
        content=json.dumps({**body, **fields}),
        headers={"content-type": "application/json"},
    )
    assert r.status_code < 500, (fields, r.text)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["message"] and "\n" not in error["message"]
    elif not stream:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    else:
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text


def test_the_server_answers_the_same_after_random_bodies(client):
    first = client.post("/v1/chat/completions", json=GOOD).json()["choices"][0]["message"]["content"]
    for bad in ({"model": "tiny"}, {"messages": 5}, {"model": "tiny", "messages": [], "n": 3}, [1, 2], "x"):
        assert client.post("/v1/chat/completions", json=bad).status_code == 400
    assert client.post("/v1/chat/completions", json=GOOD).json()["choices"][0]["message"]["content"] == first


# ------------------------------------------------------------------------------------------------ the command line
def _numeric_options():
    """(command path, option) for every int / float option of every command, found in the CLI itself."""
    import typer

    from flashdraft.cli import app

    found = []

    def walk(command, path):
        for name, sub in sorted(getattr(command, "commands", {}).items()):
            walk(sub, [*path, name])
        for param in command.params:
            if param.param_type_name == "option" and param.opts and _numeric(param):
                found.append((tuple(path), param.opts[0]))

    walk(typer.main.get_command(app), [])
    return found


def _numeric(param) -> bool:
    """An int or float option (click's param type; typer's own copy of click describes it by annotation)."""
    import typing

    if getattr(getattr(param, "type", None), "name", None) in ("integer", "float"):
        return True
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    kinds = set(typing.get_args(annotation)) or {annotation}
    return bool(kinds & {int, float}) and not kinds & {bool, str}


NUMERIC_OPTIONS = _numeric_options()


def _not_a_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return True
    return False


@pytest.mark.parametrize(
    ("path", "option"), NUMERIC_OPTIONS, ids=[" ".join((*p, o)) for p, o in NUMERIC_OPTIONS]
)
@settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    value=st.one_of(
        st.sampled_from(["x", "1\x1c2", "a\u2028b", "--", "1e"]),  # line separators that are not "\n"
        st.text(min_size=1, max_size=6),
    ).filter(_not_a_number)
)
def test_every_numeric_option_given_garbage_is_one_line_and_status_2(
    path, option, value, capsys, monkeypatch
):
    from flashdraft.cli import main

    monkeypatch.setattr("sys.argv", ["flashdraft", *path, f"{option}={value}"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.strip()]
    assert exit_info.value.code == 2, (path, option, value, lines)
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in lines[0], lines
