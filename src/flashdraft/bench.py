"""`flashdraft bench`: acceptance length τ and speedup, measured side by side on the same machine.

Local backend (`--backend local`, the default): every method runs in this process on the same prompts, interleaved
prompt by prompt (and in a rotating order) so that machine drift hits all of them alike.

    ar      our plain decode loop (generate_ar): the reference every other output is compared with at T=0
    hf      transformers `generate`: what users run without speculation
    dflash  our DFlash engine (generate with the drafter)
    sd      transformers assisted generation with a small draft model sharing the target's tokenizer
    pld     transformers prompt-lookup decoding (`prompt_lookup_num_tokens`)

Timing. Every method reports the time to its first emitted token(s) (TTFT) and the time after it (the decode
phase). For our engine TTFT is prefill + first token (`GenerationResult.prefill_s`). For transformers methods a
streamer timestamps the first chunk `generate` emits after the prompt (one token for `hf`; for `sd`/`pld` the first
verify step, which transformers fuses with prefill). TPOT = decode time / tokens emitted after the first chunk,
averaged over prompts; the headline speedup is z-lab's: mean TPOT of the baseline / mean TPOT of the method
(decode only). tokens/s counts every new token over TTFT + decode (end to end). One warm-up prompt per method runs
before measuring and is excluded.

τ (mean acceptance length) = tokens emitted per target forward in the decode phase, bonus token included (1.0 for
plain decoding). For sd/pld it is the mean size of the chunks transformers streams (one per target forward). The
per-slot acceptance rate of slot k is P(draft k accepted | drafts 1..k-1 accepted), from the per-step logs
`draft_lengths` / `accepted_drafts` of the engine.

OpenAI backend (`--backend openai`): the same prompts sent to any OpenAI-compatible server (vLLM, SGLang, ...) at
each `--concurrency` level; throughput, latency percentiles, TTFT when streaming, and the server's own acceptance
figures when it exposes them (SGLang `meta_info`, vLLM Prometheus `spec_decode` counters before/after each level).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from .datasets import BenchDataset, load_bench_dataset
from .progress import busy_machine_warning, progress_bar

__all__ = [
    "METHODS",
    "BenchConfig",
    "BenchError",
    "SampleRecord",
    "ServerBenchConfig",
    "acceptance_histogram",
    "bench_command",
    "mean_acceptance_length",
    "parse_prometheus",
    "per_slot_acceptance",
    "percentile",
    "run_bench",
    "run_server_bench",
    "speedup",
    "summarize_records",
    "time_per_output_token",
    "vllm_spec_stats",
]

METHODS: dict[str, str] = {
    "ar": "flashdraft plain decoding (same loop, no drafter)",
    "hf": "transformers generate (greedy / sampling, no speculation)",
    "dflash": "flashdraft DFlash speculative decoding (default: cost-aware verify length, --block-size auto)",
    "dflash-fixed": "flashdraft DFlash with a fixed verify length: the drafter's trained block (the paper's setting)",
    "sd": "transformers assisted generation with a small draft model",
    "pld": "transformers prompt-lookup decoding",
}
DFLASH_METHODS = ("dflash", "dflash-fixed")
REFERENCE = "ar"  # the output every method must reproduce at T=0, and the first speedup baseline
HF_BASELINE = "hf"

console = Console(stderr=True)


class BenchError(ValueError):
    """A benchmark that cannot run as asked (bad method list, missing model, unreachable server, ...)."""


# =============================================================================================== metrics
# Pure functions on step logs: tested with hand-made logs in tests/test_bench.py.


def mean_acceptance_length(acceptance_lengths: Sequence[int]) -> float | None:
    """τ pooled over steps: tokens emitted / target forwards (None without steps)."""
    return sum(acceptance_lengths) / len(acceptance_lengths) if acceptance_lengths else None


def acceptance_histogram(acceptance_lengths: Sequence[int], max_length: int | None = None) -> list[int]:
    """counts[n] = number of steps that emitted n tokens, for n = 0..max_length (z-lab's histogram layout)."""
    top = max([max_length or 0, *acceptance_lengths]) if acceptance_lengths else (max_length or 0)
    counts = [0] * (top + 1)
    for n in acceptance_lengths:
        counts[n] += 1
    return counts


def per_slot_acceptance(draft_lengths: Sequence[int], accepted_drafts: Sequence[int]) -> list[dict[str, Any]]:
    """Acceptance of draft slot k = 1..max(draft_lengths), one dict per slot.

    A step that proposed d drafts and had a accepted reached slot k when k <= d and a >= k-1 (every earlier slot
    was accepted); slot k was accepted when a >= k. `rate` = accepted / reached (conditional, what a drafter is
    trained for); `unconditional_rate` = accepted / steps that proposed slot k (vLLM's per-position rate).
    """
    if len(draft_lengths) != len(accepted_drafts):
        raise ValueError("draft_lengths and accepted_drafts must have one entry per step")
    slots = []
    for k in range(1, max(draft_lengths, default=0) + 1):
        proposed = sum(1 for d in draft_lengths if d >= k)
        reached = sum(1 for d, a in zip(draft_lengths, accepted_drafts, strict=True) if d >= k and a >= k - 1)
        accepted = sum(1 for d, a in zip(draft_lengths, accepted_drafts, strict=True) if d >= k and a >= k)
        slots.append(
            {
                "slot": k,
                "proposed": proposed,
                "reached": reached,
                "accepted": accepted,
                "rate": accepted / reached if reached else None,
                "unconditional_rate": accepted / proposed if proposed else None,
            }
        )
    return slots


def time_per_output_token(decode_s: float, decode_tokens: int) -> float | None:
    """Seconds per token of the decode phase (None when nothing was decoded after the first chunk)."""
    return decode_s / decode_tokens if decode_tokens > 0 and decode_s > 0 else None


def speedup(baseline_tpot: float | None, method_tpot: float | None) -> float | None:
    """How many times faster than the baseline: baseline TPOT / method TPOT."""
    if not baseline_tpot or not method_tpot:
        return None
    return baseline_tpot / method_tpot


def percentile(values: Sequence[float], q: float) -> float | None:
    """q-th percentile (0..100) with linear interpolation, like numpy's default."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


# =============================================================================================== records


@dataclass
class SampleRecord:
    """One method on one prompt turn: every raw number the summaries are computed from."""

    dataset: str
    conversation_id: str
    turn: int
    method: str
    prompt_tokens: int
    new_tokens: int
    ttft_s: float  # until the first emitted chunk
    decode_s: float  # after it
    decode_tokens: int  # tokens emitted after the first chunk
    step_tokens: list[int] = field(default_factory=list)  # tokens per target forward in the decode phase (τ)
    draft_lengths: list[int] = field(default_factory=list)  # dflash: drafts proposed per step
    accepted_drafts: list[int] = field(default_factory=list)  # dflash: drafts accepted per step
    stop_reason: str = ""
    matches_reference: bool | None = None  # None: not compared (sampling, or the reference itself)
    first_mismatch: int | None = None
    output_ids: list[int] = field(default_factory=list, repr=False)
    output_text: str | None = field(default=None, repr=False)

    @property
    def total_s(self) -> float:
        return self.ttft_s + self.decode_s

    @property
    def tpot_s(self) -> float | None:
        return time_per_output_token(self.decode_s, self.decode_tokens)

    def to_dict(self, with_outputs: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d.pop("output_ids")
        d.pop("output_text")
        d["total_s"] = self.total_s
        d["tpot_s"] = self.tpot_s
        if with_outputs:
            d["output_ids"] = self.output_ids
            d["output_text"] = self.output_text
        return d


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix of the other); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize_records(records: Sequence[SampleRecord], block_size: int | None = None) -> dict[str, Any]:
    """Aggregate the records of one method (usually on one dataset)."""
    new_tokens = sum(r.new_tokens for r in records)
    total_s = sum(r.total_s for r in records)
    decode_tokens = sum(r.decode_tokens for r in records)
    decode_s = sum(r.decode_s for r in records)
    tpots = [r.tpot_s for r in records if r.tpot_s is not None]
    ttfts = [r.ttft_s for r in records]
    steps = [n for r in records for n in r.step_tokens]
    compared = [r for r in records if r.matches_reference is not None]
    summary: dict[str, Any] = {
        "samples": len(records),
        "new_tokens": new_tokens,
        "decode_tokens": decode_tokens,
        "total_s": total_s,
        "decode_s": decode_s,
        "tokens_per_s": new_tokens / total_s if total_s > 0 else None,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else None,
        "tpot_s": _mean(tpots),  # mean over prompts of decode_s / decode_tokens
        "ttft_s": _mean(ttfts),
        "ttft_p50_s": percentile(ttfts, 50),
        "tau": mean_acceptance_length(steps),
        "tau_per_sample_mean": _mean(
            [sum(r.step_tokens) / len(r.step_tokens) for r in records if r.step_tokens]
        ),
        "steps": len(steps),
        "compared": len(compared),
        "mismatches": sum(1 for r in compared if not r.matches_reference),
    }
    drafted = any(d > 0 for r in records for d in r.draft_lengths)
    if drafted or any(n > 1 for n in steps):
        summary["acceptance_histogram"] = acceptance_histogram(steps, block_size)
    if drafted:
        # How many proposals each step verified (0 = a plain step): what a cost-aware policy chose.
        lengths = [d for r in records for d in r.draft_lengths]
        summary["verify_length_histogram"] = {
            str(n): lengths.count(n) for n in range(max(lengths) + 1) if lengths.count(n)
        }
        summary["slot_acceptance"] = per_slot_acceptance(
            [d for r in records for d in r.draft_lengths], [a for r in records for a in r.accepted_drafts]
        )
    return summary


def add_speedups(by_method: dict[str, dict[str, Any]]) -> None:
    """Speedups of every method vs `ar` and vs `hf` (when they ran), in place."""
    for baseline in (REFERENCE, HF_BASELINE):
        base = by_method.get(baseline)
        for summary in by_method.values():
            summary[f"speedup_vs_{baseline}"] = speedup(base["tpot_s"], summary["tpot_s"]) if base else None
            summary[f"throughput_speedup_vs_{baseline}"] = (
                summary["tokens_per_s"] / base["tokens_per_s"]
                if base and base["tokens_per_s"] and summary["tokens_per_s"]
                else None
            )


# =============================================================================================== configs


@dataclass
class BenchConfig:
    target: str
    datasets: list[str]
    methods: list[str] = field(default_factory=lambda: ["ar", "hf", "dflash"])
    draft: str | None = None
    assistant: str | None = None
    max_samples: int | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    block_size: int | None = None
    pld_tokens: int = 10
    seed: int = 0
    out_dir: Path | None = None
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    thinking: bool | None = None
    chat: bool = True
    save_outputs: bool = False
    warmup: bool = True
    plots: bool = True
    command: str | None = None
    show_progress: bool = True


@dataclass
class ServerBenchConfig:
    base_url: str
    datasets: list[str]
    model: str | None = None
    concurrency: list[int] = field(default_factory=lambda: [1])
    api: str = "chat"  # chat -> /v1/chat/completions, completion -> /v1/completions
    stream: bool = True
    max_samples: int | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    timeout_s: float = 600.0
    thinking: bool | None = None
    api_key: str | None = None  # sent as a Bearer token; never written to results
    out_dir: Path | None = None
    save_outputs: bool = False
    warmup: bool = True
    plots: bool = True
    command: str | None = None
    show_progress: bool = True


def parse_methods(text: str | Sequence[str]) -> list[str]:
    items = [m.strip().lower() for m in (text.split(",") if isinstance(text, str) else text) if m.strip()]
    unknown = [m for m in items if m not in METHODS]
    if unknown:
        raise BenchError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if not items:
        raise BenchError(f"no methods given; choose from {', '.join(METHODS)}")
    methods = list(dict.fromkeys(items))
    if REFERENCE not in methods:
        methods.insert(0, REFERENCE)  # the output-equality check and speedups need the reference
    return methods


def parse_concurrency(text: str | Sequence[int]) -> list[int]:
    try:
        levels = (
            [int(x) for x in text.split(",") if x.strip()]
            if isinstance(text, str)
            else [int(x) for x in text]
        )
    except ValueError:
        raise BenchError(f"--concurrency expects comma-separated positive integers, got {text!r}") from None
    if not levels or any(c < 1 for c in levels):
        raise BenchError(f"--concurrency expects comma-separated positive integers, got {text!r}")
    return levels


def split_datasets(text: str) -> list[str]:
    """`gsm8k,humaneval` -> two datasets; a file path containing a comma stays whole."""
    if Path(text).expanduser().is_file():
        return [text]
    names = [d.strip() for d in text.split(",") if d.strip()]
    if not names:
        raise BenchError("no dataset given")
    return names


def _validate_common(max_new_tokens: int, temperature: float, max_samples: int | None) -> None:
    if max_new_tokens < 1:
        raise BenchError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if not math.isfinite(temperature) or temperature < 0:
        raise BenchError(f"--temperature must be >= 0, got {temperature}")
    if max_samples is not None and max_samples < 1:
        raise BenchError(f"--max-samples must be at least 1, got {max_samples}")


def validate_config(cfg: BenchConfig) -> None:
    """Every check that needs no model: fail in a second, not after loading weights."""
    cfg.methods = parse_methods(cfg.methods)
    _validate_common(cfg.max_new_tokens, cfg.temperature, cfg.max_samples)
    if any(m in DFLASH_METHODS for m in cfg.methods) and not cfg.draft:
        raise BenchError("method dflash needs a drafter: pass --draft DIR")
    if "sd" in cfg.methods and not cfg.assistant:
        raise BenchError(
            "method sd needs a small draft model sharing the target's tokenizer: pass --assistant MODEL "
            "(e.g. qwen2.5-coder-0.5b-instruct for qwen2.5-coder-1.5b-instruct)"
        )
    if cfg.block_size is not None and cfg.block_size < 1:
        raise BenchError(f"--block-size must be at least 1, got {cfg.block_size}")
    if cfg.dtype is not None and cfg.dtype not in ("float32", "bfloat16", "float16"):
        raise BenchError(f"--dtype must be float32, bfloat16 or float16, got {cfg.dtype!r}")
    if cfg.pld_tokens < 1:
        raise BenchError(f"--pld-tokens must be at least 1, got {cfg.pld_tokens}")


# =============================================================================================== machine info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(
    device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    import transformers

    from . import __version__

    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "flashdraft": __version__,
        "device": str(device) if device is not None else None,
        "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
    }
    try:
        import psutil

        info["physical_cores"] = psutil.cpu_count(logical=False)
        info["memory_gb"] = round(psutil.virtual_memory().total / 1e9, 1)
    except ImportError:
        pass
    if hasattr(os, "getloadavg"):  # other jobs on the machine make timings noisy: record how busy it was
        info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    if device is not None and torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


# =============================================================================================== local runners


@dataclass
class RunOutput:
    new_ids: list[int]
    ttft_s: float
    decode_s: float
    first_chunk: int  # tokens emitted with the first chunk (1 for plain decoding)
    step_tokens: list[int]
    draft_lengths: list[int] = field(default_factory=list)
    accepted_drafts: list[int] = field(default_factory=list)
    stop_reason: str = ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _ChunkTimer:
    """A transformers streamer (duck-typed: put/end) that timestamps the first emitted chunk and records every
    chunk's size. generate() first puts the prompt, then one chunk per target forward (1 token for greedy, the accepted
    tokens + 1 for assisted / prompt-lookup decoding).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.prompt_seen = False
        self.first_at: float | None = None
        self.chunks: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        if self.first_at is None:
            _sync(self.device)
            self.first_at = time.perf_counter()
        self.chunks.append(int(value.numel()))

    def end(self) -> None:
        pass


