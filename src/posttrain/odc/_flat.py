"""ODC without FSDP2: flat parameter buffers per unit, gathered and pushed by module hooks.

[Note: flat ODC]
FSDP2 does its unshard, reshard and reduce bookkeeping per parameter: allocate and copy the
all-gather input, copy out each parameter, swap it onto the module, and in backward copy every
gradient into a reduce buffer and back into a sharded ``.grad``. ODC needs none of it, because
its gathers and pushes are plain copies and adds:

- A *unit* is a module whose own parameters (those not inside another unit) are flattened in
  registration order into vectors, padded to a multiple of the shard size: one vector of the
  trainable parameters and one of the frozen ones (``requires_grad=False``: gathered, never
  pushed, stepped or given accumulator space). A parameter shared by several modules (tied
  embeddings) is stored once; every module that uses it sees the same tensor. Shard rank ``r``
  owns elements ``[r*S, (r+1)*S)`` of each vector (:attr:`FlatUnit.shard`, what the optimizer
  steps, in the model's dtype) and exposes them, cast to the mixed-precision ``param_dtype``, in
  its ``params`` region at minibatch entry, exactly as in [Note: ODC layouts].
- Forward pre-hook: fresh tensors of the whole vectors are filled from every owner's exposure
  (one copy per owner and vector); the trainable one becomes a leaf that requires grad, and both
  are split into views that are set on the modules in place of their parameters. Forward
  post-hook: a resharded unit frees the vectors' storage and hooks its outputs, so the first
  gradient reaching them refills the same storage before the unit's backward reads its saved
  weights (or, under activation checkpointing, recomputes its forward).
- Prefetch (``ODCConfig.prefetch``, on by default on an accelerator): a unit's pre-hook also
  gathers the resharded unit that came after it in the last forward into fresh vectors, on a
  side stream (the next pre-hook waits for its event), and the first gradient reaching a unit
  refills it and then the storage of the unit whose forward ended before it (the next one
  backward needs). The gathers are the same copies from constant exposures, only earlier; a
  prefetch no forward took is dropped at minibatch exit (counted in ``prefetch_stats``).
- When autograd has accumulated the leaf's gradient (one tensor: the split's backward
  concatenates; the split covers the padding too, so no slice backward zero-fills and copies the
  whole vector again), row ``p`` is added into owner ``p``'s accumulator (in ``reduce_dtype``)
  and both are freed.
- Entry, exit, the accumulators, collective and deterministic modes, HSDP and failure handling
  are the minibatch protocol's (``_protocol.py``).

The module's parameters are not registered on it while it is sharded: the optimizer gets
:meth:`FlatODC.parameters` (or, through :func:`posttrain.odc.flat_shard`, the model's own
``parameters()``: the same shards as DTensors, [Note: flat ODC as a module]), a plain module's
``state_dict()`` raises (use :meth:`FlatODC.full_state_dict` or
:meth:`FlatODC.sharded_state_dict`), and :meth:`FlatODC.close` puts the full parameters back.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

from posttrain._compat import all_gather_single, in_backward, tree_flatten, tree_map_only, tree_unflatten
from posttrain.device import on_stream
from posttrain.models.blocks import find_blocks
from posttrain.spans import comm_span

from ._protocol import Minibatch, MinibatchProtocol, traced
from .config import ODCConfig

__all__ = ["FlatODC", "FlatUnit"]


@dataclass(eq=False)
class FlatUnit:
    """One unit's flat layout and its live tensors. See [Note: flat ODC]."""

    name: str
    module: nn.Module
    slots: list[tuple[nn.Module, str, int]]  # (module, attribute, index into params)
    params: list[nn.Parameter]  # unique, in flat order: trainable first, then frozen
    param_names: list[str]  # one name per unique parameter (its first slot)
    num_trainable: int  # params[:num_trainable] require grad
    numel: int  # trainable elements, unpadded
    frozen_numel: int
    shard_numel: int  # S: padded trainable elements per rank
    frozen_shard_numel: int
    reshard: bool
    master_dtype: torch.dtype
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    params_offset: int = 0
    grads_offset: int = 0
    shard: nn.Parameter | None = field(default=None, repr=False)  # this rank's trainable slice
    frozen_shard: torch.Tensor | None = field(default=None, repr=False)
    full: torch.Tensor | None = field(default=None, repr=False)  # this microbatch's trainable leaf
    frozen_full: torch.Tensor | None = field(default=None, repr=False)

    @property
    def gather_bytes(self) -> int:
        return (self.shard_numel + self.frozen_shard_numel) * self.param_dtype.itemsize

    @property
    def reduce_bytes(self) -> int:
        return self.shard_numel * self.reduce_dtype.itemsize

    @property
    def sizes(self) -> list[int]:
        return [p.numel() for p in self.params]


