"""``flat_shard``: flat ODC on a model, returned as the model itself, as FSDP2's ``fully_shard`` does.

[Note: flat ODC as a module]
``fully_shard(model)`` changes the model's class in place, so the loop a user already has keeps
working: the optimizer takes ``model.parameters()``, ``torch.nn.utils.clip_grad_norm_`` computes
the global norm over their DTensor gradients, ``model.state_dict()`` is the sharded state for
``torch.distributed.checkpoint``. :func:`flat_shard` does the same for flat ODC: the model's
class becomes a subclass of its own and of :class:`FlatODCModule`, whose

- ``parameters()`` / ``named_parameters()`` are this rank's flat shards, one per unit with
  trainable parameters, as DTensors of the padded vector that share the shards' storage
  (:meth:`FlatODC.dtensor_parameters`): an optimizer steps them in place, and their gradients
  are set when a minibatch ends, so torch's norm and clipping see every rank's shards;
- ``state_dict()`` / ``load_state_dict()`` are :meth:`FlatODC.sharded_state_dict` and
  :meth:`FlatODC.load_sharded_state_dict`: unpadded DTensors per unit, so a checkpoint written
  with ``torch.distributed.checkpoint`` loads on any shard size;
- ``minibatch(num_tokens=...)`` is ODC's one addition to the loop: the block that runs a
  minibatch's microbatches (ranks synchronize when entering and leaving it, never per layer);
- ``odc`` is the :class:`FlatODC` handle (statistics, buffers, split-backward hooks), whose
  ``close()`` puts the full parameters back and gives the model its own class again.

The model's forward is unchanged. Optimizer state built on these parameters is padded to the
shard size, so it resumes on the same world size; the sharded model state does not depend on it.
The flat-sharded model is the root of what the loop holds: ``parameters()`` and ``state_dict()``
of a module that contains it see its shards only through ``state_dict`` (which a parent calls
with a prefix), not through ``parameters()`` (a parent's walks its children's registrations).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import fields, replace
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from ._flat import FlatODC
from ._protocol import Minibatch
from .config import ODCConfig

__all__ = ["FlatODCModule", "flat_shard"]


class FlatODCModule(nn.Module):
    """What :func:`flat_shard` makes a model (a mixin placed before the model's own class). See
    [Note: flat ODC as a module]."""

    odc: FlatODC

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's flat shards as DTensors, ``("<unit>.flat", parameter)``."""
        for name, p in self.odc.dtensor_parameters():
            yield (f"{prefix}.{name}" if prefix else name), p

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """This rank's flat shards as DTensors: what the optimizer steps."""
        for _, p in self.named_parameters():
            yield p

    def state_dict(self, *args: Any, destination: dict[str, Any] | None = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, Any]:
        """The sharded state: one unpadded DTensor per unit and kind (``"<unit>.flat"``,
        ``"<unit>.flat_frozen"``) under ``prefix``, for ``torch.distributed.checkpoint``; no
        communication. Written into ``destination`` when given (as a parent module asks)."""
        out = destination if destination is not None else {}
        for key, value in self.odc.sharded_state_dict().items():
            out[prefix + key] = value
        return out

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False):
        """Copy a :meth:`state_dict` (e.g. filled by ``torch.distributed.checkpoint.load``) into the
        shards. A missing key is always an error (a shard would keep stale values); an unexpected
        one is with ``strict``, and is returned otherwise."""
        unexpected = sorted(set(state_dict) - set(self.odc.sharded_state_dict()))
        if strict and unexpected:
            raise ValueError(f"unexpected keys in the state dict of a flat-ODC model: {unexpected[:5]}")
        self.odc.load_sharded_state_dict(state_dict)
        return nn.modules.module._IncompatibleKeys([], unexpected)

    def minibatch(self, *, num_tokens: int | None = None) -> AbstractContextManager[Minibatch]:
        """One optimizer step's microbatches: see :meth:`FlatODC.minibatch`."""
        return self.odc.minibatch(num_tokens=num_tokens)

    def full_state_dict(self) -> dict[str, Any]:
        """Every parameter under its original name, whole (a collective): for export."""
        return self.odc.full_state_dict()


_CLASSES: dict[type, type] = {}


def flat_shard(
    model: nn.Module,
    units: Sequence[nn.Module] | None = None,
    group: dist.ProcessGroup | None = None,
    config: ODCConfig | None = None,
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    **overrides,
) -> nn.Module:
    """Shard a plain model over its data-parallel ranks and train it with ODC, without FSDP2;
    returns the model, now also a :class:`FlatODCModule` (see [Note: flat ODC as a module]).

    A collective over the data-parallel ranks: every rank calls it with the same model
    structure; the first rank's initial values are broadcast to the others. See [Note: flat ODC].

    Args:
        model: an unsharded model, on the CPU or on this rank's GPU (one floating dtype per unit;
            fp32 for mixed precision). On a GPU the shared regions are device memory shared by
            CUDA IPC ([Note: the device transport]).
        units: modules whose parameters are gathered and freed together, in any order; default:
            the transformer blocks (``model.layers``, ``model.model.layers``, ... see
            :func:`posttrain.models.find_blocks`), then ``model`` for what remains. ``model``
            itself, if listed, keeps its parameters gathered from forward until its backward;
            the others free theirs after forward and gather again for backward.
        group: the data-parallel ranks, all on this host (default: the world). Ignored if
            ``mesh`` is given.
        config: an :class:`~posttrain.odc.ODCConfig`; keyword ``overrides`` replace its fields.
        mesh: a 1-D mesh of the shard ranks, or a 2-D ``(replicate, shard)`` mesh for HSDP:
            ODC inside each shard group (one host), one gradient all-reduce across replicas per
            minibatch.
        mp_policy: FSDP2's :class:`~torch.distributed.fsdp.MixedPrecisionPolicy`: parameters
            are exposed and gathered in ``param_dtype`` (once per minibatch: half the bytes of
            fp32 for bf16), gradients accumulated in ``reduce_dtype`` (default: ``param_dtype``),
            the optimizer steps the shards in the model's dtype; ``cast_forward_inputs`` casts
            floating inputs of every unit to ``param_dtype``, ``output_dtype`` the model's output.

    Returns:
        ``model``: ``model.parameters()`` for the optimizer, ``with model.minibatch(): ...``
        around each minibatch's microbatches, ``model.odc.close()`` to put the full parameters back.
    """
    unknown = sorted(set(overrides) - {f.name for f in fields(ODCConfig)})
    if unknown:
        raise TypeError(f"flat_shard got unexpected keyword arguments {unknown} (ODCConfig has "
                        f"{', '.join(f.name for f in fields(ODCConfig))})")
    if isinstance(model, FlatODCModule):
        raise ValueError(f"{type(model).__name__} is already sharded by flat ODC (model.odc.close() first)")
    handle = FlatODC(model, units, group, replace(config or ODCConfig(), **overrides), mesh=mesh, mp_policy=mp_policy)
    own = type(model)
    cls = _CLASSES.get(own)
    if cls is None:
        cls = _CLASSES[own] = type(f"FlatODC{own.__name__}", (FlatODCModule, own), {"__module__": own.__module__})
    model.__class__ = cls
    model.__dict__["odc"] = handle

    def restore() -> None:
        model.__class__ = own
        model.__dict__.pop("odc", None)

    handle.on_close = restore
    return model
