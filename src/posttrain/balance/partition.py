"""Partition weighted items into ``k`` sets with sums as equal as possible.

``karmarkar_karp`` is the multi-way largest differencing method (Karmarkar & Karp, 1982, as
used by the ODC reference); ``greedy`` is longest-processing-time first (LPT); ``refine`` is a
local search between the heaviest set, the lightest set and every other set, best transfer
first (see [Note: refine]). ``refined_starts`` refines KK and LPT; ``balanced_partition`` keeps
the smallest spread of those (and of round-robin, refined, where that starts out tighter), so it
is never worse than any of its starting points.

Every function returns ``k`` lists of item indices; each index appears exactly once.

[Note: refine]
A transfer of weight ``d`` (one item moved, or the difference of items swapped) from a set with
sum ``a`` to one with sum ``b < a`` lowers ``a**2 + b**2`` by ``2 d (a - b - d)``, positive
exactly when ``0 < d < a - b``: neither set ends above ``a`` or below ``b``, so the largest sum
never rises and the smallest never falls. Every step below makes only such transfers, so the
sum of squares falls strictly and the search ends.

1. Sweeps (at most ``_SWEEPS``): pair the i-th heaviest set with the i-th lightest and make each
   pair's best move or swap, all pairs at once (they are disjoint). Cheap vectorized passes that
   do most of the work when ``k`` is large: they leave fewer single transfers, and cheaper ones
   (narrower gaps).
2. Rounds: the transfer with the largest drop among (a) the heaviest set against every other
   set and (b) every set against the lightest, each a single move or a one-for-one swap.
3. When no round transfer exists, an exchange of up to two items of the heaviest set for up to
   two of the lightest (``_bundle_transfer``); then transfers again.
It stops when neither 2 nor 3 finds a transfer (or after ``max_transfers`` of them): then no move
or swap between the heaviest set and any other lowers the larger of the two, and none between
any set and the lightest raises the smaller.

Partners are found by bisection, not by trying all ``O(n^2)`` pairs: with the items sorted by
weight, an item ``x`` of the heaviest set can only swap with a ``y`` with ``w_x - G < w_y < w_x``
(``G`` the spread), a contiguous slice found with ``np.searchsorted``; a move is a swap with a
weightless sentinel item that always sits in the lightest set. After KK the spread is small, so
the slices are short and a round costs a few dozen vectorized operations.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

import numpy as np

__all__ = ["balanced_partition", "greedy", "karmarkar_karp", "refine", "refine_transfers", "refined_starts",
           "round_robin", "spread"]

# Transfers must beat this fraction of the largest set sum: float noise in the running sums
# must not count as an improvement (which could cycle).
_REL_TOL = 1e-12
# refine's vectorized sweeps: at most this many, each over at most this many (pair, x, y) cells
# (beyond that, e.g. 2 sets of thousands of items, bisecting alone is cheaper).
_SWEEPS = 8
_SWEEP_CELLS = 1 << 21
# refine's two-for-two exchanges: only between sets of at most this many items (pairs ~ n^2 / 2)
_BUNDLE_ITEMS = 128
# refine's transfers try at most this many partners per item first (see _best_transfer)
_PARTNERS = 64


def _check(weights: Sequence[float], k: int) -> None:
    if k < 1:
        raise ValueError(f"cannot partition into k={k} sets; k must be at least 1")
    for i, w in enumerate(weights):
        if not w >= 0:  # also catches NaN
            raise ValueError(f"weight {i} is {w}; weights must be non-negative numbers")


def spread(parts: list[list[int]], weights: Sequence[float]) -> float:
    """``max - min`` of the set sums.

    Args:
        parts: item indices per set.
        weights: weight per item index.
    """
    sums = [sum(weights[i] for i in p) for p in parts]
    return max(sums) - min(sums)


def round_robin(weights: Sequence[float], k: int) -> list[list[int]]:
    """Item ``i`` to set ``i % k``.

    Args:
        weights: weight per item (only checked; round-robin ignores them).
        k: number of sets.
    """
    _check(weights, k)
    return [list(range(r, len(weights), k)) for r in range(k)]


def greedy(weights: Sequence[float], k: int) -> list[list[int]]:
    """Heaviest item first onto the lightest set (LPT).

    Args:
        weights: weight per item.
        k: number of sets.
    """
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

    A tuple is kept as its ``k`` sums only; which items a set holds is recovered at the end by
    replaying the merges backwards. Nearly every merge joins a tuple and a single item, which
    just adds the item to the lightest set: one ``O(log k)`` bisection and a list insert, not a
    sort of ``k`` sets (two tuples are merged with a numpy sort).

    Args:
        weights: weight per item.
        k: number of sets.
    """
    _check(weights, k)
    n = len(weights)
    if k == 1 or n == 0:
        return [list(range(n))] + [[] for _ in range(k - 1)]
    w = [float(x) for x in weights]
    # State ids 0..n-1 are single items; ids from n are tuples, kept as their negated sums in
    # ascending order (heaviest set first), so ``bisect`` keeps them sorted.
    neg: dict[int, list[float]] = {}
    heap = [(-w[i], i, i) for i in range(n)]  # (-spread, tie-break, state id)
    heapq.heapify(heap)
    # ("seed", state, item): item alone in slot 0 of a new state.
    # ("add", parent, state, item, p): item added to state's lightest set, which lands in slot p.
    # ("merge", parent, a, b, perm): parent slot j holds a's slot perm[j] and b's slot k-1-perm[j].
    log: list[tuple] = []
    next_id = n

    def as_state(i: int) -> int:
        nonlocal next_id
        if i >= n:
            return i
        neg[next_id] = [-w[i]] + [0.0] * (k - 1)
        log.append(("seed", next_id, i))
        next_id += 1
        return next_id - 1

    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        if a < n and b >= n:
            a, b = b, a
        a = as_state(a)
        s = neg.pop(a)
        if b < n:  # the single item pairs with the lightest set; the rest pair with empties
            v = s.pop() - w[b]
            p = bisect.bisect_right(s, v)
            s.insert(p, v)
            log.append(("add", next_id, a, b, p))
        else:
            merged = np.asarray(s) + np.asarray(neg.pop(b))[::-1]
            perm = np.argsort(merged, kind="stable")
            s = merged[perm].tolist()
            log.append(("merge", next_id, a, b, perm))
        neg[next_id] = s
        heapq.heappush(heap, (s[0] - s[-1], next_id, next_id))
        next_id += 1
    owner = [0] * n
    root = heap[0][2]
    maps: dict[int, list[int]] = {root: list(range(k))}  # state -> final set of each of its slots
    for rec in reversed(log):
        if rec[0] == "add":
            _, parent, child, item, p = rec
            pm = maps.pop(parent)  # reused in place: the child's map differs by one slot moved
            owner[item] = pm[p]
            pm.append(pm.pop(p))
            maps[child] = pm
        elif rec[0] == "seed":
            owner[rec[2]] = maps.pop(rec[1])[0]
        else:
            _, parent, a, b, perm = rec
            pm = np.asarray(maps.pop(parent))
            for child, slots in ((a, perm), (b, k - 1 - perm)):
                child_map = np.empty(k, dtype=np.int64)
                child_map[slots] = pm
                maps[child] = child_map.tolist()
    parts: list[list[int]] = [[] for _ in range(k)]
    for i, r in enumerate(owner):
        parts[r].append(i)
    return parts


