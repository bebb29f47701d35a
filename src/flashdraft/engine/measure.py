"""Measuring the price list (costs.py): the real target and drafter timed on this machine, cached.

`measure_costs` times the target's verify over n = 1..B tokens (and longer forwards, for batches) at two context
lengths, the draft pass for one row and for several, and the draft head in fp32 and bf16. Measurements are cached per
machine, thread count, model and dtype under `$FLASHDRAFT_HOME/costs/` (or `$FLASHDRAFT_COST_CACHE`), so a process
pays for them once. The drafter is timed through the same engine and proposers that decode with it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ..drafter.vocab import drafter_vocabulary, vocabulary_key
from ..files import atomic_write_text
from ..kernels import attention as short_query
from ..kernels.cpu_info import cpu_name  # noqa: F401 - what a price list is cached under (benchmarks read it here)
from ..kernels.packed_linear import is_packed
from ..kernels.plan import is_kernel_linear
from .costs import CostModel

VERIFY_LENGTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
# Batched decoding verifies b rows x n tokens in one forward: its cost is read at b * n tokens (the weights are read
# once either way, and attention over the context sums over rows), so longer forwards are measured too.
BATCH_TOKENS = (32, 64, 128)
DRAFT_BATCH_ROWS = 4
CONTEXTS = (64, 512)
# Seconds a price list's measurement may take before it stops at the contexts it has (`measure_costs`): on a quiet
# 2-core CPU SmolLM2-135M's took 32 s; on a busy one (a build beside it) over 4 minutes, before a server answered.
# `$FLASHDRAFT_PRICE_BUDGET_S` sets another.
PRICE_BUDGET_S = 60.0
COST_MODEL_VERSION = 8  # 3: the machine named with its vector extensions (cpu_name); 4: beside a static
# cache the draft pass is timed through the engine's own proposer (its compiled block pass, if compiled); 5: the
# draft head's price per slot (draft_slot_s); 6: on a CPU in fp32 the static verify reads only the columns in use
# (attention.narrow_mask), and int8 layers of one input are one GEMM (kernels/inductor_passes.py);
# 7: the interleaved rounds alternate their order (interleaved_medians), so no length is timed after a far longer one;
# 8: no length priced above a longer one (no_dearer_than_longer)


def cost_cache_dir() -> Path:
    env = os.environ.get("FLASHDRAFT_COST_CACHE")
    if env:
        return Path(env).expanduser()
    from ..models.packs import flashdraft_home

    return flashdraft_home() / "costs"


def cost_key(target: Any, draft: Any) -> dict[str, Any]:
    """What the timings depend on: machine, threads, library versions, model shapes and dtypes."""
    from ..targets.capabilities import uses_static_cache
    from .compiled import kernels_tag

    device = target.device
    verify = {}
    if uses_static_cache(target):  # priced as the engine runs it: static cache, compiled or not
        verify = {"verify": {"static_cache": True, "compile": target.plan.compile_key}}
        if target.plan.compiled:  # priced with the kernels this version of compiled.py chooses
            verify["verify"]["kernels"] = kernels_tag()
    quantize = getattr(target, "quantize", None)  # int8 weights cost another price list than the bf16 ones
    # attention.py's short-query attention (on a CPU) prices verifies unlike transformers' SDPA function does
    attention = getattr(getattr(target, "config", None), "_attn_implementation", None)
    model = getattr(target, "model", None)
    packed = isinstance(model, torch.nn.Module) and is_packed(model)  # oneDNN's linears price unlike MKL's
    vocab = drafter_vocabulary(draft, target, target.vocab_size)  # the draft head's rows price its pass
    return {
        **({"draft_vocab": vocabulary_key((vocab, target.vocab_size))} if vocab is not None else {}),
        **({"linear": "onednn-packed"} if packed else {}),
        **verify,
        **({"quantize": quantize} if quantize else {}),
        **({"attention": attention} if attention == short_query.NAME else {}),
        "version": COST_MODEL_VERSION,
        "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
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
    model = measure_costs(target, draft, log=log)
    model.key = key
    _MEMORY[digest] = model
    if cache and model.complete:  # one cut short by its budget (a busy machine) is measured again next time
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(model.to_dict(), indent=2) + "\n")
        except OSError:
            pass  # a read-only home only costs a re-measure next time
    return model


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of `fn()` over `repeats` calls after one warm-up (CUDA synchronised)."""
    return interleaved_medians([fn], repeats)[0]


