"""A run's metrics file and TensorBoard events, appended as the run goes."""

from __future__ import annotations

import csv
import json
import os

__all__ = ["MetricsLog"]


class MetricsLog:
    """Rank 0's record of a run as it goes: every rank's row of each step appended to ``path``
    (CSV if it ends in ``.csv``, else JSON lines) and flushed, so an interrupted run keeps what
    it did; a resumed run (``resume=True``) continues the same file, a fresh one replaces it.
    With ``tensorboard``, the first row's ``scalars`` (those it has) also go there as TensorBoard
    events, at step ``row["step"] + 1``."""

    def __init__(self, path: str | None, tensorboard: str | None = None, *, resume: bool = False,
                 scalars: tuple[str, ...] = ("loss",)) -> None:
        self.path = path
        self.scalars = scalars
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
