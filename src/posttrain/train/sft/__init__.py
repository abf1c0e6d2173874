"""Data-parallel training runs (``posttrain train``): a built-in model or a local ``transformers``
checkpoint on synthetic data or records (chat, prompt/completion, text, token ids) with loss masks,
sharded by any :mod:`posttrain.dp` engine, balanced by :mod:`posttrain.balance`.

- :mod:`.config`: :class:`TrainConfig`;
- :mod:`.minibatches`: :class:`TrainData`, the sequences of every step;
- :mod:`.loop`: building the model, engine and optimizer; one rank's step (:class:`SFTTrainer`
  on :class:`posttrain.train.core.Trainer`, which runs the steps, checkpoints and metrics);
- :mod:`.metrics`: per-step timing and its summary;
- :mod:`.bounds`: the even and partition bounds (no communication);
- :mod:`.launch`: starting a run; exporting a checkpoint.
"""

from .bounds import (
                    PARTITION_CANDIDATES,
                    partition_bound_worker,
                    partition_candidates,
                    sequence_times_worker,
)
from .config import SYNTHETIC_VOCAB, TrainConfig
from .launch import export_checkpoint, run_training
from .loop import (
    SFTTrainer,
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
from .metrics import STAT_FIELDS, gather_step_stats, summarize
from .minibatches import Sample, TrainData, load_tokenizer, model_vocab_size

__all__ = [
                    "PARTITION_CANDIDATES",
                    "STAT_FIELDS",
                    "SYNTHETIC_VOCAB",
                    "SFTTrainer",
                    "Sample",
                    "TrainConfig",
                    "TrainData",
                    "Training",
                    "build_training",
                    "evaluate",
                    "export_checkpoint",
                    "export_model",
                    "gather_step_stats",
                    "load_tokenizer",
                    "loss_units",
                    "microbatch_loss",
                    "model_vocab_size",
                    "partition_bound_worker",
                    "partition_candidates",
                    "plan_step",
                    "run_training",
                    "sequence_times_worker",
                    "step_cost",
                    "summarize",
                    "train_worker",
]
