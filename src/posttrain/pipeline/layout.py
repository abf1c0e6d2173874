"""Where stages live: which rank runs each stage, and which of its chunks it is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["StageLayout"]


@dataclass(frozen=True)
class StageLayout:
    """``num_ranks * num_chunks`` stages over ``num_ranks`` ranks.

    Attributes:
        num_ranks: pipeline ranks (devices).
        num_chunks: model chunks per rank.
        shape: ``loop``: stage ``s`` on rank ``s % num_ranks`` (interleaved schedules); ``v``: the
            first ``num_ranks`` stages go down the ranks and the next come back up, so rank 0
            holds the first and the last stage (V-shape schedules, two chunks).
    """

    num_ranks: int
    num_chunks: int = 1
    shape: Literal["loop", "v"] = "loop"

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks={self.num_ranks} must be at least 1")
        if self.num_chunks < 1:
            raise ValueError(f"num_chunks={self.num_chunks} must be at least 1")
        if self.shape not in ("loop", "v"):
            raise ValueError(f"shape={self.shape!r} is not one of loop, v")
        if self.shape == "v" and self.num_chunks != 2:
            raise ValueError(f"a V-shape layout has 2 chunks per rank, got num_chunks={self.num_chunks}")

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.num_chunks

    def rank_of(self, stage: int) -> int:
        self._check(stage)
        if self.shape == "v" and stage >= self.num_ranks:
            return 2 * self.num_ranks - 1 - stage
        return stage % self.num_ranks

    def chunk_of(self, stage: int) -> int:
        """Index of ``stage`` among its rank's chunks, in model order (0 = earliest layers)."""
        self._check(stage)
        return stage // self.num_ranks

    def stage_of(self, rank: int, chunk: int) -> int:
        if not (0 <= rank < self.num_ranks and 0 <= chunk < self.num_chunks):
            raise ValueError(f"no stage for {rank=} {chunk=} in {self}")
        if self.shape == "v" and chunk == 1:
            return 2 * self.num_ranks - 1 - rank
        return chunk * self.num_ranks + rank

    def _check(self, stage: int) -> None:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} out of range for {self.num_stages} stages")
