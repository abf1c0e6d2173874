"""Pipeline schedule generators: ``(num_ranks, num_microbatches, ...) -> {rank: [Action]}``.

Each generator returns a :class:`Schedule`: compute actions (``F``, ``B``, or ``I`` + ``W`` when
the backward is split) in a valid per-rank order, plus the memory it needs (peak resident
chunk-microbatches per rank, from the shared dependency model). Communication and offload are
added later by :mod:`posttrain.pipeline.passes`. A *stage* is one model chunk on one rank (see
:class:`StageLayout`); a rank runs ``num_chunks`` stages. docs/pipeline.md describes the
group-interleaved constructions; tests pin their action orders and figures.

Most generators are one greedy rule on a unit clock (``F = I = W = 1``, ``B = 2``): each rank
keeps ordered queues of forwards and backwards; when free it runs, in this priority, the next
backward (``B``, or ``I`` when split) whose inputs are ready; the next forward whose input is
ready, if fewer than ``cap(rank)`` chunk-microbatches are in flight; a pending ``W``; else it
waits. The queues and caps define the family:

- ``gpipe``: all forwards, then all backwards (cap ``m``).
- ``1f1b`` (Narayanan et al., PipeDream-Flush): cap ``p - r`` on rank ``r``.
- ``interleaved_1f1b`` (Narayanan et al., SC 2021): ``v`` chunks per rank; not the greedy rule but
  Megatron-LM's construction written out (``2(p-r-1) + (v-1)p + 1`` warm-up forwards, then strict
  backward/forward alternation), action for action torch's ``ScheduleInterleaved1F1B``.
- ``group_interleaved`` (the family PipeOffload uses): groups of ``g`` microbatches, each through
  chunk 0, then chunk 1, ...; ``g = p`` is ``interleaved_1f1b``; for ``g < p`` the greedy rule with
  cap ``2(p-r-1) + (v-1)g + 1`` and the group order followed strictly (bubbles grow as ``g``
  shrinks).
- ``group_interleaved_zb``: group-interleaved with the backward split, on fixed ``I``/``W``/``F``
  slots: every rank runs them in turn (the odd ranks one unit later); one block of ``g``
  microbatches is laid out stage by stage in the first free slot of each kind at or after its
  input and repeats every ``3vg`` units. For ``g >= p/2`` it is Megatron's order with the backward
  split; below, where that order deadlocks, the slots let a later forward take the turn.
  :attr:`Schedule.block_times` gives the block's own timing.
- ``interleaved_zb``: the same family as a modulo schedule (the building block of Qi et al.,
  "Pipeline Parallelism with Controllable Memory"): one block of ``g`` microbatches laid out once
  on a unit clock, each microbatch's F chain down and I chain up placed without waits where that
  fits, repeated every ``3vg`` units; a ``W`` takes the first free unit after its ``I``.
- ``zb_h1`` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, the handcrafted ZB-H1):
  not the greedy rule but the published order: 1F1B's warm-up (``p - r - 1`` forwards on rank
  ``r``), then ``F`` and ``I`` alternately, each ``W`` held back ``r`` backwards so the later ranks
  start their ``I`` chain sooner; the held ``W`` fill the tail. Every rank holds at most ``p``
  chunk-microbatches (1F1B's peak over all ranks, reached on every rank); on the unit clock
  (``F = I = W = 1``, ``m >= p``) the bubble is ``p - 1`` units, a third of 1F1B's ``3(p - 1)``.
- ``zb_h1_tight``: the greedy rule with 1F1B's per-rank cap ``p - r`` and split backward: the
  memory of 1F1B on every rank, a bubble of ``2(p - 1)`` units.
- ``zbv``: V-shape placement (rank 0 holds the first and the last stage), split backward,
  cap ``2p`` (1F1B's activation memory, counted in half-size chunks); deeper stages first.

Every schedule is validated by :mod:`posttrain.pipeline.deps`, and the peak in-flight count it
produces is the schedule's stated memory need (:attr:`Schedule.predicted_peaks`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ._ir import Action, format_schedule
from .deps import SimResult, simulate
from .layout import StageLayout

__all__ = ["GROUPED_SCHEDULES", "ONE_CHUNK_SCHEDULES", "SCHEDULES", "Schedule", "build_schedule",
           "check_schedule_options", "default_chunks"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "group_interleaved", "group_interleaved_zb", "interleaved_zb",
             "zb_h1", "zb_h1_tight", "zbv")
ONE_CHUNK_SCHEDULES = ("gpipe", "1f1b", "zb_h1", "zb_h1_tight")  # one chunk per rank
GROUPED_SCHEDULES = ("group_interleaved", "group_interleaved_zb", "interleaved_zb")  # take a group size


@dataclass(frozen=True)
class Schedule:
    """A generated schedule and what it promises.

    Attributes:
        name: generator name.
        layout: stage placement.
        num_microbatches: microbatches per step.
        actions: ``{rank: [Action]}``.
        predicted_peaks: peak in-flight chunk-microbatches per rank (unit clock).
        group_size: microbatch group size (group-interleaved family), else ``None``.
        block_times: for the repeated-block constructions (``group_interleaved_zb``,
            ``interleaved_zb``), every action's start in the repeated block (unit clock, from 0);
            the runtime starts each action as soon as its inputs are ready instead, which is never
            later. ``None`` for the others.
    """

    name: str
    layout: StageLayout
    num_microbatches: int
    actions: dict[int, list[Action]]
    predicted_peaks: tuple[int, ...]
    group_size: int | None = None
    block_times: dict[Action, int] | None = None

    @property
    def block_makespan(self) -> int | None:
        """The makespan at :attr:`block_times`, or ``None``."""
        return None if self.block_times is None else max(self.block_times.values()) + 1

    def text(self) -> dict[int, str]:
        return format_schedule(self.actions)

    def simulate(self, **kwargs) -> SimResult:
        return simulate(self.actions, self.layout, self.num_microbatches, **kwargs)


def _greedy(layout: StageLayout, m: int, fwd: dict[int, list[deque]], bwd: dict[int, list[deque]],
            cap: list[int], split: bool, *, forward_first: bool = False) -> dict[int, list[Action]]:
    """Run the priority rule on a unit clock; ``fwd[r]``/``bwd[r]`` are queues of stages-microbatch
    pairs (the head of each queue is a candidate; earlier queues win ties). ``forward_first``
    (GPipe) runs every forward of a rank before any backward."""
    p, last = layout.num_ranks, layout.num_stages - 1
    dur = {"F": 1, "B": 2, "I": 1, "W": 1}
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, mb) -> end time
    free = [0] * p
    inflight = [0] * p
    pending_w: list[deque] = [deque() for _ in range(p)]
    release: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # (end time, 1) in-flight decrements
    out: dict[int, list[Action]] = {r: [] for r in range(p)}
    bkind = "I" if split else "B"
    total = sum(len(q) for qs in fwd.values() for q in qs) * (3 if split else 2)
    scheduled = 0

    def ready(kind: str, s: int, j: int, t: int) -> bool:
        if kind == "F":
            return s == 0 or done.get(("F", s - 1, j), t + 1) <= t
        return done.get(("F", s, j), t + 1) <= t and (s == last or done.get((bkind, s + 1, j), t + 1) <= t)

    t = 0
    while scheduled < total:
        for r in range(p):
            if free[r] > t:
                continue
            live = inflight[r] - sum(1 for e in release[r] if e <= t)
            choice = None
            for q in ([] if forward_first and any(fwd[r]) else bwd[r]):
                if q and ready(bkind, *q[0], t):
                    choice = (bkind, q)
                    break
            if choice is None and live < cap[r]:
                for q in fwd[r]:
                    if q and ready("F", *q[0], t):
                        choice = ("F", q)
                        break
            if choice is None and split and pending_w[r]:
                choice = ("W", pending_w[r])
            if choice is None:
                continue
            kind, q = choice
            s, j = q.popleft()
            out[r].append(Action(s, kind, j))
            done[(kind, s, j)] = t + dur[kind]
            free[r] = t + dur[kind]
            scheduled += 1
            if kind == "F":
                inflight[r] += 1
            elif kind == "I":
                pending_w[r].append((s, j))
            if kind in ("B", "W"):
                release[r].append(t + dur[kind])
        t += 1
        if t > 10 * total + 10:
            raise AssertionError(f"schedule rule made no progress: {layout=} {m=} {cap=}")
    return out


def _stage_queues(layout: StageLayout, m: int, group_size: int, *, reverse_chunks: bool) -> dict[int, list[deque]]:
    out = {}
    for r in range(layout.num_ranks):
        order = []
        chunks = range(layout.num_chunks)
        for g0 in range(0, m, group_size):
            for c in (reversed(chunks) if reverse_chunks else chunks):
                order += [(layout.stage_of(r, c), j) for j in range(g0, min(m, g0 + group_size))]
        out[r] = [deque(order)]
    return out


def default_chunks(name: str) -> int:
    """Chunks per rank ``name`` runs when none is asked for: 1 for the one-chunk schedules, 2 for
    ``zbv`` (always) and the interleaved families."""
    return 1 if name in ONE_CHUNK_SCHEDULES else 2


def check_schedule_options(name: str, *, num_ranks: int, num_microbatches: int, num_chunks: int | None = None,
                           group_size: int | None = None) -> None:
    """Refuse what ``name`` cannot run or would ignore: an unknown name, no ranks or microbatches,
    a chunk count other than its own (one-chunk schedules: 1, ``zbv``: 2), or a group size for a
    schedule without microbatch groups. Messages name the parameter and its command-line flag.

    Raises:
        ValueError: the first problem found.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    if num_ranks < 1:
        raise ValueError(f"{name}: num_ranks={num_ranks} must be at least 1")
    if num_microbatches < 1:
        raise ValueError(f"{name}: num_microbatches={num_microbatches} must be at least 1")
    if num_chunks is not None:
        if name in ONE_CHUNK_SCHEDULES and num_chunks != 1:
            raise ValueError(f"{name} runs one chunk per rank, got num_chunks={num_chunks}: drop it")
        if name == "zbv" and num_chunks != 2:
            raise ValueError(f"zbv runs 2 chunks per rank (a V), got num_chunks={num_chunks}: drop it")
        if num_chunks < 1:
            raise ValueError(f"{name}: num_chunks={num_chunks} must be at least 1")
    if group_size is not None and name not in GROUPED_SCHEDULES:
        why = " (its group is the ranks: group_interleaved with group_size=num_ranks)" if name == "interleaved_1f1b" else ""
        raise ValueError(f"{name} takes no group size{why}, got group_size={group_size}: drop it; "
                         f"only {', '.join(GROUPED_SCHEDULES)} group microbatches")


