"""Structured output: a grammar per row, enforced on the target's logits at every position a step decides.

A `Constraint` says what a request wants (any JSON object, a JSON schema, a regex, a choice among strings, an EBNF
or Lark grammar); `compile_constraint` turns it into the target tokenizer's grammar (xgrammar, cached per target and
constraint) and a `RowGrammar` follows one row through its decoding.

In a verify step the block is [anchor, d1 .. dk]: the logits at position j decide the token after d1 .. dj, so they
are masked by the grammar's state after d1 .. dj (`RowGrammar.fill`: the matcher walks the drafts, fills one mask per
position and rolls back). A draft the grammar rejects ends the walk: the target's token before it is masked, so it can
never equal that draft, and the positions after it cannot be reached. Once the step's tokens are decided the matcher
takes them (`RowGrammar.advance`). Plain decoding runs the same loop with one position per step, so a constrained
DFlash row emits exactly what plain constrained decoding emits: at T=0 the masked argmax, at T>0 the seed's draw
from the masked distribution (the mask is applied before temperature, top-k and top-p, as vLLM does).

The grammar helps the proposals too, which changes no output: drafts are steered (`steer_drafts`: a refused draft
replaced by the drafter's best allowed token), and the text a grammar forces next (a schema's keys and punctuation, a
tool call's fixed head: xgrammar's jump-forward string) is proposed without a draft pass, in the tokenizer's own
spelling (`RowGrammar.jump_forward`; the cost-aware policy weighs it beside prompt lookup, batched_dflash.py).

Why xgrammar (measured on a 2-core AMD EPYC, SmolLM2's 49k vocabulary, a 4-field JSON schema, 51 tokens of
output): one mask took 5 µs median / 13 µs mean against llguidance 1.9's 54 / 210 µs, and the 16 masks of a
15-draft verify 197 µs against 650 µs (about 1 % of a compiled int8 verify); it is what vLLM and SGLang use, and its
matchers roll back. It is an optional dependency (`flashdraft[structured]`): on Linux x86-64 it pulls in triton.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from ..targets.target import Target

KINDS = ("json_object", "json_schema", "regex", "choice", "ebnf", "lark", "structural_tag")


class GrammarError(ValueError):
    """A constraint that cannot be compiled (invalid or unsupported schema, regex or grammar), in one line."""


@dataclass(frozen=True)
class Constraint:
    """What a row's output must match. `spec`: the JSON schema (as canonical JSON text), the regex, the grammar, the
    choices (a JSON list of strings) or xgrammar's structural tag (JSON text, tool_calls.py builds them); empty for
    `json_object`."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown constraint kind {self.kind!r} (one of {', '.join(KINDS)})")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str | type) -> Constraint:
        """From a schema dict, its JSON text, or a pydantic model class."""
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
            schema = schema.model_json_schema()
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if isinstance(schema, bool):
            return cls("json_object") if schema else cls("json_schema", "false")
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def grammar(cls, text: str) -> Constraint:
        """A grammar in EBNF (xgrammar's GBNF dialect, rules with `::=`), else in Lark."""
        return cls("ebnf" if "::=" in text else "lark", text)

    @classmethod
    def choice(cls, choices: list[str]) -> Constraint:
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise GrammarError("a choice constraint needs a non-empty list of strings")
        return cls("choice", json.dumps(choices))


def constraint_from_response_format(response_format: Any) -> Constraint | None:
    """OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
    "schema", "strict"}}), a pydantic model class, or a `Constraint`; None for plain text."""
    if response_format is None or isinstance(response_format, Constraint):
        return response_format
    if isinstance(response_format, type) and hasattr(response_format, "model_json_schema"):
        return Constraint.json_schema(response_format)
    if not isinstance(response_format, dict):
        raise GrammarError(
            f"response_format must be an object like {{'type': 'json_object'}}, got {type(response_format).__name__}"
        )
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        inner = response_format.get("json_schema")
        if not isinstance(inner, dict):
            raise GrammarError("response_format of type json_schema needs a 'json_schema' object")
        schema = inner.get("schema", inner.get("json_schema"))
        if schema is None:
            raise GrammarError("response_format.json_schema needs a 'schema'")
        return Constraint.json_schema(schema)
    if kind == "structural_tag":  # vLLM and SGLang take xgrammar's structural tags here: {"type", "format"}
        if not isinstance(response_format.get("format"), dict):
            raise GrammarError("response_format of type structural_tag needs a 'format' object")
        return Constraint("structural_tag", json.dumps(response_format))
    raise GrammarError(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema or structural_tag)"
    )


