"""`flashdraft serve`: the official openai client against a server started here (tiny random model + drafter)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from conftest import VOCAB, running_server
from flashdraft import DFlashDraftModel, Target, generate, generate_ar

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

MODEL = "tiny"


def tiny_tokenizer():
    """Word-level tokenizer over the tiny vocabulary: token i is the word `w{i}`; a plain chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<pad>",
        chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}w5",
    )


@pytest.fixture(scope="module")
def server(models):
    from flashdraft.serve import Engine, build_app

    model = models["llama"]
    target = Target(model, tiny_tokenizer(), name=MODEL)
    draft = DFlashDraftModel.for_target(
        model.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1
    ).eval()
    engine = Engine(target, draft, max_queue=8)
    with running_server(build_app(engine, MODEL)) as base:
        yield {"base": base, "target": target, "draft": draft, "engine": engine,
               "client": openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)}  # fmt: skip
    engine.close()


MESSAGES = [{"role": "user", "content": "w7 w9 w11 w3 w20"}]


def expected(server, messages=MESSAGES, max_tokens=24, **sampling):
    target = server["target"]
    ids = target.encode_prompt(messages)
    res = generate(target, server["draft"], ids, max_tokens, **sampling)
    return ids, res, target.tokenizer.decode(res.new_tokens, skip_special_tokens=True)


def test_chat_greedy_equals_generate_with_usage_and_spec_stats(server):
    ids, res, text = expected(server)
    out = server["client"].chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0
    )
    assert out.choices[0].message.content == text
    assert out.usage.prompt_tokens == ids.shape[1] and out.usage.completion_tokens == res.num_new_tokens
    assert out.choices[0].finish_reason == ("stop" if res.stop_reason == "stop_token" else "length")
    spec = out.model_extra["spec_decode"]
    assert spec["num_accepted_draft_tokens"] <= spec["num_draft_tokens"]
    # every decode step's tokens are in the histogram: all but the first token (which prefill gives)
    hist = spec["acceptance_histogram"]
    assert sum(n * count for n, count in enumerate(hist)) == out.usage.completion_tokens - 1


def test_streaming_chat_and_usage(server):
    _, res, text = expected(server)
    stream = server["client"].chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == res.num_new_tokens and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


def test_completions_text_and_token_prompts(server):
    target, client = server["target"], server["client"]
    ids = target.encode_prompt("w4 w8 w15", chat=False)
    res = generate(target, server["draft"], ids, 12)
    text = target.tokenizer.decode(res.new_tokens, skip_special_tokens=True)
    assert (
        client.completions.create(model=MODEL, prompt="w4 w8 w15", max_tokens=12, temperature=0)
        .choices[0]
        .text
        == text
    )
    by_ids = client.completions.create(model=MODEL, prompt=ids[0].tolist(), max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == text
    streamed = client.completions.create(
        model=MODEL, prompt="w4 w8 w15", max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text


def test_seeded_sampling_is_plain_sampling_with_that_seed(server):
    target = server["target"]
    ids = target.encode_prompt(MESSAGES)
    plain = generate_ar(target, ids, 20, temperature=0.9, top_p=0.95, seed=7)
    want = target.tokenizer.decode(plain.new_tokens, skip_special_tokens=True)
    for _ in range(2):
        out = server["client"].chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0.9, top_p=0.95, seed=7
        )
        assert out.choices[0].message.content == want


def test_stop_strings_and_stop_ids(server):
    _, res, text = expected(server, max_tokens=24)
    words = text.split()
    assert len(words) >= 4
    stop_word = words[3]
    out = server["client"].chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, stop=[stop_word]
    )
    assert out.choices[0].message.content == text[: text.index(stop_word)]
    assert out.choices[0].finish_reason == "stop"
    stop_id = res.new_tokens[2]
    by_id = server["client"].completions.create(
        model=MODEL, prompt=server["target"].encode_prompt(MESSAGES)[0].tolist(), max_tokens=24, temperature=0,
        stop=[stop_id],
    )  # fmt: skip
    assert by_id.choices[0].finish_reason == "stop"


def test_concurrent_requests_all_answered_correctly(server):
    prompts = [[{"role": "user", "content": f"w{3 + i} w{10 + i} w{20 + i}"}] for i in range(6)]
    wanted = [expected(server, p, max_tokens=16)[2] for p in prompts]

    def ask(messages):
        out = server["client"].chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, temperature=0
        )
        return out.choices[0].message.content

    before = sum(n for rows, n in server["engine"].steps_by_rows.items() if rows > 1)
    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(ask, prompts)) == wanted
    # They were decoded together (continuous batching), not one after another.
    assert sum(n for rows, n in server["engine"].steps_by_rows.items() if rows > 1) > before
    assert "flashdraft:decode_steps_by_batch_size" in httpx.get(f"{server['base']}/metrics", timeout=10).text