def _check_counts(name: str, num_ranks: int, num_microbatches: int, minimum: int) -> None:
    if num_ranks < 1:
        raise ValueError(f"{name}: num_ranks={num_ranks} must be at least 1")
    if num_microbatches < minimum:
        raise ValueError(f"{name} needs at least {minimum} microbatches for {num_ranks} ranks, "
                         f"got num_microbatches={num_microbatches}")


def _check_groups(name: str, num_ranks: int, num_microbatches: int, group_size: int) -> None:
    _check_counts(name, num_ranks, num_microbatches, 1)
    if not 1 <= group_size <= num_ranks:
        raise ValueError(f"{name}: group_size={group_size} must be in [1, num_ranks={num_ranks}]")
    _check_counts(name, num_ranks, num_microbatches, group_size)
    if num_microbatches % group_size:
        raise ValueError(f"{name}: num_microbatches={num_microbatches} must be a multiple of group_size={group_size} "
                         "(`num_microbatches`, `group_size`)")


def _finish(name: str, layout: StageLayout, m: int, actions, group_size=None, block_times=None) -> Schedule:
    sim = simulate(actions, layout, m)
    return Schedule(name, layout, m, actions, tuple(sim.peaks()), group_size, block_times)


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """GPipe (Huang et al., 2019): every forward, then every backward."""
    _check_counts("gpipe", num_ranks, num_microbatches, 1)
    layout = StageLayout(num_ranks)
    q = _stage_queues(layout, num_microbatches, num_microbatches, reverse_chunks=False)
    actions = _greedy(layout, num_microbatches, q, _stage_queues(layout, num_microbatches, num_microbatches,
                                                                 reverse_chunks=True),
                      [num_microbatches] * num_ranks, split=False, forward_first=True)
    return _finish("gpipe", layout, num_microbatches, actions)


