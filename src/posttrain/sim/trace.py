"""Timelines of simulated runs: Chrome trace JSON (chrome://tracing, Perfetto) and a PNG."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from .dp import DPResult

__all__ = ["chrome_trace", "plot_dp_timelines", "plot_pipeline_sim", "write_chrome_trace"]

_COLORS = {"compute": "#2b8cbe", "comm": "#fdae6b", "wait": "#de2d26"}


def chrome_trace(results: Sequence[DPResult]) -> dict:
    """Trace events: one process per simulated run, one thread per rank and lane, times in us."""
    events = []
    for pid, res in enumerate(results):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": res.strategy}})
        for s in res.spans:
            tid = s.rank * 3 + ("compute", "comm", "wait").index(s.lane)
            events.append({"ph": "X", "name": s.name, "cat": s.lane, "pid": pid, "tid": tid,
                           "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6})
        for r in range(res.world_size):
            for lane_i, lane in enumerate(("compute", "comm", "wait")):
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": r * 3 + lane_i,
                               "args": {"name": f"rank {r} {lane}"}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(results: Sequence[DPResult], path: str) -> None:
    if not any(res.spans for res in results):
        raise ValueError("no timeline recorded: simulate with trace=True")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(chrome_trace(results), f)


def plot_dp_timelines(results: Sequence[DPResult], path: str, *, max_ranks: int = 16) -> None:
    """One panel per run (same time axis), ``max_ranks`` ranks each: compute, communication in
    flight and waiting (blocked on a gather, a collective or the barrier)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not any(res.spans for res in results):
        raise ValueError("no timeline recorded: simulate with trace=True")
    end = max(res.time for res in results)
    ranks = min(max_ranks, max(res.world_size for res in results))
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 1.0 + 0.35 * ranks * len(results)), sharex=True, squeeze=False)
    for ax, res in zip(axes[:, 0], results):
        lanes: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for s in res.spans:
            if s.rank < ranks:
                lanes.setdefault((s.rank, s.lane), []).append((s.start * 1e3, (s.end - s.start) * 1e3))
        for (rank, lane), bars in lanes.items():
            y = rank + {"compute": 0.0, "comm": 0.3, "wait": 0.0}[lane]
            h = {"compute": 0.55, "comm": 0.25, "wait": 0.55}[lane]
            ax.broken_barh(bars, (y - 0.3, h), facecolors=_COLORS[lane], linewidth=0)
        ax.set_yticks(range(ranks))
        ax.set_yticklabels([f"rank {r}" for r in range(ranks)], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, end * 1e3)
        ax.set_title(f"{res.strategy}: {res.time * 1e3:.1f} ms, {res.throughput:,.0f} tokens/s, "
                     f"bubble {res.bubble_fraction:.1%}", fontsize=9)
    axes[-1, 0].set_xlabel("ms")
    fig.legend(handles=[Patch(color=c, label=k) for k, c in _COLORS.items()], loc="upper right", fontsize=8, ncol=3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)




def plot_pipeline_sim(res, path: str) -> None:
    """Per rank: compute actions as bars, copies as thin bars below, and resident activation
    bytes on a second axis (a :class:`posttrain.sim.pipeline.PipelineSimResult`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"F": "#2b8cbe", "B": "#31a354", "I": "#31a354", "W": "#a1d99b", "OFFLOAD": "#e6550d", "RELOAD": "#756bb1"}
    n = res.num_ranks
    fig, axes = plt.subplots(n, 1, figsize=(12, 1.3 * n + 1), sharex=True, squeeze=False)
    for rank, ax in enumerate(axes[:, 0]):
        for (r, a), t0 in res.sim.start.items():
            if r != rank or a.kind not in colors:
                continue
            copy = a.kind in ("OFFLOAD", "RELOAD")
            ax.broken_barh([(t0, res.sim.end[(r, a)] - t0)], (-0.6 if copy else 0, 0.4 if copy else 1),
                           facecolors=colors[a.kind], edgecolor="white", linewidth=0.3)
        ax.set_yticks([])
        ax.set_ylabel(f"rank {rank}", fontsize=8)
        mem = ax.twinx()
        curve = res.memory_curve_bytes(rank)
        if curve:
            xs, ys = zip(*curve)
            mem.step(xs, [y / 2**30 for y in ys], where="post", color="black", linewidth=1)
        mem.set_ylabel("GiB", fontsize=7)
    axes[0, 0].set_title(f"{res.schedule} v={res.num_chunks} g={res.group_size} offload {res.offload_chunks}: "
                         f"makespan {res.makespan:.4g} (no offload {res.base_makespan:.4g}), peak {max(res.peaks)} "
                         "chunk-microbatches", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
