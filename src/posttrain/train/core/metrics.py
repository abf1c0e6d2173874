"""A run's metrics file, TensorBoard events and Weights & Biases run, appended as the run goes."""

from __future__ import annotations

import csv
import json
import os
import time
from typing import Any

__all__ = ["MetricsLog"]


class MetricsLog:
    """Rank 0's record of a run as it goes: every rank's row of each step appended to ``path``
    (CSV if it ends in ``.csv``, else JSON lines) and flushed, so an interrupted run keeps what
    it did; a resumed run (``resume_from``: the steps its checkpoint holds) continues the same
    file after dropping the rows of steps past the checkpoint (a run killed after its last
    checkpoint wrote rows that the resumed run writes again; a line cut short by the kill goes
    too), so every step appears once; a fresh run replaces the file. With ``tensorboard``, the
    first row's ``scalars`` (those it has) also go there as TensorBoard events, at step
    ``row["step"] + 1``; a resumed run purges the events past its checkpoint the same way. With
    ``wandb`` (a Weights & Biases project) the same scalars go to a W&B run at the same steps,
    with ``config`` as its configuration; given ``state_dir`` (the checkpoint folder) the run's
    id is kept there, so that a resumed run continues the same W&B run.

    Writes are buffered: the file and the events reach the disk every ``flush_every`` seconds and
    at :meth:`close` (which the trainer runs however the run ends), so a run killed outright loses
    at most that window's rows, and the cost of a flush per step is gone."""

    def __init__(self, path: str | None, tensorboard: str | None = None, *, resume_from: int = 0,
                 scalars: tuple[str, ...] = ("loss",), wandb: str | None = None,
                 config: dict[str, Any] | None = None, state_dir: str | None = None,
                 flush_every: float = 2.0) -> None:
        self.path = path
        self.scalars = scalars
        self.flush_every = flush_every
        self._flushed = time.monotonic()
        self._wandb = None
        if wandb:  # first: a W&B run that cannot start leaves no file opened (and truncated) behind
            self._wandb = _start_wandb(wandb, config or {}, state_dir, resume_from)
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
        head = rows[0]
        step = head["step"] + 1
        figures = {f"train/{name}": head[name] for name in self.scalars if head.get(name) is not None}
        if self._tb is not None:
            for key, value in figures.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None and step >= self._wandb.step:  # W&B refuses steps it has (a resumed run's)
            self._wandb.log(figures, step=step)
        if time.monotonic() - self._flushed >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Write what is buffered to the file and the events."""
        if self._file is not None:
            self._file.flush()
        if self._tb is not None:
            self._tb.flush()
        self._flushed = time.monotonic()

    def close(self, failed: bool = False) -> None:
        """Flush and close everything; the W&B run is finished (uploaded where online), marked
        failed where the training run ``failed``."""
        try:  # the file and the events first: a W&B finish that fails (network, Ctrl-C) must not lose rows
            if self._file is not None:
                file, self._file = self._file, None
                file.close()
            if self._tb is not None:
                tb, self._tb = self._tb, None
                tb.close()
        finally:
            if self._wandb is not None:
                run, self._wandb = self._wandb, None
                run.finish(exit_code=1 if failed else 0)


#: The file in the checkpoint folder that names the W&B run a resumed run continues.
WANDB_RUN_FILE = "wandb-run.json"


def _start_wandb(project: str, config: dict[str, Any], state_dir: str | None, resume_from: int):
    """A W&B run in ``project``: a new one, or (resuming, with the id kept in ``state_dir``) the
    run this training run started, continued."""
    import wandb

    kept = os.path.join(state_dir, WANDB_RUN_FILE) if state_dir else None
    run_id = None
    if kept and resume_from and os.path.exists(kept):
        try:
            with open(kept) as f:
                run_id = json.load(f).get("id")
        except (OSError, ValueError, AttributeError):
            import warnings

            warnings.warn(f"{kept} is unreadable: the resumed run starts a new W&B run", RuntimeWarning, stacklevel=2)
        if not isinstance(run_id, str):
            run_id = None
    try:
        run = wandb.init(project=project, config=config, id=run_id, resume="allow" if run_id else None)
    except Exception as e:  # wandb's own errors (no API key, network) in one line
        from posttrain.errors import RunError

        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RunError(f"`wandb` {project}: W&B could not start a run: {first} (WANDB_MODE=offline logs "
                       "without an account; `wandb sync` uploads later)") from e
    if kept and not run_id:
        os.makedirs(state_dir, exist_ok=True)
        with open(kept + ".tmp", "w") as f:
            json.dump({"id": run.id, "project": project}, f)
        os.replace(kept + ".tmp", kept)
    return run


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
