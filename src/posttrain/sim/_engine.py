"""A small discrete-event engine: a clock, an event heap, processes as generators.

A process is a generator that yields either a number (wait that many seconds) or an
:class:`Event` (wait until it fires). Events fire at most once; callbacks added after an event
fired run at the current time. :class:`Link` is a FIFO server (a transfer waits for the ones
issued before it); :class:`Rendezvous` fires when all of its ``n`` parties have arrived, which is
how a collective (all-gather, reduce-scatter, barrier) makes the early ranks wait for the late.

Ties are broken by insertion order, so a simulation is deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Generator

__all__ = ["Engine", "Event", "Link", "Rendezvous"]


class Event:
    __slots__ = ("_callbacks", "engine", "fired")

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.fired = False
        self._callbacks: list[Callable[[], None]] = []

    def fire(self) -> None:
        if self.fired:
            raise AssertionError("event fired twice")
        self.fired = True
        for cb in self._callbacks:
            self.engine.at(self.engine.now, cb)
        self._callbacks.clear()

    def add(self, cb: Callable[[], None]) -> None:
        if self.fired:
            self.engine.at(self.engine.now, cb)
        else:
            self._callbacks.append(cb)


class Engine:
    """The clock and the event heap."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        if t < self.now:
            raise AssertionError(f"scheduling at {t} before now={self.now}")
        heapq.heappush(self._heap, (t, self._seq, fn))
        self._seq += 1

    def event(self) -> Event:
        return Event(self)

    def timeout(self, delay: float) -> Event:
        ev = Event(self)
        self.at(self.now + delay, ev.fire)
        return ev

    def process(self, gen: Generator) -> Event:
        """Start ``gen``; the returned event fires when it returns."""
        done = Event(self)

        def step() -> None:
            try:
                y = next(gen)
            except StopIteration:
                done.fire()
                return
            if isinstance(y, Event):
                y.add(step)
            else:
                if y < 0:
                    raise AssertionError(f"negative delay {y}")
                self.at(self.now + y, step)

        self.at(self.now, step)
        return done

    def run(self) -> float:
        """Run until no event is left; returns the final time."""
        heap = self._heap
        while heap:
            t, _, fn = heapq.heappop(heap)
            self.now = t
            fn()
        return self.now


class Link:
    """A FIFO server: each transfer starts when the previous one has finished."""

    __slots__ = ("busy", "engine", "free_at")

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.free_at = 0.0
        self.busy = 0.0

    def use(self, duration: float) -> Event:
        start = max(self.engine.now, self.free_at)
        self.free_at = start + duration
        self.busy += duration
        ev = Event(self.engine)
        self.engine.at(self.free_at, ev.fire)
        return ev


class Rendezvous:
    """Fires when ``n`` parties have arrived (at the last arrival's time)."""

    __slots__ = ("arrived", "done", "engine", "n")

    def __init__(self, engine: Engine, n: int) -> None:
        self.engine = engine
        self.n = n
        self.arrived = 0
        self.done = Event(engine)

    def arrive(self) -> Event:
        self.arrived += 1
        if self.arrived > self.n:
            raise AssertionError(f"{self.arrived} arrivals at a rendezvous of {self.n}")
        if self.arrived == self.n:
            self.done.fire()
        return self.done
