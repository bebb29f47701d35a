"""llama.cpp as a bench baseline (bench/llamacpp.py), against a stand-in `llama-server`.

The stand-in speaks llama-server's protocol (`/health`, `/completion` with token-id prompts, `tokens`, `timings`,
`stop_type`) and really decodes: it greedily continues the prompt with the tiny target through transformers. So the
bench's llama.cpp rows must show ar's tokens, which proves the prompt ids went out and the answer came back intact;
the servers' command lines, logs and the one-line errors are checked too. The real llama-server is run by hand
(benchmarks/README.md), not here: it needs a build and a GGUF."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from flashdraft.bench import BenchConfig, BenchError, run_bench
from test_bench import tiny  # noqa: F401 - the module's fixture: a tiny target, drafter and chat set on disk

FAKE_SERVER = textwrap.dedent(
    """
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    args = sys.argv[1:]
    if "--version" in args:
        print("version: 1 (stand-in)")
        sys.exit(0)
    arg = lambda name: args[args.index(name) + 1]
    model_file = arg("-m")
    source = open(model_file).read().strip()
    if source == "BROKEN":
        print("llama_model_load: error loading model: not a GGUF file", flush=True)
        sys.exit(1)
    import torch, transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    eos = model.config.eos_token_id


    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _reply(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._reply(200 if self.path == "/health" else 404, {"status": "ok"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with open(model_file + ".requests", "a") as f:
                f.write(json.dumps(body) + "\\n")
            ids = torch.tensor([body["prompt"]])
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=body["n_predict"],
                                     do_sample=False, eos_token_id=None if body["ignore_eos"] else eos,
                                     pad_token_id=eos)
            new = out[0, ids.shape[1]:].tolist()
            ms = (time.perf_counter() - t0) * 1000
            stop = "eos" if new and new[-1] == eos and not body["ignore_eos"] else "limit"
            self._reply(200, {"tokens": new, "stop_type": stop,
                              "timings": {"prompt_ms": 0.1 * ms, "predicted_ms": 0.9 * ms, "predicted_n": len(new),
                                          "draft_n": 4, "draft_n_accepted": 2}})


    ThreadingHTTPServer(("127.0.0.1", int(arg("--port"))), Handler).serve_forever()
    """
)


@pytest.fixture
def llama_server(tmp_path):
    """A stand-in llama-server executable in its own directory."""
    folder = tmp_path / "llama.cpp" / "bin"
    folder.mkdir(parents=True)
    binary = folder / "llama-server"
    binary.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    return binary


def _config(tiny, tmp_path, gguf, **kw):  # noqa: F811 - `tiny` is the fixture's value
    return BenchConfig(target=str(tiny / "target"), datasets=[str(tiny / "chat.jsonl")], max_new_tokens=8,
                       out_dir=tmp_path / "run", threads=1, show_progress=False, save_outputs=True, llamacpp_model=str(gguf),
                       **kw)  # fmt: skip


def test_llamacpp_rows_beside_ar(tiny, llama_server, tmp_path):  # noqa: F811
    gguf = tmp_path / "target.gguf"
    gguf.write_text(str(tiny / "target"))
    draft = tmp_path / "draft.gguf"
    draft.write_text("a drafter")
    cfg = _config(tiny, tmp_path, gguf, methods=["llamacpp", "llamacpp-lookup", "llamacpp-dflash"],
                  llamacpp=str(llama_server.parent), llamacpp_draft=str(draft), llamacpp_draft_max=7,
                  llamacpp_args="-fa off --no-repack")  # fmt: skip
    results = run_bench(cfg)

    samples = json.loads((tmp_path / "run" / "results.json").read_text())["samples"]  # with the output ids
    ar = {(s["conversation_id"], s["turn"]): s["output_ids"] for s in samples if s["method"] == "ar"}
    for method in ("llamacpp", "llamacpp-lookup", "llamacpp-dflash"):
        got = [s for s in samples if s["method"] == method]
        assert len(got) == 3  # two turns, then one
        for s in got:  # the same prompt tokens went out, the same greedy answer came back
            assert s["output_ids"] == ar[(s["conversation_id"], s["turn"])], method
            assert s["matches_reference"] is None  # another engine: timed, not held to ar's tokens
            assert s["ttft_s"] > 0 and s["decode_s"] > 0
        row = results["summary"]["chat"][method]
        assert row["tokens_per_s"] > 0 and row["speedup_vs_ar"] > 0
    assert results["equality"]["compared"] == 0  # only llama.cpp beside ar: nothing held to ar

    info = results["settings"]["llamacpp"]
    assert info["binary"] == str(llama_server) and "stand-in" in info["version"]
    commands = info["commands"]
    assert "--spec-type none" in commands["llamacpp"] and "-t 1" in commands["llamacpp"]
    assert all(c.endswith(" -fa off --no-repack") for c in commands.values())  # --llamacpp-args: every server
    assert "--spec-type ngram-simple" in commands["llamacpp-lookup"]
    assert (
        f"--model-draft {draft}" in commands["llamacpp-dflash"]
        and "--spec-draft-n-max 7" in commands["llamacpp-dflash"]
    )

    requests = [json.loads(line) for line in (tmp_path / "target.gguf.requests").read_text().splitlines()]
    assert all(r["cache_prompt"] is False and r["top_k"] == 1 and r["n_predict"] in (8, 16) for r in requests)
    assert (tmp_path / "run" / "llamacpp" / "llamacpp.log").exists()


def test_llamacpp_is_found_on_path(tiny, llama_server, tmp_path, monkeypatch):  # noqa: F811
    gguf = tmp_path / "target.gguf"
    gguf.write_text(str(tiny / "target"))
    monkeypatch.setenv("PATH", f"{llama_server.parent}{os.pathsep}{os.environ['PATH']}")
    results = run_bench(_config(tiny, tmp_path, gguf, methods=["llamacpp"], plots=False))
    assert results["settings"]["llamacpp"]["binary"] == str(llama_server)


def test_llamacpp_bad_input_is_one_line(tiny, llama_server, tmp_path, monkeypatch):  # noqa: F811
    gguf = tmp_path / "target.gguf"
    gguf.write_text("BROKEN")
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    cases = [
        (dict(methods=["llamacpp"]), "llama-server is not on PATH"),
        (dict(methods=["llamacpp"], llamacpp=str(tmp_path)), "no llama-server executable there"),
        (dict(methods=["llamacpp-dflash"], llamacpp=str(llama_server)), "--llamacpp-draft"),
        (dict(methods=["llamacpp"], llamacpp=str(llama_server), llamacpp_args="-fa 'off"), "--llamacpp-args"),
        (
            dict(methods=["llamacpp"], llamacpp=str(llama_server)),
            "not a GGUF file",
        ),  # the server's last words
    ]
    for kw, message in cases:
        with pytest.raises(BenchError, match=message) as e:
            run_bench(_config(tiny, tmp_path, gguf, **kw))
        assert "\n" not in str(e.value)
    with pytest.raises(BenchError, match="--llamacpp-model"):
        run_bench(
            _config(
                tiny, tmp_path, tmp_path / "missing.gguf", methods=["llamacpp"], llamacpp=str(llama_server)
            )
        )


def test_the_server_sleeps_between_its_prompts(tiny, llama_server, tmp_path):  # noqa: F811
    """Stopped (SIGSTOP) but while its own prompt runs: its idle threads take no CPU from the methods timed beside."""
    from flashdraft.bench.llamacpp import LlamaCppServer

    gguf = tmp_path / "target.gguf"
    gguf.write_text(str(tiny / "target"))
    server = LlamaCppServer("llamacpp", llama_server, gguf, threads=1, context=256, log_path=tmp_path / "log")

    def state() -> str:
        return (Path("/proc") / str(server.process.pid) / "stat").read_text().split(")")[-1].split()[0]

    try:
        assert state() == "T"
        got = server.complete([2, 4, 9, 10], 5, 0.0, 0, stop_ids=[])
        assert len(got["new_ids"]) == 5 and got["stop_reason"] == "max_new_tokens"
        assert state() == "T"
    finally:
        server.close()
    assert server.process.poll() is not None