class ServerOutput:
    """A `flashdraft serve` process's output, read as it comes (an unread pipe can fill and stall the server)."""

    def __init__(self, proc) -> None:
        import queue

        self.proc, self.lines, self._queue = proc, [], queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float = 180) -> re.Match:
        """The first line matching `pattern`; fails, with the output so far, if the server exits or stays silent."""
        import queue

        deadline = time.time() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(deadline - time.time(), 0.01))
            except queue.Empty:
                pytest.fail(f"no line matching {pattern!r} within {timeout} s; output: {''.join(self.lines)}")
            if line is None:
                pytest.fail(
                    f"the server exited ({self.proc.wait()}) before {pattern!r}: {''.join(self.lines)}"
                )
            self.lines.append(line)
            if match := re.search(pattern, line):
                return match


def wait_until_ready(base: str, output: ServerOutput, timeout: float = 180) -> None:
    """`/health` answers 200 once the server is ready (503 while it starts); fails loudly when it never does."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"{base}/health was not 200 within {timeout} s; output: {''.join(output.lines)}")


def test_sigterm_drains_in_flight_requests_then_exits(models, tmp_path):
    """`flashdraft serve` in its own process: SIGTERM during a streamed answer lets it finish (every token, the
    usage chunk, [DONE]), then the server exits."""
    import os
    import signal
    import subprocess
    import sys

    model = models["llama"]
    model.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    draft = DFlashDraftModel.for_target(model.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1)
    draft.save_pretrained(tmp_path / "draft")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flashdraft", "serve", "--target", str(tmp_path / "target"), "--draft",
         str(tmp_path / "draft"), "--port", "0", "--block-size", "4", "--threads", "1",
         "--served-model-name", MODEL],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
    )  # fmt: skip
    output = ServerOutput(proc)
    try:  # --port 0: the server takes a free port and says which, so no other process can take it first
        base = output.wait_for(r"on (http://127\.0\.0\.1:\d+)/v1").group(1)
        wait_until_ready(base, output)
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "stop": []}  # fmt: skip
        chunks = []
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if not chunks:
                    proc.send_signal(signal.SIGTERM)  # mid-answer
                chunks.append(line[6:])
        assert chunks[-1] == "[DONE]"
        assert len(chunks) > 20  # the answer streamed for many chunks after the signal (one chunk per step)
        usage = json.loads(chunks[-2])["usage"]
        finish = [
            json.loads(c)["choices"][0]["finish_reason"] for c in chunks[:-2] if json.loads(c)["choices"]
        ]
        ids = Target(model, tiny_tokenizer()).encode_prompt(MESSAGES)
        alone = generate_ar(Target(model), ids, 200)
        assert usage["completion_tokens"] == alone.num_new_tokens and finish[-1] in ("stop", "length")
        # uvicorn re-raises the signal once it has drained, so the exit status is the usual one for SIGTERM.
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
        print("".join(output.lines))


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ("{not json", 400, "JSON"),
        ({"model": "gpt-9", "messages": MESSAGES}, 404, "does not exist"),
        ({"model": MODEL, "messages": MESSAGES, "temperature": 5}, 400, "temperature"),
        ({"model": MODEL, "messages": MESSAGES, "n": 2}, 400, "n is not supported"),
        ({"model": MODEL, "messages": MESSAGES, "max_tokens": 10_000}, 400, "exceeds the model's context"),
        (
            {
                "model": MODEL,
                "messages": MESSAGES,
                "tools": [{"type": "web_search"}],
            },
            400,
            "only function tools",
        ),  # fmt: skip
        (
            {"model": MODEL, "messages": MESSAGES, "response_format": {"type": "json_schema"}},
            400,
            "response_format: response_format of type json_schema needs a 'json_schema' object",
        ),
        ({"model": MODEL, "messages": MESSAGES, "guided_regex": "a(b"}, 400, "guided_regex: invalid regex"),
        ({"model": MODEL, "messages": MESSAGES, "repetition_penalty": 1.2}, 400, "repetition_penalty"),
        ({"model": MODEL, "messages": MESSAGES, "min_p": 0.1}, 400, "min_p"),
        ({"model": MODEL, "messages": MESSAGES, "ignore_eos": True}, 400, "ignore_eos"),
        ({"model": MODEL, "messages": MESSAGES, "logit_bias": {"5": 10}}, 400, "logit_bias"),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            },
            400,
            "image_url",
        ),  # fmt: skip
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL, "messages": MESSAGES, "stop": [10_000]}, 400, "stop token ids"),
        ("[" * 50_000 + "]" * 50_000, 400, ""),  # nested too deep to parse: still the OpenAI error body
    ],
)
def test_bad_input_is_a_4xx_with_an_openai_error_and_the_server_keeps_serving(server, body, status, needle):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server['base']}/v1/chat/completions", content=content,
                   headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["type"]
    assert httpx.get(f"{server['base']}/health", timeout=10).json()["status"] == "ok"
    ok = server["client"].chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    assert ok.choices[0].message.content is not None


def test_a_client_that_leaves_mid_stream_frees_its_place(server, monkeypatch):
    """Counted in the target's forwards, not in seconds: the answer stops well before a whole one."""
    engine, target = server["engine"], server["target"]
    real_forward = target.forward
    forwards = [0]

    def slow_forward(
        *args, **kwargs
    ):  # a step takes 20 ms, so the client's leaving lands early in the answer
        forwards[0] += 1
        time.sleep(0.02)
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(target, "forward", slow_forward)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "temperature": 0, "stream": True}
    whole = httpx.post(f"{server['base']}/v1/chat/completions", json={**body, "stream": False}, timeout=60)
    assert whole.json()["usage"]["completion_tokens"] == 200
    whole_forwards, forwards[0] = forwards[0], 0
    assert whole_forwards >= 40  # room to see the answer cut short
    with httpx.stream("POST", f"{server['base']}/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content": "w' in line:
                break  # first real text: leave
    deadline = time.time() + 30
    while engine.running and time.time() < deadline:
        time.sleep(0.02)
    assert not engine.running, "the left request was still decoding after 30 s"
    assert forwards[0] < whole_forwards // 2, (forwards[0], whole_forwards)
    monkeypatch.setattr(target, "forward", real_forward)
    ok = server["client"].chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    assert ok.choices[0].message.content is not None


def test_models_health_and_metrics(server):
    base = server["base"]
    assert [m.id for m in server["client"].models.list()] == [MODEL]
    server["client"].chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for name in (
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "flashdraft:requests_total",
        "flashdraft:e2e_request_latency_seconds_bucket",
    ):
        assert name in text, name
    requests = [line for line in text.splitlines() if line.startswith("flashdraft:requests_total{")]
    assert any('status="200"' in line and float(line.rsplit(" ", 1)[1]) >= 1 for line in requests)


def test_plain_server_without_drafter(models):
    """--draft is optional: the same server decodes plainly (the honest baseline)."""
    from fastapi.testclient import TestClient

    from flashdraft.serve import Engine, build_app

    target = Target(models["llama"], tiny_tokenizer(), name=MODEL)
    engine = Engine(target, None)
    try:
        with TestClient(build_app(engine, MODEL)) as client:
            r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 12,
                                                          "temperature": 0})  # fmt: skip
            assert r.status_code == 200, r.text
            ids = target.encode_prompt(MESSAGES)
            want = target.tokenizer.decode(generate_ar(target, ids, 12).new_tokens, skip_special_tokens=True)
            assert r.json()["choices"][0]["message"]["content"] == want and r.json()["spec_decode"] is None
    finally:
        engine.close()
    assert torch.is_grad_enabled()  # the engine's worker thread does not change the caller's grad mode
    from flashdraft.serve.engine import EngineRequest, QueueFullError

    with pytest.raises(
        QueueFullError, match="shutting down"
    ):  # after close(): refused (HTTP 503), not queued
        engine.submit(EngineRequest(prompt_ids=[5, 6], max_tokens=2), asyncio.new_event_loop())


