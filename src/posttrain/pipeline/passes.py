"""Lowering passes: pure functions from a schedule to a longer schedule.

- :func:`add_send_recv`: a ``SEND_F`` after every forward whose next stage is on another rank and
  the matching ``RECV_F`` right before that stage's forward; likewise ``SEND_B``/``RECV_B`` for
  gradients going back. Stages on the same rank pass tensors directly.
- :func:`add_offload`: per :class:`OffloadPolicy`, an ``OFFLOAD`` right after the forward of each
  offloaded chunk-microbatch and a ``RELOAD`` placed before the compute action that precedes its
  backward, so it is issued when the action before that one starts (a copy is issued where it
  sits, see :func:`posttrain.pipeline.deps.simulate`): a whole action's time to land, and it lands an action ahead of the
  backward. Offloaded chunks are each rank's first ``chunks``
  chunks: in model order the first chunk runs its forward first and its backward last, so it
  lives longest (PipeOffload, Wan et al., ICML 2025). A chunk-microbatch whose lifespan (end of
  forward to start of backward, on the clock of the given durations) is not longer than
  ``min_lifespan`` stays resident: its round trip could not be hidden. Under a split backward,
  the part ``W`` needs of an offloaded chunk-microbatch goes out again on its own: an
  ``OFFLOAD_W`` right after ``I`` and a ``RELOAD_W`` placed like a ``RELOAD``, before the compute
  action that precedes ``W`` (when the ``I``-to-``W`` gap is longer than ``min_lifespan`` and the
  policy's ``weight`` is on).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._ir import COMPUTE_KINDS, Action
from .deps import Durations, simulate
from .layout import StageLayout

__all__ = ["OffloadPolicy", "add_offload", "add_send_recv"]


@dataclass(frozen=True)
class OffloadPolicy:
    """Which saved activations go to host memory.

    Attributes:
        chunks: offload each rank's first ``chunks`` chunks (0: none; ``num_chunks``: full).
        min_lifespan: keep a chunk-microbatch resident unless its forward-to-backward gap is
            longer than this (time units of the durations used to plan; a gap of 0, a backward
            right after the forward, is never worth a round trip).
        weight: under a split backward, also offload what ``W`` keeps between ``I`` and ``W``
            (same chunks, same ``min_lifespan`` rule on the ``I``-to-``W`` gap).
        fraction: the share of each offloaded chunk-microbatch's saved bytes that goes to host
            memory (the tensors saved first; 1: all of it). Below 1 it is selective offload within
            a chunk: the copies shrink with it, and the rest stays on the device.
    """

    chunks: int = 0
    min_lifespan: float = 0.0
    weight: bool = True
    fraction: float = 1.0

    def __post_init__(self) -> None:
        if self.chunks < 0:
            raise ValueError(f"offload chunks={self.chunks} must be non-negative")
        if self.min_lifespan < 0:
            raise ValueError(f"min_lifespan={self.min_lifespan} must be non-negative")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"offload fraction={self.fraction} must be in (0, 1]")

    @staticmethod
    def parse(text: str, num_chunks: int) -> OffloadPolicy:
        """``none``, ``full`` or a chunk count (the CLI's ``--offload``)."""
        if text == "none":
            return OffloadPolicy(0)
        if text == "full":
            return OffloadPolicy(num_chunks)
        try:
            k = int(text)
        except ValueError:
            raise ValueError(f"offload={text!r} is not none, full or a number of chunks") from None
        if not 0 <= k <= num_chunks:
            raise ValueError(f"offload={k} must be between 0 and the {num_chunks} chunks per rank")
        return OffloadPolicy(k)


def add_send_recv(schedule: dict[int, list[Action]], layout: StageLayout) -> dict[int, list[Action]]:
    """The schedule with explicit point-to-point transfers between ranks."""
    last = layout.num_stages - 1
    out: dict[int, list[Action]] = {r: [] for r in schedule}
    for rank, actions in schedule.items():
        for a in actions:
            s, j = a.stage, a.microbatch
            if a.kind == "F" and s > 0 and layout.rank_of(s - 1) != rank:
                out[rank].append(Action(s, "RECV_F", j))
            if a.kind in ("B", "I") and s < last and layout.rank_of(s + 1) != rank:
                out[rank].append(Action(s, "RECV_B", j))
            out[rank].append(a)
            if a.kind == "F" and s < last and layout.rank_of(s + 1) != rank:
                out[rank].append(Action(s, "SEND_F", j))
            if a.kind in ("B", "I") and s > 0 and layout.rank_of(s - 1) != rank:
                out[rank].append(Action(s, "SEND_B", j))
    return out


def add_offload(schedule: dict[int, list[Action]], layout: StageLayout, num_microbatches: int,
                policy: OffloadPolicy, *, durations: Durations | None = None) -> dict[int, list[Action]]:
    """The schedule with ``OFFLOAD``/``RELOAD`` per ``policy`` (see the module docstring)."""
    durations = durations or Durations()
    if policy.chunks > layout.num_chunks:
        raise ValueError(f"offload chunks={policy.chunks} exceeds the {layout.num_chunks} chunks per rank")
    if policy.chunks == 0:
        return {r: list(a) for r, a in schedule.items()}
    plan = simulate(schedule, layout, num_microbatches, durations=durations)
    out: dict[int, list[Action]] = {}
    for rank, actions in schedule.items():
        chosen, chosen_w = set(), set()
        for a in actions:
            if a.kind == "F" and layout.chunk_of(a.stage) < policy.chunks:
                s, j = a.stage, a.microbatch
                bwd = next(b for b in (Action(s, "B", j), Action(s, "I", j)) if (rank, b) in plan.start)
                if plan.start[(rank, bwd)] - plan.end[(rank, a)] > policy.min_lifespan:
                    chosen.add((s, j))
                w = Action(s, "W", j)
                if (policy.weight and bwd.kind == "I"
                        and plan.start[(rank, w)] - plan.end[(rank, bwd)] > policy.min_lifespan):
                    chosen_w.add((s, j))
        lowered: list[Action] = []
        for a in actions:
            reload = (("OFFLOAD", "RELOAD") if a.kind in ("B", "I") and (a.stage, a.microbatch) in chosen
                      else ("OFFLOAD_W", "RELOAD_W") if a.kind == "W" and (a.stage, a.microbatch) in chosen_w
                      else None)
            if reload:
                # prefetch: place the reload before the compute action preceding the backward
                # (never ahead of its own offload: the copy stream runs in list order)
                prev = next((k for k in range(len(lowered) - 1, -1, -1) if lowered[k].kind in COMPUTE_KINDS),
                            len(lowered))
                after_offload = lowered.index(Action(a.stage, reload[0], a.microbatch)) + 1
                lowered.insert(max(prev, after_offload), Action(a.stage, reload[1], a.microbatch))
            lowered.append(a)
            if a.kind == "F" and (a.stage, a.microbatch) in chosen:
                lowered.append(Action(a.stage, "OFFLOAD", a.microbatch))
            if a.kind == "I" and (a.stage, a.microbatch) in chosen_w:
                lowered.append(Action(a.stage, "OFFLOAD_W", a.microbatch))
        out[rank] = lowered
    return out
