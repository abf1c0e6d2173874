"""Minibatch plans: which sequence goes to which rank and microbatch, and what it will cost.

[Note: balancing methods]
- ``round_robin``: sequence ``i`` to rank ``i % world_size``, packed in order into microbatches.
- ``local_sort``: round-robin, then each rank packs its sequences longest first.
- ``same_micro``: the best FSDP can do. FSDP's per-layer collectives make rank ``r``'s
  microbatch ``j`` wait for every rank's microbatch ``j``, so every rank runs the same number of
  microbatches and each microbatch position ``j`` should be balanced: sequences are partitioned into
  ``count * world_size`` cost-balanced microbatches (``count`` per rank), sorted by cost, and dealt ``world_size`` at a time.
  The partition is LPT under the token budget (costliest sequence first into the cheapest
  microbatch with room); ``count`` starts at a lower bound (total tokens, and sequences over
  half the budget, which cannot share a microbatch) and grows while that fails. There is no
  local search on top: on the simulator's length profiles it barely shortens FSDP's step and
  costs more than the rest of the plan.
- ``diff_micro``: ODC. Ranks meet only at the end of the minibatch, so only each rank's *total*
  cost matters: sequences are partitioned over ranks by cost (Karmarkar-Karp, refined by local
  search: see [Note: refine] in ``partition.py``) and each rank packs its own share into as
  many microbatches as it needs. It also considers ``same_micro``'s per-rank split and keeps the
  lightest worst rank, so its worst rank is never worse than ``same_micro``'s.
Every microbatch holds at most ``max_tokens`` tokens.

``same_micro`` can contain empty microbatches (fewer sequences than microbatch slots): FSDP
trainers run a zero-weight dummy there to keep the collectives matched.

Predicted step time: ``sync="microbatch"`` (FSDP) is ``sum_j max_r cost(r, j)``; ``sync="minibatch"``
(ODC) is ``max_r sum_j cost(r, j)``. Under ``sync="microbatch"`` a rank with fewer microbatches
than others idles through the microbatches it lacks.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from .cost import CostModel, TokenCost
from .packing import pack_share
from .partition import refined_starts, round_robin

__all__ = ["METHODS", "Microbatch", "Plan", "plan_minibatch"]

METHODS = ("round_robin", "local_sort", "same_micro", "diff_micro")
Method = Literal["round_robin", "local_sort", "same_micro", "diff_micro"]


@dataclass(frozen=True)
class Microbatch:
    """Sequences processed in one forward+backward on one rank."""

    sequence_ids: tuple[int, ...]
    num_tokens: int
    cost: float


@dataclass(frozen=True)
class Plan:
    """rank -> microbatches -> sequence ids, with predicted costs. See [Note: balancing methods].

    Attributes:
        method: the balancing method that produced it.
        max_tokens: the per-microbatch token budget.
        ranks: ``ranks[r]`` is rank ``r``'s microbatches in execution order.
    """

    method: str
    max_tokens: int
    ranks: tuple[tuple[Microbatch, ...], ...]
    lengths: tuple[int, ...] = field(repr=False)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def microbatches_for(self, rank: int) -> tuple[Microbatch, ...]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside world_size={self.world_size}")
        return self.ranks[rank]

    @property
    def rank_costs(self) -> list[float]:
        return [sum(m.cost for m in mbs) for mbs in self.ranks]

    @property
    def rank_tokens(self) -> list[int]:
        return [sum(m.num_tokens for m in mbs) for mbs in self.ranks]

    @property
    def num_microbatches(self) -> list[int]:
        return [len(mbs) for mbs in self.ranks]

    @property
    def imbalance(self) -> float:
        """``max / mean`` of the ranks' total costs (1.0 is perfect)."""
        costs = self.rank_costs
        mean = sum(costs) / len(costs)
        return max(costs) / mean if mean > 0 else 1.0

    def step_time(self, sync: Literal["minibatch", "microbatch"] = "minibatch") -> float:
        """Predicted compute-bound step time in cost units (communication not included)."""
        if sync == "minibatch":
            return max(self.rank_costs)
        if sync == "microbatch":
            busiest = max(self.num_microbatches)
            return sum(
                max((mbs[j].cost if j < len(mbs) else 0.0) for mbs in self.ranks) for j in range(busiest)
            )
        raise ValueError(f"sync={sync!r} is not one of 'minibatch', 'microbatch'")

    def summary(self) -> str:
        """A few lines: per-rank microbatches, tokens, cost; imbalance and predicted step times."""
        lines = [
            f"plan {self.method}: {len(self.lengths)} sequences, {self.world_size} ranks, "
            f"max_tokens={self.max_tokens}, imbalance {self.imbalance:.3f}, step time "
            f"{self.step_time('minibatch'):.4g} (minibatch sync) / {self.step_time('microbatch'):.4g} (per-microbatch sync)"
        ]
        for r, mbs in enumerate(self.ranks):
            lines.append(
                f"  rank {r}: {len(mbs):3d} microbatches, {self.rank_tokens[r]:7d} tokens, cost {self.rank_costs[r]:.4g}"
            )
        return "\n".join(lines)


# diff_micro's worst rank within this fraction of the mean is good enough for one start: the
# ODC reference reaches 0.01-0.06% at 8-32 ranks, and 0.03% is ~0.3 ms of a 1 s step.
_GOOD_ENOUGH = 3e-4
# _fill_bins gives up on a sequence after this many bins without room (then one more microbatch per rank is
# cheaper than a search that is quadratic in the bins).
_MAX_SKIPS = 32


