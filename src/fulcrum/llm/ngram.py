"""Prompt-lookup (n-gram) drafting, vLLM's `ngram` speculative method: the tokens that followed
the most recent earlier occurrence of a sequence's last n tokens are proposed as its next ones."""

from __future__ import annotations

from collections.abc import Sequence as Tokens

import numpy as np


def propose_ngram(tokens: Tokens[int], *, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k draft tokens for `tokens` (prompt + output): for n from max_n down to min_n, the
    most recent earlier occurrence of the last n tokens, and the (at most k) tokens after it;
    [] when no suffix of min_n tokens or more occurred before."""
    length = len(tokens)
    if k < 1 or length < min_n + 1:
        return []
    t = np.asarray(tokens, dtype=np.int64)
    # Every earlier occurrence ends where the last token recurs (not at the end itself).
    ends = np.flatnonzero(t[: length - 1] == t[length - 1])
    if ends.size == 0:
        return []
    # match[i]: how many tokens, back from ends[i], equal the suffix (capped at max_n).
    match = np.ones(ends.size, dtype=np.int64)
    running = np.ones(ends.size, dtype=bool)
    for back in range(1, min(max_n, length - 1)):
        idx = ends - back
        running &= idx >= 0
        running &= t[np.maximum(idx, 0)] == t[length - 1 - back]
        if not running.any():
            break
        match += running
    best = int(match.max())
    if best < min_n:
        return []
    # The longest n first; among its occurrences the most recent (the last index).
    end = int(ends[np.flatnonzero(match == best)[-1]])
    return [int(x) for x in t[end + 1 : end + 1 + k]]
