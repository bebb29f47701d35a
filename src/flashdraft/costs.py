"""What the hardware charges: measured seconds for a target verify of n tokens and for a draft pass.

Verifying n tokens does not cost n one-token steps (the weights are read once), nor a constant (small-row GEMMs,
attention over the context). `measure_costs` times the real target and drafter on this machine at two context
lengths; `CostModel` interpolates in n and is linear in the context. Measurements are cached per machine, thread
count, model and dtype under `$FLASHDRAFT_HOME/costs/` (or `$FLASHDRAFT_COST_CACHE`), so a process pays for them once.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .files import atomic_write_text

VERIFY_LENGTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
# Batched decoding verifies b rows x n tokens in one forward: its cost is read at b * n tokens (the weights are read
# once either way, and attention over the context sums over rows), so longer forwards are measured too.
BATCH_TOKENS = (32, 64, 128)
DRAFT_BATCH_ROWS = 4
CONTEXTS = (64, 512)
COST_MODEL_VERSION = 2


@dataclass
class CostModel:
    """t_verify(n, c) = base[n] + slope[n] * c, t_draft(c) = draft_base + draft_slope * c (seconds); a batched
    draft pass of b rows costs t_draft(c) + (b - 1) * draft_row_s."""

    lengths: list[int]  # measured verify lengths, ascending, starting at 1
    verify_base: list[float]
    verify_slope: list[float]
    draft_base: float = 0.0
    draft_slope: float = 0.0
    draft_row_s: float = 0.0
    draft_dtype: str = "float32"  # the precision the drafter and its head run in (the faster one measured)
    head_s: dict[str, float] = field(default_factory=dict)  # draft-head time per dtype, for the record
    measured_s: float = 0.0
    key: dict[str, Any] = field(default_factory=dict)

    def verify_s(self, n: int | torch.Tensor, context: int) -> torch.Tensor:
        """Seconds for a target forward over n tokens after `context` cached ones (n may be a tensor)."""
        n = torch.as_tensor(n, dtype=torch.float32)
        xs = torch.tensor(self.lengths, dtype=torch.float32)
        ys = torch.tensor(self.verify_base) + torch.tensor(self.verify_slope) * context
        # Timing noise (a busy machine) must never price a verify at or below zero.
        return _interp(n, xs, ys.clamp(min=1e-6))

    def step_s(self, max_proposals: int, context: int, propose_s: float) -> torch.Tensor:
        """[max_proposals + 1]: seconds of a step that verifies 0..max_proposals proposals after paying propose_s."""
        return propose_s + self.verify_s(torch.arange(1, max_proposals + 2), context)

    def draft_s(self, context: int) -> float:
        return self.draft_base + self.draft_slope * context

    def draft_batch_s(self, rows: int, context: int) -> float:
        """One draft pass over `rows` rows (batched decoding), each after about `context` tokens."""
        return self.draft_s(context) + max(0, rows - 1) * self.draft_row_s

    def summary(self, context: int = 256) -> str:
        plain = float(self.verify_s(1, context))
        ratios = ", ".join(f"{n}: {float(self.verify_s(n, context)) / plain:.2f}" for n in self.lengths[1:])
        return (
            f"cost model @ {context} tokens of context: plain step {plain * 1e3:.1f} ms, draft pass "
            f"{self.draft_s(context) * 1e3:.1f} ms ({self.draft_dtype}), verify t(n)/t(1) = {ratios}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def _interp(x: torch.Tensor, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear interpolation; past the last measured length, linear extrapolation that never falls
    below the last measurement (a noisy last segment must not make longer verifies look cheaper)."""
    x = x.clamp(min=float(xs[0]))
    i = torch.searchsorted(xs, x.contiguous(), right=True).clamp(1, len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return torch.where(x > xs[-1], torch.maximum(y, ys[-1]), y)


def cost_cache_dir() -> Path:
    env = os.environ.get("FLASHDRAFT_COST_CACHE")
    if env:
        return Path(env).expanduser()
    from .packs import flashdraft_home

    return flashdraft_home() / "costs"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cost_key(target: Any, draft: Any) -> dict[str, Any]:
    """What the timings depend on: machine, threads, library versions, model shapes and dtypes."""
    device = target.device
    return {
        "version": COST_MODEL_VERSION,
        "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": device.type,
        "target": str(target.name),
        "target_shape": [target.num_layers, target.hidden_size, target.vocab_size],
        "target_dtype": str(target.dtype),
        "draft_shape": [
            draft.config.num_hidden_layers,
            draft.config.intermediate_size,
            draft.config.block_size,
        ],
    }


_MEMORY: dict[str, CostModel] = {}


def load_or_measure_costs(target: Any, draft: Any, cache: bool = True, log: Any = None) -> CostModel:
    """The cost model of this target + drafter on this machine: from memory, from the disk cache, or measured."""
    key = cost_key(target, draft)
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    if digest in _MEMORY:
        return _MEMORY[digest]
    path = cost_cache_dir() / f"{digest}.json"
    if cache and path.exists():
        try:
            model = CostModel.from_dict(json.loads(path.read_text()))
            _MEMORY[digest] = model
            return model
        except (OSError, ValueError, TypeError):
            pass  # a damaged cache entry is measured again
    if log:
        log("measuring verify and draft costs on this machine (once per model, dtype and thread count)…")
    model = measure_costs(target, draft)
    model.key = key
    _MEMORY[digest] = model
    if cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(model.to_dict(), indent=2) + "\n")
        except OSError:
            pass  # a read-only home only costs a re-measure next time
    return model


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of `fn()` over `repeats` calls after one warm-up (CUDA synchronised)."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def measure_costs(
    target: Any,
    draft: Any,
    lengths: tuple[int, ...] = VERIFY_LENGTHS,
    contexts: tuple[int, ...] = CONTEXTS,
    repeats: int = 3,
    batch_tokens: tuple[int, ...] = BATCH_TOKENS,
) -> CostModel:
    """Time the target's verify (with the drafter's layer taps, as in decoding) and the draft pass."""
    from .proposers import DFlashProposer

    target.check_decodable()
    t_start = time.perf_counter()
    block = draft.config.block_size
    lengths = (tuple(n for n in lengths if n <= block) or (1,)) + tuple(n for n in batch_tokens if n > block)
    contexts = tuple(min(c, max(8, target.max_context - block - 1)) for c in contexts)
    taps = tuple(draft.config.target_layer_ids)
    device = target.device
    gen = torch.Generator().manual_seed(0)
    high = min(target.vocab_size, 5000)
    low = min(10, high - 1)
    ids = torch.randint(low, high, (1, max(contexts) + block + 1), generator=gen).to(device)

    # Which precision runs the draft head (B-1 rows x vocab) faster here: bf16 wins on CPUs with avx512_bf16/AMX
    # and on GPUs, loses badly on CPUs without them. The drafter only proposes, so its precision cannot change
    # the output.
    weight = target.lm_head.weight
    rows = torch.randn(block - 1, target.hidden_size, generator=gen).to(device)
    head_s = {}
    for dtype in {weight.dtype, torch.bfloat16}:
        w = weight.to(dtype)
        x = rows.to(dtype)
        head_s[str(dtype).removeprefix("torch.")] = median_seconds(
            lambda w=w, x=x: torch.nn.functional.linear(x, w), 5
        )
    draft_dtype = min(head_s, key=head_s.get)

    per_context: list[list[float]] = []
    draft_times: list[float] = []
    proposer = DFlashProposer(draft, target, dtype=getattr(torch, draft_dtype))
    for c in contexts:
        cache = target.new_cache()
        prefill = target.forward(ids[:, :c], cache, taps)
        times = []
        for n in lengths:

            def verify(n=n, c=c, cache=cache):
                target.forward(ids[:, c : c + n], cache, taps)
                target.keep(
                    cache, [0]
                )  # recurrent state back to the context: the price of the rollback included
                target.crop(cache, c)

            times.append(median_seconds(verify, repeats))
        per_context.append(times)
        proposer.start(prefill.features)
        draft_times.append(
            median_seconds(lambda c=c: proposer.draft_confidences(int(ids[0, c]), c, block - 1), repeats)
        )
    c0, c1 = contexts[0], contexts[-1]
    span = max(c1 - c0, 1)
    one_row, many_rows = (
        _measure_draft_rows(target, draft, ids[:, :c0], draft_dtype, rows, repeats)
        for rows in (1, DRAFT_BATCH_ROWS)
    )
    slope = [max(0.0, (b - a) / span) for a, b in zip(per_context[0], per_context[-1], strict=True)]
    base = [a - s * c0 for a, s in zip(per_context[0], slope, strict=True)]
    d_slope = max(0.0, (draft_times[-1] - draft_times[0]) / span)
    return CostModel(
        lengths=list(lengths),
        verify_base=base,
        verify_slope=slope,
        draft_base=draft_times[0] - d_slope * c0,
        draft_slope=d_slope,
        draft_row_s=max(0.0, (many_rows - one_row) / (DRAFT_BATCH_ROWS - 1)),
        draft_dtype=draft_dtype,
        head_s=head_s,
        measured_s=time.perf_counter() - t_start,
    )


def _measure_draft_rows(
    target: Any, draft: Any, prompt: torch.Tensor, dtype: str, rows: int, repeats: int
) -> float:
    """Seconds of one batched draft pass over `rows` rows with `prompt` as each row's context."""
    from .batch import BatchedDFlashProposer, BatchRow
    from .sampling import SamplingParams

    proposer = BatchedDFlashProposer(
        draft, target, block_size=draft.config.block_size, dtype=getattr(torch, dtype)
    )
    batch = []
    features = target.forward(prompt, None, tuple(draft.config.target_layer_ids)).features
    for _ in range(rows):
        row = BatchRow(prompt, 2, SamplingParams(), set(), 0, tokens=[int(prompt[0, -1])])
        row.prompt = prompt[:, :-1]  # the last prompt token plays the anchor
        proposer.add(row, features[:, :-1])
        batch.append(row)
    pending = list(proposer.pending)

    def draft_all():
        proposer.cache = type(proposer.cache)(ragged=True)
        proposer.absorbed = [0] * rows
        proposer.pending = list(pending)
        proposer.draft_rows(batch)

    return median_seconds(draft_all, repeats)
