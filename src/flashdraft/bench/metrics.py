"""What a benchmark measures: τ, acceptance histograms, per-slot acceptance, TPOT, speedups, percentiles."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .config import HF_BASELINE, REFERENCE


@dataclass
class RunOutput:
    """What one method returned for one prompt (the local, MLX and llama.cpp runs alike)."""

    new_ids: list[int]
    ttft_s: float
    decode_s: float
    first_chunk: int  # tokens emitted with the first chunk (1 for plain decoding)
    step_tokens: list[int]
    draft_lengths: list[int] = field(default_factory=list)
    accepted_drafts: list[int] = field(default_factory=list)
    stop_reason: str = ""
    grammar_s: float = 0.0
    step_s: list[float] = field(default_factory=list)  # each decode step's wall time

    @classmethod
    def of(cls, result: Any, drafting: bool, token_times: list[float]) -> RunOutput:
        """An engine's GenerationResult (either backend's); `token_times`: when each step's tokens reached the host
        (the times between are the decode steps'). Plain decoding proposes nothing: its all-zero draft logs carry
        no information, so they are left out."""
        return cls(
            new_ids=result.new_tokens,
            ttft_s=result.prefill_s,
            decode_s=result.decode_s,
            first_chunk=1,
            step_tokens=list(result.acceptance_lengths),
            draft_lengths=list(result.draft_lengths) if drafting else [],
            accepted_drafts=list(result.accepted_drafts) if drafting else [],
            stop_reason=result.stop_reason,
            grammar_s=result.grammar_s,
            step_s=[b - a for a, b in zip(token_times, token_times[1:], strict=False)],
        )


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


def mean_or_none(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


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
    grammar_s: float = 0.0  # structured output: the grammar's part of decode_s
    matches_reference: bool | None = None  # None: not compared (sampling, or the reference itself)
    first_mismatch: int | None = None
    # each decode step's wall time (engine methods); results.json keeps the slowest and the median (and all of
    # them with --save-outputs)
    step_s: list[float] = field(default_factory=list, repr=False)
    output_ids: list[int] = field(default_factory=list, repr=False)
    output_text: str | None = field(default=None, repr=False)

    @property
    def total_s(self) -> float:
        return self.ttft_s + self.decode_s

    @property
    def tpot_s(self) -> float | None:
        return time_per_output_token(self.decode_s, self.decode_tokens)

    def step_summary(self) -> dict[str, Any]:
        """The slowest decode step (its index and seconds) and the median step; empty when steps were not timed."""
        if not self.step_s:
            return {}
        slowest = max(range(len(self.step_s)), key=self.step_s.__getitem__)
        return {"slowest_step": slowest, "slowest_step_s": self.step_s[slowest],
                "median_step_s": _median(self.step_s)}  # fmt: skip

    def to_dict(self, with_outputs: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d.pop("output_ids")
        d.pop("output_text")
        d.pop("step_s")
        d["total_s"] = self.total_s
        d["tpot_s"] = self.tpot_s
        d.update(self.step_summary())
        if with_outputs:  # --save-outputs: each step's time too (what a step of each draft length costs)
            d["output_ids"] = self.output_ids
            d["output_text"] = self.output_text
            d["step_s"] = [round(t, 6) for t in self.step_s]
        return d


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


# A decode step this many times the turn's median and at least this long: a compile (or a CUDA graph recorded) inside
# the answer, which its tok/s includes (on an H100, 20-55 s inside one turn of a compiled bench: 2026-11-26).
STALL_RATIO, STALL_MIN_S = 20.0, 0.25


def stalls(records: Sequence[SampleRecord]) -> list[dict[str, Any]]:
    """The turns with a stalled decode step (`STALL_RATIO`), slowest first: where a compile happened mid-answer."""
    found = []
    for r in records:
        steps = r.step_summary()
        if steps and steps["slowest_step_s"] >= max(STALL_MIN_S, STALL_RATIO * steps["median_step_s"]):
            found.append({"dataset": r.dataset, "conversation_id": r.conversation_id, "turn": r.turn,
                          "method": r.method, **steps, "decode_s": r.decode_s})  # fmt: skip
    return sorted(found, key=lambda x: -x["slowest_step_s"])


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
        "tpot_s": mean_or_none(tpots),  # mean over prompts of decode_s / decode_tokens
        "ttft_s": mean_or_none(ttfts),
        "ttft_p50_s": percentile(ttfts, 50),
        "tau": mean_acceptance_length(steps),
        "tau_per_sample_mean": mean_or_none(
            [sum(r.step_tokens) / len(r.step_tokens) for r in records if r.step_tokens]
        ),
        "steps": len(steps),
        "compared": len(compared),
        "mismatches": sum(1 for r in compared if not r.matches_reference),
    }
    if any(r.grammar_s for r in records):  # structured output: the grammar's share of the decode phase
        summary["grammar_share"] = sum(r.grammar_s for r in records) / decode_s if decode_s > 0 else None
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
