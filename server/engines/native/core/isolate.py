"""Find the rows that make a batched forward fail. Pure.

A forward over rows R raised. Rows are independent in a forward, so a row that fails alone is a
culprit; bisection finds every culprit with O(c log |R|) probes (c culprits):

    culprits(R) = []          if probe(R) succeeds
                = R           if |R| == 1
                = culprits(left half) + culprits(right half)

The caller then fails the culprits only, retries the rest once, and fails the rest only if that
retry raises again (a failure that needs several rows together, or that is not about rows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def find_culprits(rows: Sequence[int], probe: Callable[[list[int]], bool]) -> list[int]:
    """rows: indices of a set whose forward failed; probe(subset) -> whether a forward over
    that subset alone succeeds. Returns the rows that fail alone (maybe none: the failure needed
    several rows together, or went away)."""
    rows = list(rows)
    if len(rows) <= 1:
        return [r for r in rows if not probe([r])]
    mid = len(rows) // 2
    return _search(rows[:mid], probe) + _search(rows[mid:], probe)


def _search(rows: list[int], probe: Callable[[list[int]], bool]) -> list[int]:
    if probe(rows):
        return []
    if len(rows) == 1:
        return rows
    mid = len(rows) // 2
    return _search(rows[:mid], probe) + _search(rows[mid:], probe)
