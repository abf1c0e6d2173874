"""Pipeline simulation: a schedule from :mod:`posttrain.pipeline` with real durations, activation
bytes, a host link and an offload policy.

It runs the same dependency model as the runtime's tests (:func:`posttrain.pipeline.simulate`):
compute actions on a compute stream, ``OFFLOAD``/``RELOAD`` on one copy stream per rank (both
directions share it, as in the PipeOffload reference), a copy taking
``activation_bytes / host_bandwidth``. Whether offload hides is read two ways: the measured
overhead (makespan with offload over makespan without), and the design's criterion
``k = (D2H + H2D) / (F + B + W)`` of one chunk-microbatch (hides fully when ``k <= 1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from posttrain.pipeline import Action, Durations, OffloadPolicy, SimResult, add_offload, build_schedule, simulate

__all__ = ["PipelineSimResult", "PipelineWorkload", "design_copy_peak", "format_pipeoffload_table", "pipeoffload_table",
           "simulate_pipeline"]


@dataclass(frozen=True)
class PipelineWorkload:
    """Per chunk-microbatch costs.

    Attributes:
        forward_s: seconds of one chunk's forward on one microbatch (``F``).
        input_grad_s: its input-gradient backward (``I``; a full ``B`` is ``I + W``).
        weight_grad_s: its weight-gradient backward (``W``).
        activation_bytes: saved activations of one chunk-microbatch.
        host_bandwidth: bytes/s of the device-host link, per copy direction (shared stream).
    """

    forward_s: float = 1.0
    input_grad_s: float = 1.0
    weight_grad_s: float = 1.0
    activation_bytes: float = 1.0
    host_bandwidth: float = math.inf

    def __post_init__(self) -> None:
        for name in ("forward_s", "input_grad_s", "weight_grad_s", "activation_bytes"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name}={v} must be a non-negative number")
        if not self.host_bandwidth > 0:
            raise ValueError(f"host_bandwidth={self.host_bandwidth} must be a positive number of bytes/s "
                             "(--host-gbps)")

    @property
    def copy_s(self) -> float:
        return self.activation_bytes / self.host_bandwidth

    @property
    def k(self) -> float:
        """Round-trip copy time over compute time of one chunk-microbatch."""
        compute = self.forward_s + self.input_grad_s + self.weight_grad_s
        return 2 * self.copy_s / compute if compute > 0 else math.inf

    def durations(self) -> Durations:
        return Durations(F=self.forward_s, B=self.input_grad_s + self.weight_grad_s, I=self.input_grad_s,
                         W=self.weight_grad_s, OFFLOAD=self.copy_s, RELOAD=self.copy_s)


@dataclass
class PipelineSimResult:
    """What one configuration costs.

    Attributes:
        makespan: seconds of the step with offload.
        base_makespan: the same schedule without offload.
        peaks: per rank, peak resident chunk-microbatches.
        sim: the full simulation (start/end of every action, memory intervals).
    """

    schedule: str
    num_ranks: int
    num_chunks: int
    group_size: int | None
    offload_chunks: int
    workload: PipelineWorkload
    makespan: float
    base_makespan: float
    peaks: list[int]
    sim: SimResult

    @property
    def peak_bytes(self) -> float:
        return max(self.peaks) * self.workload.activation_bytes

    @property
    def overhead(self) -> float:
        """Makespan with offload over without, minus one (0: the offload hides completely)."""
        return self.makespan / self.base_makespan - 1.0 if self.base_makespan > 0 else 0.0

    @property
    def bubble_fraction(self) -> float:
        r = self.num_ranks
        return sum(self.sim.bubble_fraction(k) for k in range(r)) / r

    def copy_utilization(self, rank: int) -> float:
        busy = sum(self.sim.end[key] - t0 for key, t0 in self.sim.start.items()
                   if key[0] == rank and key[1].kind in ("OFFLOAD", "RELOAD"))
        return busy / self.makespan if self.makespan else 0.0

    def memory_curve_bytes(self, rank: int) -> list[tuple[float, float]]:
        return [(t, n * self.workload.activation_bytes) for t, n in self.sim.memory_curve(rank)]

    @property
    def hidden(self) -> bool:
        """The offload costs less than 1% of the step."""
        return self.overhead <= 0.01


def simulate_pipeline(schedule: str, *, num_ranks: int, num_microbatches: int, num_chunks: int = 1,
                      group_size: int | None = None, offload_chunks: int = 0,
                      workload: PipelineWorkload = PipelineWorkload(),
                      min_lifespan: float | None = None) -> PipelineSimResult:
    """Simulate one step.

    Args:
        schedule: a name from :data:`posttrain.pipeline.SCHEDULES`.
        offload_chunks: offload each rank's first this many chunks (longest-lived first).
        min_lifespan: skip chunk-microbatches whose forward-to-backward gap is not longer
            (default: one round trip, ``2 * copy time``: shorter cannot be hidden).
    """
    sched = build_schedule(schedule, num_ranks=num_ranks, num_microbatches=num_microbatches,
                           num_chunks=num_chunks, group_size=group_size)
    d = workload.durations()
    base = simulate(sched.actions, sched.layout, num_microbatches, durations=d)
    policy = OffloadPolicy(offload_chunks, 2 * workload.copy_s if min_lifespan is None else min_lifespan)
    lowered = add_offload(sched.actions, sched.layout, num_microbatches, policy, durations=d)
    res = simulate(lowered, sched.layout, num_microbatches, durations=d)
    return PipelineSimResult(schedule=schedule, num_ranks=num_ranks, num_chunks=sched.layout.num_chunks,
                             group_size=sched.group_size, offload_chunks=offload_chunks, workload=workload,
                             makespan=res.makespan, base_makespan=base.makespan, peaks=res.peaks(), sim=res)


# The unit-cost table of design/pipeoffload.md (the reference's own scheduler, p=8, m=32,
# F = I = W = 1): peaks for 0..v chunks offloaded, and makespans for v=2.
PAPER_PEAKS = {(2, 8): [16, 8, 2], (2, 4): [12, 6, 3], (2, 1): [13, 5, 2], (4, 2): [22, 14, 8, 4, 3]}
PAPER_MAKESPANS = {(2, 8): 206, (2, 4): 210, (2, 1): 240}


PAPER_TABLE_SCHEDULES = ("group_interleaved", "group_interleaved_zb", "interleaved_zb")


def held_for_w_at_peak(res: SimResult) -> int:
    """At the first peak of the rank with the highest peak: how many resident chunk-microbatches
    have finished their ``I`` and are held only for their ``W`` (0 without split backward)."""
    peaks = res.peaks()
    rank = peaks.index(max(peaks))
    t = next(t for t, n in res.memory_curve(rank) if n == peaks[rank])
    return sum(1 for (r, a), w_end in res.end.items()
               if r == rank and a.kind == "W" and res.end[(r, Action(a.stage, "I", a.microbatch))] <= t < w_end)


def design_copy_peak(res: SimResult, offload_chunks: int, *, copy: float = 1.0, lead: float = 1.0) -> int:
    """Peak resident chunk-microbatches of a run without copy actions, with each rank's first
    ``offload_chunks`` chunks offloaded by the rule of design/pipeoffload.md, every copy taking
    ``copy`` and never waiting for another: a chunk-microbatch is resident from its forward's
    start until its offload, started at the forward's end, finishes; and again from its reload,
    timed to finish ``lead`` (one backward) before its backward starts, until the backward
    (``B``, or ``W`` when split) finishes. Not our runtime's count (one copy stream, each copy
    issued where it sits in the rank's list): the count that explains the paper's table."""
    layout = res.layout
    resident: dict[int, list[tuple[float, float, int]]] = {}
    for (rank, a), t0 in res.start.items():
        if a.kind != "F":
            continue
        s, j, end = a.stage, a.microbatch, res.end
        bwd = (rank, Action(s, "B", j)) if (rank, Action(s, "B", j)) in end else (rank, Action(s, "I", j))
        release = end.get((rank, Action(s, "W", j)), end[bwd])
        spans = [(t0, release)]
        if layout.chunk_of(s) < offload_chunks:
            gone = end[(rank, a)] + copy
            spans = [(t0, gone), (max(gone, res.start[bwd] - lead - copy), release)]
        resident.setdefault(rank, []).extend((lo, hi, s) for lo, hi in spans)
    return max(SimResult(layout, res.start, res.end, resident).peaks())


def pipeoffload_table(*, num_ranks: int = 8, num_microbatches: int = 32) -> list[dict]:
    """Our group-interleaved constructions on the paper's unit clock next to the paper's figures,
    one row per (schedule, v, g), with 0..v chunks offloaded.

    - ``peaks``: our runtime's count with free copies (``host_bandwidth = inf``), every
      chunk-microbatch of an offloaded chunk offloaded (``min_lifespan = 0``).
    - ``design_peaks``: :func:`design_copy_peak` (one-unit copies) of the same run;
      ``design_block_peaks``: the same at the repeated-block constructions' block times
      (``None`` for ``group_interleaved``).
    - ``makespan`` as run (each action as soon as its inputs are ready); ``block_makespan`` at
      block times."""
    rows = []
    for (v, g), paper in PAPER_PEAKS.items():
        for name in PAPER_TABLE_SCHEDULES:
            runs = [simulate_pipeline(name, num_ranks=num_ranks, num_microbatches=num_microbatches, num_chunks=v,
                                      group_size=g, offload_chunks=k, min_lifespan=0.0) for k in range(v + 1)]
            sched = build_schedule(name, num_ranks=num_ranks, num_microbatches=num_microbatches, num_chunks=v,
                                   group_size=g)
            plain = runs[0].sim  # nothing offloaded: the schedule as run, no copy actions
            block = None if sched.block_times is None else sched.simulate(not_before=sched.block_times)
            rows.append({"schedule": name, "chunks": v, "group_size": g, "peaks": [max(r.peaks) for r in runs],
                         "held_for_w": [held_for_w_at_peak(r.sim) for r in runs],
                         "design_peaks": [design_copy_peak(plain, k) for k in range(v + 1)],
                         "design_block_peaks": None if block is None else [design_copy_peak(block, k)
                                                                           for k in range(v + 1)],
                         "makespan": plain.makespan, "block_makespan": sched.block_makespan,
                         "paper_peaks": paper, "paper_makespan": PAPER_MAKESPANS.get((v, g))})
    return rows


def format_pipeoffload_table(rows: list[dict]) -> str:
    def cells(x) -> str:
        return "-" if x is None else ",".join(f"{n:g}" for n in x)

    lines = ["p=8, m=32, F=I=W=1; peak chunk-microbatches for 0..v chunks offloaded:",
             "  ours: free copies, as our runtime counts them; held for W: of those at the peak, how many ran",
             "  their I and wait for their W; design copies: one-unit copies, each reload landing one unit",
             "  before its backward (design/pipeoffload.md's rule), as run and at block times",
             "makespan: as run / at block times / paper",
             f"{'schedule':20} {'v':>2} {'g':>2}  {'ours':13} {'held for W':13} {'design copies':27} {'paper':13} "
             f"{'makespan':>18}"]
    for r in rows:
        design = f"{cells(r['design_peaks'])} | {cells(r['design_block_peaks'])}"
        block = "-" if r["block_makespan"] is None else f"{r['block_makespan']:g}"
        lines.append(f"{r['schedule']:20} {r['chunks']:>2} {r['group_size']:>2}  {cells(r['peaks']):13} "
                     f"{cells(r['held_for_w']):13} {design:27} {cells(r['paper_peaks']):13} "
                     f"{r['makespan']:>5g} / {block:>4} / {r['paper_makespan'] or '-'}")
    return "\n".join(lines)