def interleaved_medians(fns: list[Any], repeats: int) -> list[float]:
    """Median wall time of each of `fns` after one warm-up call each, over `repeats` rounds that call every one once
    in turn (CUDA synchronised): a slow stretch of the machine weighs on all of them alike, not on whichever was
    timed first. Timed one after another, a bf16 price list (2-core EPYC VM) had a plain step at 14.3 ms where
    decoding took 11.2, and a 4-token verify at 0.88 of it (benchmarks/README.md, 2026-11-29 evening).
    The rounds go up and down the list in turn (the warm-ups down, so the first round starts where they end), so each
    call follows itself or a neighbour: a verify of one token timed right after one of 128 (the last length) cost 38
    ms where plain decoding's took 26 (int8, 2-core AMX Xeon), and priced every verify of 2-8 tokens below it."""
    times: list[list[float]] = [[] for _ in fns]
    order = list(zip(fns, times, strict=True))
    for fn, _ in reversed(order):  # warm-up (a compiled length compiles here)
        fn()
    for round_ in range(repeats):
        for fn, spent in order if round_ % 2 == 0 else reversed(order):
            t0 = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            spent.append(time.perf_counter() - t0)
    return [statistics.median(spent) for spent in times]


def no_dearer_than_longer(seconds: list[float]) -> list[float]:
    """Verify times over increasing lengths, each capped by every longer one's: a verify of n tokens does no more
    work than one of n + 1 (the engine could pad it there), so a shorter length timed dearer was timed in a slow
    stretch of the machine. A compiled w8a16 price list (2-core Zen 4 EPYC) had one token at 512 of context at 17.1
    ms and two at 12.8, and priced plain decoding's step at 13.7 ms after 256 tokens where decoding took 11.0
    (benchmarks/README.md, 2026-12-06)."""
    capped = list(seconds)
    for i in range(len(capped) - 2, -1, -1):
        capped[i] = min(capped[i], capped[i + 1])
    return capped


