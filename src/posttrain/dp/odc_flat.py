"""Flat ODC as a data-parallel engine (``--dp odc``): :func:`posttrain.odc.flat_shard` behind the
engine interface, with checkpoints of the flat shards and their optimizer state."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import posttrain.odc as odc
from posttrain.models import checkpoint_blocks, find_blocks

from .engine import CommHook, DataParallelEngine, EngineConfig, MinibatchInfo, ensure_optimizer_state
from .fsdp import data_parallel_mesh, mixed_precision
from .registry import register_engine

__all__ = ["FlatODCEngine"]


@register_engine("odc")
class FlatODCEngine(DataParallelEngine):
    """ODC on flat per-block buffers (no FSDP2): ranks synchronize once per minibatch and may run
    different numbers of microbatches (``mode="collective"``: a barrier at every gather/reduce)."""

    checkpoint_format = "odc-flat"

    def __init__(self, model: nn.Module, config: EngineConfig) -> None:
        super().__init__(model, config)
        blocks = find_blocks(model)
        if config.activation_checkpointing:
            checkpoint_blocks(blocks)
        mesh = data_parallel_mesh(config)
        self.handle = odc.flat_shard(model, [*blocks, model], mesh=mesh, mp_policy=mixed_precision(config),
                                     mode=config.mode, deterministic=config.deterministic)

    @property
    def equal_microbatches(self) -> bool:
        return self.config.mode == "collective"

    def parameters(self) -> list[torch.Tensor]:
        return self.handle.parameters()

    @contextmanager
    def minibatch(self, num_tokens: int) -> Iterator[MinibatchInfo]:
        with self.handle.minibatch(num_tokens=num_tokens) as mb:
            yield MinibatchInfo(mb.global_tokens, float(mb.global_tokens))

    def set_comm_hook(self, hook: CommHook | None) -> None:
        self.handle.on_comm = hook

    @property
    def stats(self) -> dict[str, int]:
        return dict(self.handle.stats)

    # ------------------------------------------------------------ checkpoints
    def _units_by_shard(self) -> dict[int, odc.FlatUnit]:
        return {id(u.shard): u for u in self.handle.layouts if u.shard is not None}

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Model: the handle's sharded state dict. Optimizer: per unit, each state tensor shaped
        like the shard as a DTensor of the unpadded vector (so it reshards), scalars as they are;
        parameter groups with unit names in place of indices."""
        ensure_optimizer_state(optimizer)
        units = self._units_by_shard()
        osd = optimizer.state_dict()
        order = [p for g in optimizer.param_groups for p in g["params"]]
        if any(id(p) not in units for p in order):
            raise ValueError("the optimizer steps tensors that are not this engine's parameters()")
        names = [units[id(p)].name for p in order]
        state = {}
        for index, values in osd["state"].items():
            u = units[id(order[index])]
            state[u.name] = {k: self.handle.as_dtensor(u, v) if isinstance(v, torch.Tensor) and v.shape == u.shard.shape
                             else v for k, v in values.items()}
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]
        return {"model": self.handle.sharded_state_dict(), "optim": {"state": state, "param_groups": groups}}

    def load_state_dict(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        self.handle.load_sharded_state_dict(state["model"])
        units = self._units_by_shard()
        order = [p for g in optimizer.param_groups for p in g["params"]]
        index = {units[id(p)].name: i for i, p in enumerate(order)}
        osd_state = {}
        for name, values in state["optim"]["state"].items():
            if name not in index:
                raise ValueError(f"the checkpoint has optimizer state for {name!r}, which this model does not train")
            shard = order[index[name]]
            local = {}
            for k, v in values.items():
                if isinstance(v, DTensor):
                    t = torch.zeros_like(shard)
                    odc.FlatODC.from_dtensor(v, t)
                    local[k] = t
                else:
                    local[k] = v
            osd_state[index[name]] = local
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state["optim"]["param_groups"]]
        optimizer.load_state_dict({"state": osd_state, "param_groups": groups})

    def iter_full_state(self) -> Iterator[dict[str, torch.Tensor]]:
        return self.handle.iter_full_units()

    def close(self) -> None:
        self.handle.close(restore=False)
