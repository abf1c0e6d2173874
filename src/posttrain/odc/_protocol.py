"""The ODC minibatch protocol, shared by both ODC engines (on FSDP2 and flat).

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

An engine owns the parameters and decides what is exposed and where gradients go; it gives
:class:`MinibatchProtocol` its layouts (what each unit occupies in the shm regions, see
[Note: ODC layouts] in ``_comm.py``) and an :class:`EngineSteps` with the four engine-specific
steps. The protocol owns the transport, the barriers, push accounting, failure and closing.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.profiler import record_function

from posttrain._compat import profiler_enabled
from posttrain.device import add_into

from ._cuda import DeviceTransport
from ._transport import ShmTransport
from .config import ODCConfig

logger = logging.getLogger(__name__)

__all__ = ["EngineSteps", "Layout", "Minibatch", "MinibatchProtocol", "traced"]

_TAG_ENTER, _TAG_EXIT, _TAG_GATHER, _TAG_REDUCE = 1, 2, 3, 4
_TOKENS_SLOT, _PUSHES_SLOT = 0, 1
_UNTRACED = nullcontext()


def traced(name: str) -> AbstractContextManager:
    """``record_function(name)`` while a torch profiler records, else a no-op: the label costs
    time on every use even with no profiler, and the engines use it on every gather and push."""
    return record_function(name) if profiler_enabled() else _UNTRACED


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


class Layout(Protocol):
    """What the protocol needs of one unit's place in the shm regions."""

    name: str
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    params_offset: int
    grads_offset: int

    @property
    def gather_bytes(self) -> int: ...

    @property
    def reduce_bytes(self) -> int: ...


class EngineSteps(Protocol):
    """The engine-specific steps of the protocol."""

    def expose(self) -> None:
        """Write this rank's fresh parameter shards into its ``params`` region."""

    def release(self) -> None:
        """Free what the minibatch left gathered."""

    def clear_grads(self) -> None:
        """No rank ran a backward: set the shards' gradients to ``None``."""

    def write_grads(self, reduced: Callable[[Layout], torch.Tensor]) -> None:
        """Set the shards' ``.grad`` from ``reduced(layout)``: this owner's summed gradient of
        that unit (flat, reduce dtype, already divided by ``grad_divide_factor``'s caller)."""