class LocalMethods:
    """Loads the models once and runs any method on a prompt."""

    def __init__(self, cfg: BenchConfig) -> None:
        from .model import DFlashDraftModel
        from .target import load_target

        self.cfg = cfg
        self.target = load_target(cfg.target, dtype=cfg.dtype, device=cfg.device)
        self.device = self.target.device
        self.stop_ids = self.target.eos_token_ids
        tok = self.target.tokenizer
        pad = getattr(tok, "pad_token_id", None) if tok is not None else None
        self.pad_id = pad if pad is not None else (self.stop_ids[0] if self.stop_ids else 0)
        self.draft = None
        self.block_size: int | None = (
            None  # the drafter's trained block (histogram bins, fixed verify length)
        )
        self.verify: int | str = "auto"  # what method dflash verifies: "auto" or a fixed block size
        self.cost_model = None
        if any(m in DFLASH_METHODS for m in cfg.methods):
            self.draft = DFlashDraftModel.from_pretrained(
                cfg.draft, dtype=self.target.dtype, device=self.device
            )
            self.target.check_drafter(self.draft.config)
            self.block_size = self.draft.config.block_size
            self.verify = cfg.block_size or "auto"
            if cfg.block_size and cfg.block_size > self.block_size:
                raise BenchError(
                    f"--block-size {cfg.block_size} exceeds the drafter's block size {self.block_size}"
                )
            if self.verify == "auto" and "dflash" in cfg.methods:
                from .costs import load_or_measure_costs

                self.cost_model = load_or_measure_costs(
                    self.target, self.draft, log=lambda m: console.print(m, soft_wrap=True)
                )
                console.print(self.cost_model.summary(), soft_wrap=True)
        self.assistant = None
        if "sd" in cfg.methods:
            self.assistant = load_target(cfg.assistant, dtype=self.target.dtype, device=self.device)
            other = self.assistant.tokenizer
            if tok is not None and other is not None and tok.get_vocab() != other.get_vocab():
                raise BenchError(
                    f"assistant {cfg.assistant!r} does not share the tokenizer of {cfg.target!r}: sd needs a "
                    "draft model of the same family"
                )

    @property
    def drafter_info(self) -> dict[str, Any] | None:
        if self.draft is None:
            return None
        c = self.draft.config
        return {
            "path": str(self.cfg.draft),
            "block_size": c.block_size,
            "layers": c.num_hidden_layers,
            "target_layer_ids": list(c.target_layer_ids),
            "mask_token_id": c.mask_token_id,
            "parameters": self.draft.num_parameters(),
            "flashdraft": getattr(c, "flashdraft", None) or {},
        }

    def hf_generation_settings(self) -> dict[str, Any]:
        """The transformers settings that decide what sd/pld do (recorded in results.json)."""
        settings: dict[str, Any] = {"prompt_lookup_num_tokens": self.cfg.pld_tokens}
        if self.assistant is not None:
            gen = self.assistant.model.generation_config
            defaults = (
                gen._get_default_generation_params() if hasattr(gen, "_get_default_generation_params") else {}
            )
            for key in (
                "num_assistant_tokens",
                "num_assistant_tokens_schedule",
                "assistant_confidence_threshold",
            ):
                value = getattr(gen, key, None)
                settings[key] = value if value is not None else defaults.get(key)
        return settings

    def run(self, method: str, input_ids: torch.Tensor, max_new_tokens: int, seed: int) -> RunOutput:
        if method in ("ar", *DFLASH_METHODS):
            return self._run_engine(method, input_ids, max_new_tokens, seed)
        extra: dict[str, Any] = {}
        if method == "sd":
            extra["assistant_model"] = self.assistant.model
        elif method == "pld":
            extra["prompt_lookup_num_tokens"] = self.cfg.pld_tokens
        return self._run_transformers(input_ids, max_new_tokens, seed, extra)

    def _run_engine(self, method: str, input_ids: torch.Tensor, max_new_tokens: int, seed: int) -> RunOutput:
        from .generate import generate, generate_ar

        common = dict(max_new_tokens=max_new_tokens, temperature=self.cfg.temperature, seed=seed)
        if method in DFLASH_METHODS:
            verify = self.verify if method == "dflash" else self.block_size
            res = generate(
                self.target, self.draft, input_ids, block_size=verify, costs=self.cost_model, **common
            )
        else:
            res = generate_ar(self.target, input_ids, **common)
        return RunOutput(
            new_ids=res.new_tokens,
            ttft_s=res.prefill_s,
            decode_s=res.decode_s,
            first_chunk=1,
            step_tokens=list(res.acceptance_lengths),
            # Plain decoding proposes nothing: its all-zero draft logs carry no information.
            draft_lengths=list(res.draft_lengths) if method in DFLASH_METHODS else [],
            accepted_drafts=list(res.accepted_drafts) if method in DFLASH_METHODS else [],
            stop_reason=res.stop_reason,
        )

    def _run_transformers(
        self, input_ids: torch.Tensor, max_new_tokens: int, seed: int, extra: dict[str, Any]
    ) -> RunOutput:
        kwargs: dict[str, Any] = {
            "attention_mask": torch.ones_like(input_ids),
            "max_new_tokens": max_new_tokens,
            "eos_token_id": self.stop_ids or None,
            "pad_token_id": self.pad_id,
        }
        if self.cfg.temperature == 0:
            # None stops the model's generation_config from injecting sampling parameters.
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=self.cfg.temperature, top_p=1.0, top_k=0)
            torch.manual_seed(seed)
        timer = _ChunkTimer(self.device)
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.target.model.generate(input_ids, streamer=timer, **kwargs, **extra)
        _sync(self.device)
        t_end = time.perf_counter()
        new_ids = out[0, input_ids.shape[1] :].tolist()
        stop_reason = "max_new_tokens"
        for i, tok in enumerate(new_ids):  # generate pads after a stop token in some modes; cut there
            if tok in self.stop_ids:
                new_ids = new_ids[: i + 1]
                stop_reason = "stop_token"
                break
        first_at = timer.first_at if timer.first_at is not None else t_end
        first_chunk = timer.chunks[0] if timer.chunks else len(new_ids)
        return RunOutput(
            new_ids=new_ids,
            ttft_s=first_at - t0,
            decode_s=t_end - first_at,
            first_chunk=min(first_chunk, len(new_ids)),
            step_tokens=timer.chunks[1:],  # decode-phase forwards, like the engine's acceptance lengths
            stop_reason=stop_reason,
        )


