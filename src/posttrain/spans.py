"""Timelines of real and simulated runs: one span type, a recorder, and the Chrome-trace export.

A :class:`Span` is one interval on one rank's timeline, in seconds, on a *lane*:

- ``compute``: forward/backward (a real run's ``microbatch``, a pipeline's ``1F0``, the optimizer);
- ``comm``: a gather or reduce (under FSDP2 with gloo it includes waiting for the slowest rank at
  that layer; under ODC it is a one-sided copy that never waits for a peer);
- ``wait``: blocked on peers (a simulated rendezvous or barrier, a real minibatch ``sync``);
- ``copy``: an activation offload or reload.

Real runs record spans with a :class:`Recorder` on every rank, in ``time.perf_counter`` seconds.
On Linux that clock is ``CLOCK_MONOTONIC``, shared by all processes of a host, so spans of
different ranks line up without any clock exchange. The simulator produces the same type.
:func:`write_chrome_trace` writes any runs as one Chrome trace (chrome://tracing, ui.perfetto.dev),
so a real run and a simulated one open side by side; ``posttrain.lab.plots`` draws them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["COMM_KINDS", "LANES", "Recorder", "Span", "chrome_trace", "write_chrome_trace"]

#: Lanes in drawing order.
LANES = ("compute", "comm", "wait", "copy")
#: Names a :class:`Recorder` files under ``comm``.
COMM_KINDS = ("gather", "reduce")
_LANE_OF = {"gather": "comm", "reduce": "comm", "sync": "wait", "barrier": "wait", "OFFLOAD": "copy", "RELOAD": "copy"}


@dataclass(frozen=True)
class Span:
    """One interval of one rank's timeline, in seconds."""

    rank: int
    lane: str
    name: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


def lane_of(name: str) -> str:
    """The lane a recorded name belongs to (``compute`` unless it is communication, waiting or a copy)."""
    return _LANE_OF.get(name, "compute")


class Recorder:
    """The spans of one rank of a real run. ``add(name, start, end)`` fits the engines'
    communication hook (``DataParallelEngine.set_comm_hook``)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.spans: list[Span] = []

    def add(self, name: str, start: float, end: float) -> None:
        self.spans.append(Span(self.rank, lane_of(name), name, start, end))

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, start, time.perf_counter())

    def total(self, name: str) -> float:
        """Seconds recorded under ``name``."""
        return sum(s.duration for s in self.spans if s.name == name)

    def clear(self) -> None:
        self.spans.clear()


def chrome_trace(runs: Mapping[str, Sequence[Span]]) -> dict:
    """Trace events: one process per run, one thread per rank and lane, times in microseconds from
    each run's first span."""
    events = []
    for pid, (label, spans) in enumerate(runs.items()):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
        t0 = min((s.start for s in spans), default=0.0)
        threads = set()
        for s in spans:
            tid = s.rank * len(LANES) + (LANES.index(s.lane) if s.lane in LANES else 0)
            threads.add((tid, s.rank, s.lane))
            events.append({"ph": "X", "name": s.name, "cat": s.lane, "pid": pid, "tid": tid,
                           "ts": (s.start - t0) * 1e6, "dur": s.duration * 1e6})
        for tid, rank, lane in sorted(threads):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": f"rank {rank} {lane}"}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(runs: Mapping[str, Sequence[Span]], path: str) -> None:
    """:func:`chrome_trace` of ``runs`` to ``path`` (JSON).

    Raises:
        ValueError: no run has a span.
    """
    if not any(runs.values()):
        raise ValueError("no run has a span to write (a simulation records them with trace=True)")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(chrome_trace(runs), f)
