"""Prompt lookup: proposals copied from earlier in the text (the continuation of the latest earlier occurrence of the
text's last n-gram), free to propose, and keyed for the policy's acceptance table by n-gram size and slot.

`prompt_lookup` scans back over the text; `LookupIndex` gives the same answers from an index it extends as the text
grows, which the batched proposer asks every row for at every step."""

from __future__ import annotations

LOOKUP_MAX_TOKENS = 10
LOOKUP_MAX_NGRAM = 3


def prompt_lookup(
    tokens: list[int], max_tokens: int, max_ngram: int = 3, window: int = 4096
) -> tuple[list[int], int]:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the longest trailing n-gram
    (n = max_ngram .. 1) within the last `window` tokens. Returns (proposal, n), ([], 0) when nothing matches."""
    if max_tokens <= 0 or len(tokens) < 2:
        return [], 0
    start = max(0, len(tokens) - window)
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        first = tail[0]
        # latest occurrence ending before the tail itself
        for i in range(len(tokens) - n - 1, start - 1, -1):
            if tokens[i] == first and tokens[i : i + n] == tail:
                follow = tokens[i + n : i + n + max_tokens]
                if follow:
                    return follow, n
                break
    return [], 0


class LookupIndex:
    """`prompt_lookup` over a live list of tokens that only grows (a row's prompt and output), answered from an
    index: the latest start of every n-gram (n = 1..max_ngram) that ends before the list's last token, extended by
    the tokens appended since the last lookup. A lookup then reads max_ngram dict entries where the scan went back
    over the window: 4-5 us a lookup at any length, where the scan took 7-9 us after 300 tokens, 16-21 after 1000
    and 54-73 after 3000 (GSM8K text on a 2-core Xeon; at 16 rows 0.2-0.3 ms a step after 1000 tokens, beside a
    13-ms batched step; benchmarks/README.md, 2026-12-06)."""

    def __init__(self, tokens: list[int], max_ngram: int = LOOKUP_MAX_NGRAM, window: int = 4096) -> None:
        self.tokens = tokens
        self.max_ngram = max_ngram
        self.window = window
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> its latest start (lengths never collide)
        self.length = 0  # the list's length when it was last indexed
        self.pruned = 0  # the length at the last pruning

    def _extend(self) -> None:
        tokens, length = self.tokens, len(self.tokens)
        if length < self.length:  # not the list it indexed (the list only grows): index it anew
            self.latest.clear()
            self.length = self.pruned = 0
        # Starts out of the window never match again: dropped once a window, so at most two windows' are kept.
        if length - self.pruned >= self.window:
            start = length - self.window
            self.latest = {gram: i for gram, i in self.latest.items() if i >= start}
            self.pruned = length
        # An n-gram starting at i is indexed once it ends before the last token (i + n <= length - 1); those that
        # did by the last length (i + n <= self.length - 1) are in already.
        for i in range(max(0, self.length - self.max_ngram), length - 1):
            for n in range(max(1, self.length - i), min(self.max_ngram, length - 1 - i) + 1):
                self.latest[tuple(tokens[i : i + n])] = i
        self.length = length

    def lookup(self, max_tokens: int) -> tuple[list[int], int]:
        """What `prompt_lookup(tokens, max_tokens, max_ngram, window)` returns."""
        tokens = self.tokens
        if max_tokens <= 0 or len(tokens) < 2:
            return [], 0
        self._extend()
        start = max(0, len(tokens) - self.window)
        for n in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            i = self.latest.get(tuple(tokens[-n:]))
            if i is not None and i >= start:  # the latest is out of the window: every earlier one is too
                return tokens[i + n : i + n + max_tokens], n
        return [], 0

    def with_key(self, max_tokens: int) -> tuple[list[int], int]:
        """The proposal and the key of its first slot in the acceptance table, keyed by (matched n-gram size,
        slot): slot j's key is that plus j."""
        proposal, ngram = self.lookup(min(max_tokens, LOOKUP_MAX_TOKENS))
        return proposal, max(ngram - 1, 0) * LOOKUP_MAX_TOKENS


__all__ = ["LOOKUP_MAX_NGRAM", "LOOKUP_MAX_TOKENS", "LookupIndex", "prompt_lookup"]
