"""The longest common prefix of two token sequences: one definition for the prefix cache (how many
of a cached block's tokens a prompt continues) and its diagnostics (where a prompt leaves an
earlier one). No imports from the rest of trine (no torch), so every layer can use it.
"""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of `a` and `b`, two sequences of one type (a list and a
    tuple never compare equal): bisection over slice comparisons, which run in C."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
