"""Pipeline parallelism with activation offload: schedules as data (this package's first part).

``build_schedule(name, num_ranks=, num_microbatches=, ...)`` returns a :class:`Schedule`
(``{rank: [Action]}`` plus its predicted memory), :func:`simulate` validates and times any
schedule, and :mod:`posttrain.pipeline.passes` lowers one (send/recv, offload/reload). See
[Note: pipeline vocabulary] in ``_ir.py``.
"""

from ._ir import COMPUTE_KINDS, KINDS, Action, format_schedule, parse_schedule
from .layout import StageLayout
from .passes import OffloadPolicy, add_offload, add_send_recv
from .schedules import SCHEDULES, Schedule, build_schedule
from .simulate import Durations, ScheduleError, SimResult, simulate

__all__ = [
    "COMPUTE_KINDS", "KINDS", "SCHEDULES", "Action", "Durations", "OffloadPolicy", "Schedule", "ScheduleError",
    "SimResult", "StageLayout", "add_offload", "add_send_recv", "build_schedule", "format_schedule",
    "parse_schedule", "simulate",
]
