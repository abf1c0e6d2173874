"""Pipeline x data parallelism, with ODC (or FSDP2, for comparison) as the data-parallel axis.

``world = pp x dp`` processes form a ``(dp, pp)`` grid: the ``pp`` ranks of one row are one
pipeline (a *replica*), the ``dp`` ranks of one column hold the same stages and shard their
parameters with flat ODC (:func:`posttrain.odc.flat_shard` over that column's 1-D mesh, one unit
per transformer block plus one per stage for its embedding or norm and head).

Each step, the step's records are balanced over the replicas at the minibatch level
(``balance``, default ``diff_micro``): under ODC the replicas may run *different numbers of
microbatches* in a step, since a stage gathers its peers' shards one-sidedly and its column
synchronizes once, when the step ends, never per layer. Each replica runs the schedule built for
its own microbatch count. The loss of every microbatch is its summed token loss over the step's
trained tokens in all replicas (the minibatch context's global count), and ODC sums gradients over
the column: the gradient of the step's mean token loss, whatever the placement.

FSDP2 as the data-parallel axis (``dp="fsdp"``, :class:`ColumnFSDP2`) shards the same units with
``fully_shard`` over the column: its per-layer all-gathers and reduce-scatters are collectives of
the column, so every replica must run the same number of microbatches in the same order
(``same_micro``), and gradients are averaged over the column (the loss divisor is the global
count over the replicas). Tied input and output embeddings: :class:`TiedEmbedding`.

Split-backward schedules (zb_h1, zbv, the ``*_zb`` families) run under ODC: their weight pass
(torch's ``stage_backward_weight``) assigns ``.grad`` without autograd's accumulation, so the hook
that pushes a unit's gradient does not fire; the runner hands the weights to
:meth:`ColumnODC.after_weight` after each ``W`` instead. Between ``I`` and ``W`` the gathered
weights are freed (:meth:`ColumnODC.after_input`) and gathered again before ``W``. Refused: split
backward under FSDP2 (its reduce-scatter runs from backward hooks a separate weight pass
bypasses), and a tied embedding whose first and last stage share a rank (one pipeline rank, or
``zbv``'s V).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import posttrain.odc as odc
from posttrain.balance import FlopsCost, plan_minibatch

__all__ = ["SPLIT_BACKWARD", "PipelineGrid", "replica_plans", "shard_stages"]

#: Schedules whose backward is split into input (I) and weight (W) parts.
SPLIT_BACKWARD = ("zb_h1", "zb_h1_tight", "zbv", "interleaved_zb", "group_interleaved_zb")


class PipelineGrid:
    """This process's place in the ``(dp, pp)`` grid and its two groups (a collective to build).

    Attributes:
        pp_rank, dp_rank: positions in the pipeline and among the replicas.
        pp_group: the ranks of this pipeline (for :class:`~posttrain.pipeline.PipelineRunner`).
        dp_mesh: the 1-D mesh of the ranks holding the same stages (for ODC).
    """

    def __init__(self, pp: int, dp: int) -> None:
        if dist.get_world_size() != pp * dp:
            raise ValueError(f"{dist.get_world_size()} processes for --ranks {pp} x --dp-size {dp}")
        mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
        self.pp, self.dp = pp, dp
        self.pp_rank = mesh.get_local_rank("pp")
        self.dp_rank = mesh.get_local_rank("dp")
        self.pp_group = mesh.get_group("pp")
        self.dp_mesh = mesh["dp"]


class _RankStages(nn.Module):
    """The stages one rank holds, as one module for flat ODC (its forward is never called)."""

    def __init__(self, stages: dict[int, nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleDict({str(s): m for s, m in sorted(stages.items())})


def shard_stages(stages: dict[int, nn.Module], mesh, *, mode: str = "odc", deterministic: bool = False):
    """Shard ``stages`` (this rank's) over ``mesh`` (the ranks holding the same stages) with flat
    ODC; the handle (build the optimizer on ``handle.parameters()``).

    Units: every transformer block; the input embedding and the LM head each on their own (so a
    tied embedding's two copies, on the first and the last stage's ranks, are sharded alike and
    their gradient shards can be summed, see :class:`TiedEmbedding`); then each stage for what is
    left (the final norm)."""
    container = _RankStages(stages)
    units = _units(container)
    return odc.flat_shard(container, units, mesh=mesh, mode=mode, deterministic=deterministic)


def _units(container: nn.Module) -> list[nn.Module]:
    units: list[nn.Module] = []
    for stage in container.stages.values():
        units += list(stage.layers)
        ends = [m for m in (getattr(stage, "embed_tokens", None), getattr(stage, "lm_head", None)) if m is not None]
        units += ends
        inside = {id(p) for m in [*stage.layers, *ends] for p in m.parameters()}
        if any(id(p) not in inside for p in stage.parameters()):
            units.append(stage)  # what is left: the final norm
    return units


class ColumnODC:
    """Flat ODC over a column (see :func:`shard_stages`): replicas may run different counts."""

    equal_microbatches = False

    def __init__(self, stages: dict[int, nn.Module], mesh, *, mode: str = "odc", deterministic: bool = False) -> None:
        self.handle = shard_stages(stages, mesh, mode=mode, deterministic=deterministic)
        self.equal_microbatches = mode == "collective"

    def parameters(self) -> list[torch.Tensor]:
        return self.handle.parameters()

    @contextmanager
    def minibatch(self, num_tokens: int) -> Iterator[float]:
        """Yields the loss divisor: the column's global count (ODC sums gradients)."""
        with self.handle.minibatch(num_tokens=num_tokens) as mb:
            yield float(mb.global_tokens)

    def is_weight(self):
        return owned_storage(self.handle)

    # -- what the pipeline runner calls around a split backward (ShardedWeights) ----------------
    def weights_of(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each gathered leaf's per-parameter views (see :meth:`posttrain.odc.FlatODC.weight_views`)."""
        return self.handle.weight_views(leaves)

    def after_input(self, weights: list[torch.Tensor]) -> None:
        """Free the gathered weights from ``I`` until ``W`` (an unsharded copy per microbatch)."""
        self.handle.release_weights(weights)

    def before_weight(self, weights: list[torch.Tensor]) -> None:
        self.handle.regather_weights(weights)

    def after_weight(self, weights: list[torch.Tensor]) -> None:
        """Push the weight gradients ``W`` assigned (see :meth:`posttrain.odc.FlatODC.push_grads`)."""
        self.handle.push_grads(weights)

    def tied_shard(self) -> torch.Tensor | None:
        for u in self.handle.layouts:
            if u.name.endswith((".embed_tokens", ".lm_head")) and u.shard is not None:
                return u.shard
        return None

    def full_parameters(self, stages: dict[int, nn.Module]) -> None:
        """Put the full parameters back on ``stages`` (a collective over the column)."""
        self.handle.close()

    def close(self) -> None:
        self.handle.close(restore=False)


class ColumnFSDP2:
    """FSDP2 over a column: ``fully_shard`` on the same units; every replica must run the same
    number of microbatches in the same order."""

    equal_microbatches = True

    def __init__(self, stages: dict[int, nn.Module], mesh) -> None:
        from torch.distributed.fsdp import fully_shard

        self.container = _RankStages(stages)
        self.group = mesh.get_group()
        for unit in _units(self.container):
            fully_shard(unit, mesh=mesh)

    def parameters(self) -> list[torch.Tensor]:
        return list(self.container.parameters())

    @contextmanager
    def minibatch(self, num_tokens: int) -> Iterator[float]:
        """Yields the loss divisor: the column's global count over its size (FSDP2 averages)."""
        yield odc.global_token_count(num_tokens, self.group) / dist.get_world_size(self.group)

    def is_weight(self):
        """Saved tensors in the storage of a parameter the module holds unsharded right now."""
        container = self.container

        def owns(t: torch.Tensor) -> bool:
            from torch.distributed.tensor import DTensor

            ptr = t.untyped_storage().data_ptr()
            return any(not isinstance(p, DTensor) and p.untyped_storage().data_ptr() == ptr
                       for p in container.parameters())

        return owns

    def tied_shard(self) -> torch.Tensor | None:
        for stage in self.container.stages.values():
            for name in ("embed_tokens", "lm_head"):
                m = getattr(stage, name, None)
                if m is not None:
                    return m.weight
        return None

    def full_parameters(self, stages: dict[int, nn.Module]) -> None:
        """Replace every sharded parameter of ``stages`` by its full tensor (a collective)."""
        from torch.distributed.tensor import DTensor

        for stage in stages.values():
            for m in stage.modules():
                for name, p in list(m._parameters.items()):
                    if isinstance(p, DTensor):
                        m._parameters[name] = nn.Parameter(p.full_tensor().detach())

    def close(self) -> None:
        pass


__all__ += ["ColumnFSDP2", "ColumnODC"]


class TiedEmbedding:
    """Tied input and output embeddings under pipeline x ODC: the first stage's rank and the
    last stage's rank of each replica hold a copy, sharded alike over their columns; after each
    step's gradients are final, the two gradient shards are summed (one all-reduce per replica
    between those two ranks), so both copies take the same step and stay equal. Built on every
    rank (a collective: it creates one group per replica)."""

    def __init__(self, grid: PipelineGrid, column, first_rank: int, last_rank: int) -> None:
        self.group = None
        for d in range(grid.dp):
            g = dist.new_group([d * grid.pp + first_rank, d * grid.pp + last_rank])
            if d == grid.dp_rank and grid.pp_rank in (first_rank, last_rank):
                self.group = g
        self.shard = column.tied_shard() if self.group is not None else None

    def sync(self) -> None:
        if self.group is not None and self.shard is not None and self.shard.grad is not None:
            g = self.shard.grad
            dist.all_reduce(g.to_local() if hasattr(g, "to_local") else g, group=self.group)


__all__.append("TiedEmbedding")


def replica_plans(lengths: list[int], *, replicas: int, max_tokens: int, method: str, model_config,
                  runnable=None) -> list[list[list[int]]]:
    """Per replica, its microbatches (record positions): the step balanced over the replicas.

    ``runnable(m)``: whether the schedule runs ``m`` microbatches (some need a multiple of their
    group size). Where it does not, the microbatch with the most records is split in two (halves of
    equal cost) until it does; a replica that cannot get there is an error."""
    cost = FlopsCost.from_config(model_config)
    plan = plan_minibatch(lengths, world_size=replicas, max_tokens=max_tokens, method=method, cost=cost)
    out = [[list(m.sequence_ids) for m in plan.microbatches_for(d) if m.sequence_ids] for d in range(replicas)]
    if runnable is None:
        return out
    for d, sets in enumerate(out):
        while not runnable(len(sets)):
            widest = max(range(len(sets)), key=lambda j: len(sets[j])) if sets else None
            if widest is None or len(sets[widest]) < 2:
                raise ValueError(f"replica {d} gets {len(sets)} microbatches, which the schedule cannot run, and none "
                                 "can be split further; raise --sequences or lower --max-tokens")
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


def owned_storage(handle) -> callable:
    """A predicate: whether a tensor lives in a gathered parameter buffer of ``handle`` (a
    saved weight, not an activation)."""

    def owns(t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        for u in handle.layouts:
            for buf in (u.full, u.frozen_full):
                if buf is not None and buf.untyped_storage().data_ptr() == ptr:
                    return True
        return False

    return owns


__all__.append("owned_storage")