# =============================================================================================== local bench loop


def _progress(enabled: bool) -> Progress:
    return progress_bar(enabled, unit="prompts", console=console)


def _default_out_dir(datasets: Sequence[str]) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    label = "-".join(Path(d).name.split(".")[0] for d in datasets)[:60]
    return Path("bench-results") / f"{label}-{stamp}"


def _load_datasets(names: Sequence[str], max_samples: int | None, seed: int) -> list[BenchDataset]:
    return [load_bench_dataset(name, max_samples=max_samples, seed=seed) for name in names]


def _dataset_info(ds: BenchDataset) -> dict[str, Any]:
    return {
        "name": ds.name,
        "source": ds.source,
        "records": ds.num_records,
        "conversations": len(ds.conversations),
        "turns": ds.num_turns,
        "sample_indices": ds.sample_indices,
    }


def _mismatch_entry(rec: SampleRecord, ref: RunOutput, out: RunOutput, tokenizer: Any) -> dict[str, Any]:
    i = rec.first_mismatch or 0
    lo = max(0, i - 8)

    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else str(ids)

    return {
        "dataset": rec.dataset,
        "conversation_id": rec.conversation_id,
        "turn": rec.turn,
        "method": rec.method,
        "first_mismatch": i,
        "reference_tokens": len(ref.new_ids),
        "method_tokens": len(out.new_ids),
        "reference_ids": ref.new_ids[lo : i + 8],
        "method_ids": out.new_ids[lo : i + 8],
        "reference_text": text(ref.new_ids[lo : i + 8]),
        "method_text": text(out.new_ids[lo : i + 8]),
    }


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run the local benchmark and write results.json, report.md and plots to `cfg.out_dir`; return the results."""
    validate_config(cfg)
    datasets = _load_datasets(cfg.datasets, cfg.max_samples, cfg.seed)
    previous_threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _run_local(cfg, datasets)
    finally:
        torch.set_num_threads(previous_threads)  # callers in the same process keep their setting


def _run_local(cfg: BenchConfig, datasets: list[BenchDataset]) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    out_dir = Path(cfg.out_dir) if cfg.out_dir else _default_out_dir(cfg.datasets)

    console.print(f"loading {cfg.target}" + (f" + drafter {cfg.draft}" if cfg.draft else ""))
    runner = LocalMethods(cfg)
    target, tokenizer = runner.target, runner.target.tokenizer
    greedy = cfg.temperature == 0
    records: list[SampleRecord] = []
    mismatches: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    interrupted = False
    started = datetime.now(timezone.utc)
    load_at_start = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    busy = busy_machine_warning(target.device.type, torch.get_num_threads())
    if busy:
        console.print(f"[yellow]warning:[/] {busy}")

    def encode(messages: list[dict[str, str]], system: str | None) -> torch.Tensor:
        return target.encode_prompt(messages, chat=cfg.chat, enable_thinking=cfg.thinking, system=system)

    with torch.inference_mode():
        if cfg.warmup:
            # First-call overheads (allocator, kernels, lazy init) are paid here by every method, not measured.
            first = datasets[0].conversations[0]
            ids = encode([{"role": "user", "content": first.user_turns[0]}], first.system)
            for method in cfg.methods:
                runner.run(method, ids, min(cfg.max_new_tokens, 16), cfg.seed)

        total_turns = sum(ds.num_turns for ds in datasets)
        prompt_index = 0
        with _progress(cfg.show_progress) as progress:
            task = progress.add_task("bench", total=total_turns)
            try:
                for ds in datasets:
                    progress.update(task, description=ds.name)
                    for conv in ds.conversations:
                        messages: list[dict[str, str]] = []
                        for turn, user_text in enumerate(conv.user_turns):
                            messages.append({"role": "user", "content": user_text})
                            ids = encode(messages, conv.system)
                            if ids.shape[1] + cfg.max_new_tokens > target.max_context:
                                skipped.append(
                                    {"dataset": ds.name, "conversation_id": conv.id, "turn": turn,
                                     "reason": f"prompt of {ids.shape[1]} tokens + max_new_tokens exceeds the "
                                               f"context of {target.max_context}"}
                                )  # fmt: skip
                                progress.advance(task, len(conv.user_turns) - turn)
                                break
                            # Rotate the order so no method always runs first (cache warmth, thermal drift).
                            shift = prompt_index % len(cfg.methods)
                            order = cfg.methods[shift:] + cfg.methods[:shift]
                            seed = cfg.seed + prompt_index
                            outputs = {m: runner.run(m, ids, cfg.max_new_tokens, seed) for m in order}
                            ref = outputs[REFERENCE]
                            for method in cfg.methods:
                                out = outputs[method]
                                rec = SampleRecord(
                                    dataset=ds.name,
                                    conversation_id=conv.id,
                                    turn=turn,
                                    method=method,
                                    prompt_tokens=int(ids.shape[1]),
                                    new_tokens=len(out.new_ids),
                                    ttft_s=out.ttft_s,
                                    decode_s=out.decode_s,
                                    decode_tokens=max(len(out.new_ids) - out.first_chunk, 0),
                                    step_tokens=out.step_tokens,
                                    draft_lengths=out.draft_lengths,
                                    accepted_drafts=out.accepted_drafts,
                                    stop_reason=out.stop_reason,
                                    output_ids=out.new_ids,
                                )
                                if greedy and method != REFERENCE:
                                    rec.first_mismatch = first_difference(ref.new_ids, out.new_ids)
                                    rec.matches_reference = rec.first_mismatch is None
                                    if not rec.matches_reference:
                                        mismatches.append(_mismatch_entry(rec, ref, out, tokenizer))
                                if cfg.save_outputs and tokenizer is not None:
                                    rec.output_text = tokenizer.decode(out.new_ids, skip_special_tokens=True)
                                records.append(rec)
                            # The next turn is conditioned on the target's own answer (z-lab's mt-bench protocol).
                            answer = (
                                tokenizer.decode(ref.new_ids, skip_special_tokens=True) if tokenizer else ""
                            )
                            messages.append({"role": "assistant", "content": answer})
                            prompt_index += 1
                            progress.advance(task)
            except KeyboardInterrupt:
                interrupted = True
                console.print("[yellow]interrupted: writing the results measured so far[/]")

    results = _local_results(cfg, runner, datasets, records, mismatches, skipped, started, interrupted)
    results["machine"]["load_average_start"] = load_at_start
    write_results(results, out_dir, records if cfg.save_outputs else None, plots=cfg.plots)
    results["out_dir"] = str(out_dir)
    return results


def _local_results(
    cfg: BenchConfig,
    runner: LocalMethods,
    datasets: list[BenchDataset],
    records: list[SampleRecord],
    mismatches: list[dict[str, Any]],
    skipped: list[dict[str, Any]],
    started: datetime,
    interrupted: bool,
) -> dict[str, Any]:
    summary: dict[str, dict[str, Any]] = {}
    groups = [ds.name for ds in datasets] + (["all"] if len(datasets) > 1 else [])
    for group in groups:
        by_method = {}
        for method in cfg.methods:
            recs = [r for r in records if r.method == method and (group == "all" or r.dataset == group)]
            if recs:
                by_method[method] = summarize_records(recs, runner.block_size)
        add_speedups(by_method)
        summary[group] = by_method
    settings = {
        "backend": "local",
        "target": cfg.target,
        "draft": cfg.draft,
        "assistant": cfg.assistant,
        "methods": cfg.methods,
        "datasets": cfg.datasets,
        "max_samples": cfg.max_samples,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "block_size": runner.block_size,
        "verify": runner.verify,
        "cost_model": runner.cost_model.to_dict() if runner.cost_model is not None else None,
        "seed": cfg.seed,
        "chat_template": cfg.chat,
        "enable_thinking": cfg.thinking,
        "stop_token_ids": runner.stop_ids,
        "warmup": cfg.warmup,
        "transformers_generation": runner.hf_generation_settings(),
    }
    return {
        "kind": "flashdraft-bench",
        "version": 1,
        "command": cfg.command,
        "started": started.isoformat(timespec="seconds"),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "interrupted": interrupted,
        "settings": settings,
        "machine": machine_info(runner.device, runner.target.dtype),
        "drafter": runner.drafter_info,
        "datasets": [_dataset_info(ds) for ds in datasets],
        "definitions": {
            "ttft_s": "time to the first emitted chunk (prefill + first token; for sd/pld the first verify step)",
            "tpot_s": "mean over prompts of decode time / tokens emitted after the first chunk",
            "speedup_vs_X": "mean TPOT of X / mean TPOT of the method (decode phase only, z-lab convention)",
            "throughput_speedup_vs_X": "tokens/s of the method / tokens/s of X, end to end (TTFT included)",
            "tau": "tokens emitted per target forward in the decode phase, bonus token included (pooled)",
            "acceptance_histogram": "counts[n] = decode steps that emitted n tokens",
            "slot_acceptance.rate": "P(draft slot k accepted | slots < k accepted)",
        },
        "summary": summary,
        "equality": {
            "checked": cfg.temperature == 0,
            "reference": REFERENCE,
            "mismatches": len(mismatches),
            "compared": sum(1 for r in records if r.matches_reference is not None),
            "details": mismatches,
        },
        "skipped": skipped,
        "samples": [r.to_dict() for r in records],
    }


# =============================================================================================== server backend


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


_PROM_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_PROM_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
VLLM_SPEC_COUNTERS = {
    "num_drafts": "vllm:spec_decode_num_drafts",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
VLLM_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def parse_prometheus(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """{metric name without `_total`: {sorted label pairs: value}} from a Prometheus text exposition."""
    metrics: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _PROM_LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        name = m.group(1).removesuffix("_total")
        labels = tuple(sorted(_PROM_LABEL.findall(m.group(2) or "")))
        metrics.setdefault(name, {})[labels] = value
    return metrics


def _counter_sum(metrics: dict[str, dict[Any, float]], name: str) -> float:
    return sum(metrics.get(name, {}).values())


def _per_position(metrics: dict[str, dict[Any, float]]) -> dict[int, float]:
    out: dict[int, float] = {}
    for labels, value in metrics.get(VLLM_PER_POSITION, {}).items():
        pos = dict(labels).get("position")
        if pos is not None and pos.isdigit():
            out[int(pos)] = out.get(int(pos), 0.0) + value
    return out


def vllm_spec_stats(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """Acceptance over one run from vLLM's spec_decode counters scraped before and after it."""
    if not after:
        return None
    before = before or {}
    delta = {
        key: _counter_sum(after, name) - _counter_sum(before, name)
        for key, name in VLLM_SPEC_COUNTERS.items()
    }
    if delta["num_drafts"] <= 0:
        return None
    pos_after, pos_before = _per_position(after), _per_position(before)
    per_pos = [pos_after[k] - pos_before.get(k, 0.0) for k in sorted(pos_after)]
    conditional = []
    previous = delta["num_drafts"]
    for accepted in per_pos:
        conditional.append(accepted / previous if previous > 0 else None)
        previous = accepted
    return {
        **delta,
        "tau": 1.0 + delta["num_accepted_tokens"] / delta["num_drafts"],
        "draft_acceptance_rate": (
            delta["num_accepted_tokens"] / delta["num_draft_tokens"]
            if delta["num_draft_tokens"] > 0
            else None
        ),
        "per_position_rate": [a / delta["num_drafts"] for a in per_pos],
        "per_position_conditional_rate": conditional,
    }


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
    return part.get("content") or ""


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
            await _send(client, cfg, url, _payload(cfg, model, messages, cfg.max_new_tokens), req)
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
            "mean_spec_accept_length": _mean(accept_lengths),
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
        with _progress(cfg.show_progress) as progress:
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
    _validate_common(cfg.max_new_tokens, cfg.temperature, cfg.max_samples)
    datasets = _load_datasets(cfg.datasets, cfg.max_samples, cfg.seed)
    out_dir = Path(cfg.out_dir) if cfg.out_dir else _default_out_dir(cfg.datasets)
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
        "datasets": [_dataset_info(ds) for ds in datasets],
        "warmup_error": run["warmup_error"],
        "levels": run["levels"],
        "requests": run["requests"],
    }
    write_server_results(results, out_dir, plots=cfg.plots)
    results["out_dir"] = str(out_dir)
    return results


