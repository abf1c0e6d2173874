"""Paper tables reproduced by the simulator: the PipeOffload unit-cost table.

``posttrain simulate pipeline --paper-table`` prints :func:`format_pipeoffload_table`.
"""

from __future__ import annotations

import copy
import functools

from posttrain.pipeline import Action, SimResult, build_schedule
from posttrain.sim.pipeline import simulate_pipeline

__all__ = ["PAPER_MAKESPANS", "PAPER_PEAKS", "design_copy_peak", "format_pipeoffload_table", "held_for_w_at_peak",
           "pipeoffload_table"]


# The unit-cost table of the PipeOffload paper (its reference's own scheduler, p=8, m=32,
# F = I = W = 1): peaks for 0..v chunks offloaded, and makespans for v=2.
PAPER_PEAKS = {(2, 8): [16, 8, 2], (2, 4): [12, 6, 3], (2, 1): [13, 5, 2], (4, 2): [22, 14, 8, 4, 3]}
PAPER_MAKESPANS = {(2, 8): 206, (2, 4): 210, (2, 1): 240}


PAPER_TABLE_SCHEDULES = ("group_interleaved", "group_interleaved_zb", "interleaved_zb")


def held_for_w_at_peak(res: SimResult) -> int:
    """At the first peak of the rank with the highest peak: how many resident chunk-microbatches
    have finished their ``I`` and are held only for their ``W`` (0 without split backward; an
    ``OFFLOAD_W``'d one counts only once its ``RELOAD_W`` has started)."""
    peaks = res.peaks()
    rank = peaks.index(max(peaks))
    t = next(t for t, n in res.memory_curve(rank) if n == peaks[rank])

    def away(a: Action) -> bool:  # W's part on the host at t
        out, back = (rank, Action(a.stage, "OFFLOAD_W", a.microbatch)), (rank, Action(a.stage, "RELOAD_W", a.microbatch))
        return out in res.end and res.end[out] <= t < res.start[back]

    return sum(1 for (r, a), w_end in res.end.items()
               if r == rank and a.kind == "W" and res.end[(r, Action(a.stage, "I", a.microbatch))] <= t < w_end
               and not away(a))


def design_copy_peak(res: SimResult, offload_chunks: int, *, copy: float = 1.0, lead: float = 1.0) -> int:
    """Peak resident chunk-microbatches of a run without copy actions, with each rank's first
    ``offload_chunks`` chunks offloaded by the paper's rule (docs/pipeline.md), every copy taking
    ``copy`` and never waiting for another: a chunk-microbatch is resident from its forward's
    start until its offload, started at the forward's end, finishes; and again from its reload,
    timed to finish ``lead`` (one backward) before its backward starts, until the backward
    (``B``, or ``W`` when split) finishes. Not our runtime's count (one copy stream, each copy
    issued where it sits in the rank's list): the count that explains the paper's table."""
    layout = res.layout
    resident: dict[int, list[tuple[float, float, int, float]]] = {}
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
        resident.setdefault(rank, []).extend((lo, hi, s, 1) for lo, hi in spans)
    return max(SimResult(layout, res.start, res.end, resident).peaks())


def pipeoffload_table(*, num_ranks: int = 8, num_microbatches: int = 32) -> list[dict]:
    """Our group-interleaved constructions on the paper's unit clock next to the paper's figures
    (see :func:`_pipeoffload_table`); computed once per process (the simulations are
    slow), a copy each call."""
    return copy.deepcopy(_cached_table(num_ranks, num_microbatches))


@functools.cache
def _cached_table(num_ranks: int, num_microbatches: int) -> list[dict]:
    return _pipeoffload_table(num_ranks=num_ranks, num_microbatches=num_microbatches)


def _pipeoffload_table(*, num_ranks: int = 8, num_microbatches: int = 32) -> list[dict]:
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
             "  before its backward (the paper's rule), as run and at block times",
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
