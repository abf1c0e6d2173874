"""Schedule generators: pure functions ``(num_ranks, num_microbatches, ...) -> Schedule``.

Every generator here is one rule, run on a unit clock (``F = I = W = 1``, ``B = 2``): each rank
keeps ordered queues of forwards and backwards; when it is free it runs, in this priority,

1. the next backward (``B``, or ``I`` when split) whose inputs are ready;
2. the next forward whose input is ready, if fewer than ``cap(rank)`` chunk-microbatches are in
   flight (forward started, backward not finished);
3. a pending ``W`` (split schedules fill bubbles with them);

and otherwise waits. The queues and caps define the schedule family:

- ``gpipe``: all forwards, then all backwards (cap = m).
- ``1f1b`` (Narayanan et al., PipeDream-Flush): cap ``p - r`` on rank ``r``.
- ``interleaved_1f1b`` (Narayanan et al., SC'21): ``v`` chunks per rank in a loop; microbatches
  in groups of ``p``, each group through chunk 0, then chunk 1, ... This one is not the greedy
  rule but Megatron-LM's construction written out (``2(p-r-1) + (v-1)p + 1`` warm-up forwards,
  then strict backward/forward alternation): the greedy rule, which runs a ready backward first,
  took 5-18% longer (p=8, m=32, v=2: 252 units against 213), and this order is exactly torch's
  ``ScheduleInterleaved1F1B``, so the two runtimes can be compared action for action.
- ``group_interleaved`` (Qi et al., "Pipeline Parallelism with Controllable Memory", the family
  PipeOffload uses): groups of ``g`` microbatches; ``g = p`` is ``interleaved_1f1b`` above. For
  ``g < p`` the greedy rule with cap ``2(p-r-1) + (v-1)g + 1``: smaller ``g`` keeps fewer
  microbatches of each chunk alive. Known limit of this construction: each rank follows the
  group order strictly, so a rank waits for a group to come round the loop and bubbles grow as
  ``g`` shrinks (p=8, m=32, v=2: makespan 253 units at g=4, 637 at g=1, where the paper's schedule
  stays within 240). Megatron's strict alternation with a ``g``-sized warm-up deadlocks for
  ``g < p``. ``interleaved_zb`` below drops the strict order and has few bubbles instead.
- ``group_interleaved_zb``: the same family with split backward, on fixed slots: every rank runs
  ``I``, ``W``, ``F`` in turn, one unit each, the odd ranks one unit later than the even ones. One
  block of ``g`` microbatches is laid out stage by stage, each action in the first unit of its
  kind (``W`` right after its ``I``) that is at or after its input and not yet taken in any
  period of ``3vg`` units; the block repeats every period, and each rank runs its actions in block
  order as soon as their inputs are ready. For ``g >= p/2`` (checked for every ``p <= 8``) this is
  exactly the fixed order of Megatron-LM's schedule with split backward: ``(p-r-1) + (v-1)g + 1``
  forwards in group order, then ``I``, its ``W`` and the next forward in turn (that order
  deadlocks below ``p/2``: a rank's forward of chunk ``c`` needs the last rank's forward of chunk
  ``c - 1``, which it runs only after a backward that waits on the first rank; the slots keep the
  turn and let a later microbatch's forward take it). On the paper's clock (p=8, m=32) it gives
  the reference scheduler's figures in design/pipeoffload.md but two full-offload peaks (v=2:
  g=8 16, 8, 2; g=4 12, 6, 2 where the paper has 12, 6, 3; g=1 13, 5, 2; v=4, g=2: 22, 14, 8, 4,
  2 where the paper has 22, 14, 8, 4, 3) and the makespans: 206 at g=8 and 210 at g=4 as run,
  and at g=1 the paper's 240 is the block's own timing (:attr:`Schedule.block_makespan`), which
  this runtime squeezes to 215 by starting each action as soon as it can.
- ``interleaved_zb``: the same family built another way, as a modulo schedule (the "building
  block" of Qi et al., "Pipeline Parallelism with Controllable Memory"): one block of ``g``
  microbatches is laid out once on a unit clock and repeated every ``3vg`` units (each rank's
  whole share of the block: ``v`` chunks times F, I, W), so after the first block there is no
  bubble. Backward is split; each microbatch's F chain down the stages and I chain back up is
  placed at the first start where every one of its ``2pv`` actions lands on a unit that its rank
  has free in every period (no wait at any hop: lifespans are the shortest possible), else action
  by action in the first free unit; each W takes the first free unit after its I. The result, on
  the paper's clock (p=8, m=32, v=2): ``g = 8`` gives the reference scheduler's makespan 206 and
  peak 16 exactly; ``g = 1`` gives makespan 219 and peak 10, against 240 and 13 for the paper's
  group-interleaved schedule and 213 and 23 for ``interleaved_1f1b``. Its cost: a W waits for a
  free unit (up to ``3vg - 1`` units after its I), and a reloaded chunk-microbatch stays resident
  until its W, so offload saves less than linear here (``g = 1``: 10 -> 5 with half offloaded).
- ``zb_h1`` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B's order and memory
  with the backward split into ``I`` and ``W``; ``W`` fills the bubbles.
- ``zbv``: V-shape placement (rank 0 holds the first and the last stage), split backward,
  cap ``2p`` (1F1B's activation memory, counted in half-size chunks); deeper stages first.

The rule is validated by :func:`posttrain.pipeline.simulate` and the peak in-flight count it
produces is the schedule's stated memory need (:attr:`Schedule.predicted_peaks`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ._ir import Action, format_schedule
from .layout import StageLayout
from .simulate import SimResult, simulate

__all__ = ["SCHEDULES", "Schedule", "build_schedule"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "group_interleaved", "group_interleaved_zb", "interleaved_zb",
             "zb_h1", "zbv")


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


def _check_counts(name: str, num_ranks: int, num_microbatches: int, minimum: int) -> None:
    if num_ranks < 1:
        raise ValueError(f"{name}: num_ranks={num_ranks} must be at least 1")
    if num_microbatches < minimum:
        raise ValueError(f"{name} needs at least {minimum} microbatches for {num_ranks} ranks, "
                         f"got num_microbatches={num_microbatches}")


def _check_groups(name: str, num_ranks: int, num_microbatches: int, group_size: int) -> None:
    if not 1 <= group_size <= num_ranks:
        raise ValueError(f"{name}: group_size={group_size} must be in [1, num_ranks={num_ranks}]")
    _check_counts(name, num_ranks, num_microbatches, group_size)
    if num_microbatches % group_size:
        raise ValueError(f"{name}: num_microbatches={num_microbatches} must be a multiple of group_size={group_size}")


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
    """ZB-H1: 1F1B's memory, backward split into I and W, W filling the bubbles."""
    return _one_chunk_1f1b("zb_h1", num_ranks, num_microbatches, split=True)


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


def build_schedule(name: str, *, num_ranks: int, num_microbatches: int, num_chunks: int = 1,
                   group_size: int | None = None) -> Schedule:
    """The named schedule.

    Args:
        name: one of :data:`SCHEDULES`.
        num_ranks: pipeline ranks.
        num_microbatches: microbatches per step.
        num_chunks: chunks per rank (interleaved families; ``zbv`` always uses 2).
        group_size: microbatch group size for ``group_interleaved``, ``group_interleaved_zb`` and
            ``interleaved_zb`` (default ``num_ranks``).
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    single = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb_h1": zb_h1, "zbv": zbv}
    if name in single:
        if num_chunks != 1 and name != "zbv":
            raise ValueError(f"{name} runs one chunk per rank, got num_chunks={num_chunks}")
        return single[name](num_ranks, num_microbatches)
    if name == "interleaved_1f1b":
        return interleaved_1f1b(num_ranks, num_microbatches, num_chunks=num_chunks)
    grouped = {"interleaved_zb": interleaved_zb, "group_interleaved_zb": group_interleaved_zb}.get(name, group_interleaved)
    return grouped(num_ranks, num_microbatches, num_chunks=num_chunks,
                   group_size=num_ranks if group_size is None else group_size)
