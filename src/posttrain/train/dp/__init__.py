"""Data-parallel training runs (``posttrain train``): a GPT or Llama on synthetic or JSONL data,
sharded by any :mod:`posttrain.dp` engine, balanced by :mod:`posttrain.balance`.

- :mod:`.config`: :class:`TrainConfig`;
- :mod:`.minibatches`: :class:`TrainData`, the sequences of every step;
- :mod:`.loop`: building the model, engine and optimizer; one rank's loop;
- :mod:`.checkpoint`: save, resume (any world size), refusal of mismatched checkpoints;
- :mod:`.metrics`: per-step metrics, their summary and files;
- :mod:`.ideal`: the even and partition bounds (no communication);
- :mod:`.launch`: forked CPU processes or torchrun.
"""

from .bounds import (
                    PARTITION_CANDIDATES,
                    pack_share,
                    partition_bound_worker,
                    partition_candidates,
                    sequence_times_worker,
)
from .checkpoint import check_resumable, latest_checkpoint, resume, save_checkpoint
from .config import DP_CHOICES, OPTIMIZERS, PRECISIONS, SYNTHETIC_VOCAB, TrainConfig
from .launch import run_training, under_torchrun
from .loop import Training, build_training, make_optimizer, microbatch_loss, plan_step, train_worker
from .metrics import STAT_FIELDS, gather_step_stats, summarize, write_metrics
from .minibatches import TrainData

__all__ = [
    "DP_CHOICES", "OPTIMIZERS", "PARTITION_CANDIDATES", "PRECISIONS", "STAT_FIELDS", "SYNTHETIC_VOCAB", "TrainConfig",
    "TrainData", "Training", "build_training", "check_resumable", "gather_step_stats",
    "latest_checkpoint", "make_optimizer", "microbatch_loss", "pack_share", "partition_bound_worker",
    "partition_candidates", "plan_step", "resume", "run_training", "save_checkpoint", "sequence_times_worker",
    "summarize", "train_worker", "under_torchrun", "write_metrics",
]
