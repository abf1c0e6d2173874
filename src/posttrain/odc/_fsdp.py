"""ODC on FSDP2: FSDP2's all-gather and reduce-scatter replaced by one-sided shm operations.

FSDP2 keeps doing what it does (sharding, unshard/reshard, mixed-precision casts, gradient
layout); ODC installs its gather and scatter-accumulate through FSDP2's public
``set_custom_all_gather`` / ``set_custom_reduce_scatter`` and runs the minibatch protocol of
``_protocol.py`` around them. Create with :func:`enable`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from posttrain import _compat
from posttrain._compat import all_gather_single

from ._comm import ModuleLayout, ODCAllGather, ODCReduceScatter, regroup_gather
from ._protocol import Minibatch, MinibatchProtocol
from .config import ODCConfig

__all__ = ["ODC", "enable"]


def enable(model: nn.Module, config: ODCConfig | None = None, /, **overrides) -> ODC:
    """Switch a ``fully_shard``-ed model from FSDP2's collectives to ODC.

    A collective over the data-parallel group: every rank calls it with the same model
    structure. Allocates the shared-memory buffers (unlinked from ``/dev/shm`` before this
    returns) and installs ODC's gather and scatter-accumulate on every FSDP module.

    Args:
        model: a model on which ``fully_shard`` was applied (to blocks and/or the root).
        config: an :class:`ODCConfig`; keyword ``overrides`` replace its fields
            (``enable(model, deterministic=True)``).

    Returns:
        The :class:`ODC` handle: ``with odc.minibatch(): ...``, ``odc.close()``.

    Raises:
        ValueError: the model has no FSDP module, its parameters are not sharded on dim 0 over a
            1-D or (replicate, shard) mesh, or its shard group spans hosts.
    """
    return ODC(model, replace(config or ODCConfig(), **overrides))


class ODC:
    """ODC on one FSDP2 model; create with :func:`enable`. See [Note: ODC minibatch protocol]."""

    def __init__(self, model: nn.Module, config: ODCConfig) -> None:
        _compat.check_torch_version()
        self.config = config
        self.layouts = self._build_layouts(model)
        first = self.layouts[0].params[0].param
        shard_group, replicate_group = self._groups(first)
        self._shard_ranks = dist.get_process_group_ranks(shard_group)
        self._group_kinds: dict[int, bool] = {}
        self._protocol = MinibatchProtocol(
            config, shard_group=shard_group, replicate_group=replicate_group, layouts=self.layouts,
            steps=self, param_ids={id(p.param) for lay in self.layouts for p in lay.params},
            device=first.device,
        )
        self.rank = self._protocol.rank
        self.shard_size = self._protocol.shard_size
        try:
            for lay in self.layouts:
                mod = lay.module
                mod.set_custom_all_gather(ODCAllGather(self, lay))
                mod.set_custom_reduce_scatter(ODCReduceScatter(self, lay))
                # ODC sums raw gradients and divides once at the sync.
                mod.set_gradient_divide_factor(1.0)
                # Every trainable parameter appears in every push, used or not: fixed layout
                # (torch 2.11-2.12 cannot: a push without a parameter is refused in scatter_accumulate).
                lay.all_params_pushed = _compat.reduces_unused_params(mod)
                if replicate_group is not None:
                    mod.set_requires_all_reduce(False, recurse=False)
        except BaseException:
            self._protocol.close()
            raise

    # ------------------------------------------------------------- public API
    @property
    def stats(self) -> dict[str, int]:
        """Counts since creation: gathers, regrouped gathers, pushes, and their bytes."""
        return self._protocol.stats

    @property
    def on_comm(self) -> Callable[[str, float, float], None] | None:
        """Called as ``on_comm(kind, start, end)`` (``kind`` "gather" or "reduce", times from
        ``time.perf_counter``) after every gather and scatter-accumulate FSDP2 asks for."""
        return self._protocol.on_comm

    @on_comm.setter
    def on_comm(self, fn: Callable[[str, float, float], None] | None) -> None:
        self._protocol.on_comm = fn

    @property
    def in_minibatch(self) -> bool:
        return self._protocol.in_minibatch

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self._protocol.shard_group

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        return self._protocol.replicate_group

    @contextmanager
    def minibatch(self, *, num_tokens: int | None = None) -> Iterator[Minibatch]:
        """One optimizer step's worth of microbatches; see :meth:`MinibatchProtocol.minibatch`."""
        with self._protocol.minibatch(num_tokens=num_tokens) as mb:
            yield mb

    def failed_peer(self) -> str | None:
        """What a peer of this rank that failed says, else ``None`` (for waits outside ODC's own)."""
        return None if self._protocol is None else self._protocol.failed_peer()

    def close(self) -> None:
        """Free the shared buffers and remove ODC's hooks. Idempotent; the model must not be
        trained through this handle afterwards."""
        self._protocol.close()

    def __enter__(self) -> ODC:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        p = self._protocol
        if exc is not None and not p.closed and p.broken is None:
            p.fail(f"{type(exc).__name__}: {exc}")
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _build_layouts(model: nn.Module) -> list[ModuleLayout]:
        layouts = []
        for name, mod in model.named_modules():
            if not isinstance(mod, FSDPModule):
                continue
            params = _compat.sharded_params(mod)
            if params:
                layouts.append(ModuleLayout.build(name or "<root>", mod, params))
        if not layouts:
            raise ValueError(
                f"{type(model).__name__} has no FSDP-sharded parameters: apply "
                "torch.distributed.fsdp.fully_shard to its blocks and root before "
                "posttrain.odc.enable(model)"
            )
        return layouts

    def _groups(self, param: nn.Parameter) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
        if not isinstance(param, DTensor):
            raise ValueError("ODC expects FSDP2 DTensor parameters")
        mesh = param.device_mesh
        for lay in self.layouts:
            for info in lay.params:
                p = info.param
                if p.device != param.device:
                    raise ValueError(f"parameter of {lay.name!r} is on {p.device} and another on {param.device}; "
                                     "ODC takes a model on one device (its transport follows it)")
                if p.device_mesh != mesh:
                    raise ValueError(f"FSDP module {lay.name!r} uses another device mesh; ODC needs one mesh")
        placements = param.placements
        shard_dims = [i for i, pl in enumerate(placements) if isinstance(pl, Shard)]
        if (
            mesh.ndim not in (1, 2)
            or len(shard_dims) != 1
            or placements[shard_dims[0]].dim != 0
            or shard_dims[0] != mesh.ndim - 1
            or any(not isinstance(pl, Replicate) for i, pl in enumerate(placements) if i != shard_dims[0])
        ):
            raise ValueError(
                f"ODC supports FSDP (placements (Shard(0),)) and HSDP (placements (Replicate(), "
                f"Shard(0)) on a (replicate, shard) mesh); got {placements} on a {mesh.ndim}-D mesh"
            )
        shard_group = mesh.get_group(mesh.ndim - 1)
        replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        if replicate_group is not None and shard_group.size() == 1:
            raise ValueError(
                "ODC on FSDP2 with one rank per shard group and several replicas: FSDP2 neither reduce-scatters "
                "over one rank nor hands such gradients over before its own all-reduce; shard over 2 or more "
                "ranks, or use flat ODC (posttrain.odc.flat_shard) or plain FSDP2"
            )
        return shard_group, replicate_group

    # ------------------------------------------------- steps of the protocol
    def expose(self) -> None:
        if self.shard_size == 1:  # FSDP2 accumulates into .grad itself: only this minibatch's (collect_local)
            self.clear_grads()
        for lay in self.layouts:
            exposed, off = self._protocol.params_view(self.rank, lay), 0
            for p in lay.params:  # copy_ casts to the mixed-precision param dtype
                n = p.padded_data.numel()
                exposed[off : off + n].copy_(p.padded_data)
                off += n

    def collect_local(self) -> None:
        """One rank (no replicas): FSDP2 does not reduce-scatter over one rank, so no push
        arrived; its gradients are in ``.grad`` (accumulated since :meth:`expose` cleared them),
        and become this minibatch's one push."""
        if self.shard_size != 1:
            return
        for lay in self.layouts:
            trainable = [info for info in lay.params if info.requires_grad]
            if not any(info.param.grad is not None for info in trainable):
                continue
            flat, off = torch.zeros(lay.reduce_numel, dtype=lay.reduce_dtype, device=trainable[0].param.device), 0
            for info in trainable:
                g = info.param.grad
                if g is not None:
                    local = g.to_local().reshape(-1)
                    flat[off : off + local.numel()].copy_(local)
                off += info.padded_data.numel()
            self._protocol.push_rows(lay, flat.view(1, -1))
        self.clear_grads()

    def release(self) -> None:
        for lay in self.layouts:
            lay.module.reshard()

    def clear_grads(self) -> None:
        for lay in self.layouts:
            for info in lay.params:
                info.param.grad = None

    def write_grads(self, reduced) -> None:
        for lay in self.layouts:
            flat, off = reduced(lay), 0
            for info in lay.params:
                if not info.requires_grad:
                    continue
                p = info.param
                local_shape = p.to_local().shape
                g = flat[off : off + local_shape.numel()].view(local_shape)
                off += info.padded_data.numel()
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.to_local().copy_(g)

    # --------------------------------------------------- comms (called by FSDP2)
    def _is_shard_group(self, group: dist.ProcessGroup) -> bool:
        key = id(group)
        if key not in self._group_kinds:
            self._group_kinds[key] = dist.get_process_group_ranks(group) == self._shard_ranks
        return self._group_kinds[key]

    def gather(self, lay: ModuleLayout, output: torch.Tensor, input: torch.Tensor, group) -> None:
        p = self._protocol
        if not p.in_minibatch:
            p.check_usable()
            # Outside a minibatch (e.g. evaluation) a forward gathers like FSDP: a collective.
            all_gather_single(output, input, group=group)
            return
        p.before_gather()
        if output.dtype != lay.param_dtype:
            raise AssertionError(f"ODC gather of {lay.name}: FSDP gathers {output.dtype}, ODC exposed {lay.param_dtype}")
        if self._is_shard_group(group):
            out = output.view(self.shard_size, -1)
            if not lay.checked:
                if out.shape[1] != lay.gather_numel or not torch.equal(input, p.params_view(self.rank, lay)):
                    raise AssertionError(
                        f"ODC's exposed shards of {lay.name} do not match FSDP2's all-gather input "
                        f"({out.shape[1]} vs {lay.gather_numel} elements); the FSDP2 internals read in "
                        "posttrain._compat have changed"
                    )
                lay.checked = True
            for q in range(self.shard_size):
                if q != self.rank:
                    out[q].copy_(p.params_view(q, lay))
        else:
            # reshard_after_forward=int: FSDP2 re-gathers over a smaller post-forward group.
            exposures = [p.params_view(q, lay) for q in range(self.shard_size)]
            out = output.view(dist.get_world_size(group), -1)
            regroup_gather(out, lay, exposures, skip_slot=dist.get_rank(group))
            p.stats["regrouped_gathers"] += 1
        p.stats["gathers"] += 1
        p.stats["gather_bytes"] += output.numel() * output.element_size()

    def scatter_accumulate(self, lay: ModuleLayout, output: torch.Tensor, input: torch.Tensor, group) -> None:
        self._protocol.check_in_minibatch_for_backward()
        if not self._is_shard_group(group):
            raise AssertionError(f"ODC reduce of {lay.name} over an unexpected group {dist.get_process_group_ranks(group)}")
        rows = input.view(self.shard_size, -1)
        if rows.shape[1] < lay.reduce_numel and not lay.all_params_pushed:
            raise RuntimeError(
                f"ODC on FSDP2: a trainable parameter of {lay.name} got no gradient in this backward, and FSDP2 in "
                f"torch {torch.__version__} leaves it out of the reduce-scatter (2.13 and later reduce it as zero); "
                "give every trainable parameter a gradient each backward, freeze it, upgrade torch, or use flat ODC"
            )
        if rows.shape[1] != lay.reduce_numel or input.dtype != lay.reduce_dtype:
            raise AssertionError(
                f"ODC reduce of {lay.name}: FSDP2 pushes {rows.shape[1]} x {input.dtype}, "
                f"ODC expects {lay.reduce_numel} x {lay.reduce_dtype}"
            )
        self._protocol.push_rows(lay, rows)
        output.zero_()  # FSDP2 adds this into .grad; the real gradient is written at the sync