class _Refill:
    """The gradient hook of a resharded unit's outputs in one forward: the first gradient to
    arrive refills the unit's freed storage (the saved weight views read it) and, with prefetch,
    starts refilling :attr:`before` (the unit whose forward ended before this one: the next
    backward) ahead."""

    def __init__(self, odc: FlatODC, u: FlatUnit, full: torch.Tensor | None, frozen: torch.Tensor | None) -> None:
        self.odc, self.u = odc, u
        self.tensors = (full, frozen)
        self.sizes = [t.untyped_storage().nbytes() if t is not None else 0 for t in self.tensors]
        self.before: _Refill | None = None
        self.started = self.fired = False
        self.event: object | None = None

    def start(self, *, ahead: bool) -> None:
        """Fill the storage again (once): on the side stream ``ahead``, else here."""
        if self.started:
            return
        self.started = True
        bufs = []
        for t, nbytes in zip(self.tensors, self.sizes):
            if t is None or t.untyped_storage().nbytes() == nbytes:
                bufs.append(None)  # absent, or already refilled
                continue
            storage = t.untyped_storage()
            storage.resize_(nbytes)
            # A tensor of its own on the same storage: filling it does not bump the version
            # counter that autograd checks on the saved weight views.
            bufs.append(torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, t.shape, t.stride()))
        if all(b is None for b in bufs):
            return
        if ahead:
            self.event = self.odc._ahead(lambda: self.odc._fill(self.u, *bufs, "prefetch"))
            self.odc.prefetch_stats["prefetched"] += 1
        else:
            self.odc._fill(self.u, *bufs)

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        if not self.fired:
            self.fired = True
            self.start(ahead=False)
            self.odc._wait(self.event)
            before, self.before = self.before, None
            if before is not None:
                before.start(ahead=True)
        return grad


class _ModelSharded(RuntimeError):
    pass


class _AfterBackward(torch.autograd.Function):
    """Identity on tensors; calls ``fn`` when the gradients of all of them are computed."""

    @staticmethod
    def forward(ctx, fn, *tensors):
        ctx.fn = fn
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.fn()
        return (None, *grads)


