"""Timelines of real and simulated runs: one span type, a recorder, and the Chrome-trace export.

A :class:`Span` is one interval on one rank's timeline, in seconds, on a *lane*:

- ``compute``: forward/backward (a real run's ``microbatch``, a pipeline's ``1F0``, the optimizer);
- ``comm``: a gather or reduce (under FSDP2 with gloo it includes waiting for the slowest rank at
  that layer; under ODC it is a one-sided copy that never waits for a peer);
- ``wait``: blocked on peers (a simulated rendezvous or barrier, a real minibatch ``sync``);
- ``copy``: an activation offload or reload.

Real runs record spans with a :class:`Recorder` on every rank, in ``time.perf_counter`` seconds.
On Linux that clock is ``CLOCK_MONOTONIC``, shared by all processes of a host, so spans of
different ranks line up without any clock exchange. On an accelerator the host's clock times
kernel launches, not kernels, so a recorder given the device times its spans with timing events
on the stream instead (:meth:`Recorder.resolve` turns them into seconds once the device has run
them, placed on the host clock from an anchor event recorded at :meth:`Recorder.clear`, when the
device is idle). Engines time their communication through :func:`comm_span`, so a gather or a
push is timed where it runs (ODC's prefetched gathers on their side stream). The simulator
produces the same type.
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

__all__ = ["COMM_KINDS", "LANES", "Recorder", "Span", "chrome_trace", "comm_span", "write_chrome_trace"]

#: Lanes in drawing order.
LANES = ("compute", "comm", "wait", "copy")
#: Names a :class:`Recorder` files under ``comm`` that hold up the compute (a ``prefetch``, a
#: gather ahead on a side stream, is drawn on the comm lane but runs beside the compute).
COMM_KINDS = ("gather", "reduce")
_LANE_OF = {"gather": "comm", "reduce": "comm", "prefetch": "comm",
             "sync": "wait", "barrier": "wait", "OFFLOAD": "copy", "RELOAD": "copy"}


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
    """The spans of one rank of a real run. It is an engine's communication hook
    (``DataParallelEngine.set_comm_hook``): called as ``recorder(name, start, end)``, or, through
    :func:`comm_span`, timing the communication itself.

    Args:
        rank: the rank its spans belong to.
        device: where the rank computes: on an accelerator, :meth:`span` times with events on the
            current stream, and :meth:`resolve` (after the device has finished them, e.g. after a
            step's synchronization) turns them into spans; on the CPU (default) spans are host times.
    """

    def __init__(self, rank: int = 0, device=None) -> None:
        self.rank = rank
        self.spans: list[Span] = []
        self.device = device if device is not None and device.type != "cpu" else None
        self._pending: list[tuple[str, object, object]] = []  # (name, start event, end event)
        self._anchor: tuple[float, object] | None = None  # (host time, event) the device times count from

    def add(self, name: str, start: float, end: float) -> None:
        self.spans.append(Span(self.rank, lane_of(name), name, start, end))

    __call__ = add

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        if self.device is None:
            start = time.perf_counter()
            try:
                yield
            finally:
                self.add(name, start, time.perf_counter())
            return
        if self._anchor is None:
            self._anchor = (time.perf_counter(), self._event())
        first = self._event()
        try:
            yield
        finally:
            self._pending.append((name, first, self._event()))

    def _event(self):
        import torch

        event = torch.Event(self.device, enable_timing=True)
        event.record()
        return event

    def resolve(self) -> None:
        """Turn the device-timed spans into spans (host seconds from the anchor). Waits for each
        span's events first (an event not yet reached cannot be timed; spans may be on several
        streams, e.g. a prefetch on the side stream); after the step's synchronization that costs
        nothing. Nothing on the CPU."""
        if not self._pending:
            return
        for _, first, last in self._pending:
            first.synchronize()
            last.synchronize()
        t0, anchor = self._anchor
        for name, first, last in self._pending:
            start = t0 + anchor.elapsed_time(first) / 1e3
            self.add(name, start, start + first.elapsed_time(last) / 1e3)
        self._pending.clear()

    def total(self, name: str) -> float:
        """Seconds recorded under ``name`` (device-timed spans once :meth:`resolve` has run)."""
        return sum(s.duration for s in self.spans if s.name == name)

    def clear(self) -> None:
        """Start a new window (a step); on an accelerator, at a point where the device is idle
        (its anchor is taken here)."""
        self.spans.clear()
        self._pending.clear()
        self._anchor = (time.perf_counter(), self._event()) if self.device is not None else None


@contextmanager
def comm_span(hook, kind: str) -> Iterator[None]:
    """Time a communication of ``kind`` (``gather``, ``reduce``) for an engine's hook: a
    :class:`Recorder` (or anything with ``span``) times it itself (events on an accelerator);
    a plain ``hook(kind, start, end)`` gets host times; ``None``: nothing."""
    if hook is None:
        yield
        return
    span = getattr(hook, "span", None)
    if span is not None:
        with span(kind):
            yield
        return
    start = time.perf_counter()
    yield
    hook(kind, start, time.perf_counter())


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
