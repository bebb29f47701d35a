"""The speculative decode loop (batch size 1): prefill -> [propose -> verify -> accept -> roll back]*.

    prefill   target(prompt), taps -> features of the prompt; first token x_P sampled from the last logits
    propose   drafter([x, MASK x (B-1)]) with the context features -> B-1 draft tokens (greedy)
    verify    target([x, d_1 .. d_{B-1}]) in one forward -> keep the longest accepted prefix + one target token
    rollback  crop the target cache to the fixed tokens; their features become new draft context

At temperature 0 the output is the target's own greedy decoding token for token; at temperature > 0 it is an exact
sample from the target's distribution (see sampling.py). `generate_ar` runs the very same loop with no proposer,
so comparisons between the two measure speculation and nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any

import torch

from .costs import CostModel, load_or_measure_costs
from .model import DFlashDraftModel
from .proposers import AdaptiveProposer, DFlashProposer, NoProposer, Proposer
from .sampling import SamplingParams, position_uniforms, sample_token, verify_block
from .target import Target, TargetError


class GenerationError(ValueError):
    """Invalid generation request (batch, lengths, block size)."""


@dataclass
class GenerationResult:
    sequences: torch.Tensor  # [1, prompt + new] like transformers' generate
    prompt_length: int
    acceptance_lengths: list[int] = field(
        default_factory=list
    )  # tokens emitted per verify step, bonus included
    draft_lengths: list[int] = field(default_factory=list)  # drafts proposed per verify step
    accepted_drafts: list[int] = field(
        default_factory=list
    )  # drafts accepted per step (before stop/length cuts)
    prefill_s: float = 0.0  # prefill + first token
    decode_s: float = 0.0  # every verify step after that
    stop_reason: str = "max_new_tokens"
    proposer_stats: dict[str, Any] = field(
        default_factory=dict
    )  # e.g. steps by source for the adaptive proposer

    @property
    def new_tokens(self) -> list[int]:
        return self.sequences[0, self.prompt_length :].tolist()

    @property
    def num_new_tokens(self) -> int:
        return self.sequences.shape[1] - self.prompt_length

    @property
    def num_steps(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        """τ: mean tokens per verify step (1.0 for plain decoding)."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.num_new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens from the decode phase per second (the first token comes from prefill)."""
        n = self.num_new_tokens - 1
        return n / self.decode_s if self.decode_s > 0 and n > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_new_tokens": self.num_new_tokens,
            "num_steps": self.num_steps,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_lengths": self.acceptance_lengths,
            "draft_lengths": self.draft_lengths,
            "accepted_drafts": self.accepted_drafts,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "stop_reason": self.stop_reason,
            "proposer_stats": self.proposer_stats,
        }


def _as_target(target: Target | Any) -> Target:
    return target if isinstance(target, Target) else Target(target)


def _as_input_ids(input_ids: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    if isinstance(input_ids, (str, bytes)):
        raise GenerationError(
            "input_ids must be token ids, not text: encode the prompt first, e.g. target.encode_prompt(text)"
        )
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise GenerationError(
                f"input_ids must be an integer tensor of token ids, got dtype {input_ids.dtype}"
            )
        ids = input_ids.long()
    else:
        rows = input_ids if len(input_ids) and isinstance(input_ids[0], (list, tuple)) else [input_ids]
        bad = next(
            (t for row in rows for t in row if isinstance(t, bool) or not isinstance(t, Integral)), None
        )
        if bad is not None:
            raise GenerationError(
                f"input_ids must be integer token ids, found {bad!r} ({type(bad).__name__})"
            )
        try:
            ids = torch.tensor(input_ids, dtype=torch.long)
        except (ValueError, TypeError) as e:
            raise GenerationError(f"input_ids must be a [n] or [1, n] list of token ids: {e}") from None
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2:
        raise GenerationError(f"input_ids must be [1, n] or [n], got shape {tuple(ids.shape)}")
    if ids.shape[0] != 1:
        raise GenerationError(
            f"batch size {ids.shape[0]}: generate() decodes one sequence; use generate_batch() for several prompts"
        )
    if ids.shape[1] == 0:
        raise GenerationError("the prompt is empty")
    return ids.to(device)


def check_request(
    target: Target, input_ids: torch.Tensor | Sequence[int], max_new_tokens: int
) -> torch.Tensor:
    """The prompt as a [1, n] id tensor on the target's device, after the checks every request gets."""
    target.check_decodable()
    ids = _as_input_ids(input_ids, target.device)
    prompt_len = ids.shape[1]
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if prompt_len + max_new_tokens > target.max_context:
        raise GenerationError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's context of "
            f"{target.max_context} tokens"
        )
    if int(ids.max()) >= target.vocab_size or int(ids.min()) < 0:
        raise GenerationError(f"prompt holds token ids outside the vocabulary (0..{target.vocab_size - 1})")
    return ids


def cut_emitted(emitted: list[int], remaining: int, stops: set[int]) -> tuple[list[int], bool]:
    """A step's emitted tokens cut to the `remaining` budget and after the first stop token (which a stop ends the
    output inside an accepted run with); returns (tokens kept, whether a stop token ended them)."""
    emitted = emitted[:remaining]
    for i, tok in enumerate(emitted):
        if tok in stops:
            return emitted[: i + 1], True
    return emitted, False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode(
    target: Target,
    proposer: Proposer,
    input_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_token_ids: Sequence[int] | None = None,
    block_size: int | None = None,
    seed: int | None = None,
    on_tokens: Callable[[list[int]], Any] | None = None,
) -> GenerationResult:
    """The loop shared by speculative and plain decoding; `proposer` decides which one it is (and may propose
    fewer tokens than the block allows: the adaptive proposer chooses its verify length per step)."""
    ids = check_request(target, input_ids, max_new_tokens)
    prompt_len = ids.shape[1]
    block_size = proposer.max_block_size if block_size is None else block_size
    if not isinstance(block_size, int) or not 1 <= block_size <= proposer.max_block_size:
        raise GenerationError(
            f"block_size must be between 1 and the drafter's block size {proposer.max_block_size}, got {block_size!r}"
        )
    stops = set(target.eos_token_ids if stop_token_ids is None else stop_token_ids)
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())

    def uniforms(start: int, count: int) -> torch.Tensor | None:
        return None if sampling.greedy else position_uniforms(seed, start, count)

    taps = proposer.tap_layer_ids
    device = target.device

    # ---- prefill
    _sync(device)
    t0 = time.perf_counter()
    cache = target.new_cache()
    out = target.forward(ids, cache, taps, last_logits_only=True)
    first = sample_token(out.logits[0, -1], sampling, uniforms(prompt_len, 1))
    history = [*ids[0].tolist(), first]  # prompt + fixed tokens, for proposers that look back (prompt lookup)
    proposer.bind_history(history)
    proposer.start(out.features)
    tokens = [first]
    _sync(device)
    t1 = time.perf_counter()
    result = GenerationResult(sequences=ids, prompt_length=prompt_len, prefill_s=t1 - t0)
    done = first in stops or max_new_tokens == 1
    if first in stops:
        result.stop_reason = "stop_token"
    if (
        on_tokens and on_tokens([first]) is True
    ):  # the caller has what it needs (a stop string, a client gone)
        done, result.stop_reason = True, "caller"

    # ---- decode
    while not done:
        remaining = max_new_tokens - len(tokens)
        anchor_position = (
            prompt_len + len(tokens) - 1
        )  # the anchor is the last fixed token, not yet in the cache
        max_drafts = min(block_size - 1, remaining - 1)  # never verify past max_new_tokens
        drafts = (
            proposer.propose(tokens[-1], anchor_position, max_drafts).to(device)
            if max_drafts > 0
            else torch.empty(0, dtype=torch.long, device=device)
        )
        num_drafts = int(drafts.shape[0])
        if num_drafts > max_drafts:
            raise RuntimeError(
                f"{type(proposer).__name__} proposed {num_drafts} tokens, at most {max_drafts} allowed"
            )
        block = torch.cat([torch.tensor([tokens[-1]], device=device), drafts])[None]
        out = target.forward(block, cache, taps)
        accepted, emitted = verify_block(
            out.logits[0], drafts, sampling, uniforms(anchor_position + 1, num_drafts + 1)
        )
        proposer.observe(num_drafts, accepted)

        emitted, stopped = cut_emitted(emitted, remaining, stops)
        if stopped:
            result.stop_reason = "stop_token"
            done = True
        tokens.extend(emitted)
        history.extend(emitted)
        result.acceptance_lengths.append(len(emitted))
        result.draft_lengths.append(num_drafts)
        result.accepted_drafts.append(accepted)
        if on_tokens and on_tokens(emitted) is True and not done:
            done, result.stop_reason = True, "caller"
        if len(tokens) >= max_new_tokens:
            done = True
        if not done:
            # Keep anchor + accepted drafts in the target cache; their features extend the draft context.
            target.keep(cache, [accepted + 1])
            target.crop(cache, anchor_position + accepted + 1)
            proposer.accept(None if out.features is None else out.features[:, : accepted + 1])
    _sync(device)
    result.decode_s = time.perf_counter() - t1
    result.proposer_stats = proposer.stats()
    result.sequences = torch.cat([ids, torch.tensor([tokens], dtype=torch.long, device=device)], dim=1)
    return result


def generate(
    target: Target | Any,
    draft: DFlashDraftModel | Proposer,
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
) -> GenerationResult:
    """Lossless speculative generation with a DFlash drafter (or any `Proposer`).

    `target` is a `Target` or a transformers causal LM; `stop_token_ids=None` uses the target's EOS ids, `[]`
    disables stopping. `on_tokens(new_ids)` sees every step's tokens (streaming); returning True ends the generation
    there (stop_reason "caller"). `block_size="auto"` (default, DFlash drafters): per step, prompt lookup, the drafter or a
    plain step, and the verify length, chosen by expected tokens per second under `costs` (measured on this machine
    once and cached when None). An integer verifies that many tokens (anchor included) every step, as the paper
    does; it may be smaller than the drafter's trained block size. `on_tokens` receives the new token ids after
    every step (streaming).
    """
    target = _as_target(target)
    sampling = SamplingParams(temperature, top_p, top_k)
    auto = block_size is None or block_size == "auto"
    if isinstance(block_size, str) and not auto:
        raise GenerationError(f"block_size must be 'auto' or an integer, got {block_size!r}")
    if isinstance(draft, DFlashDraftModel):
        if auto:
            target.check_drafter(draft.config)
            costs = costs or load_or_measure_costs(target, draft)
            proposer: Proposer = AdaptiveProposer(draft, target, costs)
        else:
            proposer = DFlashProposer(draft, target)
    elif isinstance(draft, Proposer):
        proposer = draft
    else:
        raise TypeError(f"draft must be a DFlashDraftModel or a Proposer, got {type(draft).__name__}")
    return decode(
        target,
        proposer,
        input_ids,
        max_new_tokens,
        sampling,
        stop_token_ids,
        None if auto else block_size,
        seed,
        on_tokens,
    )


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
) -> GenerationResult:
    """Plain autoregressive decoding with the same target wrapper, cache and sampler: the honest baseline."""
    target = _as_target(target)
    sampling = SamplingParams(temperature, top_p, top_k)
    return decode(
        target, NoProposer(), input_ids, max_new_tokens, sampling, stop_token_ids, 1, seed, on_tokens
    )


__all__ = ["GenerationResult", "GenerationError", "TargetError", "decode", "generate", "generate_ar"]
