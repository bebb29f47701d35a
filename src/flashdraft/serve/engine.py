"""The serving engine: a bounded request queue in front of one worker that runs continuous batching (in a thread of
its own, or, under `flashdraft serve`, on the main thread with the HTTP server in a thread: see `Engine.run`).

Between two decode steps the worker admits waiting requests into the batch (each gets its own prefill) up to
`max_batch_size` rows, drops rows whose client has gone (their cache rows are freed at once), then advances every row
by one speculative step (`BatchDecoder.step`: all rows verified in one target forward, each keeping its own accepted
prefix). A full queue is refused at once (HTTP 503) rather than piling up. Each request streams its text through an
asyncio queue owned by the HTTP handler (a step's events are delivered together). `close()` stops admitting, lets the
running rows finish (drain), and ends the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine.decoder import BatchDecoder
from ..engine.grammar import Constraint
from ..engine.request import BatchRow, GenerationResult
from ..generate import batch_proposer
from ..sampling import SamplingParams
from ..targets.multimodal import ImagePrompt

log = logging.getLogger(__name__)


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
    constraint: Constraint | None = None  # structured output (grammar.py)
    prompt_inputs: dict[str, Any] | None = (
        None  # an image prompt's pixels, grids, ... for the prefill (multimodal.py)
    )


class RequestHandle:
    """What the HTTP handler holds: events arrive on `events` ("text", str) ... ("done", info) | ("error", str).

    The worker's events wait in the engine's outbox and reach the event loop together, once per decode step (see
    `Engine._deliver`)."""

    def __init__(
        self, request: EngineRequest, loop: asyncio.AbstractEventLoop, outbox: list[tuple[Any, ...]]
    ) -> None:
        self.request = request
        self.loop = loop
        self._outbox = outbox
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.started: float | None = None  # admitted into the batch
        self.first_token_s: float | None = None
        self.stream: _TextStream | None = None

    def push(self, kind: str, value: Any) -> None:
        self._outbox.append((self, kind, value))

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


def _put_events(events: list[tuple[RequestHandle, str, Any]]) -> None:
    for handle, kind, value in events:
        handle.events.put_nowait((kind, value))


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
        "tree_steps": result.proposer_stats.get("tree_steps", 0),
    }


class Engine:
    """Target (+ optional drafter) behind a queue and one thread running continuous batching."""

    def __init__(
        self,
        target: Any,
        draft: Any = None,
        max_queue: int = 64,
        block_size: int | str = "auto",
        max_batch_size: int = 8,
        costs: Any = None,
        start: bool = True,
        tree: int | str | None = None,
        decoder: Any = None,
    ) -> None:
        """`start`: run the worker in a thread of its own now; False: the caller runs it (`run()`), as `serve` does
        on the main thread. `tree`: draft trees of at most this many nodes (DFlash drafters; tree.py). `decoder`:
        another backend's decoder with `BatchDecoder`'s surface (the MLX one, flashdraft.mlx.MlxDecoder)."""
        self.target = target
        self.draft = draft
        self.block_size = block_size
        self.max_queue = max_queue
        self.max_batch_size = max_batch_size if decoder is None else decoder.max_batch_size
        self.decoder = (
            decoder
            if decoder is not None
            else BatchDecoder(
                target, batch_proposer(target, draft, block_size, costs, tree=tree), max_batch_size
            )
        )
        self._queue: queue.Queue[RequestHandle | None] = queue.Queue(maxsize=max_queue)
        self._closing = False
        self._warm = threading.Event()  # set once the worker has warmed up (`run`): the server is ready
        self._outbox: list[tuple[RequestHandle, str, Any]] = []  # events of this step, not yet delivered
        self.steps_by_rows: Counter[int] = Counter()  # decode steps by the number of rows they advanced
        self.decode_s = 0.0  # time in decode steps so far
        self.grammar_s = 0.0  # of which the grammar's (structured output), summed as rows finish
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self.run, name="flashdraft-engine", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ API for the HTTP layer
    def submit(self, request: EngineRequest, loop: asyncio.AbstractEventLoop) -> RequestHandle:
        if self._closing:
            raise QueueFullError("the server is shutting down")
        handle = RequestHandle(request, loop, self._outbox)
        try:
            self._queue.put_nowait(handle)
        except queue.Full:
            raise QueueFullError(f"the server is at capacity ({self.max_queue} requests waiting)") from None
        return handle

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def running(self) -> int:
        return len(self.decoder)

    @property
    def ready(self) -> bool:
        """The worker runs and has warmed up (compiled graphs made: `warm_up`), and the engine is not closing:
        what `/health` answers 200 for, so that a load balancer sends no request to a server still compiling."""
        return self._warm.is_set() and not self._closing

    @property
    def closing(self) -> bool:
        return self._closing

    def close(self, timeout: float = 60.0) -> None:
        """Stop admitting, finish the running rows (and what already waits in the queue), end the worker."""
        self._closing = True
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    # ------------------------------------------------------------------ the worker
    def run(self) -> None:
        """The worker: admit, step, deliver, until `close()` and the queue is drained.

        On a CPU, run it on the thread that runs the process's other torch work (for `serve`, the main thread, with
        the HTTP server in a thread of its own). torch's OpenMP (libgomp) gives every thread that runs parallel
        work its own team of threads, and once more team threads exist than CPU cores it stops spin-waiting between
        parallel regions: a decode step run beside the main thread's idle team took 30-35 % longer (2-core AMD
        EPYC, SmolLM2-135M: a plain step at 8 rows 82-87 ms against 58-65 ms).
        """
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise RuntimeError(
                "this engine's worker already runs in a thread of its own (Engine(start=True))"
            )
        torch.set_grad_enabled(False)
        self.warm_up()
        self._warm.set()
        stopping = False
        while True:
            # Admit waiting requests between steps; with nothing running, sleep until one comes.
            while not self.decoder.full and not stopping:
                idle = len(self.decoder) == 0
                if idle:
                    self._deliver()  # everything said so far reaches its client before this thread sleeps
                try:
                    handle = self._queue.get(block=idle)
                except queue.Empty:
                    break
                if handle is None:
                    stopping = True
                    break
                self._admit(handle)
            self._deliver()  # the last step's events and the first tokens
            for row in list(self.decoder.rows):  # clients that went away free their rows now
                if row.tag.cancelled.is_set():
                    self.decoder.cancel(row)
            if not len(self.decoder):
                if stopping:  # drained: every request queued before close() has been answered
                    return
                continue
            self.steps_by_rows[len(self.decoder)] += 1
            t0 = time.perf_counter()
            try:
                finished = self.decoder.step()
            except Exception as e:  # noqa: BLE001 - a failed step must not take the server down
                log.exception("decode step failed")
                for row in list(self.decoder.rows):
                    row.tag.push("error", f"{type(e).__name__}: {e}")
                    self.decoder.cancel(row, "error")
                continue
            self.decode_s += time.perf_counter() - t0
            for row in finished:
                self.grammar_s += row.result.grammar_s
                self._finish(row)

    def warm_up(self) -> None:
        """Compiled (the static cache): a short answer decoded alone and then beside a second one before the first
        request, so the graphs of one row and of several exist when clients come (dynamo keeps a size of 1 apart;
        the verify's, the drafter's context and block passes). Without it the first request compiled for 60 s and
        the first batch of several again, in the middle of their answers: on a 2-core Xeon the int8 DFlash server's
        first batch of 8 GSM8K requests took 95-105 s, the plain server's 86 s (benchmarks/README.md, 2026-12-02).
        `run` calls it first, on the worker's thread (its grad mode is the steps')."""
        decoder = self.decoder
        if not (decoder.static and decoder.verify.compiled):
            return
        prompt = list(range(3, 11))
        try:
            decoder.add(prompt, 6, SamplingParams(), stop_token_ids=[])
            decoder.step()
            if self.max_batch_size > 1:
                decoder.add(prompt[::-1], 3, SamplingParams(), stop_token_ids=[])
            while len(decoder):
                decoder.step()
        except Exception:  # noqa: BLE001 - the requests' own steps will say what fails, one by one
            log.exception("warm-up failed")
            for row in list(decoder.rows):
                decoder.cancel(row, "error")

    def _deliver(self) -> None:
        """Hand the outbox to the event loops: one wake-up of each loop per decode step, not one per row and step."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, str, Any]]] = {}
        for event in self._outbox:
            by_loop.setdefault(event[0].loop, []).append(event)
        self._outbox.clear()
        for loop, events in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
                loop.call_soon_threadsafe(_put_events, events)

    def _admit(self, handle: RequestHandle) -> None:
        if handle.cancelled.is_set():
            return  # the client left while waiting
        req = handle.request
        handle.started = time.perf_counter()
        handle.stream = stream = _TextStream(self.target.tokenizer, req.stop_strings)

        def on_tokens(new: list[int]) -> bool:
            if handle.first_token_s is None:
                handle.first_token_s = time.perf_counter() - handle.started
            delta = stream.add(new)
            if delta:
                handle.push("text", delta)
            return stream.stopped or handle.cancelled.is_set()

        try:
            prompt: Any = req.prompt_ids
            if req.prompt_inputs:
                prompt = ImagePrompt(torch.tensor([req.prompt_ids]), req.prompt_inputs)
            row = self.decoder.add(
                prompt,
                req.max_tokens,
                SamplingParams(req.temperature, req.top_p, req.top_k),
                stop_token_ids=[*self.target.eos_token_ids, *req.stop_ids],
                seed=req.seed,
                on_tokens=on_tokens,
                tag=handle,
                constraint=req.constraint,
            )
        except Exception as e:  # noqa: BLE001 - one bad request fails alone
            handle.push("error", f"{type(e).__name__}: {e}")
            return
        if row.done:  # its first token already ended it
            self._finish(row)

    def _finish(self, row: BatchRow) -> None:
        handle: RequestHandle = row.tag
        if handle.cancelled.is_set():
            return
        result = row.result
        stream = handle.stream
        tail = stream.flush()
        if tail:
            handle.push("text", tail)
        # A grammar that allows no further token ends the answer where it stands (engine: "no_allowed_token").
        stopped = stream.stopped or result.stop_reason in ("stop_token", "no_allowed_token")
        finish = "stop" if stopped else "length"
        handle.push(
            "done",
            {
                "finish_reason": finish,
                "prompt_tokens": len(handle.request.prompt_ids),
                "completion_tokens": result.num_new_tokens,
                "queue_s": handle.started - handle.submitted,
                "ttft_s": handle.first_token_s,
                "total_s": time.perf_counter() - handle.started,
                "result": result,
                "spec_decode": spec_stats(
                    result, getattr(getattr(self.draft, "config", None), "block_size", None)
                )
                if self.draft is not None
                else None,
            },
        )