def _one_chunk_1f1b(name: str, num_ranks: int, num_microbatches: int, *, split: bool) -> Schedule:
    _check_counts(name, num_ranks, num_microbatches, 1)
    layout = StageLayout(num_ranks)
    fwd = _stage_queues(layout, num_microbatches, num_microbatches, reverse_chunks=False)
    bwd = _stage_queues(layout, num_microbatches, num_microbatches, reverse_chunks=True)
    actions = _greedy(layout, num_microbatches, fwd, bwd, [num_ranks - r for r in range(num_ranks)], split=split)
    return _finish(name, layout, num_microbatches, actions)


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): at most ``p - r`` microbatches in flight on rank ``r``."""
    return _one_chunk_1f1b("1f1b", num_ranks, num_microbatches, split=False)


def _strict_interleaved(layout: StageLayout, m: int, group_size: int, *, split: bool) -> dict[int, list[Action]]:
    """Interleaved 1F1B in a fixed per-rank order: forwards and backwards in group order (``g``
    microbatches through chunk 0, then chunk 1, ...; backwards through the chunks in reverse); a
    warm-up of forwards, then one backward and one forward alternately, then the remaining
    backwards.

    - ``split=False`` is Megatron-LM's interleaved 1F1B (``g = p``): ``2(p-r-1) + (v-1)p + 1``
      warm-up forwards, each backward a full ``B``. The same action order as torch's
      ``ScheduleInterleaved1F1B`` (a test checks it).
    - ``split=True`` runs each backward as ``I`` then its ``W`` at once, with
      ``(p-r-1) + (v-1)g + 1`` warm-up forwards: ``I`` takes one unit, so the first backward
      comes back to rank ``r`` one unit per stage sooner than a full ``B`` does. This is the
      order ``group_interleaved_zb``'s slots give for ``g >= p/2`` (a test checks it); below that
      it deadlocks."""
    p, v = layout.num_ranks, layout.num_chunks
    out = {}
    for r in range(p):
        fwd, bwd = [], []
        for g0 in range(0, m, group_size):
            group = range(g0, min(m, g0 + group_size))
            for c in range(v):
                fwd += [Action(layout.stage_of(r, c), "F", j) for j in group]
            for c in reversed(range(v)):
                bwd += [[Action(layout.stage_of(r, c), kind, j) for kind in (("I", "W") if split else ("B",))]
                        for j in group]
        warm = (p - r - 1) + (v - 1) * group_size + 1 if split else 2 * (p - r - 1) + (v - 1) * p + 1
        warm = min(len(fwd), warm)
        acts = fwd[:warm]
        for k in range(len(fwd) - warm):
            acts += [*bwd[k], fwd[warm + k]]
        out[r] = acts + [a for b in bwd[len(fwd) - warm:] for a in b]
    return out


def group_interleaved(num_ranks: int, num_microbatches: int, *, num_chunks: int, group_size: int,
                      name: str = "group_interleaved") -> Schedule:
    """Interleaved schedule with microbatch groups of ``group_size`` (see the module docstring)."""
    _check_groups(name, num_ranks, num_microbatches, group_size)
    layout = StageLayout(num_ranks, num_chunks)
    if group_size == num_ranks:
        return _finish(name, layout, num_microbatches,
                       _strict_interleaved(layout, num_microbatches, num_ranks, split=False), group_size)
    fwd = _stage_queues(layout, num_microbatches, group_size, reverse_chunks=False)
    bwd = _stage_queues(layout, num_microbatches, group_size, reverse_chunks=True)
    if num_chunks == 1:
        cap = [num_ranks - r for r in range(num_ranks)]
    else:
        cap = [2 * (num_ranks - r - 1) + (num_chunks - 1) * group_size + 1 for r in range(num_ranks)]
    actions = _greedy(layout, num_microbatches, fwd, bwd, cap, split=False)
    return _finish(name, layout, num_microbatches, actions, group_size)


def interleaved_1f1b(num_ranks: int, num_microbatches: int, *, num_chunks: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): :func:`group_interleaved` with ``group_size = num_ranks``."""
    return group_interleaved(num_ranks, num_microbatches, num_chunks=num_chunks, group_size=num_ranks,
                             name="interleaved_1f1b")


