"""The drafter's compiled graphs (`--compile`), made as the target's verify is (compiled.py): its block pass, its
context projection (CPU) and its LM head with its greedy drafts (and a draft tree's candidates), each compiled whole
from the target's compile options and made once per drafter, target and options. None where the verify is eager."""

from __future__ import annotations

from typing import Any

import torch

from ..kernels.static_buffers import symbolic_sizes
from .compiled import compile_whole, fresh, run_compiled


def draft_block_pass(draft: Any, target: Any) -> Any:
    """The drafter's block pass compiled as the target's verify is (`target.plan.compile_options`; None: eager), made
    once per drafter and target. Its output is copied: a replayed graph writes into the same memory next time."""
    if not target.plan.compiled:
        return None
    return _once_per_options(draft, "_flashdraft_block_passes", target, _make_block_pass)


def _once_per_options(draft: Any, store: str, target: Any, make: Any) -> Any:
    """`make(draft, options)` for this drafter and the target's compile options, made once and kept on the drafter."""
    made = draft.__dict__.setdefault(store, {})
    key = target.plan.compile_key
    if key not in made:
        made[key] = make(draft, target.plan.compile_options)
    return made[key]


def _make_block_pass(draft: Any, options: dict[str, Any]) -> Any:
    compiled = compile_whole(draft.block_pass, options, weights=draft)
    made: set[bool] = set()

    def run(x, positions, context_positions, keys, values, num_blocks, context_before_anchor) -> torch.Tensor:
        lone = _doubled(made, x.shape[0])
        if lone:  # the context's K/V marked as the cache marks its own (DraftContextCache._tag)
            x, positions, context_positions = (at_least_two(t, 0) for t in (x, positions, context_positions))
            keys, values = ([at_least_two(t, 0) for t in store] for store in (keys, values))
            for t in (*keys, *values):
                symbolic_sizes(t, 0, 2)  # rows, capacity
        # made this step (the context's K/V and positions are the cache's, marked where DraftContextCache makes them)
        x, positions = fresh(x), fresh(positions)
        for t in (x, positions):
            symbolic_sizes(t, 0)  # rows
        symbolic_sizes(context_positions, 0, 1)  # rows, capacity
        args = (x, positions, context_positions, keys, values, num_blocks, context_before_anchor)
        out = run_compiled(compiled, "the drafter's block pass", *args)
        return (out[:1] if lone else out).clone()

    return run


def draft_context_pass(draft: Any, target: Any) -> Any:
    """The drafter's context projection (`model.context_kv`: the target features fused, each layer's K/V with its
    norm and RoPE) compiled as the target's verify is (None: eager), made once per drafter and target. Eager it was
    a dozen small operators, 1.4 ms a draft pass beside a 10 ms verify in bf16 on a 2-core EPYC
    (benchmarks/README.md, 2026-11-29). One graph for any rows and width: a width of one (a step that accepted no
    draft) goes in doubled. CPU only: a prompt's whole width comes through here once, and a GPU's CUDA graphs
    would record one per width."""
    if not target.plan.compiled or target.device.type != "cpu":
        return None
    return _once_per_options(draft, "_flashdraft_context_passes", target, _make_context_pass)


