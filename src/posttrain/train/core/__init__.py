"""What every trainer shares: the configuration every run has (:mod:`.config`), the step
skeleton (:class:`Trainer`: resume, metrics, progress, checkpoint cadence, exports), checkpoints
(:mod:`.checkpoint`), the metrics file (:mod:`.metrics`) and starting a run (:mod:`.launch`).
A trainer keeps only what differs: what it builds and what one step does."""

from .checkpoint import check_resumable, latest_checkpoint, resume, save_checkpoint
from .config import OptimConfig, RunConfig, config_from_dict, config_value
from .launch import (
    OutputLock,
    check_output_path,
    check_run,
    claim_outputs,
    job_options,
    launch,
    launch_world,
    local_world,
    placement,
    under_torchrun,
)
from .metrics import MetricsLog
from .trainer import Trainer

__all__ = [
    "MetricsLog", "OptimConfig", "OutputLock", "RunConfig", "Trainer", "check_output_path", "check_resumable", "check_run",
    "claim_outputs",
    "config_from_dict", "config_value", "job_options", "latest_checkpoint", "launch", "launch_world", "local_world", "placement",
    "resume", "save_checkpoint",
    "under_torchrun",
]
