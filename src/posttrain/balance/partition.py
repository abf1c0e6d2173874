"""Partition weighted items into ``k`` sets with sums as equal as possible.

``karmarkar_karp`` is the multi-way largest differencing method (Karmarkar & Karp, 1982, as
used by the ODC reference); ``greedy`` is longest-processing-time first (LPT); ``refine`` is the
reference's local search, extended with single moves: move or swap one item between the most and
the least loaded set while that narrows their spread. ``balanced_partition`` runs all of them,
starting the local search also from round-robin, and keeps the smallest spread, so it is never
worse than any of its starting points.

Every function returns ``k`` lists of item indices; each index appears exactly once.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["balanced_partition", "greedy", "karmarkar_karp", "refine", "round_robin", "spread"]


def _check(weights: Sequence[float], k: int) -> None:
    if k < 1:
        raise ValueError(f"cannot partition into k={k} sets")
    if any(w < 0 for w in weights):
        raise ValueError("weights must be non-negative")


def spread(parts: list[list[int]], weights: Sequence[float]) -> float:
    """``max - min`` of the set sums."""
    sums = [sum(weights[i] for i in p) for p in parts]
    return max(sums) - min(sums)


def round_robin(weights: Sequence[float], k: int) -> list[list[int]]:
    _check(weights, k)
    return [list(range(r, len(weights), k)) for r in range(k)]


def greedy(weights: Sequence[float], k: int) -> list[list[int]]:
    """Heaviest item first onto the lightest set (LPT)."""
    _check(weights, k)
    heap = [(0.0, r) for r in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(weights)), key=lambda i: -weights[i]):
        total, r = heapq.heappop(heap)
        parts[r].append(i)
        heapq.heappush(heap, (total + weights[i], r))
    return parts


def karmarkar_karp(weights: Sequence[float], k: int) -> list[list[int]]:
    """Multi-way largest differencing.

    Every item starts as a k-tuple of sets (itself plus k-1 empty). Repeatedly the two tuples
    with the largest internal spread are merged, pairing the heaviest set of one with the
    lightest of the other, until one tuple remains.
    """
    _check(weights, k)
    if not weights:
        return [[] for _ in range(k)]
    heap = []
    for i, w in enumerate(weights):
        sets = [(w, [i])] + [(0.0, []) for _ in range(k - 1)]
        heap.append((-w, i, sets))  # spread of a singleton tuple is w
    heapq.heapify(heap)
    tie = len(weights)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a.sort(key=lambda s: -s[0])
        b.sort(key=lambda s: s[0])
        merged = sorted(((sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, b)), key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    return [items for _, items in heap[0][2]]


def refine(parts: list[list[int]], weights: Sequence[float], *, max_rounds: int = 1000) -> list[list[int]]:
    """Local search: move or swap one item between the heaviest and lightest set while the
    spread of that pair narrows. Returns new lists; the input is not modified."""
    parts = [list(p) for p in parts]
    sums = [sum(weights[i] for i in p) for p in parts]
    for _ in range(max_rounds):
        hi = max(range(len(parts)), key=sums.__getitem__)
        lo = min(range(len(parts)), key=sums.__getitem__)
        gap = sums[hi] - sums[lo]
        if gap <= 0:
            break
        best, best_move = gap, None
        # moving weight d from hi to lo leaves a pair spread of |gap - 2d|
        for x in parts[hi]:
            d = weights[x]
            if abs(gap - 2 * d) < best:
                best, best_move = abs(gap - 2 * d), (x, None)
            for y in parts[lo]:
                d2 = d - weights[y]
                if 0 < d2 and abs(gap - 2 * d2) < best:
                    best, best_move = abs(gap - 2 * d2), (x, y)
        if best_move is None or best >= gap - 1e-12 * max(1.0, gap):
            break
        x, y = best_move
        parts[hi].remove(x)
        parts[lo].append(x)
        sums[hi] -= weights[x]
        sums[lo] += weights[x]
        if y is not None:
            parts[lo].remove(y)
            parts[hi].append(y)
            sums[lo] -= weights[y]
            sums[hi] += weights[y]
    return parts


def balanced_partition(weights: Sequence[float], k: int) -> list[list[int]]:
    """The smallest-spread result of KK, LPT and round-robin, each refined by local search."""
    candidates = [refine(start(weights, k), weights) for start in (karmarkar_karp, greedy, round_robin)]
    return min(candidates, key=lambda p: (spread(p, weights), max(sum(weights[i] for i in s) for s in p)))