@torch.no_grad()
def measure_costs(
    target: Any,
    draft: Any,
    lengths: tuple[int, ...] = VERIFY_LENGTHS,
    contexts: tuple[int, ...] = CONTEXTS,
    repeats: int = 3,
    batch_tokens: tuple[int, ...] = BATCH_TOKENS,
    budget_s: float | None = None,
    log: Any = None,
) -> CostModel:
    """Time the target's verify (with the drafter's layer taps, as in decoding) and the draft pass, saying how far it
    is (`log`). Bounded in time whatever the machine's load: past half of `budget_s` (PRICE_BUDGET_S, or
    `$FLASHDRAFT_PRICE_BUDGET_S`) each price is timed once, not `repeats` times; past all of it, the contexts left are
    not measured and the price list does not grow with the context (`complete` False: it is not cached). A compiled
    target's graphs compile (or load) first, each said, outside the budget."""
    from ..targets.capabilities import uses_static_cache
    from .kv_cache import VERIFY_BUCKETS
    from .proposers import DFlashProposer

    target.check_decodable()
    t_start = time.perf_counter()
    compiling_s = 0.0  # a compiled target's first call of each length: compiling, not in the budget
    budget = (
        float(os.environ.get("FLASHDRAFT_PRICE_BUDGET_S", PRICE_BUDGET_S)) if budget_s is None else budget_s
    )

    def say(what: str, timing: bool = True) -> None:
        if log:
            spent = time.perf_counter() - t_start
            log(
                f"  prices: {what} ({spent - compiling_s:.0f} s of at most ~{budget:.0f} timing)"
                if timing
                else f"  prices: {what} ({spent:.0f} s)"
            )

    block = draft.config.block_size
    static = uses_static_cache(target)
    if static:  # the engine pads verifies to buckets there: those lengths are all that run (one graph each)
        lengths = tuple(sorted({n for n in VERIFY_BUCKETS if n <= block} | {block}))
    lengths = (tuple(n for n in lengths if n <= block) or (1,)) + tuple(n for n in batch_tokens if n > block)
    longest = max(block, *lengths)
    contexts = tuple(min(c, max(8, target.max_context - longest - 1)) for c in contexts)
    taps = tuple(draft.config.target_layer_ids)
    device = target.device
    gen = torch.Generator().manual_seed(0)
    high = min(target.vocab_size, 5000)
    low = min(10, high - 1)
    ids = torch.randint(low, high, (1, max(contexts) + longest + 1), generator=gen).to(device)

    # Which precision runs the draft head (B-1 rows x vocab) faster here: bf16 wins on CPUs with avx512_bf16/AMX
    # and on GPUs, loses badly on CPUs without them. The drafter only proposes, so its precision cannot change
    # the output.
    weight = target.lm_head.weight
    rows = torch.randn(block - 1, target.hidden_size, generator=gen).to(device)
    head_s = {}
    for dtype in {weight.dtype, torch.bfloat16}:
        x = rows.to(dtype)
        packed = dtype == weight.dtype and is_kernel_linear(target.lm_head)
        if packed:  # the proposer runs it as it is
            head = target.lm_head
        else:
            head = functools.partial(torch.nn.functional.linear, weight=weight.to(dtype))
        head_s[str(dtype).removeprefix("torch.")] = median_seconds(lambda h=head, x=x: h(x), 5)
    draft_dtype = min(head_s, key=head_s.get)
    if static and target.plan.compiled and device.type == "cpu":
        # Compiled on a CPU the drafter's head runs through inductor's GEMM template in the target's precision (8 ms
        # for SmolLM2's fp32 head on an avx2 EPYC); the eager products timed above do not price it, and a bf16 head
        # without bf16 instructions takes ATen's kernel: auto steps of 100-130 ms against 37 at a fixed block.
        draft_dtype = str(weight.dtype).removeprefix("torch.")

    per_context: list[list[float]] = []
    draft_times: list[float] = []
    slot_s: float | None = None
    proposer = None if static else DFlashProposer(draft, target, dtype=getattr(torch, draft_dtype))
    for i, c in enumerate(contexts):
        compiling = i == 0 and target.plan.compiled  # the first context's first calls compile the graphs
        spent = time.perf_counter() - t_start - compiling_s
        if i and spent > budget:
            say(f"budget spent: {len(contexts) - i} of {len(contexts)} contexts left unmeasured")
            break
        if spent > budget / 2:
            repeats = 1  # the rest timed once each
        if static:
            # The engine's own forwards over its static caches (compiled, if it is): the verify, and the draft pass
            # over its static context (the eager proposer's would overprice it beside a graphed verify: 2.4 ms
            # against ~2.9 for a verify of 16 on an H100). The draft's warm-up absorbs the prompt's features; the
            # timed passes draft from that context.
            t_built = time.perf_counter()
            engine = static_decoder(target, draft, ids[:, :c], dtype=draft_dtype)
            if compiling:  # its rows' joining compiles the one- and two-token graphs
                compiling_s += time.perf_counter() - t_built

            def verify(n, c=c, decoder=engine):
                decoder.forward_block(ids[:, c : c + n], torch.arange(c, c + n, device=device)[None])
                target.crop(decoder.cache, c)

            def draft_pass(decoder=engine):
                decoder.proposer.draft_rows(decoder.rows)

        else:
            cache = target.new_cache()
            prefill = target.forward(ids[:, :c], cache, taps, prefill=True)
            proposer.start(prefill.features)

            def verify(n, c=c, cache=cache):
                target.forward(ids[:, c : c + n], cache, taps)
                target.keep(cache, [0])  # recurrent state back to the context: the rollback's price included
                target.crop(cache, c)

            def draft_pass(c=c):
                proposer.draft_confidences(int(ids[0, c]), c, block - 1)

        if compiling:
            # each length's graph (and the draft pass's) compiles at its first call, or loads from inductor's
            # caches: said as it goes, and kept out of the budget, so a first start's compiling never leaves the
            # price list incomplete (uncached, measured and compiled again at every start)
            t_compile = time.perf_counter()
            for k, n in enumerate(lengths):
                say(f"compiling the verify of {n} tokens ({k + 1} of {len(lengths)})", timing=False)
                verify(n)
            say("compiling the draft pass", timing=False)
            draft_pass()
            compiling_s += time.perf_counter() - t_compile
        per_context.append(
            no_dearer_than_longer(interleaved_medians([lambda n=n: verify(n) for n in lengths], repeats))
        )
        draft_times.append(median_seconds(draft_pass, repeats))
        if slot_s is None:  # the head the engine drafts with, over one slot and over all of them
            head = engine.proposer.chain_head if static else proposer.head_logits
            hidden = torch.randn(block - 1, target.hidden_size, generator=gen).to(
                device, getattr(torch, draft_dtype)
            )
            head(hidden)  # a compiled head compiles here, not in the timing
            full, one = (
                median_seconds(lambda k=k, h=head, x=hidden: h(x[:k]), repeats) for k in (block - 1, 1)
            )
            slot_s = max(0.0, (full - one) / max(1, block - 2))
        say(f"verify of {lengths[0]}-{lengths[-1]} tokens and a draft pass after {c} tokens of context")
    measured = contexts[: len(per_context)]
    c0, c1 = measured[0], measured[-1]
    span = max(c1 - c0, 1)
    one_row, many_rows = (
        _measure_draft_rows(target, draft, ids[:, :c0], draft_dtype, rows, repeats)
        for rows in (1, DRAFT_BATCH_ROWS)
    )
    # A step costs base + slope x context. At the shortest context the fixed part (the weights read) is most of it:
    # a slope that would leave it under half is a slower second measurement (a busy machine), not attention, and
    # would price the fixed part at zero or below.
    slope = [
        min(max(0.0, (b - a) / span), a / (2 * max(c0, 1)))
        for a, b in zip(per_context[0], per_context[-1], strict=True)
    ]
    base = [a - s * c0 for a, s in zip(per_context[0], slope, strict=True)]
    d_slope = min(max(0.0, (draft_times[-1] - draft_times[0]) / span), draft_times[0] / (2 * max(c0, 1)))
    say(f"draft passes of 1 and {DRAFT_BATCH_ROWS} rows")
    model = CostModel(
        lengths=list(lengths),
        verify_base=base,
        verify_slope=slope,
        draft_base=draft_times[0] - d_slope * c0,
        draft_slope=d_slope,
        draft_row_s=max(0.0, (many_rows - one_row) / (DRAFT_BATCH_ROWS - 1)),
        draft_slot_s=slot_s or 0.0,
        draft_dtype=draft_dtype,
        head_s=head_s,
        measured_s=time.perf_counter() - t_start,
    )
    model.complete = len(measured) == len(contexts)
    return model


