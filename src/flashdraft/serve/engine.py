"""The serving engine: requests in a bounded queue, decoded by one worker thread with the speculative loop.

One sequence is decoded at a time (batch size 1, like `generate`); requests wait their turn in a FIFO queue of
`max_queue` entries, and a full queue is refused at once (HTTP 503) rather than piling up. Each request streams its
text through an asyncio queue owned by the HTTP handler. A request whose client has gone is cancelled: if it is
still waiting it is skipped, if it is running its decode loop ends at the next step, and either way its slot and
caches are freed at once.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..generate import GenerationResult, generate, generate_ar


class QueueFullError(RuntimeError):
    """The request queue is full."""


@dataclass
class EngineRequest:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_strings: list[str] = field(default_factory=list)
    stop_ids: list[int] = field(default_factory=list)


class RequestHandle:
    """What the HTTP handler holds: events arrive on `events` ("text", str) ... ("done", info) | ("error", str)."""

    def __init__(self, request: EngineRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()

    def push(self, kind: str, value: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def cancel(self) -> None:
        self.cancelled.set()


class _TextStream:
    """Incremental detokenisation with stop strings: emits only text that can no longer become part of a stop."""

    def __init__(self, tokenizer: Any, stop_strings: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stop_strings if s]
        self.hold = max((len(s) - 1 for s in self.stops), default=0)
        self.tokens: list[int] = []
        self.sent = ""
        self.stopped = False

    def add(self, new_tokens: list[int]) -> str:
        self.tokens.extend(new_tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        for s in self.stops:
            at = text.find(s, max(0, len(self.sent) - len(s)))
            if at != -1:
                self.stopped = True
                return self._emit(text[:at])
        if text.endswith("\ufffd"):  # half of a multi-byte character: wait for the rest
            return ""
        return self._emit(text[: len(text) - self.hold] if self.hold else text)

    def flush(self) -> str:
        if self.stopped:
            return ""
        return self._emit(self.tokenizer.decode(self.tokens, skip_special_tokens=True))

    def _emit(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


def spec_stats(result: GenerationResult, block_size: int | None) -> dict[str, Any]:
    """Per-response speculative statistics, shaped like vLLM's per-request spec-decode metrics."""
    drafted = [(d, a) for d, a in zip(result.draft_lengths, result.accepted_drafts, strict=True) if d > 0]
    hist = [0] * ((block_size or max(result.acceptance_lengths, default=1)) + 1)
    for n in result.acceptance_lengths:
        if n < len(hist):
            hist[n] += 1
    per_pos = [0] * max((d for d, _ in drafted), default=0)
    for _, a in drafted:
        for i in range(a):
            per_pos[i] += 1
    return {
        "mean_acceptance_length": result.mean_acceptance_length,
        "num_drafts": len(drafted),
        "num_draft_tokens": sum(d for d, _ in drafted),
        "num_accepted_draft_tokens": sum(a for _, a in drafted),
        "num_accepted_tokens_per_pos": per_pos,
        "acceptance_histogram": hist,
        "steps_by_source": result.proposer_stats.get("steps_by_source"),
    }


class Engine:
    """Target (+ optional drafter) behind a queue and one decoding thread."""

    def __init__(
        self, target: Any, draft: Any = None, max_queue: int = 64, block_size: int | str = "auto"
    ) -> None:
        self.target = target
        self.draft = draft
        self.block_size = block_size
        self.max_queue = max_queue
        self._queue: queue.Queue[RequestHandle | None] = queue.Queue(maxsize=max_queue)
        self.running = 0
        self._thread = threading.Thread(target=self._work, name="flashdraft-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API for the HTTP layer
    def submit(self, request: EngineRequest, loop: asyncio.AbstractEventLoop) -> RequestHandle:
        handle = RequestHandle(request, loop)
        try:
            self._queue.put_nowait(handle)
        except queue.Full:
            raise QueueFullError(f"the server is at capacity ({self.max_queue} requests waiting)") from None
        return handle

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the worker
    def _work(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            handle = self._queue.get()
            if handle is None:
                return
            if handle.cancelled.is_set():
                continue  # the client left while waiting
            self.running = 1
            try:
                self._run(handle)
            except Exception as e:  # noqa: BLE001 - a failed request must not take the server down
                handle.push("error", f"{type(e).__name__}: {e}")
            finally:
                self.running = 0

    def _run(self, handle: RequestHandle) -> None:
        req = handle.request
        stream = _TextStream(self.target.tokenizer, req.stop_strings)
        started = time.perf_counter()
        first_token_s: list[float] = []

        def on_tokens(new: list[int]) -> bool:
            if not first_token_s:
                first_token_s.append(time.perf_counter() - started)
            delta = stream.add(new)
            if delta:
                handle.push("text", delta)
            return stream.stopped or handle.cancelled.is_set()

        stops = [*self.target.eos_token_ids, *req.stop_ids]
        common = dict(
            max_new_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stop_token_ids=stops,
            seed=req.seed,
            on_tokens=on_tokens,
        )
        if self.draft is not None:
            result = generate(self.target, self.draft, req.prompt_ids, block_size=self.block_size, **common)
        else:
            result = generate_ar(self.target, req.prompt_ids, **common)
        if handle.cancelled.is_set():
            return
        tail = stream.flush()
        if tail:
            handle.push("text", tail)
        finish = "stop" if stream.stopped or result.stop_reason == "stop_token" else "length"
        handle.push(
            "done",
            {
                "finish_reason": finish,
                "prompt_tokens": len(req.prompt_ids),
                "completion_tokens": result.num_new_tokens,
                "queue_s": started - handle.submitted,
                "ttft_s": first_token_s[0] if first_token_s else None,
                "total_s": time.perf_counter() - started,
                "result": result,
                "spec_decode": spec_stats(
                    result, getattr(getattr(self.draft, "config", None), "block_size", None)
                )
                if self.draft is not None
                else None,
            },
        )
