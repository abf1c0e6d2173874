"""ODC's transport in GPU memory: the shm transport's interface with regions in device memory.

[Note: the device transport]
:class:`DeviceTransport` has the interface of :class:`~posttrain.odc.ShmTransport` (named
regions per rank, views of a peer's region, accumulate into a peer's region, barrier, published
values, abort, dead-peer detection, close) for ranks of one host whose parameters live on a GPU:

- Data plane: one device allocation per rank holds its regions (laid out by
  :func:`region_offsets`, as in a shm segment). At creation each rank shares its allocation by
  CUDA IPC through torch's multiprocessing reductions, one handle per peer
  (:func:`torch.multiprocessing.reductions.reduce_tensor`: torch counts one consumer per handle,
  and the producer keeps the memory while consumers hold it); the handles travel in one
  ``all_gather_object`` over the group (gloo: objects stay on the CPU). A peer's region is then
  a tensor view into the peer's memory: a gather is a ``copy_`` from it, an accumulate an add
  into it. CUDA IPC serves processes on one GPU too, which torch's symmetric memory does not (its
  CUDA backend refuses two ranks on one device, and the verification machine has one GPU);
  symmetric memory is the path for multi-node runs later, with the same view arithmetic.
- Ranks on different GPUs of the host: a handle names its GPU by the producer's index, which the
  consumer maps to its own numbering through the GPUs' UUIDs (:func:`open_handle`), so the view is
  opened on the GPU that holds the memory (no peer access needed to map it). A gather is then a
  device-to-device copy (over NVLink where the GPUs are peers); an add into a peer's memory runs
  on the peer's GPU, launched by the writer after it copied its contribution there
  (:func:`posttrain.device.add_into`; the atomic kernel likewise). Every device a rank launched work
  on is synchronized before it announces a barrier.
- Accumulate: concurrent writers into one accumulator race, as on the host. ``"atomic"`` adds
  with device atomics (a Triton ``atomic_add`` kernel for fp32 accumulators where Triton is
  installed, else ``index_add_``, which uses atomics on CUDA); ``"locked"`` takes the shm
  transport's stripe locks and waits for the add to finish before releasing them. Deterministic
  mode (one slot per writer, summed by the owner) needs neither and is the protocol's.
- Control plane: the shm transport with no regions (its header: barrier generations, published
  values, abort message, pids), so barriers, abort and dead-peer detection are the host's. Before
  a rank announces a barrier it waits for its device (every stream): every gather and push it
  issued has landed before a peer can read or zero that memory.

Closing drops the peer views first, then this rank's allocation (torch keeps a shared block
alive until every consumer released it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Mapping
from typing import Literal

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from posttrain.device import add_into, current, physical_id, staged, visible_index

from ._transport import ShmTransport, region_offsets

logger = logging.getLogger(__name__)

__all__ = ["ACCUMULATE", "DeviceTransport", "accumulate_atomic", "check_visible", "open_handle", "region_offsets",
           "triton_available"]

#: How :meth:`DeviceTransport.accumulate` makes concurrent adds race-free.
ACCUMULATE = ("atomic", "locked")
_ALIGN = 256  # device allocations and region starts: enough for any dtype and vector loads
_INDEX_CHUNK = 1 << 20
_TRITON_CHUNK = 1 << 30  # elements per kernel launch (its offsets are 32-bit)
_CREATED = 200  # the control plane's barrier tag at creation (the protocol's are small numbers)


@functools.cache
def _arange(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)


@functools.cache
def _triton_kernel():
    """The Triton atomic-add kernel, or ``None`` where Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def atomic_add(dst, src, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        value = tl.load(src + offs, mask=mask).to(tl.float32)
        tl.atomic_add(dst + offs, value, mask=mask, sem="relaxed")

    def launch(dst: torch.Tensor, src: torch.Tensor) -> None:
        block = 1024
        with current(dst.device):  # the kernel runs on the accumulator's device
            for a in range(0, dst.numel(), _TRITON_CHUNK):
                d, s_ = dst[a : a + _TRITON_CHUNK], src[a : a + _TRITON_CHUNK]
                atomic_add[(triton.cdiv(d.numel(), block),)](d, s_, d.numel(), BLOCK=block)

    return launch


def triton_available() -> bool:
    """Whether the Triton atomic-add kernel can be built here (Triton installed)."""
    return _triton_kernel() is not None


def accumulate_atomic(dst: torch.Tensor, src: torch.Tensor, *, kernel: str = "auto") -> None:
    """``dst += src`` (flat, same length; ``src`` converted to ``dst``'s dtype) with atomic adds,
    so concurrent writers into ``dst`` lose nothing.

    Args:
        kernel: ``"triton"`` (fp32 ``dst`` on a GPU with Triton), ``"index_add"`` (any device;
            atomics on CUDA; on the CPU correct for one writer at a time only), or ``"auto"``
            (Triton where it applies).
    """
    if dst.shape != src.shape or dst.dim() != 1:
        raise AssertionError(f"accumulate_atomic takes flat tensors of one length, got {tuple(dst.shape)} and "
                             f"{tuple(src.shape)}")
    if dst.numel() == 0:
        return
    usable = dst.device.type == "cuda" and dst.dtype == torch.float32 and dst.is_contiguous()
    launch = _triton_kernel() if usable else None
    if kernel == "triton" and launch is None:
        raise RuntimeError("the Triton atomic-add kernel needs Triton and a contiguous fp32 accumulator on a CUDA device")
    if kernel in ("auto", "triton") and launch is not None:
        launch(dst, src.contiguous())
        return
    if dst.device.type != "cpu" and torch.are_deterministic_algorithms_enabled():
        raise RuntimeError("under torch.use_deterministic_algorithms, index_add_ on a GPU does not use atomics and "
                           "concurrent writers would lose updates: use ODC's deterministic mode (per-writer slots)")
    src = src.to(dst.dtype)
    for a in range(0, dst.numel(), _INDEX_CHUNK):
        b = min(a + _INDEX_CHUNK, dst.numel())
        dst[a:b].index_add_(0, _arange(b - a, dst.device), src[a:b])


def check_visible(ids: list[str], indices: list[int | None], ranks: list[int]) -> None:
    """Refuse, in one line, peers whose GPU this process cannot see (``indices[i]`` ``None``: a
    launcher that gave each rank its own ``CUDA_VISIBLE_DEVICES``): a peer's memory is mapped on
    the GPU that holds it, so every rank must see every GPU of its shard group."""
    hidden = [f"rank {r} ({i})" for r, i, x in zip(ranks, ids, indices) if x is None]
    if hidden:
        raise ValueError(f"ODC's device transport maps each peer's GPU memory on that GPU, and this rank cannot see "
                         f"the GPU of {', '.join(hidden)}: make every GPU of the node visible to every rank (one "
                         "CUDA_VISIBLE_DEVICES for all; each rank still uses its own GPU)")


def open_handle(handle: tuple, device_index: int) -> torch.Tensor:
    """The tensor a :func:`~torch.multiprocessing.reductions.reduce_tensor` handle shares, opened on
    this process's device ``device_index`` (the GPU that holds it, in this process's numbering:
    the handle carries the producer's)."""
    rebuild, args = handle
    return rebuild(*args[:6], device_index, *args[7:])


class DeviceTransport:
    """One device allocation per rank of ``group``, viewed by every rank of the group. See
    [Note: the device transport]. Create with :meth:`create` (a collective); free with
    :meth:`close`."""

    def __init__(self) -> None:  # use create()
        raise TypeError("use DeviceTransport.create(group, regions, device=...)")

    @classmethod
    def create(
        cls,
        group: dist.ProcessGroup,
        regions: Mapping[str, int],
        *,
        device: torch.device,
        timeout_s: float = 1800.0,
        accumulate: Literal["atomic", "locked"] = "atomic",
    ) -> DeviceTransport:
        if accumulate not in ACCUMULATE:
            raise ValueError(f"accumulate={accumulate!r} is not one of {', '.join(ACCUMULATE)}")
        device = torch.device(device)
        if device.type == "cpu":
            raise ValueError("the device transport shares accelerator memory; on the CPU ODC uses ShmTransport")
        self = object.__new__(cls)
        self._control = ShmTransport.create(group, {}, timeout_s=timeout_s)
        self.group = group
        self.rank = self._control.rank
        self.world_size = self._control.world_size
        self.global_ranks = self._control.global_ranks
        self.device = device
        self.accumulate_mode = accumulate
        self._closed = False
        self._buffers: list[torch.Tensor] = []
        self._devices = [device]
        try:
            self._regions, self.segment_bytes = region_offsets(regions)
            own = torch.zeros(max(self.segment_bytes, _ALIGN), dtype=torch.uint8, device=device)
            # One handle per peer: torch counts each handle's consumers as one (a handle opened by
            # two peers would be released twice).
            handles = [None if r == self.rank else reduce_tensor(own) for r in range(self.world_size)]
            everyone: list = [None] * self.world_size
            dist.all_gather_object(everyone, (physical_id(device), sorted(self._regions.items()), handles), group=group)
            ids = [e[0] for e in everyone]
            indices = [visible_index(i) for i in ids]
            check_visible(ids, indices, self.global_ranks)
            if len({repr(e[1]) for e in everyone}) != 1:
                raise AssertionError(f"ranks disagree on the device region layout: {[e[1] for e in everyone]}")
            try:
                self._buffers = [own if r == self.rank else open_handle(everyone[r][2][self.rank], indices[r])
                                 for r in range(self.world_size)]
            except BaseException as exc:  # peers wait at the barrier below: tell them
                self._control.abort(f"could not open a peer's GPU memory by CUDA IPC: {type(exc).__name__}: {exc}")
                raise
            # every device this rank may launch work on: its own and its peers' (adds run where the memory is)
            self._devices = sorted({b.device for b in self._buffers}, key=lambda d: d.index)
            self._control.barrier(_CREATED)  # every rank opened every peer's allocation (or one failed: raises)
        except BaseException:
            self.close()
            raise
        logger.debug("rank %d: %d device regions of %d bytes shared by CUDA IPC", self.rank, self.world_size,
                     self.segment_bytes)
        return self

    # ------------------------------------------------------------------ views
    def region(self, rank: int, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The whole region ``name`` of ``rank``'s allocation as a flat device tensor of ``dtype``
        (a view into the peer's memory for another rank)."""
        start, nbytes = self._regions[name]
        if nbytes % dtype.itemsize:
            raise AssertionError(f"region {name!r} of {nbytes} bytes is not a multiple of {dtype}")
        return self._buffers[rank][start : start + nbytes].view(dtype)

    # ------------------------------------------------------------- operations
    def accumulate(self, dst: torch.Tensor, src: torch.Tensor, *, owner: int, byte_offset: int) -> None:
        """``dst += src`` into ``owner``'s region, race-free against other writers: device atomics,
        or the control plane's stripe locks held until the add has finished. The add runs on the
        GPU that holds ``dst`` (``src`` copied there first when it is another)."""
        if dst.numel() == 0:
            return
        if self.accumulate_mode == "atomic":
            accumulate_atomic(dst, staged(src, dst.device))
            return
        stream = torch.accelerator.current_stream(dst.device)

        def add(a: torch.Tensor, b: torch.Tensor) -> None:
            add_into(a, b)
            stream.synchronize()

        self._control.locked_apply(dst, src, owner=owner, byte_offset=byte_offset, apply=add)

    def set_value(self, slot: int, value: int) -> None:
        self._control.set_value(slot, value)

    def values(self, slot: int) -> list[int]:
        return self._control.values(slot)

    def barrier(self, tag: int) -> None:
        """The control plane's barrier, after this rank's queued device work has finished."""
        if self._closed:
            raise RuntimeError("the ODC transport is closed")
        for d in self._devices:  # every stream: pushes may run on a side stream's backward
            torch.accelerator.synchronize(d)
        self._control.barrier(tag)

    def abort(self, message: str) -> None:
        self._control.abort(message)

    def failed_peer(self) -> str | None:
        return self._control.failed_peer()

    def close(self) -> None:
        """Drop the peers' views, then this rank's allocation, and close the control plane.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            for d in self._devices:
                torch.accelerator.synchronize(d)
        own = self._buffers[self.rank] if len(self._buffers) > self.rank else None
        self._buffers = []
        del own
        self._control.close()
