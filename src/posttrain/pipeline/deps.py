"""The one dependency model: validate a schedule by running it on a clock, and measure memory.

Every rank has a compute stream (``F B I W`` and the zero-time ``SEND_*``/``RECV_*``) and a copy
stream (``OFFLOAD``/``RELOAD``); each runs its share of the rank's list in order. An action
starts when its stream is free and its dependencies have finished:

- ``F(s, j)`` after ``F(s-1, j)`` (through ``RECV_F`` when lowered);
- ``B``/``I(s, j)`` after ``F(s, j)`` and after ``B``/``I(s+1, j)`` (through ``RECV_B``), and
  after ``RELOAD(s, j)`` if there is one;
- ``W(s, j)`` after ``I(s, j)`` and after ``RELOAD_W(s, j)`` if there is one; ``OFFLOAD(s, j)``
  after ``F(s, j)``; ``RELOAD(s, j)`` after ``OFFLOAD(s, j)``; ``OFFLOAD_W(s, j)`` after
  ``I(s, j)``; ``RELOAD_W(s, j)`` after ``OFFLOAD_W(s, j)``; ``RECV_x`` after the matching
  ``SEND_x``;
- a copy (``OFFLOAD``/``RELOAD``/``OFFLOAD_W``/``RELOAD_W``) not before the compute action (``F B I W``) in front of it in
  the rank's list has started: its position is where it is issued. Sends and receives between
  them do not move that point (the runtime issues the copy there too), so lowering with
  :func:`~posttrain.pipeline.add_send_recv` changes no time and no peak.

A schedule that cannot finish (each stream waits on another) is a deadlock, reported with the
stuck actions. Activation memory (see [Note: pipeline vocabulary]): a chunk-microbatch is resident
from the start of its ``F`` until its ``OFFLOAD`` finishes, and again from the start of its
``RELOAD`` until its backward finishes; without offload, from ``F`` to backward. A split backward
ends at ``I`` for all but the part ``W`` needs (``weight_keep`` of the chunk-microbatch, per
stage): that part stays until ``W`` finishes, or until ``OFFLOAD_W`` finishes and again from
``RELOAD_W``. With ``weight_keep=1`` (the default: nothing is assumed about the model) ``W``
holds everything; the runner measures each stage's fraction (``StepResult.weight_keep``: 0 on
stage 0, whose ``I`` computes every gradient because token ids need none).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from ._ir import COMPUTE_KINDS, COPY_KINDS, Action
from .layout import StageLayout

__all__ = ["Durations", "ScheduleError", "SimResult", "simulate"]


class ScheduleError(ValueError):
    """A schedule that is not valid: missing or repeated actions, wrong order, or a deadlock."""


@dataclass(frozen=True)
class Durations:
    """Time units per action kind (defaults: unit compute, ``B = I + W``, free copies)."""

    F: float = 1.0
    B: float = 2.0
    I: float = 1.0
    W: float = 1.0
    OFFLOAD: float = 0.0
    RELOAD: float = 0.0
    OFFLOAD_W: float = 0.0
    RELOAD_W: float = 0.0


@dataclass
class SimResult:
    """Start and end of every action, and the activation memory it implies."""

    layout: StageLayout
    start: dict[tuple[int, Action], float] = field(default_factory=dict)
    end: dict[tuple[int, Action], float] = field(default_factory=dict)
    #: rank -> (t0, t1, stage, chunk-microbatches): what is resident when
    resident: dict[int, list[tuple[float, float, int, float]]] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        return max(self.end.values(), default=0.0)

    def memory_curve(self, rank: int) -> list[tuple[float, float]]:
        """``(time, chunk-microbatches resident from then on)`` at every change on ``rank``
        (whole numbers are ints: they are unless a split backward keeps a fraction for ``W``)."""
        deltas: dict[float, float] = {}
        for t0, t1, _, units in self.resident.get(rank, []):
            deltas[t0] = deltas.get(t0, 0) + units
            deltas[t1] = deltas.get(t1, 0) - units
        level, out = 0.0, []
        for t in sorted(deltas):
            level += deltas[t]
            v = round(level, 9)
            out.append((t, int(v) if v == int(v) else v))
        return out

    def peak(self, rank: int) -> float:
        """Peak resident chunk-microbatches on ``rank`` (an interval ending at ``t`` does not
        overlap one starting at ``t``)."""
        return max((n for _, n in self.memory_curve(rank)), default=0)

    def peaks(self) -> list[float]:
        return [self.peak(r) for r in range(self.layout.num_ranks)]

    def bubble_fraction(self, rank: int) -> float:
        busy = sum(self.end[key] - t0 for key, t0 in self.start.items()
                   if key[0] == rank and key[1].kind in ("F", "B", "I", "W"))
        return 1.0 - busy / self.makespan if self.makespan else 0.0


def _weight_keep(weight_keep: float | Mapping[int, float], num_stages: int) -> list[float]:
    """Per stage, the fraction of a chunk-microbatch ``W`` keeps."""
    keep = ([float(weight_keep.get(s, 1.0)) for s in range(num_stages)] if isinstance(weight_keep, Mapping)
            else [float(weight_keep)] * num_stages)
    for s, w in enumerate(keep):
        if not 0.0 <= w <= 1.0:
            raise ValueError(f"weight_keep={w} (stage {s}) must be between 0 and 1")
    return keep


def _check_complete(schedule: dict[int, list[Action]], layout: StageLayout, num_microbatches: int) -> None:
    if sorted(schedule) != list(range(layout.num_ranks)):
        raise ScheduleError(f"schedule has ranks {sorted(schedule)}, the layout has {layout.num_ranks}")
    seen: Counter[Action] = Counter()
    for rank, actions in schedule.items():
        for a in actions:
            if a.stage >= layout.num_stages or a.microbatch >= num_microbatches:
                raise ScheduleError(f"rank {rank}: {a} is outside {layout.num_stages} stages x {num_microbatches} microbatches")
            if layout.rank_of(a.stage) != rank:
                raise ScheduleError(f"rank {rank} runs {a}, but stage {a.stage} lives on rank {layout.rank_of(a.stage)}")
            seen[a] += 1
    for a, n in seen.items():
        if n > 1:
            raise ScheduleError(f"{a} appears {n} times")
    for s in range(layout.num_stages):
        for j in range(num_microbatches):
            if Action(s, "F", j) not in seen:
                raise ScheduleError(f"{Action(s, 'F', j)} is missing")
            full, split = Action(s, "B", j) in seen, Action(s, "I", j) in seen or Action(s, "W", j) in seen
            if full == split:
                raise ScheduleError(f"stage {s} microbatch {j} needs either B or I+W, not "
                                    f"{'both' if full else 'neither'}")
            if split and not (Action(s, "I", j) in seen and Action(s, "W", j) in seen):
                raise ScheduleError(f"stage {s} microbatch {j} has only one of I and W")


def _deps(a: Action, layout: StageLayout, present: set[Action]) -> list[Action]:
    s, j, last = a.stage, a.microbatch, layout.num_stages - 1

    def bwd(stage: int) -> Action:
        return Action(stage, "B", j) if Action(stage, "B", j) in present else Action(stage, "I", j)

    if a.kind == "F":
        if s == 0:
            return []
        recv = Action(s, "RECV_F", j)
        return [recv] if recv in present else [Action(s - 1, "F", j)]
    if a.kind in ("B", "I"):
        out = [Action(s, "F", j)]
        if Action(s, "RELOAD", j) in present:
            out.append(Action(s, "RELOAD", j))
        if s < last:
            recv = Action(s, "RECV_B", j)
            out.append(recv if recv in present else bwd(s + 1))
        return out
    if a.kind == "W":
        return [Action(s, "I", j)] + ([Action(s, "RELOAD_W", j)] if Action(s, "RELOAD_W", j) in present else [])
    if a.kind == "SEND_F":
        return [Action(s, "F", j)]
    if a.kind == "RECV_F":
        return [Action(s - 1, "SEND_F", j)]
    if a.kind == "SEND_B":
        return [bwd(s)]
    if a.kind == "RECV_B":
        return [Action(s + 1, "SEND_B", j)]
    if a.kind == "OFFLOAD":
        return [Action(s, "F", j)]
    if a.kind == "RELOAD":
        return [Action(s, "OFFLOAD", j)]
    if a.kind == "OFFLOAD_W":
        return [Action(s, "I", j)]
    if a.kind == "RELOAD_W":
        return [Action(s, "OFFLOAD_W", j)]
    raise AssertionError(f"unhandled kind {a.kind}")


def simulate(schedule: dict[int, list[Action]], layout: StageLayout, num_microbatches: int, *,
             durations: Durations = Durations(), not_before: Mapping[Action, float] | None = None,
             weight_keep: float | Mapping[int, float] = 1.0, offload_fraction: float = 1.0) -> SimResult:
    """Validate ``schedule`` and run it on a clock; ``not_before`` holds actions back to a given
    start (e.g. a repeated-block schedule at its block times: ``Schedule.block_times``);
    ``weight_keep``: the fraction of a chunk-microbatch a split backward keeps for ``W``, one for
    every stage or per stage (see the module docstring); ``offload_fraction``: the share of an
    offloaded chunk-microbatch its copies move (:class:`~posttrain.pipeline.OffloadPolicy`'s
    ``fraction``): the rest stays resident from its ``F`` to its backward (the copies' durations
    are the caller's, in ``durations``).

    Raises:
        ScheduleError: a missing, repeated or misplaced action, a dependency that runs later in
            the same stream (e.g. ``W`` before its ``I``), or a deadlock across ranks.
    """
    _check_complete(schedule, layout, num_microbatches)
    present = {a for actions in schedule.values() for a in actions}
    deps_of = {a: _deps(a, layout, present) for a in present}
    for a in present:
        for d in deps_of[a]:
            if d not in present:
                raise ScheduleError(f"{a} depends on {d}, which no rank runs")
    keep = _weight_keep(weight_keep, layout.num_stages)
    streams = {(r, c): [a for a in acts if (a.kind in COPY_KINDS) == (c == "copy")]
               for r, acts in schedule.items() for c in ("compute", "copy")}
    # A copy is issued where it sits in the rank's list: not before the compute action in front
    # of it has started (that is how a RELOAD placed ahead of a backward prefetches it). Only
    # F/B/I/W count: a SEND_B between that action and the copy starts when the action ends, and
    # taking it as the issue point would reload later (and count a lower peak) than the runtime,
    # which issues the copy before the compute action (``runtime.execution_order``).
    trigger: dict[Action, Action] = {}
    for acts in schedule.values():
        last_compute = None
        for a in acts:
            if a.kind in COPY_KINDS:
                if last_compute is not None:
                    trigger[a] = last_compute
            elif a.kind in COMPUTE_KINDS:
                last_compute = a
    hold = not_before or {}
    started: dict[Action, float] = {}
    pos = dict.fromkeys(streams, 0)
    free = dict.fromkeys(streams, 0.0)
    end: dict[Action, float] = {}
    res = SimResult(layout)
    remaining = sum(len(v) for v in streams.values())
    while remaining:
        progressed = False
        for key, acts in streams.items():
            while pos[key] < len(acts):
                a = acts[pos[key]]
                deps = deps_of[a]
                if any(d not in end for d in deps) or (a in trigger and trigger[a] not in started):
                    break
                t0 = max([free[key], *(end[d] for d in deps), started.get(trigger.get(a), 0.0),
                          hold.get(a, 0.0)])
                started[a] = t0
                t1 = t0 + getattr(durations, a.kind, 0.0)  # sends and receives take no time
                end[a] = t1
                free[key] = t1
                res.start[(key[0], a)], res.end[(key[0], a)] = t0, t1
                pos[key] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            def waits(a: Action) -> str:
                out = [str(d) for d in deps_of[a] if d not in end]
                if a in trigger and trigger[a] not in started:
                    out.append(f"{trigger[a]} to start (issue point)")
                return ", ".join(out)

            stuck = [f"rank {k[0]} {k[1]}: {acts[pos[k]]} waits for {waits(acts[pos[k]])}"
                     for k, acts in streams.items() if pos[k] < len(acts)]
            raise ScheduleError("deadlock: " + "; ".join(stuck))
    for (rank, a), t0 in res.start.items():
        if a.kind != "F":
            continue
        s, j = a.stage, a.microbatch
        intervals = res.resident.setdefault(rank, [])
        split = Action(s, "I", j) in end
        w = keep[s] if split else 0.0
        before = end[Action(s, "I", j)] if split else end[Action(s, "B", j)]  # the whole chunk until then
        f = offload_fraction
        if Action(s, "OFFLOAD", j) in end:
            intervals.append((t0, end[Action(s, "OFFLOAD", j)], s, f))
            intervals.append((res.start[(rank, Action(s, "RELOAD", j))], before, s, f))
            if f < 1:  # what a partial offload keeps on the device
                intervals.append((t0, before, s, 1 - f))
        else:
            intervals.append((t0, before, s, 1))
        if w > 0:  # the part W needs, from the end of I to the end of W
            release = end[Action(s, "W", j)]
            if Action(s, "OFFLOAD_W", j) in end:
                intervals.append((before, end[Action(s, "OFFLOAD_W", j)], s, w * f))
                intervals.append((res.start[(rank, Action(s, "RELOAD_W", j))], release, s, w * f))
                if f < 1:
                    intervals.append((before, release, s, w * (1 - f)))
            else:
                intervals.append((before, release, s, w))
    return res
