"""The ODC handle: buffers, the minibatch protocol and the gradient sync.

[Note: ODC minibatch protocol]
1. Enter: each rank writes its fresh parameter shards into its ``params`` region, zeroes its
   accumulator, publishes its token count, and waits at the *enter* barrier (shard group, shm).
2. Inside: every gather reads peers' ``params``; every backward adds into owners' accumulators.
   No rank waits for another; ranks may run any number of microbatches, zero included.
3. Exit: each rank publishes how many backward pushes it made and waits at the *exit*
   barrier; pushes are synchronous, so after it every push of every rank has landed. Each owner
   turns its accumulator into its shards' ``.grad`` (HSDP: after one all-reduce across replicas).
The only torch collectives inside a minibatch are the HSDP all-reduces at exit (and one tiny
all-reduce of token counts at entry under HSDP when ``num_tokens`` is given).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.profiler import record_function

from . import _compat
from ._api import ODCConfig
from ._comm import ModuleLayout, ODCAllGather, ODCReduceScatter, regroup_gather
from ._transport import ShmTransport

logger = logging.getLogger(__name__)

_TAG_ENTER, _TAG_EXIT, _TAG_GATHER, _TAG_REDUCE = 1, 2, 3, 4
_TOKENS_SLOT, _PUSHES_SLOT = 0, 1


@dataclass(frozen=True)
class Minibatch:
    """What a rank knows inside ``with odc.minibatch() as mb``.

    Attributes:
        index: 0-based count of minibatches entered on this handle.
        global_tokens: the sum of ``num_tokens`` over every data-parallel rank (shard and
            replicate), or ``None`` if ``num_tokens`` was not given. Scale each microbatch's
            summed token loss by ``1 / global_tokens`` and the gradient is the mean token loss
            of the whole minibatch however sequences were spread over ranks and microbatches.
    """

    index: int
    global_tokens: int | None


class ODC:
    """ODC on one model; create with :func:`posttrain.odc.enable`. See [Note: ODC minibatch protocol]."""

    def __init__(self, model: nn.Module, config: ODCConfig) -> None:
        self._init_protocol(config)
        self.layouts = self._build_layouts(model)
        first = self.layouts[0].params[0].param
        self.shard_group, self.replicate_group = self._groups(first)
        self._init_group()
        self._param_ids = {id(p.param) for lay in self.layouts for p in lay.params}

        params_bytes = self._place_layouts()
        slots = self.shard_size if config.deterministic else 1
        self.transport = ShmTransport.create(
            self.shard_group,
            {"params": params_bytes, "grads": self._grads_bytes * slots},
            timeout_s=config.timeout_s,
        )
        try:
            for lay in self.layouts:
                mod = lay.module
                mod.set_custom_all_gather(ODCAllGather(self, lay))
                mod.set_custom_reduce_scatter(ODCReduceScatter(self, lay))
                # ODC sums raw gradients and divides once at the sync.
                mod.set_gradient_divide_factor(1.0)
                # Every trainable parameter appears in every push, used or not: fixed layout.
                mod.set_reduce_scatter_unused_params(True, recurse=False)
                if self.replicate_group is not None:
                    mod.set_requires_all_reduce(False, recurse=False)
            self._step_hook = register_optimizer_step_pre_hook(self._check_step)
        except BaseException:
            self.transport.close()
            raise
        logger.info(
            "[rank %d] ODC on %d FSDP modules, shard size %d%s: %.1f MiB params, %.1f MiB grads exposed",
            dist.get_rank(), len(self.layouts), self.shard_size,
            " (HSDP)" if self.replicate_group is not None else "",
            params_bytes / 2**20, self._grads_bytes * slots / 2**20,
        )

    # ------------------------------------------------------------------ setup
    def _init_protocol(self, config: ODCConfig) -> None:
        """State of the minibatch protocol, shared by both engines."""
        _compat.check_torch_version()
        self.config = config
        self._in_minibatch = False
        self._broken: str | None = None
        self._closed = False
        self._minibatch_index = -1
        self._pushes = 0
        self._step_hook = None
        self.stats = {"gathers": 0, "regrouped_gathers": 0, "pushes": 0, "gather_bytes": 0, "push_bytes": 0}
        #: Called as ``on_comm(kind, start, end)`` (``kind`` "gather" or "reduce", times from
        #: ``time.perf_counter``) after every gather and scatter-accumulate FSDP2 asks for;
        #: the training loop uses it for wait-time accounting and timelines.
        self.on_comm: Callable[[str, float, float], None] | None = None


    def _place_layouts(self) -> int:
        """Give every layout its 64-byte aligned offsets in the regions; the ``params`` region's size."""
        params_bytes = grads_bytes = 0
        for lay in self.layouts:
            lay.params_offset = params_bytes
            params_bytes += -(-lay.gather_bytes // 64) * 64
            lay.grads_offset = grads_bytes
            grads_bytes += -(-lay.reduce_bytes // 64) * 64
        self._grads_bytes = grads_bytes
        return params_bytes

    def _init_group(self) -> None:
        self.rank = dist.get_rank(self.shard_group)
        self.shard_size = dist.get_world_size(self.shard_group)
        self._shard_ranks = dist.get_process_group_ranks(self.shard_group)
        self._group_kinds: dict[int, bool] = {}

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
                if p.device.type != "cpu":
                    raise ValueError(
                        f"parameter of {lay.name!r} is on {p.device}; the shared-memory ODC "
                        "transport serves CPU models only"
                    )
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
        return shard_group, replicate_group

    # ----------------------------------------------------------- the protocol
    @property
    def in_minibatch(self) -> bool:
        return self._in_minibatch

    @contextmanager
    def minibatch(self, *, num_tokens: int | None = None) -> Iterator[Minibatch]:
        """One optimizer step's worth of microbatches. See [Note: ODC minibatch protocol].

        Args:
            num_tokens: this rank's loss tokens in the minibatch; if given, every rank must give
                it and ``Minibatch.global_tokens`` is their sum.

        Raises:
            RuntimeError: nested use, a closed handle, or an earlier failure.
            posttrain.odc.PeerFailedError: a peer failed or timed out; this handle is then
                unusable and the job should stop.
        """
        info = self._enter(num_tokens)
        try:
            yield info
        except BaseException as exc:
            self._fail(f"minibatch {info.index} raised {type(exc).__name__}: {exc}")
            raise
        try:
            self._exit()
        except BaseException as exc:
            self._fail(f"sync of minibatch {info.index} failed: {type(exc).__name__}: {exc}")
            raise

    def _usable(self) -> None:
        if self._closed:
            raise RuntimeError("this ODC handle is closed")
        if self._broken:
            raise RuntimeError(f"this ODC handle is unusable after an earlier failure: {self._broken}")

    def _enter(self, num_tokens: int | None) -> Minibatch:
        self._usable()
        if self._in_minibatch:
            raise RuntimeError("odc.minibatch() is already active on this rank; minibatches do not nest")
        if num_tokens is not None and (not isinstance(num_tokens, int) or num_tokens < 0):
            raise ValueError(f"num_tokens={num_tokens!r} must be a non-negative int")
        with record_function("ODC::minibatch_enter"):
            self._minibatch_index += 1
            t = self.transport
            with torch.no_grad():
                self._expose()
                t.region(self.rank, "grads", torch.uint8).zero_()
            t.set_value(_TOKENS_SLOT, -1 if num_tokens is None else num_tokens)
            self._pushes = 0
            t.barrier(_TAG_ENTER)
            global_tokens = None
            values = t.values(_TOKENS_SLOT)
            if num_tokens is not None:
                if min(values) < 0:
                    raise ValueError("num_tokens must be given on every rank or on none")
                global_tokens = sum(values)
                if self.replicate_group is not None:
                    total = torch.tensor([global_tokens], dtype=torch.int64)
                    dist.all_reduce(total, group=self.replicate_group)
                    global_tokens = int(total.item())
            self._in_minibatch = True
        return Minibatch(self._minibatch_index, global_tokens)

    def _exit(self) -> None:
        t = self.transport
        with record_function("ODC::minibatch_sync"):
            t.set_value(_PUSHES_SLOT, self._pushes)
            t.barrier(_TAG_EXIT)  # every push of every rank has landed
            self._in_minibatch = False
            self._release()
            total_pushes = sum(t.values(_PUSHES_SLOT))
            if self.replicate_group is not None:
                count = torch.tensor([total_pushes], dtype=torch.int64)
                dist.all_reduce(count, group=self.replicate_group)
                total_pushes = int(count.item())
            if total_pushes == 0:
                warnings.warn(
                    "no rank ran a backward in this minibatch; gradients are set to None "
                    "and optimizer.step() will skip these parameters",
                    stacklevel=4,
                )
                self._clear_grads()
                return
            with torch.no_grad():
                self._write_grads()

    # Engine-specific steps of the protocol; FlatODC (``_flat.py``) overrides them.
    def _expose(self) -> None:
        """Write this rank's fresh parameter shards into its ``params`` region."""
        for lay in self.layouts:
            exposed, off = self._params_view(self.rank, lay), 0
            for p in lay.params:  # copy_ casts to the mixed-precision param dtype
                n = p.padded_data.numel()
                exposed[off : off + n].copy_(p.padded_data)
                off += n

    def _release(self) -> None:
        """Free what the minibatch left gathered."""
        for lay in self.layouts:
            lay.module.reshard()

    def _clear_grads(self) -> None:
        for lay in self.layouts:
            for info in lay.params:
                info.param.grad = None

    def _write_grads(self) -> None:
        acc = self._reduced_accumulator()
        factor = self.config.grad_divide_factor
        for lay in self.layouts:
            flat = acc[lay.grads_offset : lay.grads_offset + lay.reduce_bytes].view(lay.reduce_dtype)
            off = 0
            for info in lay.params:
                if not info.requires_grad:
                    continue
                p = info.param
                local_shape = p.to_local().shape
                n = local_shape.numel()
                g = flat[off : off + n].view(local_shape)
                off += info.padded_data.numel()
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dst = p.grad.to_local()
                dst.copy_(g)
                if factor != 1.0:
                    dst.div_(factor)

    def _reduced_accumulator(self) -> torch.Tensor:
        """This owner's summed accumulator (bytes), all-reduced across replicas under HSDP."""
        grads = self.transport.region(self.rank, "grads", torch.uint8)
        if self.config.deterministic:
            slots = grads.view(self.shard_size, self._grads_bytes)
            acc = slots[0].clone()
            for lay in self.layouts:
                a, b = lay.grads_offset, lay.grads_offset + lay.reduce_bytes
                total = acc[a:b].view(lay.reduce_dtype)
                for w in range(1, self.shard_size):
                    total.add_(slots[w, a:b].view(lay.reduce_dtype))
        else:
            acc = grads
        if self.replicate_group is not None:
            dtypes = {lay.reduce_dtype for lay in self.layouts}
            if len(dtypes) == 1:
                # One all-reduce for the whole accumulator (64-byte aligned, so any dtype views it).
                dist.all_reduce(acc[: self._grads_bytes].view(dtypes.pop()), group=self.replicate_group)
            else:
                for lay in self.layouts:
                    a, b = lay.grads_offset, lay.grads_offset + lay.reduce_bytes
                    dist.all_reduce(acc[a:b].view(lay.reduce_dtype), group=self.replicate_group)
        return acc

    # --------------------------------------------------- comms (called by FSDP2)
    def _params_view(self, rank: int, lay: ModuleLayout) -> torch.Tensor:
        region = self.transport.region(rank, "params", torch.uint8)
        return region[lay.params_offset : lay.params_offset + lay.gather_bytes].view(lay.param_dtype)

    def _is_shard_group(self, group: dist.ProcessGroup) -> bool:
        key = id(group)
        if key not in self._group_kinds:
            self._group_kinds[key] = dist.get_process_group_ranks(group) == self._shard_ranks
        return self._group_kinds[key]

    def _gather(self, lay: ModuleLayout, output: torch.Tensor, input: torch.Tensor, group) -> None:
        if not self._in_minibatch:
            self._usable()
            # Outside a minibatch (e.g. evaluation) a forward gathers like FSDP: a collective.
            return dist.all_gather_single(output, input, group=group)
        if self.config.mode == "collective":
            self.transport.barrier(_TAG_GATHER)
        if output.dtype != lay.param_dtype:
            raise AssertionError(f"ODC gather of {lay.name}: FSDP gathers {output.dtype}, ODC exposed {lay.param_dtype}")
        if self._is_shard_group(group):
            out = output.view(self.shard_size, -1)
            if not lay.checked:
                if out.shape[1] != lay.gather_numel or not torch.equal(input, self._params_view(self.rank, lay)):
                    raise AssertionError(
                        f"ODC's exposed shards of {lay.name} do not match FSDP2's all-gather input "
                        f"({out.shape[1]} vs {lay.gather_numel} elements); the FSDP2 internals read in "
                        "posttrain.odc._compat have changed"
                    )
                lay.checked = True
            for q in range(self.shard_size):
                if q != self.rank:
                    out[q].copy_(self._params_view(q, lay))
        else:
            # reshard_after_forward=int: FSDP2 re-gathers over a smaller post-forward group.
            exposures = [self._params_view(q, lay) for q in range(self.shard_size)]
            out = output.view(dist.get_world_size(group), -1)
            regroup_gather(out, lay, exposures, skip_slot=dist.get_rank(group))
            self.stats["regrouped_gathers"] += 1
        self.stats["gathers"] += 1
        self.stats["gather_bytes"] += output.numel() * output.element_size()
        return None

    def _scatter_accumulate(self, lay: ModuleLayout, output: torch.Tensor, input: torch.Tensor, group) -> None:
        if not self._in_minibatch:
            self._usable()
            raise RuntimeError(
                "backward ran outside `with odc.minibatch():`; ODC accumulates gradients only "
                "inside a minibatch (enter it before the first forward whose loss you backward)"
            )
        if not self._is_shard_group(group):
            raise AssertionError(f"ODC reduce of {lay.name} over an unexpected group {dist.get_process_group_ranks(group)}")
        rows = input.view(self.shard_size, -1)
        if rows.shape[1] != lay.reduce_numel or input.dtype != lay.reduce_dtype:
            raise AssertionError(
                f"ODC reduce of {lay.name}: FSDP2 pushes {rows.shape[1]} x {input.dtype}, "
                f"ODC expects {lay.reduce_numel} x {lay.reduce_dtype}"
            )
        self._push_rows(lay, rows)
        output.zero_()  # FSDP2 adds this into .grad; the real gradient is written at the sync
        self.stats["push_bytes"] += input.numel() * input.element_size()
        return None

    def _push_rows(self, lay: ModuleLayout, rows: torch.Tensor) -> None:
        """Add row ``p`` of a local gradient into owner ``p``'s accumulator, for every ``p``."""
        t = self.transport
        a, b = lay.grads_offset, lay.grads_offset + lay.reduce_bytes
        for i in range(self.shard_size):
            owner = (self.rank + 1 + i) % self.shard_size
            grads = t.region(owner, "grads", torch.uint8)
            if self.config.deterministic:
                slot = grads.view(self.shard_size, self._grads_bytes)[self.rank, a:b]
                slot.view(lay.reduce_dtype).add_(rows[owner])
            else:
                t.accumulate(grads[a:b].view(lay.reduce_dtype), rows[owner], owner=owner, byte_offset=a)
        self._pushes += 1
        self.stats["pushes"] += 1
        if self.config.mode == "collective":
            t.barrier(_TAG_REDUCE)

    # --------------------------------------------------------------- failure
    def _check_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if not self._in_minibatch:
            return
        if any(id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"]):
            raise RuntimeError(
                "optimizer.step() inside odc.minibatch(): gradients are complete only after the "
                "`with odc.minibatch():` block exits; step after it"
            )

    def _fail(self, message: str) -> None:
        self._in_minibatch = False
        if self._broken is None:
            self._broken = message
        if not self._closed:
            self.transport.abort(message)

    def close(self) -> None:
        """Free the shared buffers and remove ODC's hooks. Idempotent; the model must not be
        trained through this handle afterwards."""
        if self._closed:
            return
        self._closed = True
        self._in_minibatch = False
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self.transport.close()

    def __enter__(self) -> ODC:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and not self._closed and self._broken is None:
            self._fail(f"{type(exc).__name__}: {exc}")
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass
