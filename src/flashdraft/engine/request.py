"""A generation request and what it returns: the checks every request gets before any work (prompt ids, lengths,
the verify length), `GenerationResult`, the tokens with their timings and speculative statistics, and `BatchRow`, a
request as one row of the decoder's batch (what the decoder and the proposers both read)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from typing import TYPE_CHECKING, Any

import torch

from ..sampling import SamplingParams, position_uniforms
from ..targets.target import Target

if TYPE_CHECKING:
    from .grammar import RowGrammar


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
    # structured output: masks (its share of a batch's), matcher walks, steered drafts, jump-forward (in decode_s)
    grammar_s: float = 0.0
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
            "grammar_s": self.grammar_s,
            "tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "stop_reason": self.stop_reason,
            "proposer_stats": self.proposer_stats,
        }


def as_target(target: Target | Any) -> Target:
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
    """The prompt as a [1, n] id tensor on the target's device, after the checks every request gets (a prompt with
    images, multimodal.py: its ids; its images refused here for a text-only target)."""
    from ..targets.multimodal import as_prompt, refuse_images

    target.check_decodable()
    input_ids, inputs = as_prompt(input_ids)
    refuse_images(target, inputs)
    ids = _as_input_ids(input_ids, target.device)
    check_prompt_fits(ids.shape[1], int(ids.min()), int(ids.max()), max_new_tokens, target)
    return ids


def check_prompt_fits(prompt_len: int, lowest: int, highest: int, max_new_tokens: Any, target: Any) -> None:
    """A prompt of `prompt_len` ids in lowest..highest and its token budget against the target's vocabulary and
    context (any backend's target: its `vocab_size` and `max_context`)."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if prompt_len + max_new_tokens > target.max_context:
        raise GenerationError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's context of "
            f"{target.max_context} tokens"
        )
    if highest >= target.vocab_size or lowest < 0:
        raise GenerationError(f"prompt holds token ids outside the vocabulary (0..{target.vocab_size - 1})")


def check_block_size(block_size: int | str | None, max_block_size: int | None) -> int | None:
    """The verify length (anchor included) as the engine takes it: None for "auto" (the cost-aware policy chooses per
    step), else an integer in 1..max_block_size (the drafter's trained block; None: no drafter to bound it). The one
    check from the command line (`--block-size`) to the engine."""
    if block_size is None or (isinstance(block_size, str) and block_size.strip().lower() == "auto"):
        return None
    if isinstance(block_size, str):
        try:
            block_size = int(block_size)
        except ValueError:
            raise GenerationError(f"block_size must be 'auto' or an integer, got {block_size!r}") from None
    if not isinstance(block_size, Integral) or isinstance(block_size, bool) or block_size < 1:
        raise GenerationError(f"block_size must be 'auto' or a positive integer, got {block_size!r}")
    if max_block_size is not None and block_size > max_block_size:
        raise GenerationError(
            f"block_size must be between 1 and the drafter's block size {max_block_size}, got {block_size}"
        )
    return int(block_size)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's; a CPU's is done when its ops return)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(eq=False)
class BatchRow:
    """One sequence of the batch: its request, its progress and its result."""

    prompt: torch.Tensor  # [1, P]
    max_new_tokens: int
    sampling: SamplingParams
    stops: set[int]
    seed: int
    on_tokens: Callable[[list[int]], Any] | None = None
    tokens: list[int] = field(default_factory=list)  # generated so far
    history: list[int] = field(default_factory=list)  # prompt + generated (for lookup proposers)
    result: GenerationResult | None = None
    done: bool = False
    started: float = 0.0  # when its prefill ended (its decode time counts from there)
    tag: Any = None  # the caller's (e.g. the server's request handle)
    grammar: RowGrammar | None = None  # structured output: the row's matcher (grammar.py)
    rope_offset: int = 0  # multimodal RoPE: its text positions' shift after its images (Target.rope_offset)

    @property
    def anchor_position(self) -> int:
        """Position of the anchor (the last fixed token, not yet in the cache) = tokens the cache holds."""
        return self.prompt.shape[1] + len(self.tokens) - 1

    def uniforms(self, start: int, count: int) -> torch.Tensor | None:
        return None if self.sampling.greedy else position_uniforms(self.seed, start, count)

    def finish(self, reason: str | None = None) -> None:
        self.done = True
        sync(self.prompt.device)
        if reason:
            self.result.stop_reason = reason
        self.result.decode_s = time.perf_counter() - self.started
        device = self.prompt.device
        self.result.sequences = torch.cat(
            [self.prompt, torch.tensor([self.tokens], dtype=torch.long, device=device)], dim=1
        )


__all__ = [
    "BatchRow",
    "GenerationError",
    "GenerationResult",
    "as_target",
    "check_block_size",
    "check_prompt_fits",
    "check_request",
    "sync",
]
