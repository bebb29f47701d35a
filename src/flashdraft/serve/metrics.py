"""Prometheus metrics: request counts and latencies, and vLLM's spec-decode counter names so dashboards that read
a vLLM server read this one (`vllm:spec_decode_*`, with `flashdraft:` aliases)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        ProcessCollector(registry=r)  # process_resident_memory_bytes, cpu seconds, open fds (Linux)
        self.model_name = model_name
        self.requests = Counter(
            "flashdraft:requests", "Finished requests", ["model_name", "endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("flashdraft:prompt_tokens", "Prompt tokens", labels, registry=r)
        self.generation_tokens = Counter(
            "flashdraft:generation_tokens", "Generated tokens", labels, registry=r
        )
        self.e2e = Histogram(
            "flashdraft:e2e_request_latency_seconds",
            "Request latency",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "flashdraft:time_to_first_token_seconds", "Time to first token", labels, buckets=LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.waiting = Gauge("flashdraft:num_requests_waiting", "Requests in the queue", labels, registry=r)
        self.running = Gauge("flashdraft:num_requests_running", "Requests decoding", labels, registry=r)
        self.steps_by_rows = Gauge(
            "flashdraft:decode_steps_by_batch_size",
            "Decode steps so far, by the number of requests the step advanced together",
            ["model_name", "rows"],
            registry=r,
        )
        self.decode_s = Gauge(
            "flashdraft:decode_seconds", "Time in decode steps so far (propose, verify, accept)", labels,
            registry=r,
        )  # fmt: skip
        self.grammar_s = Gauge(
            "flashdraft:grammar_seconds",
            "Of the decode steps' time, the grammar's (structured output: masks, steered drafts, jump-forward), "
            "counted when requests finish",
            labels,
            registry=r,
        )
        self.spec: dict[str, list[Counter]] = {}
        for name, doc in (
            ("num_drafts", "Speculative steps that verified drafts"),
            ("num_draft_tokens", "Draft tokens verified"),
            ("num_accepted_tokens", "Draft tokens accepted"),
        ):
            self.spec[name] = [
                Counter(f"{prefix}:spec_decode_{name}", doc, labels, registry=r)
                for prefix in ("vllm", "flashdraft")
            ]
        self.per_pos = [
            Counter(
                f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
                "Accepted draft tokens by position in the block",
                ["model_name", "position"],
                registry=r,
            )
            for prefix in ("vllm", "flashdraft")
        ]

    def observe(self, endpoint: str, status: int, info: dict[str, Any] | None, latency_s: float) -> None:
        m = self.model_name
        self.requests.labels(m, endpoint, str(status)).inc()
        if not info:
            return
        self.e2e.labels(m).observe(latency_s)
        if info.get("ttft_s") is not None:
            self.ttft.labels(m).observe(info["ttft_s"] + info.get("queue_s", 0.0))
        self.prompt_tokens.labels(m).inc(info["prompt_tokens"])
        self.generation_tokens.labels(m).inc(info["completion_tokens"])
        spec = info.get("spec_decode")
        if spec:
            for name, key in (
                ("num_drafts", "num_drafts"),
                ("num_draft_tokens", "num_draft_tokens"),
                ("num_accepted_tokens", "num_accepted_draft_tokens"),
            ):
                for counter in self.spec[name]:
                    counter.labels(m).inc(spec[key])
            for pos, count in enumerate(spec["num_accepted_tokens_per_pos"]):
                for counter in self.per_pos:
                    counter.labels(m, str(pos)).inc(count)

    def render(
        self,
        waiting: int,
        running: int,
        steps_by_rows: dict[int, int] | None = None,
        decode_s: float = 0.0,
        grammar_s: float = 0.0,
    ) -> bytes:
        self.waiting.labels(self.model_name).set(waiting)
        self.running.labels(self.model_name).set(running)
        self.decode_s.labels(self.model_name).set(decode_s)
        self.grammar_s.labels(self.model_name).set(grammar_s)
        for rows, steps in sorted((steps_by_rows or {}).items()):
            self.steps_by_rows.labels(self.model_name, str(rows)).set(steps)
        return generate_latest(self.registry)
