"""Fuzz `flashdraft serve` with the real model: random request bodies and known hard cases, never a 5xx.

Starts the server in-process (uvicorn in a thread) on SmolLM2-135M with the shipped drafter, asks one greedy
question, sends N random bodies built from the protocol's own fields with random types and values (plus the cases
the bad-input issue lists), then asks the same greedy question again. Writes a report (tried, status codes, 5xx
count, whether the greedy answer is unchanged) as markdown and JSON.

    python benchmarks/fuzz_serve.py --requests 1000 --out benchmarks/fuzz
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import torch

FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
    "stop", "seed", "stream", "stream_options", "presence_penalty", "frequency_penalty", "logprobs", "logit_bias",
    "return_token_ids", "chat_template_kwargs", "return_meta_info", "tools", "response_format", "echo", "user",
    "ignore_eos", "min_p", "unknown_field", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "structured_outputs", "tool_choice", "parallel_tool_calls",
]  # fmt: skip


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["none", "bool", "int", "bigint", "float", "tiny", "str", "surrogate", "list", "dict"]
    if depth > 2:
        kinds = kinds[:8]
    kind = rng.choice(kinds)
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.randint(-5, 300)
    if kind == "bigint":
        return rng.choice([2**64, -(2**70), 10**12])
    if kind == "float":
        return rng.uniform(-3, 3)
    if kind == "tiny":
        return rng.choice([1e-40, 5e-324, 1e-6, 0.0])
    if kind == "str":
        return "".join(rng.choice("abc w7 \n\t{}\"'") for _ in range(rng.randint(0, 8)))
    if kind == "surrogate":
        return "x\ud800y"
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {
        rng.choice(["role", "content", "type", "text", "x"]): random_value(rng, depth + 1) for _ in range(2)
    }


def random_body(rng: random.Random, model: str) -> dict:
    body: dict = {}
    if rng.random() < 0.8:
        body["model"] = model
    if rng.random() < 0.7:
        content = rng.choice(
            ["What is 2+2?", [{"type": "text", "text": "Hi"}], "x\ud800y", random_value(rng)]
        )
        body["messages"] = [{"role": rng.choice(["user", "system", "tool", "assistant"]), "content": content}]
    if rng.random() < 0.6:
        body["max_tokens"] = rng.choice([1, 4, 8, 0, -1, 10**6, "8"])
    for name in rng.sample(FIELDS, rng.randint(0, 4)):
        body[name] = random_value(rng)
    # Bound the work: a valid body without a limit would decode to the end of the context.
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 16 < value < 10**6:
            body[key] = 16
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 8
    return body


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
NAMED = {"type": "function", "function": {"name": "get_weather"}}
HARD_CASES = [
    ("temperature 1e-40", {"temperature": 1e-40}),
    ("lone surrogate", {"messages": [{"role": "user", "content": "x\ud800y"}]}),
    ("top_k 10^12", {"top_k": 10**12, "temperature": 0.7}),
    ("seed beyond 2^64", {"seed": 2**70, "temperature": 0.7}),
    ("unknown model", {"model": "gpt-9"}),
    ("prompt past the context", {"max_tokens": 10**7}),
    ("json_object", {"response_format": {"type": "json_object"}}),
    (
        "schema with a bad type",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objec"}},
            }
        },
    ),
    ("schema with a lookbehind pattern", {"guided_json": {"type": "string", "pattern": "(?<=a)b"}}),
    ("unclosed regex", {"guided_regex": "a(b"}),
    ("regex no token spells", {"guided_regex": "\\x00\\x01\\x02"}),
    ("empty choice", {"guided_choice": []}),
    ("undefined grammar rule", {"guided_grammar": "root ::= foo"}),
    ("two constraints", {"guided_regex": "[0-9]+", "guided_choice": ["a", "b"]}),
    ("structured_outputs unknown key", {"structured_outputs": {"xml": "<a/>"}}),
    (
        "deeply nested schema",
        {
            "guided_json": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
                },
            }
        },
    ),
    ("tools, required", {"tools": [WEATHER], "tool_choice": "required"}),
    ("tools, named, streamed", {"tools": [WEATHER], "tool_choice": NAMED, "stream": True}),
    ("tools, auto, no parallel calls", {"tools": [WEATHER], "parallel_tool_calls": False}),
    (
        "tool_choice naming a missing tool",
        {"tools": [WEATHER], "tool_choice": {**NAMED, "function": {"name": "x"}}},
    ),
    ("required without tools", {"tool_choice": "required"}),
    ("a non-function tool", {"tools": [{"type": "web_search"}]}),
    (
        "tool schema with a bad type",
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
            "tool_choice": "required",
        },
    ),  # fmt: skip
    (
        "history with calls and results",
        {
            "tools": [WEATHER],
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "rain"},
            ],
        },
    ),  # fmt: skip
    (
        "history call arguments not JSON",
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                    ],
                }
            ]
        },
    ),  # fmt: skip
    ("tool message without content", {"messages": [{"role": "tool", "tool_call_id": "c1"}]}),
    (
        "tools and a response_format",
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
    ),  # fmt: skip
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="drafters/smollm2-135m-instruct")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/fuzz"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import uvicorn

    from flashdraft.engine.measure import cpu_name
    from flashdraft.drafter.model import DFlashDraftModel
    from flashdraft.serve import Engine, build_app
    from flashdraft.targets.target import load_target

    target = load_target(args.target)
    draft = DFlashDraftModel.from_pretrained(args.draft, dtype=target.dtype)
    engine = Engine(target, draft, max_queue=16)
    server = uvicorn.Server(
        uvicorn.Config(build_app(engine, args.target), host="127.0.0.1", port=0, log_level="error")
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    good = {"model": args.target, "messages": [{"role": "user", "content": "What is 12 times 7?"}],
            "max_tokens": 24, "temperature": 0}  # fmt: skip

    def ask(body, raw: str | None = None) -> httpx.Response:
        content = raw if raw is not None else json.dumps(body)
        return httpx.post(f"{base}/v1/chat/completions", content=content,
                          headers={"content-type": "application/json"}, timeout=120)  # fmt: skip

    before = ask(good).json()["choices"][0]["message"]["content"]
    rng = random.Random(args.seed)
    codes: Counter = Counter()
    bad_shape, server_errors, examples = 0, [], {}
    t0 = time.perf_counter()
    bodies = [(name, {**good, **change}, None) for name, change in HARD_CASES]
    bodies.append(("nested 50,000 levels", None, "[" * 50_000 + "]" * 50_000))
    bodies += [(f"random {i}", random_body(rng, args.target), None) for i in range(args.requests)]
    timeouts = []
    for name, body, raw in bodies:
        try:
            r = ask(body, raw)
        except httpx.TimeoutException:
            timeouts.append((name, body))
            codes["timeout"] += 1
            continue
        codes[r.status_code] += 1
        examples.setdefault(r.status_code, name)
        if r.status_code >= 500:
            server_errors.append((name, body, r.text[:200]))
        elif r.status_code >= 400:
            try:
                error = r.json()["error"]
                assert error["message"] and error["type"]
            except (ValueError, KeyError, TypeError, AssertionError):
                bad_shape += 1
    after = ask(good).json()["choices"][0]["message"]["content"]
    seconds = time.perf_counter() - t0
    server.should_exit = True
    engine.close()

    record = {
        "machine": cpu_name(), "threads": args.threads, "target": args.target, "draft": args.draft,
        "tried": len(bodies), "status_codes": {str(k): v for k, v in sorted(codes.items(), key=str)},
        "server_errors": len(server_errors), "timeouts": len(timeouts),
        "error_bodies_not_openai_shaped": bad_shape, "greedy_answer_unchanged": before == after, "seconds": seconds,
        "seed": args.seed,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "# Fuzzing `flashdraft serve`",
        "",
        f"`python benchmarks/fuzz_serve.py --requests {args.requests} --seed {args.seed}`: {args.target} with "
        f"{args.draft}, {cpu_name()}, {args.threads} threads, {seconds:.0f} s.",
        "",
        f"- tried: {len(bodies)} bodies ({len(HARD_CASES) + 1} named hard cases, {args.requests} random)",
        "- status codes: " + ", ".join(f"{c}: {n}" for c, n in sorted(codes.items(), key=str)),
        f"- 5xx: {len(server_errors)}",
        f"- 4xx bodies not in the OpenAI error shape: {bad_shape}",
        f"- the greedy answer before and after: {'unchanged' if before == after else 'CHANGED'}",
        "",
    ]
    (args.out / "report.md").write_text("\n".join(lines))
    print("\n".join(lines))
    for name, body, text in server_errors[:5]:
        print("5xx:", name, json.dumps(body)[:300], text, file=sys.stderr)
    for name, body in timeouts[:5]:
        print("timeout:", name, json.dumps(body)[:300], file=sys.stderr)
    sys.exit(1 if server_errors or bad_shape or timeouts or before != after else 0)


if __name__ == "__main__":
    main()
