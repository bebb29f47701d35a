"""Prompt lookup: proposals copied from earlier in the text (the continuation of the latest earlier occurrence of the
text's last n-gram), free to propose, and keyed for the policy's acceptance table by n-gram size and slot."""

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


def lookup_with_key(history: list[int], max_tokens: int) -> tuple[list[int], int]:
    """Prompt lookup's proposal and the key of its first slot in the acceptance table, keyed by (matched n-gram
    size, slot): slot j's key is that plus j."""
    proposal, ngram = prompt_lookup(history, min(max_tokens, LOOKUP_MAX_TOKENS), LOOKUP_MAX_NGRAM)
    return proposal, max(ngram - 1, 0) * LOOKUP_MAX_TOKENS


__all__ = ["LOOKUP_MAX_NGRAM", "LOOKUP_MAX_TOKENS", "lookup_with_key", "prompt_lookup"]
