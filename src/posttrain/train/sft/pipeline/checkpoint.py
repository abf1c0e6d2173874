"""Checkpoints of a pipeline run, through ``torch.distributed.checkpoint``.

Each rank saves the parameters of the stages it holds and their optimizer state under the
*model's* parameter names (``hf.model.layers.3.mlp.up_proj.weight``, ...), not under stage or
rank positions, so a checkpoint loads into any split of the same model: another number of
ranks, chunks or another schedule. A tied embedding held by two ranks is saved once (the copies
are equal). Directory layout, the ``latest`` pointer and the refusal of mismatched runs are those
of the data-parallel trainer's checkpoints (:mod:`posttrain.train.core.checkpoint`).
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
    the trainer core's :func:`~posttrain.train.core.save_checkpoint` / ``resume``."""

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
    """The checkpointable state of one rank of a pipeline x data-parallel run (``--dp-size``),
    written in :class:`PipelineState`'s format: whole parameters and their optimizer state under
    the model's names (the engine's ``whole_state_dict``, a collective over the column). A
    checkpoint therefore resumes on any split, any number of pipelines, or none (and a single
    pipeline's checkpoint resumes here).

    Args:
        engine: the column's data-parallel engine (one with ``whole_state``).
        names: ``id(parameter) -> name in the model``, taken before sharding took the parameters
            off the model.
    """

    checkpoint_format = "pipeline"

    def __init__(self, engine, names: dict[int, str]) -> None:
        self.engine = engine
        self.names = names

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self.engine.whole_state_dict(optimizer, self.names)

    def load_state_dict(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        self.engine.load_whole_state_dict(state, optimizer, self.names)


__all__.append("ColumnState")
