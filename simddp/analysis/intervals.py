"""Interval arithmetic on sorted, disjoint lists of ``(start, end)`` pairs (seconds)."""

from __future__ import annotations

import bisect
from operator import itemgetter
from typing import Iterable

__all__ = ["union", "clip", "measure", "intersection"]

Intervals = list[tuple[float, float]]
_end = itemgetter(1)


def union(ivals: Iterable[tuple[float, float]]) -> Intervals:
    """The sorted, disjoint union of ``ivals`` (empty intervals dropped)."""
    out: Intervals = []
    for s, e in sorted(ivals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def clip(merged: Intervals, lo: float, hi: float) -> Intervals:
    """The part of ``merged`` (a union) inside ``[lo, hi]``."""
    n = len(merged)
    i = 0
    if n and merged[0][1] <= lo:  # the window starts past the first interval: bisect to it
        i = bisect.bisect_right(merged, lo, key=_end)
    out = []
    while i < n:
        s, e = merged[i]
        if s >= hi:
            break
        if s < lo:
            s = lo
        if e > hi:
            e = hi
        if e > s:
            out.append((s, e))
        i += 1
    return out


def measure(ivals: Intervals) -> float:
    return sum(e - s for s, e in ivals)


def intersection(a: Intervals, b: Intervals) -> float:
    """The length of the intersection of two unions."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            total += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
