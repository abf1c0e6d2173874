"""Context parallelism in the plan: the longest sequences split across ranks (planning only).

[Note: splitting a sequence]
ODC balances whole sequences, so its best step is the partition bound: one sequence longer than a
rank's even share bounds the step however the rest is placed. A sequence of ``n`` tokens split
into ``k`` *shards* on ``k`` ranks (its *group*) costs each of them about ``cost(n) / k`` plus the
exchange of keys and values inside the group:

- **causal balance** (:func:`zigzag`): the sequence is cut into ``2k`` chunks of near-equal size
  and shard ``i`` takes chunks ``i`` and ``2k-1-i``, so every shard holds the same tokens and the
  same causal attention work (the front chunks attend to few keys, the back ones to many);
- **exchange** (:class:`ExchangeCost`): each shard's attention needs every earlier key and value
  of the sequence, so the group all-gathers them in forward (each rank receives ``(k-1)/k`` of
  them, every layer) and returns their gradients in backward (a reduce-scatter of the same size).
  Its cost in the cost model's units is ``per_token * n * (k-1)/k + fixed``;
- **alignment**: a group's shards must run at the same time on its ranks. An ODC minibatch starts
  with every rank synchronized, so the plan puts every rank's shards first, in one order shared
  by all ranks (by sequence id): two groups never wait for each other.

:func:`plan_context` starts from the whole-sequence plan (``diff_micro``) and splits a sequence
(the costliest first, into the ``k`` that helps most) only where that lowers the predicted step:
the busiest rank's cost, shards included. ``context_parallel`` ``off`` never splits, ``auto``
chooses ``k`` per sequence from 2 to the world size, an integer ``K`` splits into ``K`` shards
only. A sequence longer than ``max_tokens`` must be split (into enough shards to fit).

[Note: the margin]
The plan compares predictions, and a prediction errs (the exchange's price most): a split that
saves a little on paper may lose in the run. ``min_gain`` hedges that, but on the splits the search
takes together, not on each: where several ranks tie at the top (many ranks, sequences of similar
cost), no split alone lowers the step, only several do. A margin on each split stopped the search
there (16 ranks, long_tail, 2 sequences a rank: 2 splits and 1.48x FSDP predicted, against 7 splits
and 2.95x without a margin). So the search runs without one, and the plan keeps its splits up to the
last point where the splits since the previous kept point (or since none) lower the step by more
than ``min_gain``; splits after it, which gain less together or only move ties, are dropped.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from .cost import CostModel, ModelShape, TokenCost
from .packing import pack_share, shard_lengths, zigzag
from .partition import refined_starts
from .plan import Microbatch

__all__ = ["ContextPlan", "ExchangeCost", "Shard", "plan_context", "shard_lengths", "zigzag"]


@dataclass(frozen=True)
class ExchangeCost:
    """What moving a split sequence's keys and values costs each rank of its group, in the cost
    model's units: ``per_token`` per token of the sequence (scaled by ``(k-1)/k``, the share each
    rank receives) plus ``fixed`` (the collectives' own cost, whatever their size).

    Attributes:
        per_token: cost units per token of the sequence exchanged (forward all-gather and backward
            reduce-scatter together).
        fixed: cost units a split sequence costs each of its ranks besides (one all-gather and one
            reduce-scatter a layer).
    """

    per_token: float = 0.0
    fixed: float = 0.0

    def __post_init__(self) -> None:
        if self.per_token < 0 or self.fixed < 0:
            raise ValueError(f"ExchangeCost per_token={self.per_token} and fixed={self.fixed} must be >= 0")

    @classmethod
    def for_shape(cls, shape: ModelShape, *, flops_per_byte: float, dtype_bytes: int = 2,
                  flops_per_call: float = 0.0) -> ExchangeCost:
        """For a FLOPs cost model (:class:`~posttrain.balance.FlopsCost`): the bytes of keys and
        values of one token over every layer, twice (forward and backward), at ``flops_per_byte``
        (the device's compute rate over its exchange bandwidth), and ``flops_per_call`` for each of
        a layer's two collectives (the rate times their latency)."""
        kv = 2 * shape.num_layers * shape.kv_heads * shape.head_dim * dtype_bytes
        return cls(per_token=2.0 * kv * flops_per_byte, fixed=2.0 * shape.num_layers * flops_per_call)

    def __call__(self, n: int, k: int) -> float:
        return self.per_token * n * (k - 1) / k + self.fixed if k > 1 else 0.0


@dataclass(frozen=True)
class Shard:
    """One rank's part of a split sequence.

    Attributes:
        sequence_id: the sequence.
        index: which shard (``0 .. num_shards-1``; its tokens: :func:`zigzag`).
        num_shards: how many the sequence was split into.
        group: the ranks holding its shards, in shard order.
        num_tokens: this shard's tokens.
        cost: this shard's predicted cost (its share of the sequence and of the exchange).
    """

    sequence_id: int
    index: int
    num_shards: int
    group: tuple[int, ...]
    num_tokens: int
    cost: float


@dataclass(frozen=True)
class ContextPlan:
    """A minibatch plan with split sequences: per rank, its shards (run first, in the shared order)
    and its microbatches of whole sequences. See [Note: splitting a sequence].

    Attributes:
        world_size: ranks.
        max_tokens: the microbatch token budget (every shard holds at most this many tokens).
        shards: ``shards[r]``: rank ``r``'s shards, in the order every rank runs its groups.
        ranks: ``ranks[r]``: rank ``r``'s microbatches of whole sequences, after its shards.
        split: sequence id -> its number of shards.
        lengths: tokens per sequence.
    """

    world_size: int
    max_tokens: int
    shards: tuple[tuple[Shard, ...], ...]
    ranks: tuple[tuple[Microbatch, ...], ...]
    split: dict[int, int] = field(default_factory=dict)
    lengths: tuple[int, ...] = ()

    @property
    def rank_costs(self) -> list[float]:
        return [sum(s.cost for s in sh) + sum(m.cost for m in mbs) for sh, mbs in zip(self.shards, self.ranks)]

    @property
    def rank_tokens(self) -> list[int]:
        """Tokens each rank runs, its shards' included (together every sequence's tokens once)."""
        return [sum(s.num_tokens for s in sh) + sum(m.num_tokens for m in mbs) for sh, mbs in zip(self.shards, self.ranks)]

    def microbatches_for(self, rank: int) -> tuple[Microbatch, ...]:
        """Rank ``rank``'s microbatches of whole sequences (after its shards)."""
        return self.ranks[rank]

    def shards_for(self, rank: int) -> tuple[Shard, ...]:
        """Rank ``rank``'s shards, in the order every rank runs its groups."""
        return self.shards[rank]

    @property
    def groups(self) -> list[tuple[int, ...]]:
        """The distinct groups of ranks holding a split sequence, sorted (every rank computes the same list)."""
        return sorted({s.group for sh in self.shards for s in sh})

    def step_time(self) -> float:
        """The busiest rank's predicted cost (ODC: ranks meet once per minibatch)."""
        return max(self.rank_costs)

    def summary(self) -> str:
        lines = [f"context plan: {len(self.lengths)} sequences, {self.world_size} ranks, split "
                 + (", ".join(f"{s} into {k}" for s, k in sorted(self.split.items())) or "none")
                 + f"; step time {self.step_time():.4g}"]
        for r in range(self.world_size):
            lines.append(f"  rank {r}: shards {[(s.sequence_id, s.index) for s in self.shards[r]]}, "
                         f"{len(self.ranks[r])} microbatches, cost {self.rank_costs[r]:.4g}")
        return "\n".join(lines)


def _assign(lengths: Sequence[int], costs: Sequence[float], split: dict[int, int], world_size: int,
            cost: CostModel, exchange: ExchangeCost, partitions: dict | None = None
            ) -> tuple[list[list[int]], dict[int, tuple[int, ...]], list[float]]:
    """Two placements, the lighter busiest rank wins: (1) the whole sequences partitioned over the
    ranks as ``diff_micro`` does, then each split sequence's shards (costliest first) on the least
    loaded ranks; (2) the shards first, then the whole sequences costliest first onto the least
    loaded rank. Returns the whole sequences per rank, each split sequence's group, the loads.
    ``partitions``: placement (1)'s partitions of the whole sequences, kept by which sequences are
    split (the search tries every shard count of a sequence on the same whole sequences)."""
    whole = [i for i in range(len(lengths)) if i not in split]
    shard_cost = {s: cost(lengths[s]) / k + exchange(lengths[s], k) for s, k in split.items()}
    order = sorted(split, key=lambda s: (-shard_cost[s], s))

    def place_shards(loads: list[float]) -> dict[int, tuple[int, ...]]:
        groups = {}
        heap = [(x, r) for r, x in enumerate(loads)]  # (the least loaded ranks, ties by rank)
        heapq.heapify(heap)
        for s in order:
            group = tuple(sorted(heapq.heappop(heap)[1] for _ in range(split[s])))
            groups[s] = group
            for r in group:
                loads[r] += shard_cost[s]
                heapq.heappush(heap, (loads[r], r))
        return groups

    key = tuple(sorted(split))
    parts1 = partitions.get(key) if partitions is not None else None
    if parts1 is None:  # (the partitions are read, never changed: kept as they are)
        weights = [costs[i] for i in whole]
        starts = refined_starts(weights, world_size) if whole else [[[] for _ in range(world_size)]]
        local = min(starts, key=lambda p: max(sum(weights[j] for j in q) for q in p))
        parts1 = [[whole[j] for j in p] for p in local]
        if partitions is not None:
            partitions[key] = parts1
    loads1 = [sum(costs[i] for i in p) for p in parts1]
    groups1 = place_shards(loads1)

    loads2 = [0.0] * world_size
    groups2 = place_shards(loads2)
    parts2: list[list[int]] = [[] for _ in range(world_size)]
    heap = [(x, r) for r, x in enumerate(loads2)]
    heapq.heapify(heap)
    for i in sorted(whole, key=lambda i: (-costs[i], i)):
        _, r = heapq.heappop(heap)  # the least loaded rank, ties by rank
        parts2[r].append(i)
        loads2[r] += costs[i]
        heapq.heappush(heap, (loads2[r], r))
    if max(loads2) < max(loads1):
        return parts2, groups2, loads2
    return parts1, groups1, loads1


def auto_shard_counts(world_size: int) -> list[int]:
    """The shard counts ``auto`` tries on ``world_size`` ranks: every count up to 4, then steps of
    about 1.5x (6, 8, 12, 16, 24, ...) and the world size: a split's shard count needs to be
    about right, not exact, and trying every count costs the plan ``world_size`` times more at
    scale."""
    out, k = {k for k in (2, 3, 4) if k <= world_size}, 4
    while k < world_size:
        k = 6 * k // 4 if k % 4 == 0 else 4 * k // 3
        out.add(min(k, world_size))
    if world_size >= 2:
        out.add(world_size)
    return sorted(out)


def check_context_parallel(context_parallel: str | int, world_size: int) -> None:
    """Refuse, in one line, a ``context_parallel`` that is not ``off``, ``auto`` or a shard count
    from 2 to ``world_size``."""
    if context_parallel in ("off", "auto"):
        return
    if not isinstance(context_parallel, int) or context_parallel < 2:
        raise ValueError(f"context_parallel={context_parallel!r}: use off, auto or a shard count of 2 or more")
    if context_parallel > world_size:
        raise ValueError(f"context_parallel={context_parallel} shards but only {world_size} ranks")


def plan_context(lengths: Sequence[int], *, world_size: int, max_tokens: int, cost: CostModel | None = None,
                 exchange: ExchangeCost | None = None, context_parallel: str | int = "auto",
                 min_gain: float = 0.0) -> ContextPlan:
    """Plan one minibatch with sequences split across ranks where that lowers the predicted step
    (by more than ``min_gain``, a fraction of it, for each group of splits the search takes
    together). See [Note: splitting a sequence] and [Note: the margin].

    Args:
        lengths: tokens per sequence (sequence ids are positions).
        world_size: data-parallel ranks.
        max_tokens: most tokens in one microbatch or shard.
        cost: cost model ``length -> float`` (default: tokens).
        exchange: what moving a split sequence's keys and values costs (default: nothing).
        context_parallel: ``off``, ``auto`` (2 to ``world_size`` shards per sequence,
            :func:`auto_shard_counts`, chosen where it gains) or an integer ``K`` (``K`` shards).
        min_gain: the least fraction of the predicted step the splits kept must save, counted
            from the plan without them and again from each point kept (the predictions' error:
            splits that gain less may lose).

    Raises:
        ValueError: a bad ``context_parallel``, or a sequence longer than ``max_tokens`` that no
            allowed split fits.
    """
    if world_size < 1 or max_tokens < 1:
        raise ValueError(f"world_size={world_size} and max_tokens={max_tokens} must be at least 1")
    if not 0 <= min_gain < 1:
        raise ValueError(f"min_gain={min_gain} must be in [0, 1)")
    check_context_parallel(context_parallel, world_size)
    cost = cost or TokenCost()
    exchange = exchange or ExchangeCost()
    lengths = tuple(int(n) for n in lengths)
    costs = [float(cost(n)) for n in lengths]
    ks = ([] if context_parallel == "off" else
          auto_shard_counts(world_size) if context_parallel == "auto" else [int(context_parallel)])

    def fits(n: int, k: int) -> bool:
        return n >= 2 * k and max(shard_lengths(n, k)) <= max_tokens

    split: dict[int, int] = {}
    for i, n in enumerate(lengths):  # too long for a microbatch: split it (the fewest shards that fit)
        if n > max_tokens:
            k = next((k for k in ks if fits(n, k)), None)
            if k is None:
                raise ValueError(f"max_tokens={max_tokens} is smaller than sequence {i} ({n} tokens) and "
                                 f"context_parallel={context_parallel} allows no split into shards that fit; raise "
                                 "`max_tokens`, allow more shards, or drop that sequence")
            split[i] = k

    partitions: dict = {}

    def evaluate(trial: dict[int, int]):
        parts, groups, loads = _assign(lengths, costs, trial, world_size, cost, exchange, partitions)
        top = max(loads)
        return top, parts, groups, sum(1 for x in loads if x >= top * (1 - 1e-9))

    best_step, parts, groups, at_top = evaluate(split)
    # the costliest sequences first, down to an eighth of a rank's even share: a sequence that
    # cannot bound the step may still level the ranks split (the long one split in two leaves its
    # ranks uneven by the short one beside it; split too, the short one evens them)
    even = sum(costs) / world_size
    # (a sequence already split may be split further: into 2 first, then more where its shards
    # become the busiest ranks' load)
    candidates = [i for i in sorted(range(len(lengths)), key=lambda i: -costs[i])
                  if i in split or costs[i] > even / 8][: 2 * world_size]
    # the search takes a split that lowers the busiest rank, or keeps it with fewer ranks at it
    # (ranks tied at the top need a split each before the step falls: one at a time, none alone
    # would lower it); the plan keeps the splits up to the last point where those taken since the
    # last kept point lowered the step by more than ``min_gain`` together (a margin on each split
    # alone stopped the search where many ranks tie at the top, see [Note: the margin])
    kept = (best_step, parts, groups, dict(split))
    improved = True
    while improved and ks:
        improved = False
        trial_best = None
        for i in candidates:
            for k in ks:
                if k <= split.get(i, 1) or not fits(lengths[i], k):
                    continue
                got = evaluate({**split, i: k})
                better = got[0] < best_step * (1 - 1e-9) or (got[0] <= best_step * (1 + 1e-12) and got[3] < at_top)
                if better and (trial_best is None or (got[0], got[3]) < (trial_best[0][0], trial_best[0][3])):
                    trial_best = (got, i, k)
        if trial_best is not None:
            (best_step, parts, groups, at_top), i, k = trial_best
            split[i] = k
            improved = True
            if best_step < kept[0] * (1 - max(min_gain, 1e-9)):
                kept = (best_step, parts, groups, dict(split))
    best_step, parts, groups, split = kept
    shards: list[list[Shard]] = [[] for _ in range(world_size)]
    for s in sorted(split):  # one order for every rank: groups never wait for each other
        k = split[s]
        per = cost(lengths[s]) / k + exchange(lengths[s], k)
        for idx, (r, n_tok) in enumerate(zip(groups[s], shard_lengths(lengths[s], k))):
            shards[r].append(Shard(s, idx, k, groups[s], n_tok, per))
    ranks = tuple(tuple(Microbatch(tuple(mb), sum(lengths[i] for i in mb), sum(costs[i] for i in mb))
                        for mb in pack_share(lengths, p, max_tokens)) for p in parts)
    return ContextPlan(world_size=world_size, max_tokens=max_tokens, shards=tuple(tuple(s) for s in shards),
                       ranks=ranks, split=dict(split), lengths=lengths)
