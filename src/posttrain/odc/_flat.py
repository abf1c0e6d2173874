"""ODC without FSDP2: one flat parameter buffer per unit, gathered and pushed by module hooks.

[Note: flat ODC]
FSDP2 does its unshard, reshard and reduce bookkeeping per parameter: allocate and copy the
all-gather input, copy out each parameter, swap it onto the module, and in backward copy every
gradient into a reduce buffer and back into a sharded ``.grad``. On a GPU that work runs ahead of
the kernels; on a CPU it adds to them (``benchmarks/odc_overhead.py``: one microbatch under
FSDP2 on a single rank, no communication at all, takes about 1.2x the plain model's time).
ODC needs none of it, because its gathers and pushes are plain copies and adds:

- A *unit* is a module whose own parameters (those not inside another unit) are flattened in
  registration order into one vector, padded to a multiple of the shard size. Shard rank ``r``
  owns elements ``[r*S, (r+1)*S)``, kept in :attr:`FlatODC.shards` (what the optimizer steps)
  and exposed in its ``params`` region at minibatch entry, exactly as in [Note: ODC layouts].
- Forward pre-hook: a fresh leaf tensor of the whole vector is filled from every owner's
  exposure (one copy per owner) and split into views that are set on the submodules in place of
  their parameters. Forward post-hook: a resharded unit frees the leaf's storage and hooks its
  outputs, so the first gradient reaching them refills the same storage before the unit's
  backward reads its saved weights.
- When autograd has accumulated the leaf's gradient (one tensor: the split's backward
  concatenates), it is pushed row by row into the owners' accumulators and both are freed.
- Entry, exit, the accumulators, collective mode and failure handling are those of
  :class:`~posttrain.odc.ODC`.

Per microbatch and unit this is a handful of Python calls instead of FSDP2's hundreds, one copy
per gathered byte instead of three, one add per pushed byte instead of three copies and an add.
The module's parameters are no longer registered on it: the optimizer gets
:meth:`FlatODC.parameters`, and :meth:`FlatODC.full_state_dict` rebuilds the named parameters.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten

from ._api import ODCConfig
from ._state import _TAG_GATHER, ODC
from ._transport import ShmTransport

__all__ = ["FlatODC", "flat_shard"]


@dataclass(eq=False)
class FlatUnit:
    """One unit's flat layout; field names shared with ``ModuleLayout`` where the protocol reads them."""

    name: str
    module: nn.Module
    entries: list[tuple[nn.Module, str, torch.Size]]  # (owner module, attribute, shape)
    sizes: list[int]
    numel: int  # unpadded
    shard_numel: int  # S: padded numel / shard size
    reshard: bool
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    params_offset: int = 0
    grads_offset: int = 0
    shard: nn.Parameter | None = field(default=None, repr=False)  # this rank's slice, stepped by the optimizer
    originals: list[nn.Parameter] | None = field(default=None, repr=False)  # put back if setup fails
    full: torch.Tensor | None = field(default=None, repr=False)  # this microbatch's leaf

    @property
    def gather_bytes(self) -> int:
        return self.shard_numel * self.param_dtype.itemsize

    @property
    def reduce_bytes(self) -> int:
        return self.shard_numel * self.reduce_dtype.itemsize


def flat_shard(
    model: nn.Module,
    units: Sequence[nn.Module] | None = None,
    group: dist.ProcessGroup | None = None,
    config: ODCConfig | None = None,
    /,
    **overrides,
) -> FlatODC:
    """Shard a plain model over ``group`` and train it with ODC, without FSDP2. See [Note: flat ODC].

    A collective over ``group`` (default: the world): every rank calls it with the same model
    structure; rank 0's initial values are broadcast to the others.

    Args:
        model: an unsharded CPU model in fp32.
        units: modules whose parameters are gathered and freed together, in any order; default:
            every child of a ``model.layers`` list, then ``model`` for what remains. ``model``
            itself, if listed, keeps its parameters gathered from forward until its backward;
            the others free theirs after forward and gather again for backward.
        group: the data-parallel ranks, all on this host.
        config: an :class:`~posttrain.odc.ODCConfig` (HSDP and ``deterministic`` are not
            supported here); keyword ``overrides`` replace its fields.

    Returns:
        The handle: ``with handle.minibatch(): ...`` as for :func:`posttrain.odc.enable`; build
        the optimizer on ``handle.parameters()``.
    """
    return FlatODC(model, units, group, replace(config or ODCConfig(), **overrides))


