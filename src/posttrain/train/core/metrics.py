"""A run's metrics file and TensorBoard events, appended as the run goes."""

from __future__ import annotations

import csv
import json
import os

__all__ = ["MetricsLog"]


class MetricsLog:
    """Rank 0's record of a run as it goes: every rank's row of each step appended to ``path``
    (CSV if it ends in ``.csv``, else JSON lines) and flushed, so an interrupted run keeps what
    it did; a resumed run (``resume_from``: the steps its checkpoint holds) continues the same
    file after dropping the rows of steps past the checkpoint (a run killed after its last
    checkpoint wrote rows that the resumed run writes again; a line cut short by the kill goes
    too), so every step appears once; a fresh run replaces the file. With ``tensorboard``, the
    first row's ``scalars`` (those it has) also go there as TensorBoard events, at step
    ``row["step"] + 1``; a resumed run purges the events past its checkpoint the same way."""

    def __init__(self, path: str | None, tensorboard: str | None = None, *, resume_from: int = 0,
                 scalars: tuple[str, ...] = ("loss",)) -> None:
        self.path = path
        self.scalars = scalars
        self._file = None
        self._csv = None
        self._fields: list[str] | None = None
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            if resume_from and os.path.exists(path) and os.path.getsize(path) > 0:
                self._fields = _keep_steps_before(path, resume_from)
                self._file = open(path, "a", newline="")
            else:
                self._file = open(path, "w", newline="")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(tensorboard, purge_step=resume_from + 1 if resume_from else None)

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


def _keep_steps_before(path: str, steps: int) -> list[str] | None:
    """Rewrite ``path`` with only the rows of steps before ``steps`` (and whole lines); the CSV
    header's fields, or ``None`` for JSON lines."""
    fields, kept = None, []
    with open(path, newline="") as f:
        if path.endswith(".csv"):
            reader = csv.reader(f)
            fields = next(reader, None)
            at = fields.index("step") if fields and "step" in fields else None
            for row in reader:
                if fields and len(row) == len(fields) and at is not None and row[at].isdigit() and int(row[at]) < steps:
                    kept.append(row)
        else:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line the kill cut short
                if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] < steps:
                    kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        if fields is not None:
            w = csv.writer(f)
            w.writerow(fields)
            w.writerows(kept)
        else:
            f.writelines(kept)
    os.replace(tmp, path)
    return fields
