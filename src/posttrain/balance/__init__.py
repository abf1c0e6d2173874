"""Minibatch-level load balancing: cost models, partitioners and microbatch plans.

    plan = posttrain.balance.plan_minibatch(lengths, world_size=8, max_tokens=16384,
                                            method="diff_micro", cost=QuadraticCost())
    print(plan.summary())
    for mb in plan.microbatches_for(rank): ...

See [Note: balancing methods] in ``plan.py``; sequences split across ranks (context parallelism:
planned here, run by the trainers): [Note: splitting a sequence] in ``context.py``.
"""

from .context import ContextPlan, ExchangeCost, Shard, check_context_parallel, plan_context, shard_lengths, zigzag
from .cost import (
                   CalibratedCost,
                   CostModel,
                   FlopsCost,
                   ModelShape,
                   QuadraticCost,
                   TokenCost,
                   fit_least_squares,
                   measure_step_times,
)
from .packing import PackedMicrobatch, pack_sequences, pack_share, shard_positions
from .partition import balanced_partition, greedy, karmarkar_karp, refine, round_robin, spread
from .plan import METHODS, Microbatch, Plan, plan_minibatch

__all__ = [
                   "METHODS",
                   "CalibratedCost",
                   "ContextPlan",
                   "CostModel",
                   "ExchangeCost",
                   "FlopsCost",
                   "Microbatch",
                   "ModelShape",
                   "PackedMicrobatch",
                   "Plan",
                   "QuadraticCost",
                   "Shard",
                   "TokenCost",
                   "balanced_partition",
                   "check_context_parallel",
                   "fit_least_squares",
                   "greedy",
                   "karmarkar_karp",
                   "measure_step_times",
                   "pack_sequences",
                   "pack_share",
                   "plan_context",
                   "plan_minibatch",
                   "refine",
                   "round_robin",
                   "shard_lengths",
                   "shard_positions",
                   "spread",
                   "zigzag",
]
