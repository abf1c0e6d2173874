"""The step skeleton every trainer runs: resume, steps, metrics, progress, checkpoints, exports.

A trainer (:class:`Trainer`) is one rank of a run. Its subclass builds what it trains (the model,
the engine or the pipeline's stages, the optimizer) and says what one step does
(:meth:`Trainer.train_step`, returning the step's metrics row) and how the run's model is written
(:meth:`Trainer.export`). :meth:`Trainer.run` does the rest, the same way for every trainer:

- resume from the newest checkpoint under ``checkpoint_dir`` (any world size the state allows);
- after every step: the metrics row appended to ``metrics`` and TensorBoard (rank 0 writes every
  rank's row, or only its own for trainers whose rows hold global figures), a checkpoint when
  ``checkpoint_every`` says so and after the last step, ``output_dir`` written when ``save_every``
  says so and after the last step, a progress line on rank 0;
- whatever happens, the progress bar, the metrics file and the engines closed.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from posttrain.errors import writing

from .checkpoint import resume, save_checkpoint
from .config import RunConfig
from .metrics import MetricsLog

__all__ = ["Trainer"]


class Trainer(ABC):
    """One rank of a training run (a collective object: every rank builds one and runs it).

    Args:
        cfg: the run.
        rank, world_size: this process among the run's processes.
        state: what a checkpoint holds: a :class:`~posttrain.dp.DataParallelEngine`, or any
            object with its ``state_dict(optimizer)``, ``load_state_dict(state, optimizer)`` and
            ``checkpoint_format``.
        optimizer: what steps the parameters.
        label: how progress lines name the run.
    """

    #: The row fields written to TensorBoard.
    scalars: ClassVar[tuple[str, ...]] = ("loss",)
    #: Whether a step's metrics are every rank's row (each its own times) or rank 0's alone
    #: (rows of global figures, the same on every rank).
    rows_per_rank: ClassVar[bool] = True

    def __init__(self, cfg: RunConfig, rank: int, world_size: int, *, state: Any, optimizer: torch.optim.Optimizer,
                 label: str) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.state = state
        self.optimizer = optimizer
        self.label = label
        self.resumed_from = 0

    def every_rank_rows(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """On rank 0, every rank's row of the step whose row it returned, built from what it
        already holds of the others' measurements. A trainer that overrides this saves the core
        its per-step gather of the rows (a collective that pickles every row: on small steps it
        cost several percent of the step time); by default the core gathers them."""
        raise NotImplementedError

    @abstractmethod
    def train_step(self, step: int) -> dict[str, Any]:
        """Run step ``step`` (0-based; a collective) and return its metrics row (``step`` included)."""

    def export(self) -> None:
        """Write ``cfg.output_dir`` from the current parameters (a collective)."""
        raise NotImplementedError(f"{type(self).__name__} does not write `output_dir`")

    def progress_line(self, step: int, row: dict[str, Any]) -> str | None:
        """What rank 0 prints after step ``step`` (``None``: nothing)."""
        return None

    def finish(self) -> None:  # noqa: B027 - optional
        """After the last step, on success (a collective where the subclass needs one)."""

    def close(self) -> None:  # noqa: B027 - optional
        """Free what the trainer holds (engines, buffers). Runs whatever happened; no collective."""

    def run(self) -> list[dict[str, Any]]:
        """Resume, run the remaining steps with their metrics, checkpoints and exports, and
        close; the rows of the steps run here."""
        cfg = self.cfg
        rows: list[dict[str, Any]] = []
        log = bar = None
        done = False
        try:
            start = self.resumed_from = resume(cfg, self.state, self.optimizer) if cfg.checkpoint_dir else 0
            if self.rank == 0 and (cfg.metrics or cfg.tensorboard or cfg.wandb):
                log = MetricsLog(cfg.metrics, cfg.tensorboard, resume_from=start, scalars=self.scalars,
                                 wandb=cfg.wandb, config=dataclasses.asdict(cfg), state_dir=cfg.checkpoint_dir)
            if cfg.progress and self.rank == 0:
                from tqdm import tqdm

                # no bar when stderr is not a terminal; the step lines still print
                bar = tqdm(total=cfg.steps, initial=start, desc=self.label, unit="step", leave=False, disable=None)
                if start:
                    bar.write(f"resumed from {cfg.checkpoint_dir} after step {start}")
            for step in range(start, cfg.steps):
                row = self.train_step(step)
                rows.append(row)
                if cfg.metrics or cfg.tensorboard or cfg.wandb:
                    every = [row]
                    if self.rows_per_rank:
                        if type(self).every_rank_rows is not Trainer.every_rank_rows:  # (the same on every rank)
                            every = self.every_rank_rows(row) if self.rank == 0 else None
                        else:
                            every = [None] * self.world_size if self.rank == 0 else None
                            dist.gather_object(row, every, dst=0)
                    if log is not None:
                        with writing("`metrics`", cfg.metrics or cfg.tensorboard):
                            log.append(every)
                if cfg.checkpoint_dir and cfg.due(step, cfg.checkpoint_every):
                    if log is not None:  # the rows up to a checkpoint are on disk before it is (a resume drops later ones)
                        with writing("`metrics`", cfg.metrics or cfg.tensorboard):
                            log.flush()
                    save_checkpoint(cfg, self.state, self.optimizer, step, self.rank)
                exported = bool(cfg.output_dir and cfg.due(step, cfg.save_every))
                if exported:
                    with writing(f"`output_dir` {cfg.output_dir} after step {step + 1}", cfg.output_dir):
                        self.export()
                if bar is not None:  # the step's line, then what was written after it
                    line = self.progress_line(step, row)
                    if line:
                        bar.write(line)
                    if exported:
                        bar.write(f"wrote {cfg.output_dir} after step {step + 1}")
                    bar.update(1)
            self.finish()
            done = True
        finally:
            if bar is not None:
                bar.close()
            if log is not None:
                try:
                    with writing("`metrics`", cfg.metrics or cfg.tensorboard):
                        log.close(failed=not done)
                except Exception:
                    if done:  # else the error that ended the run is the one to report
                        raise
            self.close()
        return rows