# =============================================================================================== writing results


def _fmt(value: float | None, spec: str = ".2f", scale: float = 1.0, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{value * scale:{spec}}{suffix}"


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def _method_table(by_method: dict[str, dict[str, Any]], checked: bool) -> list[str]:
    lines = [
        "| method | prompts | new tokens | tok/s | decode tok/s | TPOT ms | TTFT ms | speedup vs ar | "
        "speedup vs hf | τ | equal to ar |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, s in by_method.items():
        if method == REFERENCE:
            equal = "reference"
        elif not checked:
            equal = "not checked (T>0)"
        else:
            equal = f"{s['compared'] - s['mismatches']}/{s['compared']}"
            equal += "" if s["mismatches"] == 0 else " **MISMATCH**"
        lines.append(
            f"| {method} | {s['samples']} | {s['new_tokens']} | {_fmt(s['tokens_per_s'], '.1f')} | "
            f"{_fmt(s['decode_tokens_per_s'], '.1f')} | {_fmt(s['tpot_s'], '.1f', 1000)} | "
            f"{_fmt(s['ttft_s'], '.1f', 1000)} | {_fmt(s['speedup_vs_ar'], '.2f', suffix='×')} | "
            f"{_fmt(s['speedup_vs_hf'], '.2f', suffix='×')} | {_fmt(s['tau'])} | {equal} |"
        )
    return lines


def _acceptance_tables(group: str, s: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    hist = s.get("acceptance_histogram")
    if hist and sum(hist):
        total = sum(hist)
        keys = list(range(1, len(hist)))
        lines += [
            f"τ histogram ({group}, {total} decode steps; share of steps emitting n tokens):",
            "",
            "| n | " + " | ".join(str(k) for k in keys) + " |",
            "|---|" + "---|" * len(keys),
            "| share | " + " | ".join(f"{hist[k] / total * 100:.1f}%" for k in keys) + " |",
            "",
        ]
    verify = s.get("verify_length_histogram")
    if verify:
        total = sum(verify.values())
        keys = sorted(verify, key=int)
        lines += [
            f"Verify lengths ({group}, {total} steps; share of steps verifying n proposals, 0 = a plain step):",
            "",
            "| n | " + " | ".join(keys) + " |",
            "|---|" + "---|" * len(keys),
            "| share | " + " | ".join(f"{verify[k] / total * 100:.1f}%" for k in keys) + " |",
            "",
        ]
    slots = s.get("slot_acceptance")
    if slots:
        lines += [
            f"Per-slot acceptance ({group}): P(slot k accepted | slots < k accepted), and vLLM-style "
            "P(slot k accepted):",
            "",
            "| slot | " + " | ".join(str(x["slot"]) for x in slots) + " |",
            "|---|" + "---|" * len(slots),
            "| conditional | " + " | ".join(_fmt(x["rate"], ".0%") for x in slots) + " |",
            "| unconditional | " + " | ".join(_fmt(x["unconditional_rate"], ".0%") for x in slots) + " |",
            "| reached | " + " | ".join(str(x["reached"]) for x in slots) + " |",
            "",
        ]
    return lines


def _machine_lines(machine: dict[str, Any]) -> list[str]:
    cores = f"{machine.get('logical_cores')} logical cores"
    if machine.get("affinity_cores") and machine.get("affinity_cores") != machine.get("logical_cores"):
        cores += f" ({machine['affinity_cores']} usable)"
    lines = [
        f"- machine: {machine.get('cpu')}, {cores}, torch threads {machine.get('torch_threads')}"
        + (f", GPU {machine['gpu']}" if machine.get("gpu") else ""),
        f"- software: python {machine.get('python')}, torch {machine.get('torch')}, transformers "
        f"{machine.get('transformers')}, flashdraft {machine.get('flashdraft')} ({machine.get('platform')})",
    ]
    if machine.get("device"):
        dtype_note = ""
        if machine.get("dtype") not in (None, "float32"):
            dtype_note = (
                " (below float32, a batched verify and a one-token step round differently: near-ties can flip, so "
                "outputs may differ from ar; the mismatch count below says how often)"
            )
        lines.append(f"- device / dtype: {machine.get('device')} / {machine.get('dtype')}{dtype_note}")
    if machine.get("load_average_end"):
        start = machine.get("load_average_start")
        lines.append(
            "- load average (1 min): "
            + (f"{start[0]:.2f} at the start, " if start else "")
            + f"{machine['load_average_end'][0]:.2f} at the end"
        )
    return lines


def _cost_model_lines(settings: dict[str, Any]) -> list[str]:
    """What method dflash's cost-aware policy worked from (measured on this machine before the run)."""
    if not settings.get("cost_model"):
        return [f"- dflash verify length: fixed, {settings.get('verify')}"] if settings.get("verify") else []
    from .costs import CostModel

    return ["- dflash verify length: auto; " + CostModel.from_dict(settings["cost_model"]).summary()]


def render_report(results: dict[str, Any]) -> str:
    s = results["settings"]
    eq = results["equality"]
    lines = ["# flashdraft bench", ""]
    if results.get("command"):
        lines += [f"- command: `{results['command']}`"]
    drafter = results.get("drafter") or {}
    untrained = (drafter.get("flashdraft") or {}).get("trained") is False
    lines += [
        f"- target: `{s['target']}`"
        + (f", drafter: `{s['draft']}` (block size {s['block_size']})" if s.get("draft") else "")
        + (f", assistant (sd): `{s['assistant']}`" if s.get("assistant") else ""),
        f"- methods: {', '.join(s['methods'])}; max_new_tokens {s['max_new_tokens']}, temperature "
        f"{s['temperature']:g}, seed {s['seed']}, chat template {'on' if s['chat_template'] else 'off'}"
        + (
            ""
            if s.get("enable_thinking") is None
            else f", thinking {'on' if s['enable_thinking'] else 'off'}"
        ),
        *_machine_lines(results["machine"]),
        *_cost_model_lines(s),
        "- datasets: "
        + "; ".join(
            f"{d['name']} ({d['conversations']} of {d['records']} records, {d['turns']} turns)"
            for d in results["datasets"]
        ),
        f"- run: {results['started']} → {results['finished']}"
        + (" (INTERRUPTED)" if results["interrupted"] else ""),
        "",
        "TPOT = decode time per token after the first emitted chunk (mean over prompts); speedup = mean TPOT of "
        "the baseline / mean TPOT of the method (decode only); tok/s = all new tokens / (TTFT + decode); "
        "τ = tokens per target forward in the decode phase (bonus included). One warm-up prompt per method is "
        "excluded.",
        "",
    ]
    if untrained:
        lines += [
            "> **The drafter is untrained**: τ ≈ 1 and DFlash only adds cost. Development run only.",
            "",
        ]
    for group, by_method in results["summary"].items():
        lines += [f"## {group}", "", *_method_table(by_method, eq["checked"]), ""]
        for method, summary in by_method.items():
            if summary.get("slot_acceptance"):
                lines += _acceptance_tables(f"{group}, {method}", summary)
    lines += ["## Output equality", ""]
    if not eq["checked"]:
        lines += ["Not checked: temperature > 0 (outputs are samples).", ""]
    elif eq["mismatches"] == 0:
        lines += [f"All {eq['compared']} outputs are token-for-token identical to `{eq['reference']}`.", ""]
    else:
        lines += [
            f"**{eq['mismatches']} of {eq['compared']} outputs differ from `{eq['reference']}`** "
            "(transformers assisted generation in fp32 can legitimately differ on near-ties; listed, never hidden):",
            "",
            "| dataset | prompt | turn | method | first differing token | ar text there | method text there |",
            "|---|---|---|---|---|---|---|",
        ]
        for m in eq["details"]:
            ref_text = json.dumps(m["reference_text"], ensure_ascii=False)[1:-1].replace("|", "\\|")
            out_text = json.dumps(m["method_text"], ensure_ascii=False)[1:-1].replace("|", "\\|")
            lines.append(
                f"| {m['dataset']} | {m['conversation_id']} | {m['turn']} | {m['method']} | "
                f"{m['first_mismatch']} | `{ref_text}` | `{out_text}` |"
            )
        lines.append("")
    if results.get("skipped"):
        lines += ["## Skipped", ""]
        lines += [
            f"- {x['dataset']} {x['conversation_id']} turn {x['turn']}: {x['reason']}"
            for x in results["skipped"]
        ]
        lines.append("")
    return "\n".join(lines)


def write_results(
    results: dict[str, Any], out_dir: Path, records: Sequence[SampleRecord] | None = None, plots: bool = True
) -> list[Path]:
    """results.json, report.md and the PNG plots; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if records is not None:  # --save-outputs: texts and ids next to the numbers
        results = {**results, "samples": [r.to_dict(with_outputs=True) for r in records]}
    _write_json(out_dir / "results.json", results)
    (out_dir / "report.md").write_text(render_report(results), encoding="utf-8")
    written = [out_dir / "results.json", out_dir / "report.md"]
    if plots:
        written += _plot_local(results, out_dir)
    return written


def _pyplot() -> Any | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.print("[yellow]matplotlib is not installed: no plots (pip install 'flashdraft[bench]')[/]")
        return None
    return plt


def _save_figure(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _plot_local(results: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = _pyplot()
    if plt is None:
        return []
    from matplotlib.ticker import MaxNLocator

    written = []
    datasets = [d["name"] for d in results["datasets"]]
    summary = results["summary"]
    spec_methods = [m for m in results["settings"]["methods"] if m not in (REFERENCE, HF_BASELINE)]

    # τ histogram of every speculative method, one panel per method, one bar group per dataset.
    hist_methods = [
        m for m in spec_methods if any(summary[d].get(m, {}).get("acceptance_histogram") for d in datasets)
    ]
    if hist_methods:
        fig, axes = plt.subplots(1, len(hist_methods), figsize=(5.5 * len(hist_methods), 3.8), squeeze=False)
        for ax, method in zip(axes[0], hist_methods, strict=True):
            width = 0.8 / len(datasets)
            for i, d in enumerate(datasets):
                hist = summary[d].get(method, {}).get("acceptance_histogram") or []
                total = sum(hist)
                if not total:
                    continue
                xs = list(range(1, len(hist)))
                ax.bar([x + (i - (len(datasets) - 1) / 2) * width for x in xs],
                       [hist[x] / total for x in xs], width=width, label=d)  # fmt: skip
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_title(f"{method}: tokens per decode step (τ)")
            ax.set_xlabel("tokens emitted per target forward")
            ax.set_ylabel("share of steps")
            ax.legend(fontsize=8)
        written.append(_save_figure(fig, out_dir / "tau_histogram.png"))

    # Per-slot acceptance of the DFlash drafter: conditional (solid) and vLLM-style unconditional (dashed). A fixed
    # verify length shows the drafter itself; the cost-aware policy's verified slots are a selection.
    slot_method = next(
        (
            m
            for m in ("dflash-fixed", "dflash")
            if any(summary[d].get(m, {}).get("slot_acceptance") for d in datasets)
        ),
        None,
    )
    if slot_method:
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        num_slots = 1
        for d in datasets:
            slots = summary[d].get(slot_method, {}).get("slot_acceptance") or []
            if not slots:
                continue
            num_slots = max(num_slots, len(slots))
            ks = [x["slot"] for x in slots]
            conditional = [x["rate"] if x["rate"] is not None else float("nan") for x in slots]
            (line,) = ax.plot(ks, conditional, marker="o", label=f"{d}: given slots < k accepted")
            unconditional = [x["unconditional_rate"] or 0.0 for x in slots]
            ax.plot(ks, unconditional, linestyle="--", color=line.get_color(), label=f"{d}: unconditional")
        ax.set_xticks(range(1, num_slots + 1))
        ax.set_xlim(0.5, num_slots + 0.5)
        ax.set_title(f"{slot_method}: per-slot acceptance rate")
        ax.set_xlabel("draft slot k")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
        written.append(_save_figure(fig, out_dir / "slot_acceptance.png"))

    # Speedup bars per dataset and method, vs ar and vs hf.
    groups = list(summary)
    methods = [m for m in results["settings"]["methods"] if m != REFERENCE]
    baselines = [b for b in (REFERENCE, HF_BASELINE) if any(b in summary[g] for g in groups)]
    if methods and groups:
        fig, axes = plt.subplots(1, len(baselines), figsize=(6.5 * len(baselines), 4), squeeze=False)
        for ax, baseline in zip(axes[0], baselines, strict=True):
            width = 0.8 / len(methods)
            for i, m in enumerate(methods):
                values = [summary[g].get(m, {}).get(f"speedup_vs_{baseline}") or 0.0 for g in groups]
                ax.bar([g + (i - (len(methods) - 1) / 2) * width for g in range(len(groups))], values,
                       width=width, label=m)  # fmt: skip
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
            ax.set_xticks(range(len(groups)))
            ax.set_xticklabels(groups)
            ax.set_ylabel(f"decode speedup vs {baseline} (TPOT ratio)")
            ax.set_title(f"speedup over {baseline}")
            ax.legend(fontsize=8)
        written.append(_save_figure(fig, out_dir / "speedup.png"))
    return written


def render_server_report(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = ["# flashdraft bench (OpenAI-compatible server)", ""]
    if results.get("command"):
        lines.append(f"- command: `{results['command']}`")
    lines += [
        f"- server: {s['base_url']} model `{s['model']}`, endpoint {s['endpoint']} "
        f"({'streaming' if s['stream'] else 'not streaming'})",
        f"- max_new_tokens {s['max_new_tokens']}, temperature {s['temperature']:g}, concurrency "
        f"{', '.join(map(str, s['concurrency']))}",
        *[x.replace("- machine:", "- client machine:") for x in _machine_lines(results["client_machine"])],
        "- datasets: "
        + "; ".join(
            f"{d['name']} ({d['conversations']} conversations, {d['turns']} requests)"
            for d in results["datasets"]
        ),
        f"- run: {results['started']} → {results['finished']}",
        "",
        "Throughput = output tokens of successful requests / wall time of the level. Latency is per request "
        "(end to end); TTFT and TPOT need streaming. Acceptance: SGLang `meta_info` per request, vLLM "
        "`spec_decode` counters scraped from /metrics before and after each level.",
        "",
        "| dataset | concurrency | ok / requests | output tok/s | req/s | latency p50 / p90 / p99 s | "
        "TTFT p50 ms | TPOT mean ms | τ (server) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in results["levels"]:
        lat = lv["latency_s"] or {}
        tau = None
        if lv.get("vllm"):
            tau = lv["vllm"]["tau"]
        elif lv.get("sglang"):
            tau = lv["sglang"]["mean_spec_accept_length"] or lv["sglang"]["tau_from_verify_ct"]
        lines.append(
            f"| {lv['dataset']} | {lv['concurrency']} | {lv['ok']} / {lv['requests']} | "
            f"{_fmt(lv['output_tokens_per_s'], '.1f')}{'*' if lv['tokens_estimated'] else ''} | "
            f"{_fmt(lv['requests_per_s'], '.2f')} | {_fmt(lat.get('p50'))} / {_fmt(lat.get('p90'))} / "
            f"{_fmt(lat.get('p99'))} | {_fmt((lv['ttft_s'] or {}).get('p50'), '.0f', 1000)} | "
            f"{_fmt((lv['tpot_s'] or {}).get('mean'), '.1f', 1000)} | {_fmt(tau)} |"
        )
    lines.append("")
    if any(lv["tokens_estimated"] for lv in results["levels"]):
        lines += ["\\* output tokens counted from streamed chunks (the server sent no usage).", ""]
    vllm_levels = [lv for lv in results["levels"] if lv.get("vllm")]
    if vllm_levels:
        lines += ["## vLLM spec_decode counters", ""]
        for lv in vllm_levels:
            v = lv["vllm"]
            lines.append(
                f"- {lv['dataset']} @ {lv['concurrency']}: {v['num_drafts']:.0f} drafts, {v['num_draft_tokens']:.0f} "
                f"draft tokens, {v['num_accepted_tokens']:.0f} accepted; τ {v['tau']:.2f}, acceptance rate "
                f"{_fmt(v['draft_acceptance_rate'], '.1%')}; per position "
                + ", ".join(_fmt(r, ".0%") for r in v["per_position_rate"])
            )
        lines.append("")
    errors = [(lv, msg) for lv in results["levels"] for msg in lv["error_messages"]]
    if errors or results.get("warmup_error"):
        lines += ["## Errors", ""]
        if results.get("warmup_error"):
            lines.append(f"- warm-up request: {results['warmup_error']}")
        lines += [
            f"- {lv['dataset']} @ {lv['concurrency']} ({lv['errors']} failed): {msg}" for lv, msg in errors
        ]
        lines.append("")
    return "\n".join(lines)


def write_server_results(results: dict[str, Any], out_dir: Path, plots: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "results.json", results)
    (out_dir / "report.md").write_text(render_server_report(results), encoding="utf-8")
    written = [out_dir / "results.json", out_dir / "report.md"]
    plt = _pyplot() if plots else None
    if plt is not None and results["levels"]:
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        for name in dict.fromkeys(lv["dataset"] for lv in results["levels"]):
            pts = [
                (lv["concurrency"], lv["output_tokens_per_s"] or 0.0)
                for lv in results["levels"]
                if lv["dataset"] == name
            ]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{results['settings']['model']}: throughput")
        ax.legend(fontsize=8)
        written.append(_save_figure(fig, out_dir / "server_throughput.png"))
    return written


README_START = "<!-- flashdraft-bench:start -->"
README_END = "<!-- flashdraft-bench:end -->"


def render_readme_section(results: dict[str, Any], readme_dir: Path) -> str:
    """The block `--readme` writes between the markers: one table over datasets and methods, from results."""
    s = results["settings"]
    eq = results["equality"]
    out_dir = Path(results["out_dir"])
    try:
        rel = out_dir.resolve().relative_to(readme_dir.resolve()).as_posix()
    except ValueError:
        rel = out_dir.as_posix()
    lines = [
        README_START,
        "<!-- written by `flashdraft bench --readme`; do not edit by hand: rerun the command below -->",
        "",
        f"Command: `{results['command']}`" if results.get("command") else "",
        "",
        f"Target `{s['target']}`"
        + (f", drafter `{s['draft']}` (block size {s['block_size']})" if s.get("draft") else "")
        + (f", assistant `{s['assistant']}`" if s.get("assistant") else "")
        + f"; max_new_tokens {s['max_new_tokens']}, temperature {s['temperature']:g}; run {results['finished']}.",
        "",
        *_machine_lines(results["machine"]),
        *_cost_model_lines(s),
        "",
        "| dataset | method | prompts | tok/s | TPOT ms | TTFT ms | speedup vs ar | speedup vs hf | τ | equal to ar |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for group, by_method in results["summary"].items():
        for row in _method_table(by_method, eq["checked"])[2:]:
            cells = row.strip("|").split("|")
            # method table columns: method, prompts, new tokens, tok/s, decode tok/s, TPOT, TTFT, vs ar, vs hf, τ, equal
            keep = [cells[0], cells[1], cells[3], cells[5], cells[6], cells[7], cells[8], cells[9], cells[10]]
            lines.append(f"| {group} |" + "|".join(keep) + "|")
    verify_lines = []
    for group, by_method in results["summary"].items():
        hist = (by_method.get("dflash") or {}).get("verify_length_histogram")
        if hist and s.get("cost_model"):
            total = sum(hist.values())
            shares = ", ".join(
                f"{n}: {c / total * 100:.0f}%" for n, c in sorted(hist.items(), key=lambda x: int(x[0]))
            )
            verify_lines.append(f"- {group}: {shares}")
    if verify_lines:
        lines += [
            "",
            "Verify lengths chosen by dflash (share of steps verifying n proposals; 0 = a plain step):",
            "",
        ]
        lines += verify_lines
    lines += [
        "",
        (
            f"Output equality at T=0: {eq['compared'] - eq['mismatches']} of {eq['compared']} outputs identical to ar."
            if eq["checked"]
            else "Output equality not checked (temperature > 0)."
        ),
        "",
        f"Full report: [{rel}/report.md]({rel}/report.md) (τ histograms, per-slot acceptance, mismatches), raw "
        f"numbers: [{rel}/results.json]({rel}/results.json).",
        "",
    ]
    for png in ("speedup.png", "tau_histogram.png", "slot_acceptance.png"):
        if (out_dir / png).exists():
            lines.append(f"![{png[:-4]}]({rel}/{png})")
    lines += ["", README_END]
    return "\n".join(lines)


def check_readme(readme: Path) -> None:
    try:
        text = readme.read_text(encoding="utf-8")
    except OSError as e:
        raise BenchError(f"cannot read {readme}: {e}") from None
    if README_START not in text or README_END not in text:
        raise BenchError(f"{readme} has no {README_START} ... {README_END} block to write the table into")


def update_readme(readme: Path, results: dict[str, Any]) -> None:
    """Replace the marked block of `readme` with the tables of `results`."""
    check_readme(readme)
    text = readme.read_text(encoding="utf-8")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(head + render_readme_section(results, readme.parent) + tail, encoding="utf-8")


# =============================================================================================== console summary


def print_summary(results: dict[str, Any]) -> None:
    out = Console()
    if results.get("kind") == "flashdraft-bench-server":
        table = Table(title=f"server {results['settings']['model']}")
        for col in ("dataset", "conc.", "ok", "tok/s", "p50 s", "p99 s", "TTFT p50 ms", "τ"):
            table.add_column(col)
        for lv in results["levels"]:
            tau = (lv.get("vllm") or {}).get("tau") or (lv.get("sglang") or {}).get("mean_spec_accept_length")
            table.add_row(
                lv["dataset"], str(lv["concurrency"]), f"{lv['ok']}/{lv['requests']}",
                _fmt(lv["output_tokens_per_s"], ".1f"), _fmt((lv["latency_s"] or {}).get("p50")),
                _fmt((lv["latency_s"] or {}).get("p99")), _fmt((lv["ttft_s"] or {}).get("p50"), ".0f", 1000),
                _fmt(tau),
            )  # fmt: skip
        out.print(table)
        errors = sum(lv["errors"] for lv in results["levels"])
        if errors:
            out.print(f"[yellow]{errors} request(s) failed; see report.md[/]")
    else:
        checked = results["equality"]["checked"]
        for group, by_method in results["summary"].items():
            table = Table(title=group)
            for col in ("method", "tok/s", "TPOT ms", "TTFT ms", "vs ar", "vs hf", "τ", "= ar"):
                table.add_column(col)
            for method, s in by_method.items():
                if method == REFERENCE:
                    equal = "ref"
                elif not checked:
                    equal = "—"
                else:
                    equal = f"{s['compared'] - s['mismatches']}/{s['compared']}"
                table.add_row(
                    method, _fmt(s["tokens_per_s"], ".1f"), _fmt(s["tpot_s"], ".1f", 1000),
                    _fmt(s["ttft_s"], ".1f", 1000), _fmt(s["speedup_vs_ar"], suffix="×"),
                    _fmt(s["speedup_vs_hf"], suffix="×"), _fmt(s["tau"]),
                    equal if not (checked and s["mismatches"]) else f"[bold red]{equal}[/]",
                )  # fmt: skip
            out.print(table)
        eq = results["equality"]
        if eq["checked"] and eq["mismatches"]:
            out.print(f"[bold red]{eq['mismatches']} output(s) differ from ar[/]; see report.md")
        elif eq["checked"]:
            out.print(f"all {eq['compared']} outputs identical to ar")
    out.print(f"results in {results['out_dir']}")


# =============================================================================================== CLI


def _redacted_command(argv: Sequence[str]) -> str:
    """The command line as typed, for the report, without the API key."""
    args = list(argv)
    for i, arg in enumerate(args):
        if arg == "--api-key" and i + 1 < len(args):
            args[i + 1] = "***"
        elif arg.startswith("--api-key="):
            args[i] = "--api-key=***"
    return shlex.join(["flashdraft", *args])


def _is_untrained(draft: str) -> bool:
    from .model import read_model_card_meta

    return read_model_card_meta(draft).get("trained") is False


def bench_command(
    dataset: Annotated[
        str,
        typer.Option(
            "--dataset",
            "-d",
            help="gsm8k, humaneval, mt-bench, math500, mbpp, a jsonl file; comma-separated for several",
        ),
    ] = "gsm8k",
    target: Annotated[
        str | None, typer.Option(help="target: pack name, local path or hub id (local backend)")
    ] = None,
    draft: Annotated[str | None, typer.Option(help="DFlash drafter directory (method dflash)")] = None,
    methods: Annotated[
        str, typer.Option(help="comma-separated: ar, hf, dflash, sd, pld (ar is always run)")
    ] = "ar,hf,dflash",
    assistant: Annotated[
        str | None, typer.Option(help="small draft model for sd, same tokenizer as the target")
    ] = None,
    max_samples: Annotated[
        int | None, typer.Option(help="prompts per dataset (seeded random subset)")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(help="z-lab uses 2048")] = 256,
    temperature: Annotated[float, typer.Option(help="0 = greedy, outputs compared with ar")] = 0.0,
    block_size: Annotated[
        int | None,
        typer.Option(
            help="fixed verify length for method dflash (<= the drafter's block); default: cost-aware (auto). "
            "Method dflash-fixed always verifies the drafter's full trained block."
        ),
    ] = None,
    pld_tokens: Annotated[int, typer.Option(help="prompt_lookup_num_tokens for pld")] = 10,
    seed: Annotated[int, typer.Option(help="sample selection and sampling seed")] = 0,
    out: Annotated[
        Path | None, typer.Option("--out", help="output directory (default bench-results/<name>-<time>)")
    ] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda")] = None,
    dtype: Annotated[str | None, typer.Option(help="float32 | bfloat16 | float16")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    thinking: Annotated[
        bool | None,
        typer.Option("--thinking/--no-thinking", help="template thinking mode (default: template's)"),
    ] = None,
    chat: Annotated[bool, typer.Option(help="apply the chat template")] = True,
    save_outputs: Annotated[
        bool, typer.Option(help="store every output text and token ids in results.json")
    ] = False,
    plots: Annotated[bool, typer.Option(help="write PNG plots")] = True,
    readme: Annotated[
        Path | None, typer.Option(help="also write the summary table into this README's marked block")
    ] = None,
    backend: Annotated[str, typer.Option(help="local | openai")] = "local",
    base_url: Annotated[
        str | None, typer.Option(help="openai backend: server URL, e.g. http://127.0.0.1:8000")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="openai backend: model name (default: first of /v1/models)")
    ] = None,
    concurrency: Annotated[str, typer.Option(help="openai backend: levels, e.g. 1,4,8")] = "1",
    api: Annotated[str, typer.Option(help="openai backend: chat | completion")] = "chat",
    stream: Annotated[bool, typer.Option(help="openai backend: stream (needed for TTFT)")] = True,
    timeout: Annotated[float, typer.Option(help="openai backend: per-request timeout, seconds")] = 600.0,
    api_key: Annotated[
        str | None, typer.Option(help="openai backend: API key sent as a Bearer token")
    ] = None,
) -> None:
    """Measure acceptance length τ and speedup of ar / hf / dflash / sd / pld side by side, or benchmark a server."""
    from .errors import print_error, user_errors

    command = _redacted_command(sys.argv[1:])
    try:
        datasets = split_datasets(dataset)
        if backend == "local":
            if readme is not None:
                check_readme(readme)
                if draft and _is_untrained(draft):
                    raise BenchError(
                        f"{draft} is an untrained drafter (init-draft): its numbers are for development runs only "
                        "and are not written into a README"
                    )
            if not target:
                raise BenchError(
                    "--target is required for the local backend (or use --backend openai --base-url URL)"
                )
            cfg = BenchConfig(
                target=target, datasets=datasets, methods=parse_methods(methods), draft=draft, assistant=assistant,
                max_samples=max_samples, max_new_tokens=max_new_tokens, temperature=temperature,
                block_size=block_size, pld_tokens=pld_tokens, seed=seed, out_dir=out, device=device, dtype=dtype,
                threads=threads, thinking=thinking, chat=chat, save_outputs=save_outputs, plots=plots,
                command=command,
            )  # fmt: skip
            results = run_bench(cfg)
            if readme is not None:
                update_readme(readme, results)
        elif backend == "openai":
            scfg = ServerBenchConfig(
                base_url=base_url or "", datasets=datasets, model=model, concurrency=parse_concurrency(concurrency),
                api=api, stream=stream, max_samples=max_samples, max_new_tokens=max_new_tokens,
                temperature=temperature, seed=seed, timeout_s=timeout, thinking=thinking, api_key=api_key, out_dir=out,
                save_outputs=save_outputs, plots=plots, command=command,
            )  # fmt: skip
            results = run_server_bench(scfg)
        else:
            raise BenchError(f"--backend must be local or openai, got {backend!r}")
    except user_errors() as e:
        print_error(e)
        raise typer.Exit(2) from None
    print_summary(results)
