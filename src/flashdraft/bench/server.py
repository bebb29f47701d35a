"""The OpenAI backend: the same prompts sent to any OpenAI-compatible server at each concurrency level."""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..prompts.benchmarks import BenchDataset
from .config import (
    BenchError,
    ServerBenchConfig,
    dataset_info,
    default_out_dir,
    load_datasets,
    machine_info,
    parse_concurrency,
    progress_display,
    validate_common,
)
from .metrics import mean_or_none, percentile
from .prometheus import grammar_share, parse_prometheus, vllm_spec_stats
from .report import write_server_results


@dataclass
class ServerRequest:
    """One request of the OpenAI backend."""

    dataset: str
    conversation_id: str
    turn: int
    ok: bool = False
    error: str | None = None
    status: int | None = None
    latency_s: float | None = None
    ttft_s: float | None = None
    output_tokens: int = 0
    tokens_from_usage: bool = False  # False: counted from streamed chunks (approximate)
    prompt_tokens: int | None = None
    spec_accept_length: float | None = None  # SGLang meta_info
    spec_verify_ct: int | None = None  # SGLang meta_info
    text: str = field(default="", repr=False)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.latency_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self, with_outputs: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d.pop("text")
        d["tpot_s"] = self.tpot_s
        if with_outputs:
            d["text"] = self.text
        return d


def _server_root(base_url: str) -> str:
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


def _find_meta_info(obj: dict[str, Any]) -> dict[str, Any] | None:
    """SGLang puts `meta_info` on native responses; look at the top level and in the first choice."""
    if isinstance(obj.get("meta_info"), dict):
        return obj["meta_info"]
    choices = obj.get("choices") or []
    if choices and isinstance(choices[0], dict) and isinstance(choices[0].get("meta_info"), dict):
        return choices[0]["meta_info"]
    return None


def _apply_meta_info(req: ServerRequest, meta: dict[str, Any] | None) -> None:
    if not meta:
        return
    try:
        if meta.get("spec_accept_length") is not None:
            req.spec_accept_length = float(meta["spec_accept_length"])
        if meta.get("spec_verify_ct") is not None:
            req.spec_verify_ct = int(meta["spec_verify_ct"])
        if not req.tokens_from_usage and meta.get("completion_tokens") is not None:
            req.output_tokens, req.tokens_from_usage = int(meta["completion_tokens"]), True
    except (TypeError, ValueError):
        pass


def _apply_usage(req: ServerRequest, usage: Any) -> None:
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        req.output_tokens, req.tokens_from_usage = int(usage["completion_tokens"]), True
        if usage.get("prompt_tokens") is not None:
            req.prompt_tokens = int(usage["prompt_tokens"])


def _choice_text(choice: dict[str, Any], streaming: bool) -> str:
    if "text" in choice and isinstance(choice["text"], str):  # /v1/completions
        return choice["text"]
    part = choice.get("delta" if streaming else "message") or {}
    # Tool calls count as output: each as "[tool_call NAME] ARGUMENTS", the same whether streamed or not
    calls = "".join(
        (f"\n[tool_call {f['name']}] " if f.get("name") else "") + (f.get("arguments") or "")
        for f in (call.get("function") or {} for call in part.get("tool_calls") or [])
    )
    return (part.get("content") or "") + calls


