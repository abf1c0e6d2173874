"""The schedule IR: one small value type per pipeline action.

[Note: pipeline vocabulary]
- A *stage* is one model chunk placed on one rank; a pipeline of ``num_ranks`` ranks with
  ``num_chunks`` chunks per rank has ``num_ranks * num_chunks`` stages, numbered in model order.
- An *action* is ``(stage, kind, microbatch)``, written like ``1F0`` (stage 1, forward,
  microbatch 0). Compute kinds: ``F`` forward, ``B`` full backward, ``I`` input-gradient backward,
  ``W`` weight-gradient backward (zero-bubble schedules split ``B`` into ``I`` then ``W``).
  Lowering adds ``SEND_F``/``RECV_F`` (activations to/from the next stage), ``SEND_B``/``RECV_B``
  (gradients to/from the previous stage) and ``OFFLOAD``/``RELOAD`` (saved activations to host
  memory and back); ``OFFLOAD_W``/``RELOAD_W`` move the part of a split backward's saved
  activations that ``W`` still needs once ``I`` has run. The text forms are those of
  ``torch.distributed.pipelining`` where it has them.
- A *schedule* is ``{rank: [Action, ...]}``: each rank runs its list in order.
- A stage holds the saved activations of microbatch ``j`` from the start of ``F`` until its
  backward finishes: one *chunk-microbatch*, the unit of activation memory throughout
  ``posttrain.pipeline``. A split backward frees what only ``I`` needs when ``I`` ends and keeps
  the rest (the weight-gradient inputs, a fraction of the chunk-microbatch) until ``W``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["COMPUTE_KINDS", "COPY_KINDS", "KINDS", "Action", "format_schedule", "parse_schedule"]

Kind = Literal["F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "OFFLOAD", "RELOAD", "OFFLOAD_W",
               "RELOAD_W"]
COMPUTE_KINDS = ("F", "B", "I", "W")
COPY_KINDS = ("OFFLOAD", "RELOAD", "OFFLOAD_W", "RELOAD_W")
KINDS = (*COMPUTE_KINDS, "SEND_F", "RECV_F", "SEND_B", "RECV_B", *COPY_KINDS)
_PATTERN = re.compile(r"^(\d+)(" + "|".join(sorted(KINDS, key=len, reverse=True)) + r")(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One pipeline action; ``str(a)`` is its text form (``1F0``) and ``Action.parse`` reads it back."""

    stage: int
    kind: Kind
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; valid: {', '.join(KINDS)}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"stage and microbatch must be non-negative, got {self.stage=} {self.microbatch=}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @staticmethod
    def parse(text: str) -> Action:
        """The action written as ``text`` (``"1F0"``, ``"3SEND_B2"``, ``"0RELOAD5"``)."""
        m = _PATTERN.match(text.strip())
        if not m:
            raise ValueError(f"{text!r} is not an action; expected <stage><kind><microbatch> with kind one of "
                             f"{', '.join(KINDS)}, e.g. '1F0'")
        return Action(int(m.group(1)), m.group(2), int(m.group(3)))


def format_schedule(schedule: dict[int, list[Action]]) -> dict[int, str]:
    """``{rank: "0F0 0F1 ..."}``: the golden-test form of a schedule."""
    return {rank: " ".join(map(str, actions)) for rank, actions in sorted(schedule.items())}


def parse_schedule(text: dict[int, str]) -> dict[int, list[Action]]:
    """Inverse of :func:`format_schedule`."""
    return {rank: [Action.parse(t) for t in line.split()] for rank, line in text.items()}