def _slot_block(layout: StageLayout, group_size: int) -> dict[Action, int]:
    """Unit-clock start of every action of microbatches ``0 .. group_size-1`` on fixed slots:
    rank ``r`` runs ``I``, ``W``, ``F`` in turn from unit ``r % 2``; laid out stage by stage, each
    action takes the first unit of its kind at or after its input that no other action of the
    block takes in any period of ``3 * num_chunks * group_size`` (each rank has exactly as many
    units of each kind per period as the block has actions of that kind, so one always exists)."""
    p, n = layout.num_ranks, layout.num_stages
    period = 3 * layout.num_chunks * group_size
    taken: list[set[int]] = [set() for _ in range(p)]
    start: dict[Action, int] = {}

    def place(a: Action, t: int) -> int:
        r = layout.rank_of(a.stage)
        while "IWF"[(t - r % 2) % 3] != a.kind or t % period in taken[r]:
            t += 1
        taken[r].update((t % period, (t + 1) % period) if a.kind == "I" else (t % period,))
        start[a] = t
        if a.kind == "I":
            start[Action(a.stage, "W", a.microbatch)] = t + 1
        return t + 1

    ready = [0] * group_size  # when each microbatch's next input is ready
    for kind, stages in (("F", range(n)), ("I", reversed(range(n)))):
        for s in stages:
            for j in range(group_size):
                ready[j] = place(Action(s, kind, j), ready[j])
    return start


