"""Pipeline parallelism with activation offload.

``build_schedule(name, num_ranks=, num_microbatches=, ...)`` returns a :class:`Schedule`
(``{rank: [Action]}`` plus its predicted memory), :func:`simulate` validates and times any
schedule, :mod:`posttrain.pipeline.passes` lowers one (send/recv, offload/reload),
:func:`split_model` cuts a model into stages and :class:`PipelineRunner` runs a rank's share with
saved activations offloaded per :class:`OffloadPolicy` (:class:`ActivationStore`). See
[Note: pipeline vocabulary] in ``_ir.py`` and [Note: saved-tensor lifecycle] in ``offload.py``.
"""

from ._ir import COMPUTE_KINDS, COPY_KINDS, KINDS, Action, format_schedule, parse_schedule
from .deps import Durations, ScheduleError, SimResult, simulate
from .layout import StageLayout
from .offload import ActivationStore
from .passes import OffloadPolicy, add_offload, add_send_recv
from .runtime import PipelineActionError, PipelineRunner, StepResult, execution_order, to_torch_actions
from .schedules import (
    GROUPED_SCHEDULES,
    ONE_CHUNK_SCHEDULES,
    SCHEDULES,
    Schedule,
    build_schedule,
    check_schedule_options,
    default_chunks,
)
from .stages import split_model

__all__ = [
    "COMPUTE_KINDS", "COPY_KINDS", "GROUPED_SCHEDULES", "KINDS", "ONE_CHUNK_SCHEDULES", "SCHEDULES", "Action", "ActivationStore",
    "Durations", "OffloadPolicy",
    "PipelineActionError", "PipelineRunner", "Schedule", "ScheduleError", "SimResult", "StageLayout", "StepResult",
    "add_offload", "add_send_recv", "build_schedule", "check_schedule_options", "default_chunks", "execution_order",
    "format_schedule", "parse_schedule",
    "simulate", "split_model", "to_torch_actions",
]
