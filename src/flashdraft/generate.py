"""What users call: `generate` (one prompt), `generate_ar` (the plain baseline), `generate_batch` (many prompts).

All three run the one decode engine (engine.py: prefill -> [propose -> verify -> accept -> roll back]*), one row or
many, behind the one proposer interface (proposers.py); they differ only in the proposer they hand it:

    generate(draft)           a DFlash drafter: the cost-aware policy (`block_size="auto"`) or a fixed verify
                              length; or any single-sequence `Proposer`
    generate_ar               no proposer: one target token per step, through the very same loop, so comparisons
                              between the two measure speculation and nothing else
    generate_batch(draft)     the same, for many rows: one batched draft pass and one verify length per step;
                              continuous batching with max_batch_size

At temperature 0 the output is the target's own greedy decoding token for token; at temperature > 0 it is an exact
sample from the target's distribution, the one plain sampling draws with the same seed (sampling.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .drafter.model import DFlashDraftModel
from .engine.batched_dflash import DRAFT_SAMPLING, BatchedDFlashProposer
from .engine.costs import CostModel
from .engine.decoder import BatchDecoder
from .engine.grammar import Constraint, compile_constraint, constraint_from_response_format
from .engine.measure import load_or_measure_costs
from .engine.proposers import BatchProposer, NoProposer, PerRowProposers, Proposer
from .engine.request import GenerationError, GenerationResult, as_target, check_block_size, check_request
from .engine.tree import check_tree
from .sampling import SamplingParams
from .targets.target import Target, TargetError


def batch_proposer(
    target: Target,
    draft: DFlashDraftModel | Callable[[], Proposer] | None,
    block_size: int | str | None = "auto",
    costs: CostModel | None = None,
    draft_sampling: str = "match",
    tree: int | str | None = None,
) -> BatchProposer:
    """The proposer the engine runs: plain (`draft=None`), a DFlash drafter (one batched draft pass per step; the
    cost-aware policy for `block_size="auto"`, else the drafter's full block drafted and that many tokens
    verified), or a factory of per-row proposers. `draft_sampling` (DFlash drafters): "match" (greedy drafts,
    seed-exact) or "pq" (drafts sampled at T > 0, speculative sampling; sampling.py). `tree` (DFlash drafters):
    draft trees of at most this many nodes instead of chains, "auto" a budget of `TREE_AUTO_NODES`, None or "off"
    chains (tree.py)."""
    if draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"draft_sampling must be one of {', '.join(DRAFT_SAMPLING)}, not {draft_sampling!r}")
    if draft is None:
        return PerRowProposers(NoProposer)
    if isinstance(draft, DFlashDraftModel):
        target.check_drafter(draft.config)
        verify = check_block_size(block_size, draft.config.block_size)
        nodes = check_tree(tree)
        if verify is not None:
            return BatchedDFlashProposer(
                draft, target, block_size=verify, draft_sampling=draft_sampling, tree=nodes
            )
        costs = costs or load_or_measure_costs(target, draft)
        return BatchedDFlashProposer(draft, target, costs, draft_sampling=draft_sampling, tree=nodes)
    if check_tree(tree) is not None:
        raise ValueError("draft trees need a DFlash drafter")
    if draft_sampling != "match":
        raise ValueError(
            "draft_sampling='pq' needs a DFlash drafter (other proposers draft deterministically)"
        )
    if callable(draft):
        return PerRowProposers(draft)
    raise TypeError(
        f"draft must be a DFlashDraftModel, a proposer factory or None, got {type(draft).__name__}"
    )


def run(
    decoder: BatchDecoder,
    prompts: Sequence[torch.Tensor | Sequence[int]],
    limits: Sequence[int],
    sampling: SamplingParams,
    stop_token_ids: Sequence[int] | None,
    seeds: Sequence[int | None],
    on_tokens: Callable[[list[int]], Any] | None = None,
    constraints: Sequence[Constraint | None] | None = None,
) -> list[GenerationResult]:
    """Decode the prompts to the end on `decoder`; waiting prompts join as rows finish (continuous batching)."""
    results: list[GenerationResult | None] = [None] * len(prompts)
    waiting = list(range(len(prompts)))
    constraints = constraints or [None] * len(prompts)
    while waiting or len(decoder):
        while waiting and not decoder.full:
            i = waiting.pop(0)
            row = decoder.add(
                prompts[i],
                limits[i],
                sampling,
                stop_token_ids,
                seeds[i],
                on_tokens,
                tag=i,
                constraint=constraints[i],
            )
            if row.done:
                results[i] = row.result
        for row in decoder.step():
            results[row.tag] = row.result
    return results  # type: ignore[return-value]


def check_constraints(target: Target, response_format: Any, count: int) -> list[Constraint | None]:
    """One constraint per prompt from `response_format` (one for all, or a list with one per prompt: an OpenAI
    response_format dict, a pydantic model class or a `Constraint`), each compiled once here so an invalid one is
    refused (GrammarError) before anything decodes."""
    formats = response_format if isinstance(response_format, list) else [response_format] * count
    if len(formats) != count:
        raise GenerationError("response_format must be one value or one per prompt")
    constraints = [constraint_from_response_format(f) for f in formats]
    for c in set(constraints) - {None}:
        compile_constraint(target, c)
    return constraints


def generate(
    target: Target | Any,
    draft: DFlashDraftModel | Proposer | BatchProposer,
    input_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    block_size: int | str | None = "auto",
    seed: int | None = None,
    on_tokens: Callable[[list[int]], Any] | None = None,
    costs: CostModel | None = None,
    draft_sampling: str = "match",
    response_format: Any = None,
    tree: int | str | None = None,
) -> GenerationResult:
    """Lossless speculative generation of one sequence with a DFlash drafter (or any `Proposer`, or a
    `BatchProposer` to run as given).

    `target` is a `Target` or a transformers causal LM; `stop_token_ids=None` uses the target's EOS ids, `[]`
    disables stopping. `on_tokens(new_ids)` sees every step's tokens (streaming); returning True ends the generation
    there (stop_reason "caller"). `block_size="auto"` (default, DFlash drafters): per step, prompt lookup, the drafter
    or a plain step, and the verify length, chosen by expected tokens per second under `costs` (measured on this
    machine once and cached when None). An integer verifies that many tokens (anchor included) every step, as the
    paper does; it may be smaller than the drafter's trained block size. `draft_sampling="pq"` (T > 0, DFlash
    drafters): drafts sampled from the drafter and verified by speculative sampling, an exact sample of the target
    but not seed-exact; the default "match" drafts greedily and gives plain sampling's tokens for the same seed.
    `response_format` (structured output, grammar.py): {"type": "json_object"}, {"type": "json_schema",
    "json_schema": {"schema": ...}}, a pydantic model class, or a `Constraint` (regex, choice, EBNF, Lark); the
    output is then what plain decoding under the same constraint gives. `tree` (DFlash drafters): verify draft trees
    of at most this many nodes ("auto": `TREE_AUTO_NODES`; tree.py), the output unchanged.
    """
    target = as_target(target)
    sampling = SamplingParams(temperature, top_p, top_k)
    check_request(target, input_ids, max_new_tokens)
    constraints = check_constraints(target, response_format, 1)
    cap = None
    if isinstance(draft, DFlashDraftModel):
        proposer = batch_proposer(target, draft, block_size, costs, draft_sampling, tree)
    elif check_tree(tree) is not None:
        raise ValueError("draft trees need a DFlash drafter")
    elif draft_sampling != "match":
        raise ValueError(
            "draft_sampling='pq' needs a DFlash drafter (other proposers draft deterministically)"
        )
    elif isinstance(draft, Proposer):
        cap = check_block_size(block_size, draft.max_block_size)
        proposer = PerRowProposers(lambda: draft)
    elif isinstance(draft, BatchProposer):
        proposer = draft
    else:
        raise TypeError(
            f"draft must be a DFlashDraftModel, a Proposer or a BatchProposer, got {type(draft).__name__}"
        )
    decoder = BatchDecoder(target, proposer, max_batch_size=1, block_size=cap)
    return run(
        decoder, [input_ids], [max_new_tokens], sampling, stop_token_ids, [seed], on_tokens, constraints
    )[0]


def generate_ar(
    target: Target | Any,
    input_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    seed: int | None = None,
    on_tokens: Callable[[list[int]], Any] | None = None,
    response_format: Any = None,
) -> GenerationResult:
    """Plain autoregressive decoding with the same target wrapper, engine and sampler: the honest baseline."""
    return generate(
        target,
        NoProposer(),
        input_ids,
        max_new_tokens,
        temperature,
        top_p,
        top_k,
        stop_token_ids,
        1,
        seed,
        on_tokens,
        response_format=response_format,
    )


def generate_batch(
    target: Target | Any,
    draft: DFlashDraftModel | Callable[[], Proposer] | None,
    prompts: Sequence[torch.Tensor | Sequence[int]],
    max_new_tokens: int | Sequence[int] = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    block_size: int | str | None = "auto",
    seed: int | Sequence[int] | None = None,
    costs: CostModel | None = None,
    max_batch_size: int | None = None,
    draft_sampling: str = "match",
    response_format: Any = None,
    tree: int | str | None = None,
) -> list[GenerationResult]:
    """Decode several prompts together: each row's output is what `generate` gives it alone (greedy, fp32) or the
    same seed-exact sample. `draft=None` decodes plainly in a batch; a callable makes one `Proposer` per row.
    With `max_batch_size`, waiting prompts join as rows finish (continuous batching). `response_format`: one for
    every prompt or a list with one per prompt (None: free text), as in `generate`."""
    target = as_target(target)
    if not len(prompts):
        return []
    sampling = SamplingParams(temperature, top_p, top_k)
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(prompts)
    if len(limits) != len(prompts) or len(seeds) != len(prompts):
        raise GenerationError("max_new_tokens and seed must be one value or one per prompt")
    for ids, limit in zip(prompts, limits, strict=True):  # every request is checked before any work
        check_request(target, ids, limit)
    constraints = check_constraints(target, response_format, len(prompts))
    decoder = BatchDecoder(
        target, batch_proposer(target, draft, block_size, costs, draft_sampling, tree), max_batch_size
    )
    return run(decoder, prompts, limits, sampling, stop_token_ids, seeds, constraints=constraints)


__all__ = [
    "GenerationError",
    "GenerationResult",
    "TargetError",
    "batch_proposer",
    "generate",
    "generate_ar",
    "generate_batch",
]
