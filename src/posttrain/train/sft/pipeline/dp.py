"""Pipeline x data parallelism: any data-parallel engine (:mod:`posttrain.dp`) as the data-parallel axis.

``world = pp x dp`` processes form a ``(dp, pp)`` grid: the ``pp`` ranks of one row are one
pipeline (one *data-parallel pipeline*), the ``dp`` ranks of one column hold the same stages and shard their
parameters with the engine ``engine`` names over that column's 1-D mesh
(:func:`shard_stages`: one unit per transformer block plus one per stage for its embedding or
norm and head).

Each step, the step's records are balanced over the pipelines at the minibatch level
(``balance``, default ``diff_micro``). Under ODC the pipelines may run *different numbers of
microbatches* in a step, since a stage gathers its peers' shards one-sidedly and its column
synchronizes once, when the step ends, never per layer; each pipeline runs the schedule built for
its own microbatch count. An engine with a rendezvous per layer (FSDP2, ODC's collective mode:
``equal_microbatches``) pads every pipeline to the busiest one's count with dummy microbatches,
which needs ``same_micro`` so the real ones line up. The loss of every microbatch is its summed
token loss divided by the engine's loss divisor for the step (see [Note: data-parallel engines]):
the gradient of the step's mean token loss, whatever the placement. Tied input and output
embeddings: :class:`TiedEmbedding`.

Split-backward schedules (zb_h1, zbv, the ``*_zb`` families) run on engines with
``split_backward`` (flat ODC): their weight pass (torch's ``stage_backward_weight``) assigns
``.grad`` without autograd's accumulation, so the hook that pushes a unit's gradient does not
fire; the runner hands the weights to the engine's ``after_weight`` after each ``W`` instead.
Between ``I`` and ``W`` the gathered weights are freed (``after_input``) and gathered again
before ``W``. Refused: split backward on other engines (FSDP2 reduce-scatters from backward hooks
a separate weight pass bypasses), and a tied embedding whose first and last stage share a rank
(one pipeline rank, or ``zbv``'s V).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from posttrain.balance import FlopsCost, plan_minibatch
from posttrain.dp import DataParallelEngine, EngineConfig, build_engine

__all__ = ["SPLIT_BACKWARD", "PipelineGrid", "RankStages", "pipeline_plans", "shard_stages", "stage_units"]

#: Schedules whose backward is split into input (I) and weight (W) parts.
SPLIT_BACKWARD = ("zb_h1", "zb_h1_tight", "zbv", "interleaved_zb", "group_interleaved_zb")


class PipelineGrid:
    """This process's place in the ``(dp, pp)`` grid and its two groups (a collective to build).

    Attributes:
        pp_rank, dp_rank: positions in the pipeline and among the pipelines.
        pp_group: the ranks of this pipeline (for :class:`~posttrain.pipeline.PipelineRunner`).
        dp_mesh: the 1-D mesh of the ranks holding the same stages (for the column's engine).
    """

    def __init__(self, pp: int, dp: int, device_type: str = "cpu") -> None:
        if dist.get_world_size() != pp * dp:
            raise ValueError(f"{dist.get_world_size()} processes for `num_ranks` {pp} x `dp_size` {dp}")
        mesh = init_device_mesh(device_type, (dp, pp), mesh_dim_names=("dp", "pp"))
        self.pp, self.dp = pp, dp
        self.pp_rank = mesh.get_local_rank("pp")
        self.dp_rank = mesh.get_local_rank("dp")
        self.pp_group = mesh.get_group("pp")
        self.dp_mesh = mesh["dp"]


class RankStages(nn.Module):
    """The stages one rank holds, as one module for a data-parallel engine (its forward is never
    called: the pipeline runner calls each stage)."""

    def __init__(self, stages: dict[int, nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleDict({str(s): m for s, m in sorted(stages.items())})


def stage_units(container: RankStages) -> list[nn.Module]:
    """The units a column's engine shards: every transformer block; the input embedding and the
    LM head each on their own (so a tied embedding's two copies, on the first and the last
    stage's ranks, are sharded alike and their gradient shards can be summed, see
    :class:`TiedEmbedding`); then each stage for what is left (the final norm)."""
    units: list[nn.Module] = []
    for stage in container.stages.values():
        units += list(stage.layers)
        ends = [m for m in (getattr(stage, "embed_tokens", None), getattr(stage, "lm_head", None)) if m is not None]
        units += ends
        inside = {id(p) for m in [*stage.layers, *ends] for p in m.parameters()}
        if any(id(p) not in inside for p in stage.parameters()):
            units.append(stage)  # what is left: the final norm
    return units


def shard_stages(stages: dict[int, nn.Module], mesh, config: EngineConfig) -> DataParallelEngine:
    """Shard ``stages`` (this rank's) over ``mesh`` (the column: the ranks holding the same
    stages) with the engine ``config`` names, in :func:`stage_units`; build the optimizer on its
    ``parameters()``."""
    container = RankStages(stages)
    return build_engine(container, config, mesh=mesh, units=stage_units(container))


class TiedEmbedding:
    """Tied input and output embeddings under pipeline x data parallelism (any engine): the first
    stage's rank and the
    last stage's rank of each pipeline hold a copy, sharded alike over their columns; after each
    step's gradients are final, the two gradient shards are summed (one all-reduce per pipeline
    between those two ranks), so both copies take the same step and stay equal. Built on every
    rank (a collective: it creates one group per pipeline)."""

    def __init__(self, grid: PipelineGrid, engine: DataParallelEngine, first_rank: int, last_rank: int) -> None:
        self.group = None
        for d in range(grid.dp):
            g = dist.new_group([d * grid.pp + first_rank, d * grid.pp + last_rank])
            if d == grid.dp_rank and grid.pp_rank in (first_rank, last_rank):
                self.group = g
        self.shards: list[torch.Tensor] = []
        if self.group is not None:
            for stage in engine.model.stages.values():
                for name in ("embed_tokens", "lm_head"):
                    if getattr(stage, name, None) is not None:
                        self.shards += engine.unit_parameters(getattr(stage, name))

    def sync(self) -> None:
        for shard in self.shards:
            if shard.grad is not None:
                g = shard.grad
                dist.all_reduce(g.to_local() if hasattr(g, "to_local") else g, group=self.group)


__all__.append("TiedEmbedding")


def pipeline_plans(lengths: list[int], *, pipelines: int, max_tokens: int, method: str, model_config,
                  runnable=None) -> list[list[list[int]]]:
    """Per pipeline, its microbatches (record positions): the step balanced over the pipelines.

    ``runnable(m)``: whether the schedule runs ``m`` microbatches (some need a multiple of their
    group size). Where it does not, the microbatch with the most records is split in two (halves of
    equal cost) until it does; a pipeline that cannot get there is an error."""
    cost = FlopsCost.from_config(model_config)
    plan = plan_minibatch(lengths, world_size=pipelines, max_tokens=max_tokens, method=method, cost=cost)
    out = [[list(m.sequence_ids) for m in plan.microbatches_for(d) if m.sequence_ids] for d in range(pipelines)]
    if runnable is None:
        return out
    for d, sets in enumerate(out):
        while not runnable(len(sets)):
            widest = max(range(len(sets)), key=lambda j: len(sets[j])) if sets else None
            if widest is None or len(sets[widest]) < 2:
                raise ValueError(f"pipeline {d} gets {len(sets)} microbatches, which the schedule cannot run, and none "
                                 "can be split further; raise `sequences` or lower `max_tokens`")
            ids = sorted(sets.pop(widest), key=lambda i: -cost(lengths[i]))
            halves: list[list[int]] = [[], []]
            for i in ids:  # largest first, each to the cheaper half
                min(halves, key=lambda h: sum(cost(lengths[k]) for k in h)).append(i)
            sets[widest:widest] = [sorted(h) for h in halves]
    return out


def runnable(cfg):
    """``m -> bool``: whether ``cfg``'s schedule runs ``m`` microbatches (at least one); each count
    is built once."""
    from functools import cache

    @cache
    def ok(m: int) -> bool:
        if m < 1:
            return False
        try:
            cfg.build(m)
        except ValueError:
            return False
        return True

    return ok


__all__.append("runnable")