# ---------------------------------------------------------------------------------------------------- compiling
_compilers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _xgrammar() -> Any:
    from ..extras import require_extra

    require_extra("structured", "xgrammar")
    import xgrammar

    return xgrammar


def _compiler(target: Target) -> Any:
    """One xgrammar compiler per target (its tokenizer's vocabulary is read once, ~0.3 s; compiled grammars are
    cached by it)."""
    compiler = _compilers.get(target)
    if compiler is None:
        if target.tokenizer is None:
            raise GrammarError("structured output needs the target's tokenizer (none was given)")
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(
            target.tokenizer, vocab_size=target.vocab_size, stop_token_ids=target.eos_token_ids or None
        )
        compiler = _compilers[target] = xgr.GrammarCompiler(info)
    return compiler


def _one_line(error: Exception) -> str:
    """xgrammar's C++ errors ("[hh:mm:ss] /project/cpp/x.cc:83: message\\n...") as their message's first line."""
    text = str(error).strip()
    text = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text)
    text = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", text)
    return text.splitlines()[0][:300] if text else type(error).__name__


def compile_constraint(target: Target, constraint: Constraint) -> Any:
    """The constraint compiled for the target's tokenizer (xgrammar's `CompiledGrammar`); GrammarError if invalid."""
    compiler = _compiler(target)
    kind, spec = constraint.kind, constraint.spec
    try:
        # JSON in one layout (", " and ": ", no other whitespace): a small model under a grammar that allows any
        # whitespace can pad with newlines until its budget runs out. A schema's objects take no properties it does
        # not name (OpenAI's strict mode, vLLM's default); json_object takes any object.
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "json_schema":
            return compiler.compile_json_schema(spec, any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in json.loads(spec))
            return compiler.compile_grammar(f"root ::= {alternatives}")
        if kind == "ebnf":
            return compiler.compile_grammar(spec)
        if kind == "structural_tag":
            return compiler.compile_structural_tag(spec)
        return compiler.compile_lark(spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise GrammarError(f"invalid {kind.replace('_', ' ')}: {_one_line(e)}") from None


# ---------------------------------------------------------------------------------------------------- per row
class RowGrammar:
    """One row's matcher: masks for a step's positions, then the tokens the step emitted."""

    def __init__(self, compiled: Any) -> None:
        self.matcher = _xgrammar().GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, first: int, drafts: list[int]) -> tuple[int, int | None]:
        """Masks for the anchor's position and after each draft the grammar accepts, into bitmask rows first,
        first + 1, ..; the matcher is left as it was. Returns (positions filled, the first filled position whose
        mask allows no token, or None)."""
        m = self.matcher
        m.fill_next_token_bitmask(bitmask, first)
        walked = 0
        for token in drafts:
            if not m.accept_token(token):
                break
            walked += 1
            if m.is_terminated():  # a stop token: the row ends with it, nothing after it can be reached
                break
            m.fill_next_token_bitmask(bitmask, first + walked)
        if walked:
            m.rollback(walked)
        empty = (bitmask[first : first + walked + 1] == 0).all(-1).nonzero()
        return walked + 1, (int(empty[0, 0]) if len(empty) else None)

    def jump_forward(self, encode: Callable[[str], Sequence[int]], max_tokens: int) -> list[int]:
        """Jump-forward as a proposal: the text the grammar forces next (xgrammar's jump-forward string: the keys and
        punctuation of a schema, a tool call's fixed head) spelled by `encode` (the target tokenizer's own
        encoding), cut to `max_tokens` and to the tokens the grammar takes in that order; the matcher is left as it
        was. Not a decision: with a BPE vocabulary the grammar allows several spellings of forced text (every token
        that is a prefix of it), and the target's choice among them is what plain decoding emits, so these tokens
        are verified like drafts; a wrong spelling costs only its verify columns."""
        m = self.matcher
        if max_tokens <= 0 or m.is_terminated():
            return []
        text = m.find_jump_forward_string()
        if not text:
            return []
        tokens = list(encode(text)[:max_tokens])
        walked = 0
        for token in tokens:
            if not m.accept_token(token):
                break
            walked += 1
        if walked:
            m.rollback(walked)
        return tokens[:walked]

    def advance(self, tokens: list[int]) -> None:
        for token in tokens:
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"the grammar refused token {token}, which its own mask allowed")