class FlatODC:
    """ODC on flat per-unit buffers: the handle :func:`posttrain.odc.flat_shard` puts on the model
    (``model.odc``), or made directly by an engine that keeps the model plain. See [Note: flat ODC].

    Args:
        model, units, group, config, mesh, mp_policy: as for :func:`posttrain.odc.flat_shard`.
    """

    def __init__(
        self,
        model: nn.Module,
        units: Sequence[nn.Module] | None,
        group: dist.ProcessGroup | None,
        config: ODCConfig,
        *,
        mesh: DeviceMesh | None = None,
        mp_policy: MixedPrecisionPolicy | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.mp_policy = mp_policy or MixedPrecisionPolicy()
        if mesh is not None:
            if mesh.ndim not in (1, 2):
                raise ValueError(f"flat ODC takes a 1-D (shard) or 2-D (replicate, shard) mesh, got {mesh.ndim}-D")
            self.shard_group = mesh.get_group(mesh.ndim - 1)
            self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        else:
            self.shard_group = group or dist.group.WORLD
            self.replicate_group = None
        self.mesh = mesh
        self.rank = dist.get_rank(self.shard_group)
        self.shard_size = dist.get_world_size(self.shard_group)
        self._hooks: list = []
        # id(gathered leaf) -> (unit, leaf, its trainable parameter views), from a forward in this
        # minibatch until the leaf's gradient is pushed (for weight_views / push_grads)
        self._gathered: dict[int, tuple[FlatUnit, torch.Tensor, list[torch.Tensor]]] = {}
        self._protocol: MinibatchProtocol | None = None
        self._closed = False
        self._dparams: list[nn.Parameter] | None = None  # the shards as DTensors (dtensor_parameters)
        self.on_close: Callable[[], None] | None = None
        first = next(iter(model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.layouts = self._build_units(model, units)  # checked before anything is taken off the model
        # prefetch ([Note: flat ODC]): it needs to see a forward begin (the model's own pre-hook) to
        # keep its order to one forward, so without the model among the units (a pipeline's stages)
        # units gather on time; the side stream (None on the CPU: gathers ahead run at once)
        auto = self.device.type != "cpu"
        self._prefetch = ((auto if config.prefetch is None else config.prefetch) and config.mode == "one-sided"
                          and any(u.module is model for u in self.layouts))
        self._side = torch.Stream(self.device) if self._prefetch and self.device.type != "cpu" else None
        self._next: dict[int, FlatUnit] = {}  # id(unit) -> the unit whose forward ran after it last time
        self._prev_pre: FlatUnit | None = None  # the unit whose pre-hook ran last
        self._ready: dict[int, tuple[torch.Tensor | None, torch.Tensor | None, object]] = {}  # prefetched vectors
        self._last_refill: _Refill | None = None  # the latest resharded unit's refill (backward's chain)
        #: prefetches issued and those no forward took (dropped at minibatch exit)
        self.prefetch_stats = {"prefetched": 0, "unused": 0}
        self._take_parameters()
        try:
            self._protocol = MinibatchProtocol(
                config, shard_group=self.shard_group, replicate_group=self.replicate_group, layouts=self.layouts,
                steps=self, param_ids={id(p) for p in self.parameters()}, device=self.device,
            )
        except BaseException:
            self._put_back([[p.detach() for p in u.params] for u in self.layouts], originals=True)
            self._closed = True
            raise
        for u in self.layouts:
            self._hooks.append(u.module.register_forward_pre_hook(self._make_pre_forward(u), with_kwargs=True))
            self._hooks.append(u.module.register_forward_hook(self._make_post_forward(u)))
        for m in {id(m): m for m in (model, *(u.module for u in self.layouts))}.values():
            self._hooks.append(m.register_state_dict_pre_hook(self._refuse_state_dict))

    # ------------------------------------------------------------------ setup
    def _build_units(self, model: nn.Module, units: Sequence[nn.Module] | None) -> list[FlatUnit]:
        if units is None:
            units = [*find_blocks(model), model]
        names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        unit_ids: dict[int, nn.Module] = {}
        for m in units:
            if id(m) not in names:
                raise ValueError(f"unit {type(m).__name__} is not a submodule of the model")
            if id(m) in unit_ids:
                raise ValueError(f"unit {names[id(m)] or '<root>'!r} is listed twice")
            unit_ids[id(m)] = m

        def label(m: nn.Module) -> str:
            return names[id(m)] or "<root>"

        # Each module's unit: the innermost listed module that contains it.
        unit_of: dict[int, nn.Module | None] = {}

        def walk(m: nn.Module, current: nn.Module | None) -> None:
            current = m if id(m) in unit_ids else current
            if id(m) in unit_of:
                return
            unit_of[id(m)] = current
            for child in m.children():
                walk(child, current)

        walk(model, None)
        slots: dict[int, list[tuple[nn.Module, str, nn.Parameter]]] = {id(u): [] for u in units}
        param_unit: dict[int, nn.Module] = {}
        missing = []
        for mod_name, m in model.named_modules(remove_duplicate=False):
            for attr, p in m._parameters.items():
                if p is None:
                    continue
                unit = unit_of[id(m)]
                full_name = f"{mod_name}.{attr}".lstrip(".")
                if unit is None:
                    missing.append(full_name)
                    continue
                seen = param_unit.setdefault(id(p), unit)
                if seen is not unit:
                    raise ValueError(
                        f"parameter {full_name} is shared by modules in units {label(seen)!r} and {label(unit)!r}; "
                        "tied parameters must belong to one unit (list a unit that contains both modules)"
                    )
                if (m, attr, p) not in [(a, b, c) for a, b, c in slots[id(unit)] if a is m and b == attr]:
                    slots[id(unit)].append((m, attr, p))
        if missing:
            raise ValueError(f"parameters outside every unit: {missing[:5]}; list a unit that contains them")

        mp = self.mp_policy
        out = []
        for unit in units:
            found = slots[id(unit)]
            if not found:
                raise ValueError(f"unit {label(unit)!r} owns no parameters")
            unique: dict[int, tuple[nn.Parameter, str]] = {}
            for m, attr, p in found:
                unique.setdefault(id(p), (p, f"{names[id(m)]}.{attr}".lstrip(".")))
            ordered = [v for v in unique.values() if v[0].requires_grad] + [
                v for v in unique.values() if not v[0].requires_grad
            ]
            params = [p for p, _ in ordered]
            index = {id(p): i for i, p in enumerate(params)}
            for p, pname in ordered:
                if p.device != self.device or not p.dtype.is_floating_point:
                    raise ValueError(
                        f"parameter {pname} is {p.dtype} on {p.device}; flat ODC takes floating-point models on one "
                        f"device ({self.device} here)"
                    )
            dtypes = {p.dtype for p in params}
            if len(dtypes) != 1:
                raise ValueError(
                    f"unit {label(unit)!r} mixes parameter dtypes {sorted(map(str, dtypes))}; "
                    "flat ODC needs one dtype per unit (cast the model, or list such parameters in their own unit)"
                )
            master = dtypes.pop()
            param_dtype = mp.param_dtype or master
            num_trainable = sum(p.requires_grad for p in params)
            numel = sum(p.numel() for p in params[:num_trainable])
            frozen_numel = sum(p.numel() for p in params[num_trainable:])
            out.append(FlatUnit(
                name=label(unit), module=unit, slots=[(m, attr, index[id(p)]) for m, attr, p in found],
                params=params, param_names=[n for _, n in ordered], num_trainable=num_trainable, numel=numel,
                frozen_numel=frozen_numel, shard_numel=-(-numel // self.shard_size),
                frozen_shard_numel=-(-frozen_numel // self.shard_size), reshard=unit is not model,
                master_dtype=master, param_dtype=param_dtype, reduce_dtype=mp.reduce_dtype or param_dtype,
            ))
        return out

    def _broadcast(self, flat: torch.Tensor) -> None:
        """Every data-parallel rank takes the first rank's values: replicas first, then shards."""
        if self.replicate_group is not None:
            src = dist.get_process_group_ranks(self.replicate_group)[0]
            dist.broadcast(flat, src=src, group=self.replicate_group)
        dist.broadcast(flat, src=dist.get_process_group_ranks(self.shard_group)[0], group=self.shard_group)

    def _take_parameters(self) -> None:
        """Flatten, broadcast and shard every unit; take the parameters off the modules."""
        r = self.rank
        for u in self.layouts:
            trainable, frozen = u.params[: u.num_trainable], u.params[u.num_trainable :]
            for tensors, numel, shard_numel, is_trainable in (
                (trainable, u.numel, u.shard_numel, True), (frozen, u.frozen_numel, u.frozen_shard_numel, False)
            ):
                if not tensors:
                    continue
                flat = torch.zeros(shard_numel * self.shard_size, dtype=u.master_dtype, device=self.device)
                torch.cat([t.detach().reshape(-1) for t in tensors], out=flat[:numel])
                self._broadcast(flat)
                mine = flat[r * shard_numel : (r + 1) * shard_numel].clone()
                if is_trainable:
                    u.shard = nn.Parameter(mine)
                else:
                    u.frozen_shard = mine
        for u in self.layouts:
            for m, attr, _ in u.slots:
                m._parameters.pop(attr, None)

    def _put_back(self, full: list[list[torch.Tensor]], *, originals: bool = False) -> None:
        """Register parameters on the modules again: the original objects, or new ones."""
        for u, values in zip(self.layouts, full):
            if originals:
                made = u.params
            else:
                made = [nn.Parameter(v, requires_grad=p.requires_grad) for v, p in zip(values, u.params)]
            for m, attr, i in u.slots:
                m.__dict__.pop(attr, None)
                m._parameters[attr] = made[i]

    # ------------------------------------------------------------- public API
    def parameters(self) -> list[nn.Parameter]:
        """This rank's trainable flat shards, one per unit that has trainable parameters:
        what the optimizer steps."""
        return [u.shard for u in self.layouts if u.shard is not None]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(unit name, shard)`` for :meth:`parameters`, in the same order."""
        return [(u.name, u.shard) for u in self.layouts if u.shard is not None]

    def dtensor_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``("<unit>.flat", parameter)`` per trainable unit: :meth:`parameters` as DTensors of the
        padded vector, sharded over the shard ranks (replicated across HSDP replicas), sharing
        the shards' storage. An optimizer may step these instead, and torch's
        ``clip_grad_norm_`` computes the global norm over them; their gradients are set when a
        minibatch ends. Made on the first call; the same objects afterwards."""
        self._check_open()
        if self._dparams is None:
            self._dparams = [nn.Parameter(self._padded_dtensor(u.shard.detach()))
                             for u in self.layouts if u.shard is not None]
        return [(f"{name}.flat", p) for (name, _), p in zip(self.named_parameters(), self._dparams)]

    def _padded_dtensor(self, local: torch.Tensor) -> DTensor:
        placements = (Shard(0),) if self.replicate_group is None else (Replicate(), Shard(0))
        return DTensor.from_local(local, self._device_mesh(), placements, run_check=False,
                                  shape=torch.Size([local.numel() * self.shard_size]), stride=(1,))

    @property
    def stats(self) -> dict[str, int]:
        """Counts since creation: gathers, pushes, and their bytes."""
        return self._protocol.stats

    @property
    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of this rank's shared regions: ``params`` (exposed shards) and ``grads`` (one
        accumulator; ``deterministic=True`` keeps one per writer)."""
        return {"params": self._protocol.params_bytes, "grads": self._protocol.grads_bytes}

    @property
    def on_comm(self) -> Callable[[str, float, float], None] | None:
        """Called as ``on_comm(kind, start, end)`` after every gather and push inside a minibatch."""
        return self._protocol.on_comm

    @on_comm.setter
    def on_comm(self, fn: Callable[[str, float, float], None] | None) -> None:
        self._protocol.on_comm = fn

    @property
    def in_minibatch(self) -> bool:
        return self._protocol.in_minibatch

    @contextmanager
    def minibatch(self, *, num_tokens: int | None = None) -> Iterator[Minibatch]:
        """One optimizer step's worth of microbatches; see :meth:`MinibatchProtocol.minibatch`."""
        if self._closed:
            raise RuntimeError("this flat ODC handle is closed")
        with self._protocol.minibatch(num_tokens=num_tokens) as mb:
            yield mb
            self._check_pushed()  # inside: a failure here is the protocol's (peers are told)
        if self._dparams is not None:
            for u, p in zip((u for u in self.layouts if u.shard is not None), self._dparams):
                p.grad = None if u.shard.grad is None else self._padded_dtensor(u.shard.grad)

    def _check_pushed(self) -> None:
        """Refuse to end a minibatch with a gradient computed but never pushed (it would be lost)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # .grad of a view
            for u, full, views in self._gathered.values():
                if full.grad is not None or any(v.grad is not None for v in views):
                    raise RuntimeError(
                        f"flat ODC: a gradient of unit {u.name!r} was computed but never pushed; a weight pass "
                        "that assigns .grad itself (torch's stage_backward_weight) must hand its weights to "
                        "handle.push_grads")

    def iter_full_units(self) -> Iterator[dict[str, torch.Tensor]]:
        """Unit by unit, every parameter under each name a module uses for it (tied parameters
        under each of their names, as ``model.state_dict()`` has them), in the model's dtype.
        A collective over the shard group; holds one unit's full parameters at a time."""
        self._check_open()
        names = {id(m): n for n, m in self.model.named_modules(remove_duplicate=False)}
        for u in self.layouts:
            values = self._gather_unit(u)
            out = {}
            for m, attr, i in u.slots:
                out[f"{names[id(m)]}.{attr}".lstrip(".")] = values[i]
            yield out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter under its original names, gathered from all ranks (a collective)."""
        out: dict[str, torch.Tensor] = {}
        for part in self.iter_full_units():
            out.update(part)
        return out

    def sharded_state_dict(self) -> dict[str, DTensor]:
        """This rank's shards as 1-D DTensors for ``torch.distributed.checkpoint``: keys
        ``"<unit>.flat"`` (trainable) and ``"<unit>.flat_frozen"``. The global shape is the unit's
        unpadded length, so a checkpoint loads on any shard size (DCP reshards)."""
        self._check_open()
        out = {}
        for u in self.layouts:
            if u.shard is not None:
                out[f"{u.name}.flat"] = self.as_dtensor(u, u.shard.detach())
            if u.frozen_shard is not None:
                out[f"{u.name}.flat_frozen"] = self.as_dtensor(u, u.frozen_shard, frozen=True)
        return out

    def load_sharded_state_dict(self, state: dict[str, DTensor]) -> None:
        """Copy a :meth:`sharded_state_dict` (e.g. filled by ``dcp.load``) into the shards."""
        self._check_open()
        with torch.no_grad():
            for u in self.layouts:
                for key, dst in ((f"{u.name}.flat", u.shard), (f"{u.name}.flat_frozen", u.frozen_shard)):
                    if dst is None:
                        continue
                    if key not in state:
                        raise ValueError(f"state dict has no {key!r}; it was saved from another model or units")
                    self.from_dtensor(state[key], dst)

    def as_dtensor(self, u: FlatUnit, local: torch.Tensor, *, frozen: bool = False) -> DTensor:
        """``local`` (a padded shard of ``u``'s trainable or frozen vector, or a tensor of the
        same shape such as optimizer state) as a DTensor of the unpadded global vector."""
        numel, shard = (u.frozen_numel, u.frozen_shard_numel) if frozen else (u.numel, u.shard_numel)
        if local.shape != (shard,):
            raise AssertionError(f"{u.name}: shard of shape {tuple(local.shape)}, expected ({shard},)")
        valid = max(0, min(shard, numel - self.rank * shard))
        placements = (Shard(0),) if self.replicate_group is None else (Replicate(), Shard(0))
        return DTensor.from_local(local[:valid], self._device_mesh(), placements, run_check=False,
                                  shape=torch.Size([numel]), stride=(1,))

    @staticmethod
    def from_dtensor(src: DTensor | torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the local part of an :meth:`as_dtensor` tensor into the padded shard ``dst``."""
        local = src.to_local() if isinstance(src, DTensor) else src
        with torch.no_grad():
            dst[: local.numel()].copy_(local.reshape(-1))
            dst[local.numel() :].zero_()

    def failed_peer(self) -> str | None:
        """What a peer of this rank that failed says, else ``None`` (for waits outside ODC's own)."""
        return None if self._protocol is None else self._protocol.failed_peer()

    def close(self, *, restore: bool = True) -> None:
        """Put the full parameters back on the model (``restore``: a collective over the shard
        group, so every rank must call it; skipped after a failure) and free the shared buffers
        and hooks. Idempotent; the handle cannot be used afterwards, the model can."""
        if self._closed:
            return
        p = self._protocol
        if restore and p is not None and p.broken is None and not p.closed and not p.in_minibatch:
            full = [self._gather_unit(u) for u in self.layouts]
            self._put_back(full)
        self._free()

    def _free(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._dparams = None
        if self.on_close is not None:
            self.on_close()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._drain()
        self._gathered.clear()
        self._ready.clear()
        self._last_refill = self._prev_pre = None
        for u in self.layouts:
            u.full = u.frozen_full = None
        if self._protocol is not None:
            self._protocol.close()

    def __enter__(self) -> FlatODC:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        p = self._protocol
        if exc is not None:
            if p is not None and not p.closed and p.broken is None:
                p.fail(f"{type(exc).__name__}: {exc}")
            self._free()  # no collective: peers may be gone
        else:
            self.close()

    def __del__(self) -> None:
        try:
            self._free()
        except Exception:
            pass

    # ---------------------------------------------------------------- helpers
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this flat ODC handle is closed; the model holds its full parameters again")

    def _device_mesh(self) -> DeviceMesh:
        if self.mesh is None:
            self.mesh = DeviceMesh.from_group(self.shard_group, self.device.type)
        return self.mesh

    def _gather_unit(self, u: FlatUnit) -> list[torch.Tensor]:
        """Every parameter of ``u``, full, in the model's dtype (a collective over the shard group)."""
        values: list[torch.Tensor] = []
        for shard, frozen in ((u.shard, False), (u.frozen_shard, True)):
            if shard is not None:
                values += self.unshard(u, shard, frozen=frozen)
        return values

    def _half(self, u: FlatUnit, frozen: bool) -> tuple[int, int, list[torch.Tensor]]:
        """``(numel, shard_numel, parameters)`` of ``u``'s trainable or frozen vector."""
        if frozen:
            return u.frozen_numel, u.frozen_shard_numel, u.params[u.num_trainable :]
        return u.numel, u.shard_numel, u.params[: u.num_trainable]

    def unshard(self, u: FlatUnit, local: torch.Tensor, *, frozen: bool = False) -> list[torch.Tensor]:
        """Unit ``u``'s trainable (``frozen``: frozen) parameters, whole, from every rank's
        shard-shaped ``local``: the shard itself, or optimizer state shaped like it. A collective
        over the shard group."""
        numel, shard_numel, params = self._half(u, frozen)
        flat = torch.empty(shard_numel * self.shard_size, dtype=local.dtype, device=local.device)
        all_gather_single(flat, local.detach().contiguous(), group=self.shard_group)
        return [v.view(p.shape).clone() for v, p in zip(flat[:numel].split([p.numel() for p in params]), params)]

    def shard_of(self, u: FlatUnit, whole: Sequence[torch.Tensor], *, frozen: bool = False) -> torch.Tensor:
        """This rank's padded shard of ``u``'s trainable (``frozen``: frozen) vector, cut out of its
        whole parameters (or state shaped like them): the inverse of :meth:`unshard`, without
        communication."""
        numel, shard_numel, _ = self._half(u, frozen)
        flat = torch.zeros(shard_numel * self.shard_size, dtype=whole[0].dtype, device=whole[0].device)
        torch.cat([t.reshape(-1) for t in whole], out=flat[:numel])
        return flat[self.rank * shard_numel : (self.rank + 1) * shard_numel].clone()

    def _refuse_state_dict(self, module, prefix, keep_vars) -> None:
        raise _ModelSharded(
            f"{type(module).__name__} is sharded by flat ODC and holds no parameters; the model flat_shard "
            "returned gives its shards (model.state_dict()) and its full parameters (model.full_state_dict(), "
            "on every rank), and model.odc.close() puts them back"
        )

    # ------------------------------------------------- steps of the protocol
    def expose(self) -> None:
        for u in self.layouts:
            view = self._protocol.params_view(self.rank, u)
            if u.shard is not None:  # copy_ casts to the mixed-precision param dtype
                view[: u.shard_numel].copy_(u.shard.detach())
            if u.frozen_shard is not None:
                view[u.shard_numel :].copy_(u.frozen_shard)

    def release(self) -> None:
        self._gathered.clear()
        self.prefetch_stats["unused"] += len(self._ready)
        if self._ready:
            self._drain()  # (an unused prefetch may still be being written)
        self._ready.clear()
        self._last_refill = self._prev_pre = None
        for u in self.layouts:
            for t in (u.full, u.frozen_full):
                if t is not None:
                    t.untyped_storage().resize_(0)  # the views left on the modules hold this storage
            u.full = u.frozen_full = None

    def clear_grads(self) -> None:
        for shard in self.parameters():
            shard.grad = None

    def write_grads(self, reduced) -> None:
        for u in self.layouts:
            if u.shard is None:
                continue
            g = reduced(u)
            if u.shard.grad is None:
                u.shard.grad = torch.empty_like(u.shard)
            u.shard.grad.copy_(g)

    def weight_views(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` with each gathered leaf of this minibatch replaced by the parameter views
        its unit's modules use (one per trainable parameter; other tensors kept). For a split
        backward (torch's ``stage_backward_input`` / ``stage_backward_weight``): with the views as
        its weights, each parameter is its own group and the weight pass runs only the nodes
        between a parameter and where its gradient meets the input gradient's path; with the one
        flat leaf of a unit as the weight, that pass would run the unit's whole backward again."""
        out: list[torch.Tensor] = []
        for t in tensors:
            entry = self._gathered.get(id(t))
            out += entry[2] if entry is not None and entry[1] is t else [t]
        return out

    def _entries(self, tensors: Iterable[torch.Tensor]) -> list[tuple[FlatUnit, torch.Tensor, list[torch.Tensor]]]:
        """The gathered entries whose leaf or one of whose views is in ``tensors``."""
        given = {id(t) for t in tensors}
        return [(u, full, views) for key, (u, full, views) in self._gathered.items()
                if key in given or any(id(v) in given for v in views)]

    def release_weights(self, tensors: Iterable[torch.Tensor]) -> int:
        """Free the gathered storage of the units whose leaves (or :meth:`weight_views`) are in
        ``tensors``: after a split backward's input pass, whose weight pass comes later, so that a
        microbatch waiting for it holds no unsharded copy of the weights. :meth:`regather_weights`
        fills them again. Units that are not resharded (the root) are kept. Returns the count freed."""
        n = 0
        for u, full, _ in self._entries(tensors):
            if u.reshard and full.untyped_storage().nbytes():
                full.untyped_storage().resize_(0)
                n += 1
        return n

    def regather_weights(self, tensors: Iterable[torch.Tensor]) -> int:
        """Gather again what :meth:`release_weights` freed (from the owners' exposures, which do
        not change inside a minibatch). Returns the count gathered."""
        n = 0
        for u, full, _ in self._entries(tensors):
            storage = full.untyped_storage()
            nbytes = full.numel() * full.element_size()
            if storage.nbytes() == nbytes:
                continue
            storage.resize_(nbytes)
            # a tensor of its own on the storage: filling it leaves the saved views' version alone
            self._fill(u, torch.empty(0, dtype=full.dtype, device=full.device).set_(storage, 0, full.shape, full.stride()), None)
            n += 1
        return n

    def push_grads(self, tensors: Iterable[torch.Tensor]) -> int:
        """Push the gradients set on gathered leaves, or on their :meth:`weight_views`, without
        autograd's accumulation into the leaf (so its post-accumulate hook did not fire): e.g.
        by ``stage_backward_weight``, which assigns ``.grad`` itself. Views' gradients are
        assembled into the leaf's flat gradient first. Tensors of no leaf of this handle, or
        without a gradient (already pushed), are skipped; returns the number of leaves pushed."""
        n = 0
        with warnings.catch_warnings():  # .grad of a view (a non-leaf): set by the weight pass, read here
            warnings.simplefilter("ignore", UserWarning)
            for u, full, views in self._entries(tensors):
                grads = [v.grad for v in views]
                if any(g is not None for g in grads):
                    flat = full.grad if full.grad is not None else torch.zeros_like(full)
                    offset = 0
                    for v, g in zip(views, grads):  # the views split full[:numel] in order
                        if g is not None:
                            flat[offset : offset + v.numel()].add_(g.reshape(-1))
                            v.grad = None
                        offset += v.numel()
                    full.grad = flat
                if full.grad is not None:
                    self._make_push(u)(full)
                    n += 1
        return n

    # ---------------------------------------------------------------- hooks
    def _ahead(self, fill: Callable[[], None]) -> object | None:
        """Run ``fill`` (gathers into buffers the compute stream allocated) on the side stream,
        after the compute stream's queued work; the event the consumer waits on (:meth:`_wait`).
        On the CPU ``fill`` runs at once and there is nothing to wait on."""
        if self._side is None:
            fill()
            return None
        self._side.wait_stream(torch.accelerator.current_stream(self.device))
        with on_stream(self._side):
            fill()
            event = torch.Event(self.device)
            event.record(self._side)
        return event

    def _drain(self) -> None:
        """Wait until the side stream has written every buffer it was given (prefetched vectors,
        refilled storages) before they are dropped: freed while it still writes them, their memory
        could go to a new tensor on the compute stream and be overwritten. Nothing on the CPU."""
        if self._side is not None:
            self._side.synchronize()

    def _wait(self, event: object | None) -> None:
        if event is not None:
            torch.accelerator.current_stream(self.device).wait_event(event)

    def _vectors(self, u: FlatUnit) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        n = self.shard_size
        full = torch.empty(u.shard_numel * n, dtype=u.param_dtype, device=self.device) if u.shard is not None else None
        frozen = (torch.empty(u.frozen_shard_numel * n, dtype=u.param_dtype, device=self.device)
                  if u.frozen_shard is not None else None)
        return full, frozen

    def _prefetch_after(self, u: FlatUnit) -> None:
        """In a minibatch's forward: learn that ``u`` came after the previous unit, and gather the
        resharded unit that came after ``u`` last time ahead of its pre-hook."""
        if self._prev_pre is not None:
            self._next[id(self._prev_pre)] = u
        self._prev_pre = u
        nxt = self._next.get(id(u))
        if nxt is None or nxt is u or not nxt.reshard or id(nxt) in self._ready:
            return
        full, frozen = self._vectors(nxt)
        self._ready[id(nxt)] = (full, frozen, self._ahead(lambda: self._fill(nxt, full, frozen, "prefetch")))
        self.prefetch_stats["prefetched"] += 1

    def _fill(self, u: FlatUnit, full: torch.Tensor | None, frozen: torch.Tensor | None, kind: str = "gather") -> None:
        """Gather every owner's shards of ``u`` into ``full`` / ``frozen`` (whole padded vectors);
        timed for the comm hook as ``kind`` (``prefetch``: ahead, beside the compute)."""
        p = self._protocol
        if not p.in_minibatch:
            with traced("ODC::gather"):
                p.check_usable()
                # Outside a minibatch (evaluation) the exposures may be stale: a collective.
                for dst, src in ((full, u.shard), (frozen, u.frozen_shard)):
                    if dst is not None:
                        all_gather_single(dst, src.detach().to(u.param_dtype), group=self.shard_group)
            return
        with comm_span(p.on_comm, kind), traced("ODC::gather"):
            p.before_gather()
            rows = full.view(self.shard_size, u.shard_numel) if full is not None else None
            frozen_rows = frozen.view(self.shard_size, u.frozen_shard_numel) if frozen is not None else None
            for q in range(self.shard_size):
                src = p.params_view(q, u)
                if rows is not None:
                    rows[q].copy_(src[: u.shard_numel])
                if frozen_rows is not None:
                    frozen_rows[q].copy_(src[u.shard_numel :])
            p.stats["gathers"] += 1
            p.stats["gather_bytes"] += u.gather_bytes * self.shard_size

    def _make_pre_forward(self, u: FlatUnit):
        cast_inputs = self.mp_policy.cast_forward_inputs and u.param_dtype != u.master_dtype

        def pre_forward(module, args, kwargs):
            # an activation checkpoint's recomputation (a unit inside a checkpointed region): its
            # gather is its own, and it teaches the prefetch nothing about the forward's order
            recompute = in_backward()
            ready = None if recompute else self._ready.pop(id(u), None)
            if ready is not None:  # gathered ahead (constant exposures: still this minibatch's)
                full, frozen, event = ready
                self._wait(event)
            else:
                full, frozen = self._vectors(u)
                self._fill(u, full, frozen)
            if self._prefetch and self._protocol.in_minibatch and not recompute:
                if u.module is self.model:  # a forward of the whole model begins: backward's chain too
                    self._last_refill = None
                    self._prev_pre = None
                self._prefetch_after(u)
            views: list[torch.Tensor] = []
            if full is not None:
                if torch.is_grad_enabled():
                    full.requires_grad_()
                    full.register_post_accumulate_grad_hook(self._make_push(u))
                views += full.split([*u.sizes[: u.num_trainable], full.numel() - u.numel])[:-1]  # not the padding
            if frozen is not None:
                views += frozen.split([*u.sizes[u.num_trainable :], frozen.numel() - u.frozen_numel])[:-1]
            u.full, u.frozen_full = full, frozen
            views = [v.view(p.shape) for v, p in zip(views, u.params)]
            if full is not None and full.requires_grad and self._protocol.in_minibatch and not recompute:
                # (a recomputation's weights give the saved tensors; gradients go to the first forward's)
                self._gathered[id(full)] = (u, full, views[: u.num_trainable])
            for m, attr, i in u.slots:
                m.__dict__[attr] = views[i]
            changed = False
            if cast_inputs:
                args, kwargs = tree_map_only(
                    torch.Tensor, lambda t: t.to(u.param_dtype) if t.is_floating_point() else t, (args, kwargs))
                changed = True
            if frozen is not None and u.reshard and torch.is_grad_enabled():
                # Free the frozen vector when the gradients of the unit's inputs are computed: its
                # backward is done then (FSDP2 reshards at the same point).
                flat, spec = tree_flatten((args, kwargs))
                idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
                if idx:
                    wrapped = _AfterBackward.apply(lambda: frozen.untyped_storage().resize_(0), *[flat[i] for i in idx])
                    for i, t in zip(idx, wrapped):
                        flat[i] = t
                    args, kwargs = tree_unflatten(flat, spec)
                    changed = True
            return (args, kwargs) if changed else None

        return pre_forward

    def _make_post_forward(self, u: FlatUnit):
        output_dtype = self.mp_policy.output_dtype if u.module is self.model else None

        def post_forward(module, args, output):
            if output_dtype is not None:
                output = tree_map_only(torch.Tensor, lambda t: t.to(output_dtype) if t.is_floating_point() else t,
                                       output)
            if not u.reshard or in_backward():
                # (a recomputation inside backward: its saved tensors read these weights right away;
                # they go with the recomputed graph)
                return output
            full, frozen = u.full, u.frozen_full
            refill = _Refill(self, u, full, frozen)
            for t in (full, frozen):
                if t is not None:
                    t.untyped_storage().resize_(0)
            if self._prefetch and self._protocol.in_minibatch and torch.is_grad_enabled():
                refill.before, self._last_refill = self._last_refill, refill
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(refill)
            return output

        return post_forward

    def _make_push(self, u: FlatUnit):
        def push(full: torch.Tensor) -> None:
            p = self._protocol
            p.check_in_minibatch_for_backward()
            with comm_span(p.on_comm, "reduce"), traced("ODC::scatter_accumulate"):
                p.push_rows(u, full.grad.view(self.shard_size, u.shard_numel))
                self._gathered.pop(id(full), None)
                full.grad = None
                full.untyped_storage().resize_(0)

        return push
