"""The best assignment of whole items to ``k`` sets: minimum largest set sum (multiway number
partitioning), exactly for small cases.

Used for the partition bound of a training step: no scheduler that keeps sequences whole can
finish a step before its heaviest rank, and this is the smallest heaviest rank there is.
"""

from __future__ import annotations

from collections.abc import Sequence

from .partition import balanced_partition

__all__ = ["min_max_partition"]


def min_max_partition(weights: Sequence[float], k: int, *, max_items_exact: int = 24,
                      node_limit: int = 2_000_000) -> tuple[list[list[int]], bool]:
    """Item indices per set, minimizing the largest set sum; and whether that is proven optimal.

    Branch and bound over items in decreasing weight, each placed on every set whose load differs
    from the sets already tried (sets of equal load are interchangeable), pruned by the best
    found so far and stopped at the lower bound ``max(max weight, total / k)``. Starts from
    :func:`~posttrain.balance.balanced_partition` (refined Karmarkar-Karp and LPT starts), which
    is also the answer when there are more than ``max_items_exact`` items or the
    search visits ``node_limit`` nodes without finishing (then the result is not proven optimal).

    Args:
        weights: non-negative item weights.
        k: number of sets.
        max_items_exact: largest item count searched exactly.
        node_limit: search budget.
    """
    if k < 1:
        raise ValueError(f"cannot partition into k={k} sets")
    if any(w < 0 for w in weights):
        raise ValueError("weights must be non-negative")
    start = balanced_partition(weights, k)
    best_max = max((sum(weights[i] for i in p) for p in start), default=0.0)
    n = len(weights)
    if n == 0 or k == 1:
        return start, True
    lower = max(max(weights), sum(weights) / k)
    if n > max_items_exact:
        return start, best_max <= lower * (1 + 1e-12)
    order = sorted(range(n), key=lambda i: -weights[i])
    loads = [0.0] * k
    assign = [0] * n
    best = {"max": best_max, "assign": None}
    nodes = 0
    eps = 1e-12 * max(1.0, best_max)

    def search(pos: int, current_max: float) -> bool:
        """True when the lower bound is reached (stop everything)."""
        nonlocal nodes
        nodes += 1
        if nodes > node_limit:
            return True
        if pos == n:
            if current_max < best["max"] - eps:
                best["max"], best["assign"] = current_max, list(assign)
            return best["max"] <= lower + eps
        w = weights[order[pos]]
        tried: set[float] = set()
        for s in sorted(range(k), key=loads.__getitem__):
            load = loads[s]
            if load in tried or load + w >= best["max"] - eps:
                continue
            tried.add(load)
            loads[s] = load + w
            assign[pos] = s
            done = search(pos + 1, max(current_max, load + w))
            loads[s] = load
            if done:
                return True
        return False

    search(0, 0.0)
    exact = nodes <= node_limit
    if best["assign"] is None:
        return start, exact
    parts: list[list[int]] = [[] for _ in range(k)]
    for pos, s in enumerate(best["assign"]):
        parts[s].append(order[pos])
    return parts, exact