def _payload(
    cfg: ServerBenchConfig, model: str, messages: list[dict[str, str]], max_tokens: int
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": cfg.temperature}
    if cfg.api == "chat":
        body["messages"] = messages
        if cfg.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": cfg.thinking}
    else:  # raw completion: the turns and answers so far as plain text (no chat template)
        body["prompt"] = "\n\n".join(m["content"] for m in messages)
    if cfg.temperature > 0:
        body["seed"] = cfg.seed
    if cfg.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def _send(
    client: Any, cfg: ServerBenchConfig, url: str, body: dict[str, Any], req: ServerRequest
) -> ServerRequest:
    import httpx

    t0 = time.perf_counter()
    try:
        if cfg.stream:
            chunks = 0
            parts: list[str] = []
            async with client.stream("POST", url, json=body) as resp:
                req.status = resp.status_code
                if resp.status_code >= 400:
                    detail = (await resp.aread()).decode("utf-8", "replace")
                    req.error = f"HTTP {resp.status_code}: {detail.strip()[:200]}"
                    return req
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        event = json.loads(data)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(event.get("error"), (dict, str)):
                        req.error = f"stream error: {str(event['error'])[:200]}"
                        return req
                    for choice in event.get("choices") or []:
                        text = _choice_text(choice, streaming=True)
                        if text:
                            if req.ttft_s is None:
                                req.ttft_s = time.perf_counter() - t0
                            parts.append(text)
                            chunks += 1
                    _apply_usage(req, event.get("usage"))
                    _apply_meta_info(req, _find_meta_info(event))
            req.text = "".join(parts)
            if not req.tokens_from_usage:
                req.output_tokens = chunks  # one token per chunk is what most servers stream
        else:
            resp = await client.post(url, json=body)
            req.status = resp.status_code
            if resp.status_code >= 400:
                req.error = f"HTTP {resp.status_code}: {resp.text.strip()[:200]}"
                return req
            payload = resp.json()
            choices = payload.get("choices") or []
            req.text = _choice_text(choices[0], streaming=False) if choices else ""
            _apply_usage(req, payload.get("usage"))
            _apply_meta_info(req, _find_meta_info(payload))
        req.latency_s = time.perf_counter() - t0
        req.ok = True
    except httpx.TimeoutException:
        req.error = f"timeout after {cfg.timeout_s:g} s"
    except httpx.HTTPError as e:
        req.error = f"{type(e).__name__}: {e}"
    except (json.JSONDecodeError, ValueError) as e:
        req.error = f"invalid response: {e}"
    return req


async def _run_conversation(
    client: Any,
    cfg: ServerBenchConfig,
    url: str,
    model: str,
    dataset: str,
    conv: Any,
    semaphore: asyncio.Semaphore,
    on_done: Callable[[int], None],
) -> list[ServerRequest]:
    """The turns of one conversation, in order; each later turn sees the server's own earlier answers."""
    results: list[ServerRequest] = []
    async with semaphore:
        messages: list[dict[str, str]] = []
        for turn, user_text in enumerate(conv.user_turns):
            messages.append({"role": "user", "content": user_text})
            req = ServerRequest(dataset=dataset, conversation_id=conv.id, turn=turn)
            body = _payload(cfg, model, messages, cfg.max_new_tokens)
            for name in ("response_format", "tools", "tool_choice"):  # a structured-output record
                if conv.meta.get(name) is not None:
                    body[name] = conv.meta[name]
            await _send(client, cfg, url, body, req)
            results.append(req)
            on_done(1)
            if not req.ok:
                on_done(len(conv.user_turns) - turn - 1)
                break
            messages.append({"role": "assistant", "content": req.text})
    return results


async def _scrape_metrics(client: Any, root: str) -> dict[str, Any] | None:
    import httpx

    try:
        resp = await client.get(root + "/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return parse_prometheus(resp.text)


async def _probe(client: Any, cfg: ServerBenchConfig, root: str) -> str:
    """Check that the server answers and find the model name (first of /v1/models when --model is not given)."""
    import httpx

    try:
        resp = await client.get(root + "/v1/models", timeout=min(10.0, cfg.timeout_s))
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach the server at {cfg.base_url}: {type(e).__name__}: {e}") from None
    if cfg.model:
        return cfg.model
    try:
        models = resp.json().get("data") or []
        return str(models[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise BenchError(
            f"{cfg.base_url} does not list its models at /v1/models: pass --model NAME"
        ) from None


def summarize_server_level(requests: Sequence[ServerRequest], wall_s: float) -> dict[str, Any]:
    ok = [r for r in requests if r.ok]
    latencies = [r.latency_s for r in ok if r.latency_s is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    tokens = sum(r.output_tokens for r in ok)

    def dist(values: list[float]) -> dict[str, float | None] | None:
        if not values:
            return None
        return {
            "mean": statistics.fmean(values),
            "p50": percentile(values, 50),
            "p90": percentile(values, 90),
            "p99": percentile(values, 99),
            "max": max(values),
        }

    accept_lengths = [r.spec_accept_length for r in ok if r.spec_accept_length is not None]
    verify = [(r.output_tokens, r.spec_verify_ct) for r in ok if r.spec_verify_ct]
    sglang = None
    if accept_lengths or verify:
        sglang = {
            "mean_spec_accept_length": mean_or_none(accept_lengths),
            "tau_from_verify_ct": sum(t for t, _ in verify) / sum(v for _, v in verify) if verify else None,
            "requests_with_meta_info": max(len(accept_lengths), len(verify)),
        }
    return {
        "requests": len(requests),
        "ok": len(ok),
        "errors": len(requests) - len(ok),
        "error_messages": sorted({r.error for r in requests if r.error})[:10],
        "wall_s": wall_s,
        "output_tokens": tokens,
        "tokens_estimated": any(not r.tokens_from_usage for r in ok),
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "latency_s": dist(latencies),
        "ttft_s": dist(ttfts),
        "tpot_s": dist(tpots),
        "sglang": sglang,
    }


async def _server_bench_async(cfg: ServerBenchConfig, datasets: list[BenchDataset]) -> dict[str, Any]:
    import httpx

    root = _server_root(cfg.base_url)
    url = root + ("/v1/chat/completions" if cfg.api == "chat" else "/v1/completions")
    limits = httpx.Limits(max_connections=max(cfg.concurrency) + 4)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    async with httpx.AsyncClient(timeout=cfg.timeout_s, limits=limits, headers=headers) as client:
        model = await _probe(client, cfg, root)
        warmup_error = None
        if cfg.warmup:
            first = datasets[0].conversations[0]
            messages = [{"role": "user", "content": first.user_turns[0]}]
            req = ServerRequest(dataset=datasets[0].name, conversation_id=first.id, turn=0)
            await _send(client, cfg, url, _payload(cfg, model, messages, min(cfg.max_new_tokens, 16)), req)
            warmup_error = req.error
            if req.error and req.status is None and "timeout" not in req.error:
                raise BenchError(f"cannot reach the server at {cfg.base_url}: {req.error}")
        levels: list[dict[str, Any]] = []
        all_requests: list[dict[str, Any]] = []
        total = sum(ds.num_turns for ds in datasets) * len(cfg.concurrency)
        with progress_display(cfg.show_progress) as progress:
            task = progress.add_task("server", total=total)
            for concurrency in cfg.concurrency:
                for ds in datasets:
                    progress.update(task, description=f"{ds.name} @ concurrency {concurrency}")
                    semaphore = asyncio.Semaphore(concurrency)
                    before = await _scrape_metrics(client, root)
                    t0 = time.perf_counter()
                    per_conv = await asyncio.gather(
                        *(
                            _run_conversation(
                                client,
                                cfg,
                                url,
                                model,
                                ds.name,
                                conv,
                                semaphore,
                                lambda n: progress.advance(task, n),
                            )
                            for conv in ds.conversations
                        )
                    )
                    wall_s = time.perf_counter() - t0
                    after = await _scrape_metrics(client, root)
                    requests = [r for conv in per_conv for r in conv]
                    level = {
                        "dataset": ds.name,
                        "concurrency": concurrency,
                        **summarize_server_level(requests, wall_s),
                    }
                    level["vllm"] = vllm_spec_stats(before, after)
                    level["grammar_share"] = grammar_share(before, after)
                    levels.append(level)
                    all_requests += [
                        {"concurrency": concurrency, **r.to_dict(cfg.save_outputs)} for r in requests
                    ]
    return {
        "model": model,
        "endpoint": url,
        "warmup_error": warmup_error,
        "levels": levels,
        "requests": all_requests,
    }


def run_server_bench(cfg: ServerBenchConfig) -> dict[str, Any]:
    """Benchmark an OpenAI-compatible server; write results.json, report.md and a plot; return the results."""
    if not cfg.base_url:
        raise BenchError("--backend openai needs --base-url URL (e.g. http://127.0.0.1:8000)")
    if not re.match(r"^https?://", cfg.base_url):
        raise BenchError(f"--base-url must start with http:// or https://, got {cfg.base_url!r}")
    if cfg.api not in ("chat", "completion"):
        raise BenchError(f"--api must be chat or completion, got {cfg.api!r}")
    if cfg.timeout_s <= 0:
        raise BenchError(f"--timeout must be positive, got {cfg.timeout_s}")
    cfg.concurrency = parse_concurrency(cfg.concurrency)
    validate_common(cfg.max_new_tokens, cfg.temperature, cfg.max_samples)
    datasets = load_datasets(cfg.datasets, cfg.max_samples, cfg.seed)
    out_dir = Path(cfg.out_dir) if cfg.out_dir else default_out_dir(cfg.datasets)
    started = datetime.now(timezone.utc)
    run = asyncio.run(_server_bench_async(cfg, datasets))
    results = {
        "kind": "flashdraft-bench-server",
        "version": 1,
        "command": cfg.command,
        "started": started.isoformat(timespec="seconds"),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "settings": {
            "backend": "openai",
            "base_url": cfg.base_url,
            "model": run["model"],
            "endpoint": run["endpoint"],
            "api": cfg.api,
            "stream": cfg.stream,
            "concurrency": cfg.concurrency,
            "datasets": cfg.datasets,
            "max_samples": cfg.max_samples,
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "seed": cfg.seed,
            "timeout_s": cfg.timeout_s,
            "enable_thinking": cfg.thinking,
            "warmup": cfg.warmup,
        },
        "client_machine": machine_info(),
        "datasets": [dataset_info(ds) for ds in datasets],
        "warmup_error": run["warmup_error"],
        "levels": run["levels"],
        "requests": run["requests"],
    }
    write_server_results(results, out_dir, plots=cfg.plots)
    results["out_dir"] = str(out_dir)
    return results
