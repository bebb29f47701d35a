"""The drafter's vocabulary: the LM head over the tokens a drafter is likely to propose, not the whole vocabulary.

A draft pass ends in the target's LM head over every drafted slot: SmolLM2's 49152 x 576 head is 28 M of the
drafter's 37 M multiply-adds a slot, most of a CPU draft pass (benchmarks/README.md). The tokens a drafter gets
accepted are mostly frequent ones, so the head can cover the K most frequent tokens only (FR-Spec, EAGLE-3's draft
vocabulary): K/V of its cost. It stays lossless: the drafter only proposes, and a token outside its vocabulary is
a token it cannot propose, never one the target cannot emit (the verify's logits are the target's own).

    token counts (token_counts.json beside the drafter: how often each target token occurs in the text it was
    trained on)  ->  vocabulary ids (the K most counted, and the target's special tokens)  ->  a head over those
    rows (`restrict_head`)  ->  draft logits [rows, K]  ->  `expand_logits`: [rows, V], -inf outside

Every consumer of draft logits (greedy argmax and confidence, draft trees' top-k, grammar steering, sampled drafts'
distributions) reads the expanded logits as it reads full ones: a token outside the vocabulary has probability 0.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from ..kernels.packed_linear import PackedLinear
from ..kernels.quantize import Fp16Linear, Int8Linear

# JSON, not safetensors: vLLM and SGLang load every *.safetensors file of a drafter's folder as its weights (vLLM then
# refuses a tensor the drafter does not have), and a drafter folder must load in them unchanged.
TOKEN_COUNTS_NAME = "token_counts.json"
# The default size: the head's cost falls with K while the tokens a drafter could have got accepted fall out of it.
# SmolLM2's drafter kept its τ to the third decimal at 8192 of 49152 tokens on 30 held-out prompts (GSM8K, HumanEval,
# MT-Bench; 4096 lost 1 % on GSM8K), and its compiled head over 15 slots went from 14.4 to 2.1 ms on a 2-core EPYC
# (benchmarks/README.md, 2026-11-28).
DEFAULT_SIZE = 8192


class DraftVocabError(ValueError):
    """A draft vocabulary that cannot be used (a bad size, counts for another vocabulary): one line."""


def count_tokens(sequences: Iterable[Iterable[int]], vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: how often each token id occurs in `sequences` (ids outside the vocabulary ignored)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in sequences:
        ids = torch.as_tensor(list(seq), dtype=torch.int64)
        ids = ids[(ids >= 0) & (ids < vocab_size)]
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def save_token_counts(path: str | Path, counts: torch.Tensor, source: str) -> None:
    """Write `token_counts.json` into a drafter directory: the counted ids and their counts (nonzero ones only),
    the vocabulary's size, and `source` (what was counted)."""
    from ..files import atomic_write_text

    counts = counts.detach().to(torch.int64).cpu()
    ids = torch.nonzero(counts).flatten()
    record = {
        "source": source,
        "tokens": int(counts.sum()),
        "vocab_size": int(counts.shape[0]),
        "ids": ids.tolist(),
        "counts": counts[ids].tolist(),
    }
    atomic_write_text(Path(path) / TOKEN_COUNTS_NAME, json.dumps(record, separators=(",", ":")) + "\n")


def load_token_counts(path: str | Path) -> tuple[torch.Tensor, str] | None:
    """(the token counts a drafter directory ships, [vocab] int64; what was counted), or None (z-lab's drafters
    ship none)."""
    file = Path(path) / TOKEN_COUNTS_NAME
    if not file.exists():
        return None
    try:
        record = json.loads(file.read_text())
        vocab, ids, values = int(record["vocab_size"]), record["ids"], record["counts"]
        counts = torch.zeros(vocab, dtype=torch.int64)
        counts[torch.tensor(ids, dtype=torch.int64)] = torch.tensor(values, dtype=torch.int64)
        source = str(record.get("source", ""))
    except (OSError, ValueError, KeyError, TypeError, IndexError, RuntimeError) as e:
        raise DraftVocabError(f"cannot read {file}: {type(e).__name__}: {e}") from None
    if len(ids) != len(values) or (counts < 0).any():
        raise DraftVocabError(
            f"{file}: `ids` and `counts` must be as long as each other, counts never negative"
        )
    return counts, source


