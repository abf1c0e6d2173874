"""``posttrain.sim``: a discrete-event simulator for cluster scales we cannot run here.

- Data parallel (:func:`simulate_dp`): FSDP's per-layer collectives vs ODC's one-sided gathers
  and pushes with one barrier per minibatch, flat or HSDP, on plans from
  :mod:`posttrain.balance`. See [Note: what the DP simulation models] in ``dp.py``.
- Pipeline (:func:`simulate_pipeline`): schedules from :mod:`posttrain.pipeline` with
  F/B/W durations, activation bytes, a host link and an offload policy.
- Timelines as :class:`posttrain.spans.Span` lists (Chrome trace: :func:`posttrain.spans.write_chrome_trace`),
  and the planner (``posttrain plan``).
"""

from .cluster import Cluster
from .costs import MODEL_SHAPES, LayerCost, ModelShape, SimModel
from .dp import CP_CALL_S, STRATEGIES, DPResult, exchange_seconds, plan_lengths, simulate_dp, simulate_minibatch
from .lengths import LENGTH_PROFILES, draw_lengths, load_lengths

__all__ = [
    "CP_CALL_S", "LENGTH_PROFILES", "MODEL_SHAPES", "STRATEGIES", "Cluster", "DPResult", "LayerCost", "ModelShape",
    "SimModel", "draw_lengths", "exchange_seconds", "load_lengths", "plan_lengths", "simulate_dp", "simulate_minibatch",
]