def static_decoder(
    target: Any, draft: Any, prompt: torch.Tensor, rows: int = 1, dtype: str | None = None
) -> Any:
    """An engine (and its batched DFlash proposer) holding `rows` rows of `prompt`, joined with real prefills:
    what the verify and the draft pass are timed on (its caches are static where the engine's are)."""
    from ..sampling import SamplingParams
    from .batched_dflash import BatchedDFlashProposer
    from .decoder import BatchDecoder

    dtype = None if dtype is None else getattr(torch, dtype)
    decoder = BatchDecoder(
        target, BatchedDFlashProposer(draft, target, block_size=draft.config.block_size, dtype=dtype)
    )
    for _ in range(rows):
        decoder.add(prompt, 2, SamplingParams(), stop_token_ids=[], seed=0)
    return decoder


def _measure_draft_rows(
    target: Any, draft: Any, prompt: torch.Tensor, dtype: str, rows: int, repeats: int
) -> float:
    """Seconds of one batched draft pass over `rows` rows, each with `prompt` as its context: the rows join an
    engine (real prefills, not timed) and its proposer drafts for all of them once."""
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        decoder = static_decoder(target, draft, prompt, rows, dtype)
        _sync()
        t0 = time.perf_counter()
        decoder.proposer.draft_rows(decoder.rows)
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