def _allowed(words: np.ndarray, token: int) -> bool:
    """Whether a token's bit is set in a bitmask row (32 tokens per int32 word)."""
    return bool((int(words[token >> 5]) >> (token & 31)) & 1)


STEER_CANDIDATES = 32  # a refused draft's replacement is looked for among the drafter's top tokens first


def steer_drafts(
    grammar: RowGrammar, logits: torch.Tensor, tokens: torch.Tensor, confidence: torch.Tensor
) -> int:
    """A row's greedy drafts made grammatical, in place: a slot whose draft the grammar refuses (after the drafts
    before it) takes the drafter's most likely allowed token instead, with the drafter's probability of that token as
    its confidence (1 where the grammar forces it). `logits` [n, V] are the drafter's for the n slots,
    `tokens` and `confidence` [n]. Only proposals change and the verify decides as before, so this is lossless. It
    stops at a stop token or where the grammar allows nothing. Returns how many slots it walked; the matcher is left
    as it was. A draft the grammar allows costs one mask (a few µs); a replaced one is looked for among the drafter's
    top tokens, and only when none of them is allowed in the whole masked vocabulary (~0.5 ms at 49k tokens)."""
    xgr = _xgrammar()
    m = grammar.matcher
    n, vocab = logits.shape
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    words = bitmask.numpy()[0]  # shares the memory: reading one word costs no tensor op
    drafts = tokens.tolist()
    top: list[list[int]] | None = None
    lse = None
    walked = 0
    for j in range(n):
        if m.is_terminated():
            break
        m.fill_next_token_bitmask(bitmask, 0)
        token = drafts[j]
        if not _allowed(words, token):  # refused: the best allowed token instead
            nonzero = np.flatnonzero(words)
            if not len(nonzero):
                break
            word = int(words[nonzero[0]]) & 0xFFFFFFFF
            if len(nonzero) == 1 and word & (word - 1) == 0:  # the one token allowed: sure to be taken
                token = int(nonzero[0]) * 32 + word.bit_length() - 1
                tokens[j], confidence[j] = token, 1.0
            else:
                if top is None:  # the drafter's leading candidates and normalisers, all slots at once
                    lse = logits.float().logsumexp(-1).cpu()
                    top = logits.topk(min(STEER_CANDIDATES, vocab), -1).indices.cpu().tolist()
                token = next((t for t in top[j] if _allowed(words, t)), -1)
                if token < 0:  # none of them allowed: the whole vocabulary, masked
                    masked = logits[j : j + 1].float().cpu().clone()
                    xgr.apply_token_bitmask_inplace(masked, bitmask)
                    token = int(masked.argmax())
                # The policy prices drafts by this confidence: the drafter's own probability of the replacement
                # (not its choice, so it is no surer than that).
                tokens[j], confidence[j] = token, float(torch.exp(logits[j, token].float().cpu() - lse[j]))
        if not m.accept_token(token):
            break
        walked += 1
    if walked:
        m.rollback(walked)
    return walked


def mask_logits(
    logits: torch.Tensor, blocks: dict[int, list[int]], grammars: dict[int, RowGrammar]
) -> dict[int, int]:
    """Mask the rows' logits [b, n, V] in place: row i's position j by its grammar's state after its first j
    drafts (`blocks[i]`: the drafts after the anchor). Positions no token can follow under the grammar are left
    unmasked (never -inf everywhere); returns, per row that has one, the first such position: the row must end
    before the token decided there."""
    b, n, vocab = logits.shape
    xgr = _xgrammar()
    bitmask = xgr.allocate_token_bitmask(b * n, vocab)
    indices, dead = [], {}
    for i, grammar in grammars.items():
        walked, empty = grammar.fill(bitmask, i * n, blocks[i][: n - 1])
        indices.extend(range(i * n, i * n + walked))
        if empty is not None:
            dead[i] = empty
            bitmask[i * n + empty] = -1
    if indices:
        flat = logits.view(b * n, vocab)
        on_device = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(flat, on_device, indices=indices)
    return dead


__all__ = [
    "Constraint",
    "GrammarError",
    "RowGrammar",
    "compile_constraint",
    "constraint_from_response_format",
    "mask_logits",
    "steer_drafts",
]