class FlatODC(ODC):
    """ODC on flat per-unit buffers; create with :func:`flat_shard`. See [Note: flat ODC]."""

    def __init__(self, model: nn.Module, units: Sequence[nn.Module] | None, group, config: ODCConfig) -> None:
        if config.deterministic:
            raise ValueError("flat ODC does not support deterministic=True; use posttrain.odc.enable on FSDP2")
        self._init_protocol(config)
        self.model = model
        self.shard_group = group or dist.group.WORLD
        self.replicate_group = None
        self._init_group()
        self.shards: list[nn.Parameter] = []
        self.layouts = self._build_units(model, units)
        params_bytes = self._place_layouts()
        self._param_ids = {id(p) for p in self.shards}
        self._hooks = []
        try:
            self.transport = ShmTransport.create(
                self.shard_group, {"params": params_bytes, "grads": self._grads_bytes}, timeout_s=config.timeout_s
            )
        except BaseException:
            self._restore()
            raise
        for u in self.layouts:
            self._hooks.append(u.module.register_forward_pre_hook(self._make_pre_forward(u)))
            self._hooks.append(u.module.register_forward_hook(self._make_post_forward(u)))
            u.originals = None
        self._step_hook = register_optimizer_step_pre_hook(self._check_step)

    # ------------------------------------------------------------------ setup
    def _build_units(self, model: nn.Module, units: Sequence[nn.Module] | None) -> list[FlatUnit]:
        if units is None:
            layers = getattr(model, "layers", None)
            if not isinstance(layers, nn.ModuleList):
                raise ValueError(
                    f"{type(model).__name__} has no `layers` ModuleList; pass units=[...] to flat_shard"
                )
            units = [*layers, model]
        names = {id(m): n or "<root>" for n, m in model.named_modules()}
        unit_ids = set()
        for m in units:
            if id(m) not in names:
                raise ValueError(f"unit {type(m).__name__} is not a submodule of the model")
            if id(m) in unit_ids:
                raise ValueError(f"unit {names[id(m)]!r} is listed twice")
            unit_ids.add(id(m))
        # A parameter belongs to the innermost unit that contains it.
        owner_of: dict[int, nn.Module] = {}

        def claim(m: nn.Module, current: nn.Module | None) -> None:
            if id(m) in unit_ids:
                current = m
            for p in m._parameters.values():
                if p is not None and current is not None:
                    owner_of.setdefault(id(p), current)
            for child in m.children():
                claim(child, current)

        claim(model, model if id(model) in unit_ids else None)
        found = []
        seen: set[tuple[int, str]] = set()
        for unit in units:
            entries, tensors = [], []
            for m in unit.modules():
                for n, p in m._parameters.items():
                    if p is None or owner_of.get(id(p)) is not unit or (id(m), n) in seen:
                        continue
                    if any(p is t for t in tensors):
                        raise ValueError(f"unit {names[id(unit)]!r} shares a parameter between modules; "
                                         "flat ODC does not support tied weights")
                    if p.device.type != "cpu" or p.dtype != torch.float32:
                        raise ValueError(
                            f"parameter {names[id(m)]}.{n} is {p.dtype} on {p.device}; flat ODC takes fp32 CPU models"
                        )
                    if not p.requires_grad:
                        raise ValueError(f"parameter {names[id(m)]}.{n} is frozen; flat ODC trains every parameter")
                    seen.add((id(m), n))
                    entries.append((m, n, p.shape))
                    tensors.append(p)
            if not entries:
                raise ValueError(f"unit {names[id(unit)]!r} owns no parameters")
            found.append((unit, entries, tensors))
        missing = [f"{names[id(m)]}.{n}".lstrip(".") for m in model.modules() for n, p in m._parameters.items()
                   if p is not None and (id(m), n) not in seen]
        if missing:
            raise ValueError(f"parameters outside every unit: {missing[:5]}; list a unit that contains them")

        # Checked: only now take the parameters off the model.
        out = []
        for unit, entries, tensors in found:
            sizes = [t.numel() for t in tensors]
            numel = sum(sizes)
            shard = -(-numel // self.shard_size)
            flat = torch.zeros(shard * self.shard_size)
            torch.cat([t.detach().reshape(-1) for t in tensors], out=flat[:numel])
            dist.broadcast(flat, src=self._shard_ranks[0], group=self.shard_group)
            for m, n, _ in entries:
                del m._parameters[n]
            mine = nn.Parameter(flat[self.rank * shard : (self.rank + 1) * shard].clone())
            self.shards.append(mine)
            out.append(FlatUnit(
                name=names[id(unit)], module=unit, entries=entries, sizes=sizes, numel=numel,
                shard_numel=shard, reshard=unit is not model, param_dtype=torch.float32,
                reduce_dtype=torch.float32, shard=mine, originals=tensors,
            ))
        return out

    def _restore(self) -> None:
        """Give the model its parameters back (setup failed after taking them)."""
        for u in self.layouts:
            for (m, n, _), p in zip(u.entries, u.originals):
                m._parameters[n] = p
        self._closed = True

    def parameters(self) -> list[nn.Parameter]:
        """This rank's flat shards, one per unit: what the optimizer steps."""
        return list(self.shards)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter under its original name, gathered from all ranks (a collective)."""
        out = {}
        names = {id(m): n for n, m in self.model.named_modules()}
        for u, shard in zip(self.layouts, self.shards):
            flat = torch.empty(u.shard_numel * self.shard_size)
            dist.all_gather_into_tensor(flat, shard.detach(), group=self.shard_group)
            for (m, n, shape), v in zip(u.entries, flat[: u.numel].split(u.sizes)):
                out[f"{names[id(m)]}.{n}".lstrip(".")] = v.view(shape).clone()
        return out

    # ------------------------------------------------------------- protocol
    def _expose(self) -> None:
        for u, shard in zip(self.layouts, self.shards):
            self._params_view(self.rank, u).copy_(shard.detach())

    def _release(self) -> None:
        for u in self.layouts:
            u.full = None

    def _clear_grads(self) -> None:
        for shard in self.shards:
            shard.grad = None

    def _write_grads(self) -> None:
        acc = self._reduced_accumulator()
        factor = self.config.grad_divide_factor
        for u, shard in zip(self.layouts, self.shards):
            g = acc[u.grads_offset : u.grads_offset + u.reduce_bytes].view(u.reduce_dtype)
            if shard.grad is None:
                shard.grad = torch.zeros_like(shard)
            shard.grad.copy_(g)
            if factor != 1.0:
                shard.grad.div_(factor)

    # ---------------------------------------------------------------- hooks
    def _fill(self, u: FlatUnit, dst: torch.Tensor) -> None:
        """Gather every owner's shard of ``u`` into ``dst`` (the whole padded vector)."""
        start = time.perf_counter()
        with record_function("ODC::gather"):
            if not self._in_minibatch:
                self._usable()
                # Outside a minibatch (evaluation) the exposures may be stale: a collective.
                dist.all_gather_into_tensor(dst, u.shard.detach(), group=self.shard_group)
            else:
                if self.config.mode == "collective":
                    self.transport.barrier(_TAG_GATHER)
                rows = dst.view(self.shard_size, u.shard_numel)
                for q in range(self.shard_size):
                    rows[q].copy_(self._params_view(q, u))
                self.stats["gathers"] += 1
                self.stats["gather_bytes"] += dst.numel() * dst.element_size()
        if self.on_comm is not None and self._in_minibatch:
            self.on_comm("gather", start, time.perf_counter())

    def _make_pre_forward(self, u: FlatUnit):
        def pre_forward(module, args):
            full = torch.empty(u.shard_numel * self.shard_size, dtype=u.param_dtype)
            self._fill(u, full)
            if torch.is_grad_enabled():
                full.requires_grad_()
                full.register_post_accumulate_grad_hook(self._make_push(u))
            u.full = full
            for (m, n, shape), v in zip(u.entries, full[: u.numel].split(u.sizes)):
                m.__dict__[n] = v.view(shape)

        return pre_forward

    def _make_post_forward(self, u: FlatUnit):
        def post_forward(module, args, output):
            full = u.full
            if not u.reshard or full is None:
                return
            storage = full.untyped_storage()
            nbytes = storage.nbytes()
            storage.resize_(0)
            if not full.requires_grad:
                return
            fired = False

            def regather(grad):
                nonlocal fired
                if not fired:
                    fired = True
                    if storage.nbytes() == 0:
                        storage.resize_(nbytes)
                        # A tensor of its own on the same storage: filling it does not bump the
                        # version counter that autograd checks on the saved weight views.
                        buf = torch.empty(0, dtype=full.dtype).set_(storage, 0, full.shape, full.stride())
                        self._fill(u, buf)
                return grad

            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(regather)

        return post_forward

    def _make_push(self, u: FlatUnit):
        def push(full: torch.Tensor) -> None:
            start = time.perf_counter()
            with record_function("ODC::scatter_accumulate"):
                if not self._in_minibatch:
                    self._usable()
                    raise RuntimeError(
                        "backward ran outside `with odc.minibatch():`; ODC accumulates gradients only "
                        "inside a minibatch (enter it before the first forward whose loss you backward)"
                    )
                grad = full.grad
                self._push_rows(u, grad.view(self.shard_size, u.shard_numel))
                self.stats["push_bytes"] += grad.numel() * grad.element_size()
                full.grad = None
                full.untyped_storage().resize_(0)
            if self.on_comm is not None:
                self.on_comm("reduce", start, time.perf_counter())

        return push

    def close(self) -> None:
        for h in getattr(self, "_hooks", []):
            h.remove()
        self._hooks = []
        super().close()
