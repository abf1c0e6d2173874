"""Per-rank timelines: where each rank spends a step (computing, communicating, waiting).

A :class:`Recorder` on every rank keeps ``(kind, start, end)`` intervals in ``time.perf_counter``
seconds. On Linux that clock is ``CLOCK_MONOTONIC``, shared by all processes of a host, so
intervals of different ranks line up without any clock exchange. Kinds:

- ``microbatch``: one forward+backward, communication inside it included;
- ``gather`` / ``reduce``: FSDP2 all-gathers and reduce-scatters (under FSDP2 with gloo they
  include the time spent waiting for the slowest rank at that layer; under ODC they are one-sided
  copies that never wait for a peer);
- ``sync``: leaving an ODC minibatch (barrier, gradients written);
- ``optimizer``: the optimizer step.

Compute time is microbatch time minus the communication inside it; everything else in a step
is waiting or communication. :func:`plot_timelines` draws runs side by side.

The engines of :mod:`posttrain.dp` report their communication calls to ``Recorder.add`` through
``DataParallelEngine.set_comm_hook``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["COMM_KINDS", "Recorder", "plot_timelines"]

COMM_KINDS = ("gather", "reduce")


class Recorder:
    """Intervals of one rank. ``add(kind, start, end)`` fits ``ODC.on_comm``."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float]] = []

    def add(self, kind: str, start: float, end: float) -> None:
        self.events.append((kind, start, end))

    @contextmanager
    def span(self, kind: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.events.append((kind, start, time.perf_counter()))

    def total(self, kind: str) -> float:
        """Seconds recorded under ``kind``."""
        return sum(e - s for k, s, e in self.events if k == kind)


_COLORS = {"compute": "#3b7dd8", "gather": "#f0a030", "reduce": "#d0502a", "sync": "#8a8a8a",
           "optimizer": "#5aa05a"}


def plot_timelines(runs: dict[str, list[list[tuple[str, float, float]]]], path: str, *,
                   title: str = "") -> None:
    """Write a PNG with one panel per run (side by side), one row per rank.

    Args:
        runs: run label -> per-rank event lists (``Recorder.events``), already cut to the
            window to show.
        path: output PNG.
        title: figure title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not runs:
        raise ValueError("no runs to plot")
    spans = []
    for per_rank in runs.values():
        starts = [s for ev in per_rank for _, s, _ in ev]
        ends = [e for ev in per_rank for _, _, e in ev]
        spans.append((max(ends) - min(starts)) if starts else 0.0)
    xmax = max(spans) * 1000 or 1.0
    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 1.2 + 0.7 * max(len(r) for r in runs.values())),
                             squeeze=False, sharex=True)
    for ax, (label, per_rank) in zip(axes[0], runs.items()):
        t0 = min((s for ev in per_rank for _, s, _ in ev), default=0.0)
        end = max((e for ev in per_rank for _, _, e in ev), default=t0)
        for rank, events in enumerate(per_rank):
            y = len(per_rank) - 1 - rank
            ax.broken_barh([(0, (end - t0) * 1000)], (y - 0.35, 0.7), color="#eeeeee")  # waiting
            for kind, s, e in sorted(events, key=lambda ev: ev[0] != "microbatch"):  # comm on top
                color = _COLORS["compute" if kind == "microbatch" else kind]
                ax.broken_barh([((s - t0) * 1000, (e - s) * 1000)], (y - 0.35, 0.7), color=color,
                               edgecolor="white" if kind == "microbatch" else None, linewidth=0.5)
        compute = [sum(e - s for k, s, e in ev if k == "microbatch") - sum(e - s for k, s, e in ev if k in COMM_KINDS)
                   for ev in per_rank]
        busy = sum(compute) / (len(per_rank) * (end - t0)) if end > t0 else 0.0
        ax.set_title(f"{label}: {(end - t0) * 1000:.0f} ms, compute {busy:.0%} of rank time")
        ax.set_yticks(range(len(per_rank)), [f"rank {r}" for r in reversed(range(len(per_rank)))])
        ax.set_xlim(0, xmax)
        ax.set_xlabel("ms")
    handles = [Patch(color=c, label=k) for k, c in _COLORS.items()] + [Patch(color="#eeeeee", label="waiting")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