def _min_per_rank(lengths: Sequence[int], world_size: int, max_tokens: int) -> int:
    """A lower bound on ``same_micro``'s microbatches per rank: the tokens must fit, and no two sequences
    longer than half the budget can share a microbatch (so trying fewer is wasted work).

    Args:
        lengths: tokens per sequence.
        world_size: ranks.
        max_tokens: the per-microbatch token budget.
    """
    by_tokens = -(-sum(lengths) // (max_tokens * world_size))
    long_ones = sum(1 for n in lengths if 2 * n > max_tokens)
    return max(1, by_tokens, -(-long_ones // world_size))


def _fill_bins(lengths: Sequence[int], costs: Sequence[float], k: int, max_tokens: int) -> list[list[int]] | None:
    """LPT under the token budget: costliest sequence first into the cheapest of ``k`` bins with
    room; None if a sequence finds no room among the cheapest ``_MAX_SKIPS + 1`` bins.

    Args:
        lengths: tokens per sequence.
        costs: cost per sequence.
        k: number of bins.
        max_tokens: the per-bin token budget.
    """
    heap = [(0.0, b) for b in range(k)]
    room = [max_tokens] * k
    bins: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(lengths)), key=lambda i: (-costs[i], -lengths[i], i)):
        skipped = []
        while True:
            if not heap or len(skipped) > _MAX_SKIPS:
                return None
            total, b = heapq.heappop(heap)
            if lengths[i] <= room[b]:
                break
            skipped.append((total, b))
        bins[b].append(i)
        room[b] -= lengths[i]
        heapq.heappush(heap, (total + costs[i], b))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return bins


def _same_micro(lengths: Sequence[int], costs: Sequence[float], world_size: int,
                max_tokens: int) -> list[list[list[int]]]:
    """Microbatches of ``count * world_size`` cost-balanced bins, dealt ``world_size`` at a time.

    Args:
        lengths: tokens per sequence.
        costs: cost per sequence.
        world_size: ranks.
        max_tokens: the per-microbatch token budget.
    """
    n = len(lengths)
    count = _min_per_rank(lengths, world_size, max_tokens)
    while True:
        if count * world_size >= n:  # one sequence per microbatch always fits
            bins = [[i] for i in range(n)] + [[] for _ in range(count * world_size - n)]
            break
        got = _fill_bins(lengths, costs, count * world_size, max_tokens)
        if got is not None:
            bins = got
            break
        count += 1
    bin_cost = [sum(costs[i] for i in b) for b in bins]
    order = sorted(range(len(bins)), key=lambda b: -bin_cost[b])
    per_rank: list[list[list[int]]] = [[] for _ in range(world_size)]
    totals = [0.0] * world_size
    for j in range(count):
        # heaviest bin of position j to the rank with the least so far (keeps totals even too)
        ranks = sorted(range(world_size), key=lambda r: (totals[r], r))
        for r, b in zip(ranks, order[j * world_size: (j + 1) * world_size]):
            per_rank[r].append(bins[b])
            totals[r] += bin_cost[b]
    # Empty bins stay: FSDP needs equal counts, so that rank runs a zero-weight dummy microbatch.
    return per_rank


def plan_minibatch(
    lengths: Sequence[int],
    *,
    world_size: int,
    max_tokens: int,
    method: Method = "diff_micro",
    cost: CostModel | None = None,
) -> Plan:
    """Assign the sequences of one minibatch to ranks and microbatches.

    Args:
        lengths: tokens per sequence; sequence ids are positions in this list.
        world_size: data-parallel ranks.
        max_tokens: most tokens in one microbatch (activation memory).
        method: one of ``round_robin``, ``local_sort``, ``same_micro``, ``diff_micro``.
        cost: cost model ``length -> float`` (default: tokens).

    Raises:
        ValueError: unknown method, bad sizes, or a sequence longer than ``max_tokens``.
    """
    if method not in METHODS:
        raise ValueError(f"unknown balancing method {method!r}; choose one of {', '.join(METHODS)}")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be at least 1")
    lengths = tuple(int(n) for n in lengths)
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"sequence {i} has length {n}; every sequence needs at least 1 token")
        if n > max_tokens:
            raise ValueError(
                f"max_tokens={max_tokens} is smaller than sequence {i} ({n} tokens); "
                "raise `max_tokens` or drop that sequence"
            )
    cost = cost or TokenCost()
    costs = [float(cost(n)) for n in lengths]

    if method in ("round_robin", "local_sort"):
        shares = round_robin(costs, world_size)
        per_rank = [pack_share(lengths, s, max_tokens, sort=method == "local_sort") for s in shares]
    elif method == "same_micro":
        per_rank = _same_micro(lengths, costs, world_size, max_tokens)
    else:
        # A second start (LPT) adds a whole refinement to the plan time; it is tried only where
        # KK's refined split leaves the worst rank more than _GOOD_ENOUGH above the mean.
        starts = refined_starts(costs, world_size, good_enough=_GOOD_ENOUGH)
        same = [[i for mb in mbs for i in mb] for mbs in _same_micro(lengths, costs, world_size, max_tokens)]
        # same_micro's split last: it wins only if strictly lighter, so diff_micro is never worse
        shares = min([*starts, same], key=lambda parts: max(sum(costs[i] for i in p) for p in parts))
        per_rank = [pack_share(lengths, s, max_tokens) for s in shares]

    ranks = tuple(
        tuple(
            Microbatch(tuple(mb), sum(lengths[i] for i in mb), sum(costs[i] for i in mb)) for mb in mbs
        )
        for mbs in per_rank
    )
    return Plan(method=method, max_tokens=max_tokens, ranks=ranks, lengths=lengths)
