"""Per-step metrics of a training run: what each rank measured, and their summary."""

from __future__ import annotations

import csv
import json
import os

import torch
import torch.distributed as dist

__all__ = ["STAT_FIELDS", "MetricsLog", "gather_step_stats", "summarize"]

#: What every rank measures per step and shares after it (one small all-gather, outside the timed step).
STAT_FIELDS = ("loss", "compute_s", "comm_s", "sync_s", "optimizer_s", "busy_s", "microbatches", "rank_tokens")


def gather_step_stats(mine: dict[str, float], world_size: int) -> dict[str, torch.Tensor]:
    """Every rank's :data:`STAT_FIELDS` values: field -> tensor of one value per rank (a collective)."""
    local = torch.tensor([float(mine[k]) for k in STAT_FIELDS], dtype=torch.float64)
    every = torch.empty(world_size * len(STAT_FIELDS), dtype=torch.float64)
    dist.all_gather_single(every, local)
    every = every.view(world_size, len(STAT_FIELDS))
    return {name: every[:, i] for i, name in enumerate(STAT_FIELDS)}


def summarize(results: list[dict]) -> dict:
    """Aggregate ranks' metrics over the steps after the first (warm-up).

    Returns tokens/s, utilization (compute share of step time averaged over ranks), wait share,
    compute seconds per step summed over ranks, the busiest rank's compute seconds per step
    (``busiest_compute_s``: per step the largest of the ranks', averaged over the steps), first and
    final loss, and mean step time.
    """
    steps = list(zip(*(r["metrics"] for r in results)))
    steady = steps[1:] or steps
    step_times = [s[0]["step_time_s"] for s in steady]
    util = [sum(r["utilization"] for r in s) / len(s) for s in steady]
    return {
        "tokens_per_s": sum(s[0]["tokens"] for s in steady) / sum(step_times),
        "utilization": sum(util) / len(util),
        "wait_share": sum(sum(r["wait_s"] for r in s) / (len(s) * s[0]["step_time_s"]) for s in steady) / len(steady),
        "compute_s": sum(sum(r["compute_s"] for r in s) for s in steady) / len(steady),
        "busiest_compute_s": sum(max(r["compute_s"] for r in s) for s in steady) / len(steady),
        "final_loss": steps[-1][0]["loss"],
        "first_loss": steps[0][0]["loss"],
        "step_time_s": sum(step_times) / len(step_times),
    }


class MetricsLog:
    """Rank 0's record of a run as it goes: every rank's row of each step appended to ``path``
    (CSV if it ends in ``.csv``, else JSON lines) and flushed, so an interrupted run keeps what
    it did; a resumed run (``resume=True``) continues the same file, a fresh one replaces it.
    With ``tensorboard``, the step's global scalars (loss, eval loss, tokens/s, step time,
    utilization) also go there as TensorBoard events."""

    SCALARS = ("loss", "eval_loss", "tokens_per_s", "step_time_s", "utilization")

    def __init__(self, path: str | None, tensorboard: str | None = None, *, resume: bool = False,
                 scalars: tuple[str, ...] | None = None) -> None:
        self.path = path
        self.scalars = scalars or self.SCALARS
        self._file = None
        self._csv = None
        self._fields: list[str] | None = None
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            if resume and os.path.exists(path) and os.path.getsize(path) > 0:
                if path.endswith(".csv"):
                    with open(path, newline="") as f:
                        self._fields = next(csv.reader(f), None)
                self._file = open(path, "a", newline="")
            else:
                self._file = open(path, "w", newline="")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(tensorboard)

    def append(self, rows: list[dict]) -> None:
        """One step's rows (every rank's, rank 0's first)."""
        if self._file is not None:
            if self.path.endswith(".csv"):
                if self._csv is None:
                    if self._fields is None:
                        self._fields = list(rows[0])
                        self._csv = csv.DictWriter(self._file, fieldnames=self._fields, extrasaction="ignore")
                        self._csv.writeheader()
                    else:
                        self._csv = csv.DictWriter(self._file, fieldnames=self._fields, extrasaction="ignore")
                self._csv.writerows(rows)
            else:
                for row in rows:
                    self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        if self._tb is not None:
            head = rows[0]
            for name in self.scalars:
                if head.get(name) is not None:
                    self._tb.add_scalar(f"train/{name}", head[name], head["step"] + 1)
            self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