class MinibatchProtocol:
    """Transport, barriers and push accounting of one ODC engine. See [Note: ODC minibatch protocol].

    Args:
        config: the :class:`ODCConfig`.
        shard_group: ranks that shard the parameters (all on this host).
        replicate_group: HSDP replicas (``None``: plain FSDP sharding).
        layouts: every unit's layout; their offsets are assigned here.
        steps: the engine's steps.
        param_ids: ``id`` of every tensor the optimizer steps (to refuse a step inside a minibatch).
        device: where the parameters live: the CPU (shared memory, :class:`ShmTransport`) or a GPU
            (:class:`~posttrain.odc._cuda.DeviceTransport`, [Note: the device transport]).
    """

    def __init__(
        self,
        config: ODCConfig,
        *,
        shard_group: dist.ProcessGroup,
        replicate_group: dist.ProcessGroup | None,
        layouts: Sequence[Layout],
        steps: EngineSteps,
        param_ids: set[int],
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.layouts = list(layouts)
        self._steps = steps
        self._param_ids = param_ids
        self.rank = dist.get_rank(shard_group)
        self.shard_size = dist.get_world_size(shard_group)
        self.shard_ranks = dist.get_process_group_ranks(shard_group)
        self._in_minibatch = False
        self._broken: str | None = None
        self._closed = False
        self._minibatch_index = -1
        self._pushes = 0
        self._views: dict[tuple[str, int, int], torch.Tensor] = {}  # _view's, until close
        self.stats = {"gathers": 0, "regrouped_gathers": 0, "pushes": 0, "gather_bytes": 0, "push_bytes": 0}
        #: Called as ``on_comm(kind, start, end)`` (``kind`` "gather" or "reduce", times from
        #: ``time.perf_counter``) after every gather and scatter-accumulate inside a minibatch.
        self.on_comm: Callable[[str, float, float], None] | None = None

        params_bytes = grads_bytes = 0
        for lay in self.layouts:
            lay.params_offset = params_bytes
            params_bytes += -(-lay.gather_bytes // 64) * 64
            lay.grads_offset = grads_bytes
            grads_bytes += -(-lay.reduce_bytes // 64) * 64
        self.params_bytes = params_bytes
        self.grads_bytes = grads_bytes
        slots = self.shard_size if config.deterministic else 1
        self.device = torch.device(device)
        regions = {"params": params_bytes, "grads": grads_bytes * slots}
        if self.device.type == "cpu":
            self.transport = ShmTransport.create(shard_group, regions, timeout_s=config.timeout_s)
        else:
            self.transport = DeviceTransport.create(shard_group, regions, device=self.device, timeout_s=config.timeout_s,
                                                    accumulate=config.device_accumulate)
        self._step_hook = register_optimizer_step_pre_hook(self._check_step)
        logger.info(
            "[rank %d] ODC on %d units, shard size %d%s: %.1f MiB params, %.1f MiB grads exposed",
            dist.get_rank(), len(self.layouts), self.shard_size, " (HSDP)" if replicate_group is not None else "",
            params_bytes / 2**20, grads_bytes * slots / 2**20,
        )

    # ----------------------------------------------------------------- state
    @property
    def in_minibatch(self) -> bool:
        return self._in_minibatch

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> str | None:
        """Why this handle is unusable, or ``None``."""
        return self._broken

    def failed_peer(self) -> str | None:
        """What a peer that failed says (see :meth:`ShmTransport.failed_peer`), else ``None``."""
        return None if self._closed else self.transport.failed_peer()

    def check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this ODC handle is closed")
        if self._broken:
            raise RuntimeError(f"this ODC handle is unusable after an earlier failure: {self._broken}")

    def check_in_minibatch_for_backward(self) -> None:
        if not self._in_minibatch:
            self.check_usable()
            raise RuntimeError(
                "backward ran outside `with odc.minibatch():`; ODC accumulates gradients only "
                "inside a minibatch (enter it before the first forward whose loss you backward)"
            )

    # ------------------------------------------------------------ the protocol
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
            self.fail(f"minibatch {info.index} raised {type(exc).__name__}: {exc}")
            raise
        try:
            self._exit()
        except BaseException as exc:
            self.fail(f"sync of minibatch {info.index} failed: {type(exc).__name__}: {exc}")
            raise

    def _enter(self, num_tokens: int | None) -> Minibatch:
        self.check_usable()
        if self._in_minibatch:
            raise RuntimeError("odc.minibatch() is already active on this rank; minibatches do not nest")
        if num_tokens is not None and (not isinstance(num_tokens, int) or num_tokens < 0):
            raise ValueError(f"num_tokens={num_tokens!r} must be a non-negative int")
        with traced("ODC::minibatch_enter"):
            self._minibatch_index += 1
            t = self.transport
            with torch.no_grad():
                self._steps.expose()
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
        with traced("ODC::minibatch_sync"):
            collect = getattr(self._steps, "collect_local", None)
            if collect is not None:  # gradients the engine keeps itself (ODC on FSDP2 over one rank)
                with torch.no_grad():
                    collect()
            t.set_value(_PUSHES_SLOT, self._pushes)
            t.barrier(_TAG_EXIT)  # every push of every rank has landed
            self._in_minibatch = False
            self._steps.release()
            total_pushes = sum(t.values(_PUSHES_SLOT))
            if self.replicate_group is not None:
                count = torch.tensor([total_pushes], dtype=torch.int64)
                dist.all_reduce(count, group=self.replicate_group)
                total_pushes = int(count.item())
            if total_pushes == 0:
                warnings.warn(
                    "no rank ran a backward in this minibatch; gradients are set to None "
                    "and optimizer.step() will skip these parameters",
                    stacklevel=5,
                )
                self._steps.clear_grads()
                return
            with torch.no_grad():
                acc = self._reduced_accumulator()
                factor = self.config.grad_divide_factor

                def reduced(lay: Layout) -> torch.Tensor:
                    g = acc[lay.grads_offset : lay.grads_offset + lay.reduce_bytes].view(lay.reduce_dtype)
                    return g.div(factor) if factor != 1.0 else g

                self._steps.write_grads(reduced)

    def _reduced_accumulator(self) -> torch.Tensor:
        """This owner's summed accumulator (bytes), all-reduced across replicas under HSDP."""
        grads = self.transport.region(self.rank, "grads", torch.uint8)
        if self.config.deterministic:
            slots = grads.view(self.shard_size, self.grads_bytes)
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
                dist.all_reduce(acc[: self.grads_bytes].view(dtypes.pop()), group=self.replicate_group)
            else:
                for lay in self.layouts:
                    a, b = lay.grads_offset, lay.grads_offset + lay.reduce_bytes
                    dist.all_reduce(acc[a:b].view(lay.reduce_dtype), group=self.replicate_group)
        return acc

    # ------------------------------------------------------- one-sided operations
    def params_view(self, rank: int, lay: Layout) -> torch.Tensor:
        """Shard-group rank ``rank``'s exposed parameters of ``lay`` (flat, param dtype)."""
        return self._view("params", rank, lay)

    def _view(self, region: str, rank: int, lay: Layout) -> torch.Tensor:
        """``lay``'s part of ``rank``'s ``params`` (param dtype) or ``grads`` (its accumulator,
        reduce dtype) region: made once, kept until :meth:`close`."""
        key = (region, rank, id(lay))
        view = self._views.get(key)
        if view is None:
            start, nbytes, dtype = ((lay.params_offset, lay.gather_bytes, lay.param_dtype) if region == "params"
                                    else (lay.grads_offset, lay.reduce_bytes, lay.reduce_dtype))
            whole = self.transport.region(rank, region, torch.uint8)
            view = self._views[key] = whole[start : start + nbytes].view(dtype)
        return view

    def before_gather(self) -> None:
        """Collective mode: the rendezvous a per-layer all-gather would be."""
        if self.config.mode == "collective":
            self.transport.barrier(_TAG_GATHER)

    def push_rows(self, lay: Layout, rows: torch.Tensor) -> None:
        """Add row ``p`` of a local gradient into owner ``p``'s accumulator, for every ``p``.

        ``rows`` is ``(shard_size, reduce_bytes / itemsize)``; a row of another dtype than the
        reduce dtype is converted by the add (bf16 gradients into fp32 accumulators).
        """
        t = self.transport
        a, b = lay.grads_offset, lay.grads_offset + lay.reduce_bytes
        for i in range(self.shard_size):
            owner = (self.rank + 1 + i) % self.shard_size
            if self.config.deterministic:
                grads = t.region(owner, "grads", torch.uint8)
                slot = grads.view(self.shard_size, self.grads_bytes)[self.rank, a:b]
                add_into(slot.view(lay.reduce_dtype), rows[owner])  # (on the owner's GPU where that is another)
            else:
                t.accumulate(self._view("grads", owner, lay), rows[owner], owner=owner, byte_offset=a)
        self._pushes += 1
        self.stats["pushes"] += 1
        self.stats["push_bytes"] += rows.numel() * rows.element_size()
        if self.config.mode == "collective":
            t.barrier(_TAG_REDUCE)

    # ---------------------------------------------------------------- failure
    def _check_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if not self._in_minibatch:
            return
        if any(id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"]):
            raise RuntimeError(
                "optimizer.step() inside odc.minibatch(): gradients are complete only after the "
                "`with odc.minibatch():` block exits; step after it"
            )

    def fail(self, message: str) -> None:
        """Mark this handle unusable and tell peers, whose barriers then fail fast."""
        self._in_minibatch = False
        if self._broken is None:
            self._broken = message
        if not self._closed:
            self.transport.abort(message)

    def close(self) -> None:
        """Free the shared buffers and the optimizer hook. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._in_minibatch = False
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self._views.clear()  # they map the segments, which close() unmaps
        self.transport.close()
