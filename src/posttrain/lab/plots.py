"""Plots of real and simulated runs (matplotlib, PNG): one lane plotter, :func:`plot_lanes`, for
every timeline, and the adapters that turn each kind of run into its spans.

- :func:`plot_timelines`: real data-parallel runs (the spans of ``posttrain train`` / the demo);
- :func:`plot_dp_timelines`: simulated data-parallel runs (:class:`~posttrain.sim.DPResult`);
- :func:`plot_pipeline`: real pipeline runs (``posttrain pipeline``), with resident activations;
- :func:`plot_pipeline_sim`: a simulated pipeline run, with resident activation bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from posttrain.spans import COMM_KINDS, Span

__all__ = ["plot_dp_timelines", "plot_lanes", "plot_pipeline", "plot_pipeline_sim", "plot_reward_curve", "plot_timelines"]

#: Colour of a span: by its name where listed, else by its lane.
COLORS = {
    "compute": "#3b7dd8", "comm": "#f0a030", "wait": "#8a8a8a", "copy": "#756bb1",
    "gather": "#f0a030", "reduce": "#d0502a", "optimizer": "#5aa05a", "sync": "#8a8a8a",
    "F": "#4c78a8", "B": "#e45756", "I": "#f58518", "W": "#72b7b2", "OFFLOAD": "#e6550d", "RELOAD": "#756bb1",
}
# (offset, height) of a lane inside a rank's row (row height 1): communication and copies in
# thin bands over compute, so both stay visible.
_BANDS = {"compute": (0.1, 0.8), "wait": (0.1, 0.8), "comm": (0.55, 0.35), "copy": (0.0, 0.15)}


def _color(s: Span) -> str:
    kind = s.name.strip("0123456789")
    return COLORS.get(s.name) or COLORS.get(kind) or COLORS.get(s.lane, "#999999")


def plot_lanes(runs: Mapping[str, Sequence[Span]], path: str | Path, *, title: str = "",
               curves: Mapping[str, Mapping[int, Sequence[tuple[float, float]]]] | None = None,
               curve_label: str = "", side_by_side: bool = True, max_ranks: int = 16,
               subtitles: Mapping[str, str] | None = None) -> Path:
    """Write a PNG: one panel per run (side by side or stacked, one time axis), one row per rank
    (at most ``max_ranks``), each span a bar coloured by its name or lane; optional per-rank
    ``curves`` (e.g. resident activations) on a second axis of each rank's row.

    Args:
        runs: run label -> spans (any ranks, seconds; each run is drawn from its first span).
        path: the PNG.
        title: figure title.
        curves: run label -> rank -> ``(seconds, value)`` steps, drawn over that rank's row.
        curve_label: what the curves measure.
        side_by_side: panels in a row (else stacked).
        max_ranks: ranks drawn per run.
        subtitles: run label -> panel title (default: the label and the run's length).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not runs or not any(runs.values()):
        raise ValueError("no spans to plot")
    spans_of = {label: [s for s in spans if s.rank < max_ranks] for label, spans in runs.items()}
    ranks = {label: (max(s.rank for s in spans) + 1 if spans else 1) for label, spans in spans_of.items()}
    origin = {label: min((s.start for s in spans), default=0.0) for label, spans in spans_of.items()}
    length = {label: max((s.end for s in spans), default=0.0) - origin[label] for label, spans in spans_of.items()}
    xmax = max(length.values()) * 1e3 or 1.0
    rows = max(ranks.values())
    n = len(runs)
    shape = (1, n) if side_by_side else (n, 1)
    size = (6.5 * n, 1.2 + 0.55 * rows) if side_by_side else (12, 0.8 + (0.45 + 0.6 * bool(curves)) * rows * n)
    fig, axes = plt.subplots(*shape, figsize=size, squeeze=False, sharex=True)
    used: dict[str, str] = {}
    for ax, label in zip(axes.flat, runs):
        t0 = origin[label]
        for r in range(ranks[label]):
            ax.broken_barh([(0, length[label] * 1e3)], (r + 0.1, 0.8), color="#f2f2f2")
        # One collection per (row band, colour): thousands of spans draw in one call each, not one by one.
        bars: dict[tuple, list[tuple[float, float]]] = {}
        for s in sorted(spans_of[label], key=lambda s: s.lane != "compute"):  # compute first, thin bands on top
            off, h = _BANDS.get(s.lane, (0.1, 0.8))
            color = _color(s)
            used.setdefault(s.name.strip("0123456789") if s.name.strip("0123456789") in COLORS else s.lane, color)
            bars.setdefault((s.rank + off, h, color, s.lane == "compute"), []).append(
                ((s.start - t0) * 1e3, max(s.duration * 1e3, 1e-3)))
        for (y, h, color, compute), xs in bars.items():
            ax.broken_barh(xs, (y, h), color=color, edgecolor="white" if compute else None, linewidth=0.3)
        for rank, steps in ((curves or {}).get(label) or {}).items():
            if rank >= ranks[label] or not steps:
                continue
            top = max(v for _, v in steps) or 1.0
            xs = [(t - t0) * 1e3 for t, _ in steps]
            ax.step(xs, [rank + 0.95 - 0.85 * v / top for _, v in steps], where="post", color="black", linewidth=0.9)
            ax.text(xs[-1], rank + 0.15, f"max {top:.3g}", fontsize=6, ha="right")
        ax.set_yticks([r + 0.5 for r in range(ranks[label])], [f"rank {r}" for r in range(ranks[label])], fontsize=7)
        ax.set_ylim(ranks[label], 0)
        ax.set_xlim(0, xmax)
        ax.set_xlabel("ms")
        ax.set_title((subtitles or {}).get(label, f"{label}: {length[label] * 1e3:.1f} ms"), fontsize=9)
    handles = [Patch(color=c, label=k) for k, c in used.items()] + [Patch(color="#f2f2f2", label="idle")]
    if curves:
        handles.append(plt.Line2D([], [], color="black", label=curve_label or "curve"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8), frameon=False, fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 0.96 if title else 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timelines(runs: Mapping[str, Sequence[Span]], path: str | Path, *, title: str = "",
                   side_by_side: bool = True) -> Path:
    """Real data-parallel runs side by side, or stacked on one time axis (run label -> the spans
    of every rank, already cut to the window to show), with each panel's share of rank time
    spent computing."""
    subtitles = {}
    for label, spans in runs.items():
        if not spans:
            continue
        ranks = max(s.rank for s in spans) + 1
        window = max(s.end for s in spans) - min(s.start for s in spans)
        compute = sum(s.duration for s in spans if s.name == "microbatch") - \
            sum(s.duration for s in spans if s.name in COMM_KINDS)
        busy = compute / (ranks * window) if window > 0 else 0.0
        subtitles[label] = f"{label}: {window * 1e3:.0f} ms, compute {busy:.0%} of rank time"
    return plot_lanes(runs, path, title=title, subtitles=subtitles, side_by_side=side_by_side)


def plot_dp_timelines(results: Sequence, path: str | Path, *, max_ranks: int = 16) -> Path:
    """Simulated data-parallel runs (:class:`~posttrain.sim.DPResult`, simulated with
    ``trace=True``), stacked on one time axis."""
    if not any(r.spans for r in results):
        raise ValueError("no timeline recorded: simulate with trace=True")
    subtitles = {r.strategy: f"{r.strategy}: {r.time * 1e3:.1f} ms, {r.throughput:,.0f} tokens/s, "
                 f"bubble {r.bubble_fraction:.1%}" for r in results}
    return plot_lanes({r.strategy: r.spans for r in results}, path, side_by_side=False, max_ranks=max_ranks,
                      subtitles=subtitles)


def _action_spans(rank: int, actions: Sequence[tuple[str, float, float]]) -> list[Span]:
    out = []
    for text, t0, t1 in actions:
        kind = text.lstrip("0123456789").rstrip("0123456789")
        if kind in ("F", "B", "I", "W"):
            out.append(Span(rank, "compute", text, t0, t1))
        elif kind in ("OFFLOAD", "RELOAD"):
            out.append(Span(rank, "copy", kind, t0, t1))
    return out


def plot_pipeline(results: list[dict], path: str | Path, title: str) -> Path:
    """Real pipeline runs (``run_pipeline`` results, one per rank): the last step's actions and the
    resident saved activations (chunk-microbatches) of every rank."""
    spans = [s for r, res in enumerate(results) for s in _action_spans(r, res["result"]["actions"])]
    curve = {r: list(res["result"]["curve"]) for r, res in enumerate(results)}
    return plot_lanes({"last step": spans}, path, title=title, curves={"last step": curve},
                      curve_label="resident saved activations (chunk-microbatches)", side_by_side=False)


def plot_pipeline_sim(res, path: str | Path) -> Path:
    """A simulated pipeline run (:class:`~posttrain.sim.pipeline.PipelineSimResult`): actions and
    copies per rank, and resident activation GiB."""
    spans = [Span(r, "copy" if a.kind in ("OFFLOAD", "RELOAD") else "compute",
                  a.kind if a.kind in ("OFFLOAD", "RELOAD") else str(a), t0, res.sim.end[(r, a)])
             for (r, a), t0 in res.sim.start.items() if a.kind in ("F", "B", "I", "W", "OFFLOAD", "RELOAD")]
    curves = {r: [(t, b / 2**30) for t, b in res.memory_curve_bytes(r)] for r in range(res.num_ranks)}
    title = (f"{res.schedule} v={res.num_chunks} g={res.group_size} offload {res.offload_chunks}: makespan "
             f"{res.makespan:.4g} s (no offload {res.base_makespan:.4g}), peak {max(res.peaks)} chunk-microbatches")
    return plot_lanes({"simulated": spans}, path, title=title, curves={"simulated": curves},
                      curve_label="resident activations (GiB)", side_by_side=False)



def plot_reward_curve(rows: Sequence[Mapping], path: str | Path, *, title: str = "", window: int = 5) -> Path:
    """Write a PNG of an RL run's mean reward per step (``posttrain rl`` metrics rows) and its
    running mean over ``window`` steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    mean = [r["reward_mean"] for r in rows]
    running = [sum(mean[max(0, i - window + 1):i + 1]) / len(mean[max(0, i - window + 1):i + 1])
               for i in range(len(mean))]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(steps, mean, color=COLORS["compute"], alpha=0.35, marker=".", linewidth=1, label="mean reward of the step")
    ax.plot(steps, running, color=COLORS["compute"], linewidth=2, label=f"running mean over {window} steps")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(min(0.0, min(mean)) - 0.05, max(1.0, max(mean)) + 0.05)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