def refine(parts: list[list[int]], weights: Sequence[float], *, max_transfers: int = 1000) -> list[list[int]]:
    """Local search between the heaviest set, the lightest and every other set, best transfer
    first, while one narrows a gap. See [Note: refine].

    The largest set sum never rises and the smallest never falls. Returns new lists (each set's
    indices ascending); the input is not modified. Deterministic.

    Args:
        parts: item indices per set, each index at most once; indices in no set stay out.
        weights: weight per item index (non-negative).
        max_transfers: most transfers after the sweeps (0: return the input unchanged). From a KK
            or LPT start ``k`` sets need about ``k`` to ``2 k``; :func:`refine_transfers` gives a
            budget that scales with the problem.

    Raises:
        ValueError: an index appears twice or is out of range, a weight is negative, or
            ``max_transfers`` is negative.
    """
    if max_transfers < 0:
        raise ValueError(f"max_transfers={max_transfers} must be non-negative; pass 0 to skip the search")
    k = len(parts)
    if k == 0:
        return []
    items = np.fromiter((i for p in parts for i in p), dtype=np.int64)
    if len(items) and (items.min() < 0 or items.max() >= len(weights)):
        bad = int(items.min() if items.min() < 0 else items.max())
        raise ValueError(f"parts hold index {bad}, outside the {len(weights)} weights; pass one weight per item")
    if len(items) and np.bincount(items).max() > 1:
        dup = int(np.argmax(np.bincount(items)))
        raise ValueError(f"parts hold index {dup} more than once; every item belongs to at most one set")
    w_items = np.asarray(weights, dtype=float)[items]
    if not (w_items >= 0).all():
        bad = int(items[np.flatnonzero(~(w_items >= 0))[0]])
        raise ValueError(f"weight {bad} is {weights[bad]}; weights must be non-negative numbers")
    order = np.argsort(w_items, kind="stable")
    # Position 0 is a weightless sentinel that always sits in the lightest set: swapping an item
    # for it is a plain move there, so moves need no search of their own; with non-negative
    # weights it keeps the order sorted.
    item = np.concatenate(([-1], items[order]))  # position -> item index
    sw = np.concatenate(([0.0], w_items[order]))  # ascending weights
    own = np.concatenate(([0], np.repeat(np.arange(k), [len(p) for p in parts])[order]))  # -> set
    sums = np.bincount(own[1:], weights=sw[1:], minlength=k)
    tol = _REL_TOL * float(sums.max())
    for _ in range(_SWEEPS if max_transfers else 0):
        if not _sweep(sw, own, sums, tol):
            break
    for _ in range(max_transfers):
        hi, lo = int(np.argmax(sums)), int(np.argmin(sums))
        gap = sums[hi] - sums[lo]
        if gap <= 2 * tol:
            break
        own[0] = lo
        best = _best_transfer(sw, own, sums, hi, lo, gap, tol)
        if best is None:
            if _bundle_transfer(sw, own, sums, hi, lo, gap, tol):
                continue
            break
        p, q = best
        src, dst = int(own[p]), int(own[q])
        d = sw[p] - sw[q]
        own[p] = dst
        if q:  # a swap; q == 0 is the sentinel (a move)
            own[q] = src
        sums[src] -= d
        sums[dst] += d
    parts_out: list[list[int]] = [[] for _ in range(k)]
    by_index = np.argsort(item[1:], kind="stable") + 1
    for i, r in zip(item[by_index].tolist(), own[by_index].tolist()):
        parts_out[r].append(i)
    return parts_out