def _make_context_pass(draft: Any, options: dict[str, Any]) -> Any:
    compiled = compile_whole(draft.context_kv, options, weights=draft)
    made: set[bool] = set()

    def run(features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        rows, width = features.shape[:2]
        if _doubled(made, rows):
            features, positions = at_least_two(features, 0), at_least_two(positions, 0)
        features, positions = fresh(at_least_two(features, 1)), fresh(at_least_two(positions, 1))
        symbolic_sizes(features, 0, 1)  # rows, width
        symbolic_sizes(positions, 0, 1)
        kvs = run_compiled(compiled, "the drafter's context projection", features, positions)
        # no copies: CPU only (no replayed graph reuses its outputs), and the cache copies them in at once
        return [(k[:rows, :, :width], v[:rows, :, :width]) for k, v in kvs]

    return run


def _doubled(made: set[bool], rows: int) -> bool:
    """Whether a pass over `rows` rows goes in doubled: one row where this process has made only the graph of
    several (dynamo keeps a size of one apart): a batch's last row drafting alone once the others have left. The
    several-row graph serves it (rows do not depend on each other) instead of a one-row graph compiled in the middle
    of its answer (3.4-3.7 s a process on a Zen 4 EPYC at 8 int8 rows, benchmarks/README.md 2026-12-03). A process
    whose first pass is one row (`generate`, the server's warm-up) makes that graph and keeps a lone row's pass
    at its own size; `made` notes the graphs run."""
    if rows == 1 and made == {True}:
        return True
    made.add(rows > 1)
    return False


def at_least_two(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`t` with a size of one along `dim` doubled (its one slice repeated), else `t`. dynamo keeps a size of one
    specialised (a graph of its own) even where `symbolic_sizes` marks it: a compiled function whose inputs can be
    one row or column wide runs its one general graph on two, where the rows do not depend on each other, and
    compiles nothing new in the middle of an answer (the likeliest cause of a 21 s step on the int8 path: a draft
    pass whose head covered one slot)."""
    return torch.cat([t, t], dim) if t.shape[dim] == 1 else t


def draft_head(
    config: Any,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    target: Any,
    module: torch.nn.Module | None = None,
    vocab: tuple[torch.Tensor, int] | None = None,
) -> Any:
    """The drafter's LM head (`model.draft_logits` over [rows, H] states) compiled as the target's verify is, made
    once per target, head precision and drafter scaling; None when the verify is eager. `run(hidden)` returns
    (logits [rows, V], each row's argmax and its softmax probability): a v1 drafter's greedy drafts and confidences
    reduced in the same graph; `run(hidden, logits=False)` returns (None, drafts, confidences) from a graph of its
    own that reduces the head's own columns and never writes the V-wide logits (a greedy chain reads nothing else:
    eager, `propose_tokens`' softmax over the expanded logits cost 0.7 ms a draft pass on a 2-core EPYC);
    `run(hidden, logits=False, top=k)` adds each row's k most likely tokens and their probabilities (a draft tree's
    candidates, tree.top_candidates), reduced in a graph of their own: eager, over the V-wide logits, they cost
    3.1 ms of a 2-core Xeon's 39 ms tree step, and the logits 1 ms more. `module`:
    a quantized head (quantize.Int8Linear) compiled as it is, in place of `weight` and `bias`. Eager, this head was
    most of a CPU draft pass: 25 of 34 ms for SmolLM2's 15 slots through MKL on a 2-core AMD EPYC, 8 ms through
    inductor's GEMM template (the module docstring). `vocab`: (ids, V) where the head covers the drafter's
    vocabulary only (vocab.py): the logits come out expanded to V columns, -inf at the others."""
    if not target.plan.compiled:
        return None
    from ..drafter.model import draft_logits, scale_draft_logits
    from ..drafter.vocab import expand_logits, vocabulary_key
    from .tree import top_candidates

    scaling = (config.output_multiplier, config.final_logit_softcapping)
    precision = weight.dtype if module is None else (type(module).__name__, module.compute_dtype)
    key = (target.plan.compile_key, precision, scaling, vocabulary_key(vocab))
    heads = target.model.__dict__.setdefault("_flashdraft_draft_heads", {})
    if key in heads:
        return heads[key]
    if module is not None:
        head = module

        def head_logits(hidden: torch.Tensor) -> torch.Tensor:
            return scale_draft_logits(config, head(hidden).float())
    else:
        head = torch.nn.Module()  # the weights as a module's parameters: constants of the frozen graph
        head.weight = torch.nn.Parameter(weight, requires_grad=False)
        head.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

        def head_logits(hidden: torch.Tensor) -> torch.Tensor:
            return draft_logits(config, hidden, head.weight, head.bias)

    holder = torch.nn.Module()  # the head and its vocabulary's ids: constants of the frozen graph
    holder.head = head
    holder.register_buffer("vocab_ids", None if vocab is None else vocab[0])

    def logits_and_drafts(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = head_logits(hidden)
        out = out if vocab is None else expand_logits(out, holder.vocab_ids, vocab[1])
        confidence, tokens = out.softmax(-1).max(-1)  # a v1 drafter's greedy drafts (model.propose_tokens)
        return out, tokens, confidence

    def drafts(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        confidence, index = head_logits(hidden).softmax(-1).max(-1)  # -inf elsewhere adds nothing to the sum
        return (index if vocab is None else holder.vocab_ids[index]), confidence

    def drafts_and_top(k: int) -> Any:
        def run(hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = head_logits(hidden)
            confidence, index = out.softmax(-1).max(-1)
            top_tokens, top_p = top_candidates(out, k)
            if vocab is not None:
                index, top_tokens = holder.vocab_ids[index], holder.vocab_ids[top_tokens]
            return index, confidence, top_tokens, top_p

        return run

    with_logits = compile_whole(logits_and_drafts, target.plan.compile_options, weights=holder)
    drafts_only = compile_whole(drafts, target.plan.compile_options, weights=holder)
    with_top: dict[int, Any] = {}  # per k: dynamo would guard on it anyway

    def run(hidden: torch.Tensor, logits: bool = True, top: int = 0) -> tuple[torch.Tensor | None, ...]:
        rows = hidden.shape[0]
        # one row's slots, `hidden[:, 1:]`, start one state into their tensor; one slot goes in doubled
        hidden = fresh(at_least_two(hidden, 0))
        symbolic_sizes(hidden, 0)  # rows x slots
        if top and not logits:
            if top not in with_top:
                with_top[top] = compile_whole(
                    drafts_and_top(top), target.plan.compile_options, weights=holder
                )
            out = run_compiled(with_top[top], "the drafter's LM head", hidden)
        else:
            out = run_compiled(with_logits if logits else drafts_only, "the drafter's LM head", hidden)
        out = tuple(t[:rows].clone() for t in out)
        return out if logits else (None, *out)

    heads[key] = run
    return run
