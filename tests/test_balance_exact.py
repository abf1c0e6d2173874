"""The exact min-max partition behind the partition bound. A failure pinpoints a search that
misses the optimum, loses or duplicates an item, or claims optimality it did not prove."""

from __future__ import annotations

import itertools
import random

import pytest

from posttrain.balance.exact import min_max_partition


def _brute(weights, k):
    best = None
    for assign in itertools.product(range(k), repeat=len(weights)):
        loads = [0.0] * k
        for i, s in enumerate(assign):
            loads[s] += weights[i]
        best = max(loads) if best is None else min(best, max(loads))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_min_max_partition_is_optimal_on_small_cases(seed):
    rng = random.Random(seed)
    n, k = rng.randint(1, 8), rng.randint(1, 4)
    weights = [rng.choice([rng.random() * 100, float(rng.randint(1, 5))]) for _ in range(n)]
    parts, exact = min_max_partition(weights, k)
    assert exact and len(parts) == k
    assert sorted(i for p in parts for i in p) == list(range(n))
    assert max(sum(weights[i] for i in p) for p in parts) == pytest.approx(_brute(weights, k))


def test_min_max_partition_beats_greedy_where_greedy_is_not_optimal():
    """3, 3, 2, 2, 2 into 2 sets: longest-first greedy gives 7 (3+2+2 | 3+2), the optimum is 6 (3+3 | 2+2+2)."""
    parts, exact = min_max_partition([3, 3, 2, 2, 2], 2)
    assert exact and max(sum([3, 3, 2, 2, 2][i] for i in p) for p in parts) == 6


def test_large_cases_fall_back_to_the_heuristic_and_say_so():
    rng = random.Random(0)
    weights = [rng.lognormvariate(7, 1) for _ in range(40)]
    parts, exact = min_max_partition(weights, 4, max_items_exact=24)
    assert sorted(i for p in parts for i in p) == list(range(40))
    assert not exact or max(sum(weights[i] for i in p) for p in parts) <= sum(weights) / 4 * (1 + 1e-9)
