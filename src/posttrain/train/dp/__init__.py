"""Data-parallel training runs (``posttrain train``): a built-in model or a local ``transformers``
checkpoint on synthetic data or records (chat, prompt/completion, text, token ids) with loss masks,
sharded by any :mod:`posttrain.dp` engine, balanced by :mod:`posttrain.balance`.

- :mod:`.config`: :class:`TrainConfig`;
- :mod:`.minibatches`: :class:`TrainData`, the sequences of every step;
- :mod:`.loop`: building the model, engine and optimizer; one rank's loop;
- :mod:`.checkpoint`: save, resume (any world size), refusal of mismatched checkpoints;
- :mod:`.metrics`: per-step metrics, their summary and files;
- :mod:`.bounds`: the even and partition bounds (no communication);
- :mod:`.launch`: forked CPU processes or torchrun.
"""

from .bounds import (
                    PARTITION_CANDIDATES,
                    partition_bound_worker,
                    partition_candidates,
                    sequence_times_worker,
)
from .checkpoint import check_resumable, latest_checkpoint, resume, save_checkpoint
from .config import SYNTHETIC_VOCAB, TrainConfig
from .launch import check_output_path, export_checkpoint, run_training, under_torchrun
from .loop import (
    Training,
    build_training,
    evaluate,
    export_model,
    loss_units,
    microbatch_loss,
    plan_step,
    step_cost,
    train_worker,
)
from .metrics import STAT_FIELDS, MetricsLog, gather_step_stats, summarize
from .minibatches import Sample, TrainData, load_tokenizer, model_vocab_size

__all__ = [
                    "PARTITION_CANDIDATES",
                    "STAT_FIELDS",
                    "SYNTHETIC_VOCAB",
                    "MetricsLog",
                    "Sample",
                    "TrainConfig",
                    "TrainData",
                    "Training",
                    "build_training",
                    "check_output_path",
                    "check_resumable",
                    "evaluate",
                    "export_checkpoint",
                    "export_model",
                    "gather_step_stats",
                    "latest_checkpoint",
                    "load_tokenizer",
                    "loss_units",
                    "microbatch_loss",
                    "model_vocab_size",
                    "partition_bound_worker",
                    "partition_candidates",
                    "plan_step",
                    "resume",
                    "run_training",
                    "save_checkpoint",
                    "sequence_times_worker",
                    "step_cost",
                    "summarize",
                    "train_worker",
                    "under_torchrun",
]
