"""Reading a server's Prometheus text: vLLM's spec-decode counters (flashdraft serve exports the same names)."""

from __future__ import annotations

import re
from typing import Any

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


def grammar_share(before: dict[str, Any] | None, after: dict[str, Any] | None) -> float | None:
    """The grammar's share of a flashdraft server's decode time over one run (`flashdraft:grammar_seconds` over
    `flashdraft:decode_seconds`, scraped before and after it); None for servers without them or no decoding."""
    if not after:
        return None
    before = before or {}
    decode = _counter_sum(after, "flashdraft:decode_seconds") - _counter_sum(
        before, "flashdraft:decode_seconds"
    )
    if decode <= 0:
        return None
    grammar = _counter_sum(after, "flashdraft:grammar_seconds") - _counter_sum(
        before, "flashdraft:grammar_seconds"
    )
    return grammar / decode


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