def test_health_is_503_until_the_engine_has_warmed_up_and_once_it_drains(models, monkeypatch):
    """`serve --compile` warms up (compiles its graphs) on the worker for minutes after the HTTP server is up: a
    load balancer must not send it requests then, so /health answers 503 "starting" until the worker is ready, 200
    "ok" while it serves, 503 "stopping" once it drains."""
    from fastapi.testclient import TestClient

    from flashdraft.serve import Engine, build_app

    entered, release = threading.Event(), threading.Event()

    def warming_up(engine):  # noqa: ANN001 - a stand-in for the compiled warm-up, held until released
        entered.set()
        assert release.wait(60), "the test never released the warm-up"

    monkeypatch.setattr(Engine, "warm_up", warming_up)
    target = Target(models["llama"], tiny_tokenizer(), name=MODEL)
    engine = Engine(target, None)
    app = build_app(engine, MODEL)
    try:
        with TestClient(app) as client:
            assert entered.wait(60), "the engine's worker never started its warm-up"
            r = client.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "starting", r.text
            release.set()
            for _ in range(600):  # the worker sets ready as soon as its warm-up returns
                r = client.get("/health")
                if r.status_code == 200:
                    break
                time.sleep(0.05)
            assert r.status_code == 200 and r.json() == {"status": "ok", "waiting": 0, "running": 0}, r.text
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3})
            assert r.status_code == 200, r.text
    finally:
        release.set()
        engine.close()
    with TestClient(app) as client:
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "stopping", r.text