def _sweep(sw: np.ndarray, own: np.ndarray, sums: np.ndarray, tol: float) -> int:
    """Pair the i-th heaviest set with the i-th lightest and make each pair's best move or swap
    (the pairs are disjoint, so all at once); returns how many pairs changed."""
    k = len(sums)
    cnt = np.bincount(own[1:], minlength=k)
    width = int(cnt.max()) + 1  # a spare column for the sentinel: a swap with it is a move
    npairs = k // 2
    if npairs == 0 or npairs * width * width > _SWEEP_CELLS:
        return 0
    # members[s]: positions of set s in ascending weight, padded with the sentinel (weight 0)
    by_set = np.argsort(own[1:], kind="stable") + 1
    members = np.zeros((k, width), dtype=np.int64)
    members[own[by_set], np.arange(len(by_set)) - np.repeat(np.cumsum(cnt) - cnt, cnt)] = by_set
    order = np.argsort(-sums, kind="stable")
    heavy, light = order[:npairs], order[::-1][:npairs]
    xa, yb = members[heavy], members[light]
    d = sw[xa][:, :, None] - sw[yb][:, None, :]  # (pair, x, y): weight going heavy -> light
    rest = (sums[heavy] - sums[light])[:, None, None] - d
    score = np.where((d > tol) & (rest > tol), d * rest, -1.0).reshape(npairs, -1)
    best = np.argmax(score, axis=1)
    i = np.flatnonzero(score[np.arange(npairs), best] > 0)
    if not len(i):
        return 0
    x, y = xa[i, best[i] // width], yb[i, best[i] % width]  # x is never padding: it would give d <= 0
    moved = sw[x] - sw[y]
    own[x] = light[i]
    own[y[y > 0]] = heavy[i][y > 0]
    sums[heavy[i]] -= moved
    sums[light[i]] += moved
    return len(i)


def _best_transfer(sw: np.ndarray, own: np.ndarray, sums: np.ndarray, hi: int, lo: int, gap: float,
                   tol: float, capped: bool = True) -> tuple[int, int] | None:
    """The round transfer with the largest drop of the sum of squares, as the positions (p, q)
    of the item going from its set to q's and of the one coming back (q == 0: the sentinel, so
    a move); None if none narrows a gap by more than ``tol``."""
    # Anchors: each x in hi, whose partners are the lighter y with w_x - gap < w_y < w_x (the
    # sentinel among them: x moves to lo), and each y in lo (the sentinel too: a move into lo),
    # whose partners are the heavier x with w_y < w_x < w_y + gap. Partners: a slice each.
    xs = np.flatnonzero(own == hi)
    anchors = np.concatenate((xs, np.flatnonzero(own == lo)))
    low = sw[anchors]  # partners lie in (low, low + gap)
    low[:len(xs)] -= gap
    starts = np.searchsorted(sw, low + tol, side="right")
    counts = np.searchsorted(sw, low + (gap - tol), side="left") - starts
    np.maximum(counts, 0, out=counts)
    if capped and counts.max(initial=0) > _PARTNERS:
        # Many light items within the gap (e.g. thousands of short sequences): first try only
        # _PARTNERS per anchor next to its own weight (small transfers, which fit under most
        # sets' gaps) and _PARTNERS around the middle of the slice (transfers of ~gap / 2, the
        # best against the opposite extreme set). Only if none improves are all tried, so the
        # stopping rule stays exact.
        nx = len(xs)
        last = np.maximum(starts + counts - _PARTNERS, starts)  # the last start that leaves _PARTNERS
        mid = np.clip(np.searchsorted(sw, low + gap / 2) - _PARTNERS // 2, starts, last)
        near = np.concatenate((last[:nx], starts[nx:]))  # hi anchors: the top; lo anchors: the bottom
        cap = np.minimum(counts, _PARTNERS)
        best = _best_pair(sw, own, sums, np.concatenate((anchors[:nx], anchors[:nx], anchors[nx:], anchors[nx:])),
                          2 * nx, np.concatenate((near[:nx], mid[:nx], near[nx:], mid[nx:])),
                          np.concatenate((cap[:nx], cap[:nx], cap[nx:], cap[nx:])), tol)
        return best if best is not None else _best_transfer(sw, own, sums, hi, lo, gap, tol, capped=False)
    return _best_pair(sw, own, sums, anchors, len(xs), starts, counts, tol)


def _best_pair(sw: np.ndarray, own: np.ndarray, sums: np.ndarray, anchors: np.ndarray, nx: int,
               starts: np.ndarray, counts: np.ndarray, tol: float) -> tuple[int, int] | None:
    """The best (p, q) among each anchor with the partners ``starts[i] .. starts[i] + counts[i]``
    (anchors ``:nx`` are the heavier item of their pairs)."""
    total = int(counts.sum())
    if not total:
        return None
    # every (anchor, partner) pair, flattened: which anchor, and the partner's position
    which = np.repeat(np.arange(len(anchors)), counts)
    partner = np.arange(total) + (starts + counts - np.cumsum(counts))[which]
    anchor = anchors[which]
    p = np.where(which < nx, anchor, partner)  # the heavier of the two: src -> dst
    q = anchor + partner - p
    d = sw[p] - sw[q]  # > tol by the slice bounds
    rest = sums[own[p]] - sums[own[q]] - d  # the gap left between the two sets
    score = np.where(rest > tol, d * rest, -1.0)  # half the drop of the sum of squares
    j = int(np.argmax(score))
    return (int(p[j]), int(q[j])) if score[j] > 0 else None


def _bundles(pos: np.ndarray, sw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Nothing, each item and each pair of the items at ``pos``: (weight, first, second), with
    position 0 (the sentinel) for "no item"."""
    i, j = np.triu_indices(len(pos), 1)
    zero = np.zeros(1, dtype=np.int64)
    first = np.concatenate((zero, pos, pos[i]))
    second = np.concatenate((zero, np.zeros(len(pos), dtype=np.int64), pos[j]))
    return sw[first] + sw[second], first, second


def _bundle_transfer(sw: np.ndarray, own: np.ndarray, sums: np.ndarray, hi: int, lo: int, gap: float,
                     tol: float) -> bool:
    """Make the exchange of up to two items of the heaviest set for up to two of the lightest
    that narrows their gap best; False if none narrows it (or a set is too big to try)."""
    xs, ys = np.flatnonzero(own == hi), np.flatnonzero(own[1:] == lo) + 1
    if max(len(xs), len(ys)) > _BUNDLE_ITEMS:
        return False
    a, a1, a2 = _bundles(xs, sw)
    b, b1, b2 = _bundles(ys, sw)
    order = np.argsort(b, kind="stable")
    b, b1, b2 = b[order], b1[order], b2[order]
    # the best partner of a bundle of hi weighs about (its weight - gap / 2): try the two nearest
    near = np.searchsorted(b, a - gap / 2)
    cand = np.stack((np.maximum(near - 1, 0), np.minimum(near, len(b) - 1)), axis=1)
    d = a[:, None] - b[cand]
    score = np.where((d > tol) & (gap - d > tol), d * (gap - d), -1.0)
    i, j = divmod(int(np.argmax(score)), 2)
    if score[i, j] <= 0:
        return False
    for p in (a1[i], a2[i]):
        if p:
            own[p] = lo
    for q in (b1[cand[i, j]], b2[cand[i, j]]):
        if q:
            own[q] = hi
    sums[hi] -= d[i, j]
    sums[lo] += d[i, j]
    return True


def refined_starts(weights: Sequence[float], k: int, *, good_enough: float | None = None) -> list[list[list[int]]]:
    """KK refined, then LPT refined unless it starts from the same split (with many items per
    set, KK mostly adds each item to the lightest set, just as LPT does, and equal weights are
    common) or KK's refined heaviest set is already within ``good_enough`` of the mean.

    Args:
        weights: weight per item.
        k: number of sets.
        good_enough: skip the second start when ``max / mean - 1`` of the set sums is at most
            this (None: always try it). A second start mostly trims the tail (the worst of many
            minibatches).
    """
    transfers = refine_transfers(len(weights), k)
    kk_start = karmarkar_karp(weights, k)
    kk = refine(kk_start, weights, max_transfers=transfers)
    if good_enough is not None:
        sums = [sum(weights[i] for i in p) for p in kk]
        if max(sums) <= sum(sums) / k * (1 + good_enough):
            return [kk]
    lpt = greedy(weights, k)
    if _shape(kk_start, weights) == _shape(lpt, weights):
        return [kk]
    return [kk, refine(lpt, weights, max_transfers=transfers)]


def _shape(parts: list[list[int]], weights: Sequence[float]) -> list[tuple[float, ...]]:
    """The split up to relabelling sets and swapping items of equal weight (which refine
    treats alike)."""
    return sorted(tuple(sorted(weights[i] for i in p)) for p in parts)


def balanced_partition(weights: Sequence[float], k: int) -> list[list[int]]:
    """The smallest-spread result of KK and LPT, each refined by local search; round-robin is
    refined too where it starts out tighter than both, so the result is never worse than it.

    Args:
        weights: weight per item.
        k: number of sets.
    """
    candidates = refined_starts(weights, k)
    rr = round_robin(weights, k)
    if spread(rr, weights) < min(spread(p, weights) for p in candidates):
        candidates.append(refine(rr, weights, max_transfers=refine_transfers(len(weights), k)))
    return min(candidates, key=lambda p: (spread(p, weights), max(sum(weights[i] for i in s) for s in p)))


def refine_transfers(n: int, k: int) -> int:
    """A :func:`refine` budget for ``n`` items over ``k`` sets: KK and LPT starts need about
    ``k`` to ``2 k`` transfers; this leaves room for worse starts and stops pathological inputs.

    Args:
        n: number of items.
        k: number of sets.
    """
    return max(1000, 4 * (n + k))
