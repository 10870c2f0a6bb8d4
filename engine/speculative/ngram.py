"""N-gram (prompt lookup) proposals on the host: copy what followed the last time the
sequence's current ending appeared in its own prompt or output.

Host code: NumPy only.
"""

from __future__ import annotations

import numpy as np


def propose(
    tokens: np.ndarray,  # i32[L]: prompt + output so far
    *,
    min_n: int,
    max_n: int,
    k: int,
) -> np.ndarray:  # i32[<= k]
    """The up to `k` tokens that followed the most recent earlier occurrence of the sequence's
    longest ending n-gram, `min_n` <= n <= `max_n` (empty: no such n-gram).

    Candidates are the earlier positions holding the last token; each is extended backwards,
    all at once, while it keeps matching, so the cost is one pass over the sequence plus
    `max_n` passes over the candidates."""
    length = len(tokens)
    if length < min_n + 1 or k < 1:
        return tokens[:0]
    ends = np.flatnonzero(tokens[: length - 1] == tokens[-1])  # i[C]: candidate match ends
    matched = np.ones(len(ends), np.int64)  # i[C]: matched length so far
    alive = np.ones(len(ends), bool)
    for m in range(1, max_n):
        if length - 1 - m < 0:
            break
        back = ends - m
        alive &= back >= 0
        alive[alive] &= tokens[back[alive]] == tokens[length - 1 - m]
        matched += alive
    good = np.flatnonzero(matched >= min_n)
    if len(good) == 0:
        return tokens[:0]
    longest = matched[good].max()
    end = ends[good[matched[good] == longest][-1]]  # the most recent of the longest
    return tokens[end + 1 : end + 1 + k]
