"""Flat ODC as a data-parallel engine (``--dp odc``): :func:`posttrain.odc.flat_shard` behind the
engine interface, with checkpoints of the flat shards and their optimizer state."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import posttrain.odc as odc

from .engine import (
    CommHook,
    DataParallelEngine,
    EngineConfig,
    MinibatchInfo,
    Shards,
    decay_flags,
    ensure_optimizer_state,
    mixed_precision,
)
from .registry import register_engine

__all__ = ["FlatODCEngine"]


@register_engine("odc")
class FlatODCEngine(DataParallelEngine):
    """ODC on flat per-block buffers (no FSDP2): ranks synchronize once per minibatch and may run
    different numbers of microbatches (``mode="collective"``: a barrier at every gather/reduce)."""

    checkpoint_format = "odc-flat"
    split_backward = True
    one_sided = True
    whole_state = True
    devices = ("cpu", "cuda")  # ODC's transport follows the parameters: host shared memory or GPU memory
    device_sharing = True

    def __init__(self, model: nn.Module, config: EngineConfig, *, mesh: DeviceMesh | None = None,
                 units: Sequence[nn.Module] | None = None) -> None:
        super().__init__(model, config, mesh=mesh, units=units)
        # the handle alone: the trainers keep the model plain (its shards through the engine)
        self.handle = odc.FlatODC(model, self.units, None,
                                  odc.ODCConfig(mode=config.mode, deterministic=config.deterministic),
                                  mesh=self.mesh, mp_policy=mixed_precision(config))
        self._masks: list[torch.Tensor] | None = None  # shards()'s, made once

    @classmethod
    def needs_equal_microbatches(cls, config: EngineConfig) -> bool:
        return config.mode == "collective"

    def parameters(self) -> list[torch.Tensor]:
        return self.handle.parameters()

    def shards(self) -> Shards:
        """The flat shards with a mask per element: a shard holds pieces of several parameters,
        and only those of two or more dimensions decay (:func:`decay_flags`'s rule)."""
        if self._masks is None:
            h, masks = self.handle, []
            for u in h.layouts:
                if u.shard is None:
                    continue
                whole = torch.zeros(u.shard_numel * h.shard_size, dtype=torch.bool, device=u.shard.device)
                pos = 0
                for p, flag in zip(u.params[: u.num_trainable], decay_flags(u.params[: u.num_trainable])):
                    whole[pos : pos + p.numel()] = bool(flag)
                    pos += p.numel()
                masks.append(whole[h.rank * u.shard_numel : (h.rank + 1) * u.shard_numel].clone())
            self._masks = masks
        return Shards(self.parameters(), self._masks, self.mesh.size(0) if self.mesh.ndim == 2 else 1)

    @contextmanager
    def minibatch(self, num_tokens: int) -> Iterator[MinibatchInfo]:
        with self.handle.minibatch(num_tokens=num_tokens) as mb:
            yield MinibatchInfo(mb.global_tokens, float(mb.global_tokens))

    def peer_failure(self) -> str | None:
        return self.handle.failed_peer()

    def set_comm_hook(self, hook: CommHook | None) -> None:
        self.handle.on_comm = hook

    @property
    def stats(self) -> dict[str, int]:
        """The handle's counters and its prefetch's (``prefetch_prefetched``, ``prefetch_unused``)."""
        return {**self.handle.stats, **{f"prefetch_{k}": v for k, v in self.handle.prefetch_stats.items()}}

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

    def iter_full_state(self, device: torch.device | None = None) -> Iterator[dict[str, torch.Tensor]]:
        where = device or torch.device("cpu")
        for part in self.handle.iter_full_units():  # (fresh tensors, gathered for this call)
            yield {k: v.to(where) for k, v in part.items()}

    # ------------------------------------------------------------ pipeline stages
    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in a unit's gathered buffer (trainable or frozen)."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(buf is not None and buf.untyped_storage().data_ptr() == ptr
                   for u in self.handle.layouts for buf in (u.full, u.frozen_full))

    def unit_parameters(self, unit: nn.Module) -> list[torch.Tensor]:
        return [u.shard for u in self.handle.layouts if u.module is unit and u.shard is not None]

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

    def _trained_units(self, optimizer: torch.optim.Optimizer) -> list[odc.FlatUnit]:
        """The units in the optimizer's order."""
        units = self._units_by_shard()
        order = [p for g in optimizer.param_groups for p in g["params"]]
        if any(id(p) not in units for p in order):
            raise ValueError("the optimizer steps tensors that are not this engine's parameters()")
        return [units[id(p)] for p in order]

    def whole_state_dict(self, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Any]:
        """Each unit's shard and its shard-shaped optimizer state gathered over the mesh
        (:meth:`~posttrain.odc.FlatODC.unshard`) and cut into whole parameters: flat ODC steps a
        unit's shard as one tensor and the optimizers here are elementwise, so a whole
        parameter's state is the concatenation of its shards'. While saving, every rank holds
        the whole parameters and optimizer state of its units at once, not its shard."""
        ensure_optimizer_state(optimizer)
        model, state = {}, {}
        for u in self._trained_units(optimizer):
            unit_names = [names[id(p)] for p in u.params[: u.num_trainable]]
            model.update(zip(unit_names, self.handle.unshard(u, u.shard)))
            values = optimizer.state.get(u.shard, {})
            per = {k: self.handle.unshard(u, v) if isinstance(v, torch.Tensor) and v.shape == u.shard.shape
                   else [v.clone() if isinstance(v, torch.Tensor) else v for _ in unit_names] for k, v in values.items()}
            for i, n in enumerate(unit_names):
                state[n] = {k: v[i] for k, v in per.items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
        return {"model": model, "optim": {"state": state, "groups": groups}}

    def load_whole_state_dict(self, state: dict[str, Any], optimizer: torch.optim.Optimizer,
                              names: dict[int, str]) -> None:
        """Cut this rank's shard out of the whole tensors (:meth:`~posttrain.odc.FlatODC.shard_of`)."""
        units = self._trained_units(optimizer)
        saved = state["optim"]["state"]
        osd = {}
        with torch.no_grad():
            for i, u in enumerate(units):
                unit_names = [names[id(p)] for p in u.params[: u.num_trainable]]
                u.shard.copy_(self.handle.shard_of(u, [state["model"][n] for n in unit_names]))
                if unit_names[0] not in saved:  # (SGD without momentum keeps no per-parameter state)
                    continue
                osd[i] = {key: self.handle.shard_of(u, [saved[n][key] for n in unit_names])
                          if _per_element(saved, state["model"], unit_names, key) else value
                          for key, value in saved[unit_names[0]].items()}
        mine = optimizer.state_dict()["param_groups"]
        groups = [{**g_saved, "params": g["params"]} for g_saved, g in zip(state["optim"]["groups"], mine)]
        optimizer.load_state_dict({"state": osd, "param_groups": groups})

    def close(self, *, restore: bool = False) -> None:
        self.handle.close(restore=restore)


def _per_element(saved: dict, params: dict, names: list[str], key: str) -> bool:
    """Whether optimizer state ``key`` is shaped like each named parameter (not a scalar like step)."""
    return all(isinstance(saved[n][key], torch.Tensor) and saved[n][key].dim() > 0
               and saved[n][key].shape == params[n].shape for n in names)