def test_every_framework_error_has_the_openai_error_body(server):
    base = server["base"]
    for r, status in (
        (httpx.get(f"{base}/v1/no-such-endpoint", timeout=10), 404),
        (httpx.get(f"{base}/v1/chat/completions", timeout=10), 405),
    ):
        assert r.status_code == status, r.text
        assert set(r.json()) == {"error"} and r.json()["error"]["message"], r.text


def test_a_lone_surrogate_is_answered_not_a_500(server):
    """Valid JSON may hold a lone UTF-16 surrogate; the tokenizer cannot encode it, so it is read as U+FFFD."""
    body = '{"model": "%s", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "w7 \\ud800 w9"}]}'
    r = httpx.post(f"{server['base']}/v1/chat/completions", content=body % MODEL,
                   headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None


def test_content_part_arrays_are_joined_text(server):
    """OpenAI's other form of a message: an array of text parts (many SDKs and UIs send it)."""
    _, _, text = expected(server)
    parts = [{"type": "text", "text": "w7 w9 "}, {"type": "text", "text": "w11 w3 w20"}]
    out = server["client"].chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=24, temperature=0
    )
    assert out.choices[0].message.content == text


def test_zlab_benchmark_request_body_is_answered_with_meta_info(server):
    """The body z-lab's `python -m dflash.benchmark --backend openai` sends (dflash 0.1.0, `send_openai`), replayed:
    `chat_template_kwargs` reaches the template, and SGLang's `meta_info` carries what the harness reads τ from."""
    ids, res, text = expected(server)
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 24,
        "temperature": 0.0,
        "top_p": 1.0,
        "chat_template_kwargs": {"enable_thinking": False},
        "return_meta_info": True,
    }
    r = httpx.post(f"{server['base']}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["message"]["content"] == text
    meta = out["meta_info"]
    assert meta["completion_tokens"] == out["usage"]["completion_tokens"] == res.num_new_tokens
    # the cost-aware policy times every step, so this run may take other steps than `res`'s: the fields agree
    steps = meta["spec_verify_ct"]
    assert 0 < steps == sum(meta["spec_accept_histogram"])
    assert meta["spec_accept_length"] == pytest.approx((res.num_new_tokens - 1) / steps)
    assert sum(n * c for n, c in enumerate(meta["spec_accept_histogram"])) == res.num_new_tokens - 1


def test_chat_template_kwargs_reach_the_template(server):
    target = server["target"]
    tok = target.tokenizer
    saved = tok.chat_template
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if extra %}w30 {% endif %}w5"
    )
    try:
        plain = target.encode_prompt(MESSAGES)[0].tolist()
        extra = target.encode_prompt(MESSAGES, template_kwargs={"extra": True})[0].tolist()
        assert extra == plain[:-1] + [30, 5]
        r = httpx.post(f"{server['base']}/tokenize", timeout=10,
                       json={"model": MODEL, "messages": MESSAGES, "chat_template_kwargs": {"extra": True}})  # fmt: skip
        assert r.json()["tokens"] == extra
    finally:
        tok.chat_template = saved


def test_an_unknown_harmless_field_is_ignored_with_a_warning(server, caplog):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "skip_special_tokens": True,
            "some_client_field": {"x": 1}}  # fmt: skip
    with caplog.at_level("WARNING", logger="flashdraft.serve.app"):
        r = httpx.post(f"{server['base']}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-flashdraft-ignored-fields"] == "skip_special_tokens,some_client_field"
    assert any("some_client_field" in rec.getMessage() for rec in caplog.records)


def test_tokenize_detokenize_and_version(server):
    base = server["base"]
    r = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": "w7 w9 w11"}, timeout=10).json()
    assert (
        r["tokens"] == [7, 9, 11] and r["count"] == 3 and r["max_model_len"] == server["target"].max_context
    )
    assert httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": [7, 9]}, timeout=10).json() == {
        "prompt": "w7 w9"
    }
    assert httpx.post(f"{base}/detokenize", json={"tokens": [10**6]}, timeout=10).status_code == 400
    assert httpx.get(f"{base}/version", timeout=10).json()["version"]