def _repeat_block(layout: StageLayout, m: int, group_size: int, block: dict[Action, int]):
    """Each rank's actions for ``m`` microbatches with ``block`` repeated every ``3vg`` units, in
    time order, and every action's start (the first at 0)."""
    period, first = 3 * layout.num_chunks * group_size, min(block.values())
    times = {Action(a.stage, a.kind, b * group_size + a.microbatch): t - first + b * period
             for a, t in block.items() for b in range(m // group_size)}
    actions = {r: [] for r in range(layout.num_ranks)}
    for a in sorted(times, key=lambda a: (times[a], a)):
        actions[layout.rank_of(a.stage)].append(a)
    return actions, times


def _block_schedule(name: str, num_ranks: int, num_microbatches: int, num_chunks: int, group_size: int,
                    make_block) -> Schedule:
    _check_groups(name, num_ranks, num_microbatches, group_size)
    layout = StageLayout(num_ranks, num_chunks)
    actions, times = _repeat_block(layout, num_microbatches, group_size, make_block(layout, group_size))
    return _finish(name, layout, num_microbatches, actions, group_size, times)


def group_interleaved_zb(num_ranks: int, num_microbatches: int, *, num_chunks: int, group_size: int) -> Schedule:
    """Group-interleaved with split backward on fixed ``I, W, F`` slots (see the module docstring)."""
    return _block_schedule("group_interleaved_zb", num_ranks, num_microbatches, num_chunks, group_size, _slot_block)


def _modulo_block(layout: StageLayout, group_size: int) -> dict[Action, int]:
    """Unit-clock start of every action of microbatches ``0 .. group_size-1`` such that repeating
    the block every ``period = 3 * num_chunks * group_size`` units never puts two actions of a
    rank on one unit (each rank has exactly ``period`` actions per block, so every placement
    below finds a free unit within one period)."""
    p, n = layout.num_ranks, layout.num_stages
    period = 3 * layout.num_chunks * group_size
    taken: list[set[int]] = [set() for _ in range(p)]
    start: dict[Action, int] = {}

    def take(a: Action, t: int) -> None:
        taken[layout.rank_of(a.stage)].add(t % period)
        start[a] = t

    def first_free(stage: int, t: int) -> int:
        while t % period in taken[layout.rank_of(stage)]:
            t += 1
        return t

    earliest = 0
    for j in range(group_size):
        chain = [Action(s, "F", j) for s in range(n)] + [Action(s, "I", j) for s in reversed(range(n))]
        for t0 in range(earliest, earliest + period):  # the whole chain without a wait, if it fits
            units = [(layout.rank_of(a.stage), (t0 + k) % period) for k, a in enumerate(chain)]
            if len(set(units)) == len(units) and all(u not in taken[r] for r, u in units):
                for k, a in enumerate(chain):
                    take(a, t0 + k)
                break
        else:  # action by action, each in the first free unit after its input
            t = earliest
            for a in chain:
                t = first_free(a.stage, t)
                take(a, t)
                t += 1
        earliest = start[Action(0, "F", j)] + 1
    for i in sorted((a for a in start if a.kind == "I"), key=start.__getitem__):
        take(Action(i.stage, "W", i.microbatch), first_free(i.stage, start[i] + 1))
    return start


def interleaved_zb(num_ranks: int, num_microbatches: int, *, num_chunks: int, group_size: int) -> Schedule:
    """Group-interleaved as a modulo schedule with split backward (see the module docstring)."""
    return _block_schedule("interleaved_zb", num_ranks, num_microbatches, num_chunks, group_size, _modulo_block)


def zb_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1 as published (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Figure 3):
    1F1B with the backward split, rank ``r`` holding back its ``W`` by ``r`` backwards.

    Rank ``r`` runs ``p - r - 1`` warm-up forwards, then ``F`` and ``I`` in turn, each ``I``
    followed by the oldest pending ``W`` once more than ``r`` are pending, and the pending ``W``
    at the end. Holding back ``r`` of them lets rank ``r`` run its ``I`` as soon as the gradient
    arrives, so the ``I`` chain climbs the ranks without waiting, at the price of ``r`` more
    chunk-microbatches than 1F1B on rank ``r``: ``p`` on every rank, 1F1B's peak over all ranks.
    On the unit clock with ``m >= p`` the makespan is ``3m + p - 1``."""
    _check_counts("zb_h1", num_ranks, num_microbatches, 1)
    layout = StageLayout(num_ranks)
    m, actions = num_microbatches, {}
    for r in range(num_ranks):
        warm = min(num_ranks - r - 1, m)
        acts = [Action(r, "F", j) for j in range(warm)]
        pending: deque[int] = deque()
        for k in range(m):
            if warm + k < m:
                acts.append(Action(r, "F", warm + k))
            acts.append(Action(r, "I", k))
            pending.append(k)
            if len(pending) > r:
                acts.append(Action(r, "W", pending.popleft()))
        actions[r] = acts + [Action(r, "W", k) for k in pending]
    return _finish("zb_h1", layout, m, actions)


def zb_h1_tight(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1 held to 1F1B's per-rank memory: the greedy rule with cap ``p - r`` and split
    backward (bubble ``2(p - 1)`` units on the unit clock)."""
    return _one_chunk_1f1b("zb_h1_tight", num_ranks, num_microbatches, split=True)


def zbv(num_ranks: int, num_microbatches: int) -> Schedule:
    """V-shape zero bubble: two chunks per rank in a V, split backward, deeper stages first."""
    _check_counts("zbv", num_ranks, num_microbatches, 1)
    layout = StageLayout(num_ranks, 2, "v")
    m = num_microbatches

    def queues() -> dict[int, list[deque]]:  # one queue per chunk, the deeper (chunk 1) first
        return {r: [deque((layout.stage_of(r, c), j) for j in range(m)) for c in (1, 0)]
                for r in range(num_ranks)}

    actions = _greedy(layout, m, queues(), queues(), [2 * num_ranks] * num_ranks, split=True)
    return _finish("zbv", layout, m, actions)


def build_schedule(name: str, *, num_ranks: int, num_microbatches: int, num_chunks: int | None = None,
                   group_size: int | None = None) -> Schedule:
    """The named schedule.

    Args:
        name: one of :data:`SCHEDULES`.
        num_ranks: pipeline ranks.
        num_microbatches: microbatches per step.
        num_chunks: chunks per rank (default :func:`default_chunks`; one-chunk schedules take only
            1, ``zbv`` only 2).
        group_size: microbatch group size for ``group_interleaved``, ``group_interleaved_zb`` and
            ``interleaved_zb`` (default ``num_ranks``); the others take none.

    Raises:
        ValueError: see :func:`check_schedule_options`, or too few microbatches for the schedule.
    """
    check_schedule_options(name, num_ranks=num_ranks, num_microbatches=num_microbatches, num_chunks=num_chunks,
                           group_size=group_size)
    num_chunks = default_chunks(name) if num_chunks is None else num_chunks
    single = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb_h1": zb_h1, "zb_h1_tight": zb_h1_tight, "zbv": zbv}
    if name in single:
        return single[name](num_ranks, num_microbatches)
    if name == "interleaved_1f1b":
        return interleaved_1f1b(num_ranks, num_microbatches, num_chunks=num_chunks)
    grouped = {"interleaved_zb": interleaved_zb, "group_interleaved_zb": group_interleaved_zb}.get(name, group_interleaved)
    return grouped(num_ranks, num_microbatches, num_chunks=num_chunks,
                   group_size=num_ranks if group_size is None else group_size)