def vocabulary_ids(
    counts: torch.Tensor, size: int, vocab_size: int, always: Iterable[int] = ()
) -> torch.Tensor | None:
    """The sorted token ids of a draft vocabulary: the `size` most counted (ties: the lower id first), and `always`
    (the target's stop and special tokens, which text counts miss). None where that is the whole vocabulary."""
    if counts.shape[0] != vocab_size:
        raise DraftVocabError(
            f"the drafter's token counts cover {counts.shape[0]} tokens but the target's vocabulary has {vocab_size}"
        )
    if size < 1:
        raise DraftVocabError(f"a draft vocabulary needs at least one token, got {size}")
    if size >= vocab_size:
        return None
    # stable sort of -counts: equal counts keep id order
    order = torch.sort(-counts, stable=True).indices[:size]
    extra = torch.tensor([t for t in set(always) if 0 <= t < vocab_size], dtype=torch.int64)
    ids = torch.unique(torch.cat([order, extra]))  # sorted
    return None if ids.numel() >= vocab_size else ids


def drafter_vocabulary(draft: nn.Module, target: object, head_rows: int) -> torch.Tensor | None:
    """The ids a drafter's head covers beside this target (None: all `head_rows`): `draft.draft_vocab_size` of
    them (0: all; unset: DEFAULT_SIZE where the drafter ships token counts, else all), the target's stop and special
    tokens always among them."""
    counts = getattr(draft, "token_counts", None)
    size = getattr(draft, "draft_vocab_size", None)
    if size == 0 or (size is None and counts is None):
        return None
    if counts is None:
        raise DraftVocabError(
            f"--draft-vocab {size} needs the drafter's token counts ({TOKEN_COUNTS_NAME}), which it does not ship: "
            "write them with `flashdraft data token-counts`"
        )
    tokenizer = getattr(target, "tokenizer", None)
    always = set(getattr(target, "eos_token_ids", None) or [])
    always |= set(getattr(tokenizer, "all_special_ids", None) or [])
    return vocabulary_ids(counts, size or DEFAULT_SIZE, head_rows, always)


def vocabulary_key(vocab: tuple[torch.Tensor, int] | None) -> str:
    """A short key naming a vocabulary (ids, V) for caches of compiled heads ('' for the whole vocabulary)."""
    if vocab is None:
        return ""
    ids, size = vocab
    digest = hashlib.sha256(ids.detach().to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:16]
    return f"{ids.numel()}/{size}/{digest}"


def restrict_head(head: nn.Module | torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor):
    """The LM head over the rows `ids`: for a dense weight (and bias) their rows, for a head module (quantize.py's,
    packed_linear.py's) a module of its kind over those rows. Returns (weight, bias) or the module."""
    if isinstance(head, torch.Tensor):
        rows = ids.to(head.device)
        return head[rows].contiguous(), None if bias is None else bias[rows].contiguous()
    if isinstance(head, Int8Linear):
        return head.select_rows(ids)
    if isinstance(head, (Fp16Linear, PackedLinear)):
        linear = nn.Linear(head.in_features, ids.numel(), bias=head.bias is not None)
        with torch.no_grad():
            linear.weight.copy_(head.weight[ids])
            if head.bias is not None:
                linear.bias.copy_(head.bias[ids])
        return type(head)(linear)
    raise DraftVocabError(f"a draft vocabulary cannot restrict a {type(head).__name__} head")


def expand_logits(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, K] logits over the vocabulary `ids` -> [rows, V], -inf at every other token."""
    full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    return full.index_copy_(1, ids, logits)


__all__ = [
    "DEFAULT_SIZE",
    "TOKEN_COUNTS_NAME",
    "DraftVocabError",
    "count_tokens",
    "drafter_vocabulary",
    "expand_logits",
    "load_token_counts",
    "restrict_head",
    "vocabulary_key",
    "save_token_counts",
    "vocabulary_ids",
]
