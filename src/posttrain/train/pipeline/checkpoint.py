"""Checkpoints of a pipeline run, through ``torch.distributed.checkpoint``.

Each rank saves the parameters of the stages it holds and their optimizer state under the
*model's* parameter names (``hf.model.layers.3.mlp.up_proj.weight``, ...), not under stage or
rank positions, so a checkpoint loads into any split of the same model: another number of
ranks, chunks or another schedule. A tied embedding held by two ranks is saved once (the copies
are equal). Directory layout, the ``latest`` pointer and the refusal of mismatched runs are those
of the data-parallel trainer's checkpoints (:mod:`posttrain.train.dp.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from posttrain.dp.engine import ensure_optimizer_state

__all__ = ["PipelineState"]


class PipelineState:
    """The checkpointable state of one pipeline rank: ``params`` (its stages' parameters, named as
    in ``model``) and the optimizer that steps them. Stands in for a data-parallel engine in
    :func:`posttrain.train.dp.checkpoint.save_checkpoint` / ``resume``."""

    checkpoint_format = "pipeline"

    def __init__(self, model: nn.Module, params: Sequence[torch.Tensor]) -> None:
        names = {}
        for name, p in model.named_parameters():
            names.setdefault(id(p), name)
        self.params = list(params)
        self.names = [names[id(p)] for p in self.params]

    def _order(self, optimizer: torch.optim.Optimizer) -> list[str]:
        index = {id(p): n for p, n in zip(self.params, self.names)}
        order = [p for g in optimizer.param_groups for p in g["params"]]
        if any(id(p) not in index for p in order):
            raise ValueError("the optimizer steps tensors that are not this rank's stage parameters")
        return [index[id(p)] for p in order]

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``{"model": {name: tensor}, "optim": {"state": {name: {...}}, "groups": [...]}}``; the
        groups hold only hyperparameters (equal on every rank), never positions."""
        ensure_optimizer_state(optimizer)
        names = self._order(optimizer)
        osd = optimizer.state_dict()
        state = {names[i]: dict(values) for i, values in osd["state"].items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]
        return {"model": {n: p.detach() for n, p in zip(self.names, self.params)},
                "optim": {"state": state, "groups": groups}}

    def load_state_dict(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        """Restore a :meth:`state_dict` filled in place by ``dcp.load``."""
        with torch.no_grad():
            for n, p in zip(self.names, self.params):
                p.copy_(state["model"][n])
        names = self._order(optimizer)
        mine = optimizer.state_dict()
        groups = [{**saved, "params": g["params"]} for saved, g in zip(state["optim"]["groups"], mine["param_groups"])]
        saved = state["optim"]["state"]  # (SGD without momentum keeps no per-parameter state)
        optimizer.load_state_dict({"state": {i: saved[n] for i, n in enumerate(names) if n in saved},
                                   "param_groups": groups})


class ColumnState:
    """The checkpointable state of one rank of a pipeline x ODC run (``--dp-size``), written in
    :class:`PipelineState`'s format: whole parameters and their optimizer state under the model's
    names. A checkpoint therefore resumes on any split, any number of replicas, or none (and a
    single pipeline's checkpoint resumes here). Saving gathers each unit's shard and its
    shard-shaped optimizer state over the column (``FlatODC.unshard``, a collective); loading cuts
    this rank's shard out of the whole tensors (``FlatODC.shard_of``). Flat ODC steps each unit's
    shard as one tensor and the optimizers here are elementwise, so a whole parameter's state is
    the concatenation of its shards'. Cost: while saving (and while loading), every rank of a
    column holds its stages' whole parameters and optimizer state at once (about three times the
    stages' parameters with AdamW), not its shard.

    Args:
        handle: the column's :class:`~posttrain.odc.FlatODC`.
        names: ``id(parameter) -> name in the model``, taken before sharding took the parameters
            off the model.
    """

    checkpoint_format = "pipeline"

    def __init__(self, handle, names: dict[int, str]) -> None:
        self.handle = handle
        self.units = [u for u in handle.layouts if u.shard is not None]
        self.unit_names = [[names[id(p)] for p in u.params[: u.num_trainable]] for u in self.units]

    def _order(self, optimizer: torch.optim.Optimizer) -> list[int]:
        index = {id(u.shard): k for k, u in enumerate(self.units)}
        order = [p for g in optimizer.param_groups for p in g["params"]]
        if any(id(p) not in index for p in order):
            raise ValueError("the optimizer steps tensors that are not this column's shards")
        return [index[id(p)] for p in order]

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """As :meth:`PipelineState.state_dict`; a collective over the column."""
        ensure_optimizer_state(optimizer)
        self._order(optimizer)
        model, state = {}, {}
        for u, names in zip(self.units, self.unit_names):
            model.update(zip(names, self.handle.unshard(u, u.shard)))
            values = optimizer.state.get(u.shard, {})
            per = {k: self.handle.unshard(u, v) if isinstance(v, torch.Tensor) and v.shape == u.shard.shape
                   else [v.clone() if isinstance(v, torch.Tensor) else v for _ in names] for k, v in values.items()}
            for i, n in enumerate(names):
                state[n] = {k: v[i] for k, v in per.items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
        return {"model": model, "optim": {"state": state, "groups": groups}}

    def load_state_dict(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        """Restore a :meth:`state_dict` filled in place by ``dcp.load``."""
        with torch.no_grad():
            for u, names in zip(self.units, self.unit_names):
                u.shard.copy_(self.handle.shard_of(u, [state["model"][n] for n in names]))
        order = self._order(optimizer)
        mine = optimizer.state_dict()
        saved = state["optim"]["state"]
        osd = {}
        for i, k in enumerate(order):
            u, names = self.units[k], self.unit_names[k]
            if names[0] not in saved:  # (SGD without momentum keeps no per-parameter state)
                continue
            osd[i] = {key: self.handle.shard_of(u, [saved[n][key] for n in names])
                      if _per_element(saved, state["model"], names, key) else value
                      for key, value in saved[names[0]].items()}
        groups = [{**g_saved, "params": g["params"]} for g_saved, g in zip(state["optim"]["groups"], mine["param_groups"])]
        optimizer.load_state_dict({"state": osd, "param_groups": groups})


def _per_element(saved: dict, params: dict, names: list[str], key: str) -> bool:
    """Whether optimizer state ``key`` is shaped like each named parameter (not a scalar like step)."""
    return all(isinstance(saved[n][key], torch.Tensor) and saved[n][key].dim() > 0
               and saved[n][key].shape == params[n].shape for n in names)


__all__.append("ColumnState")
