"""Activation offload: move the tensors autograd saves for a (stage, microbatch) to host memory and back.

:class:`ActivationStore` is used by :class:`~posttrain.pipeline.PipelineRunner`; every forward of
a stage runs under ``store.hooks(stage, microbatch)``, a ``torch.autograd.graph.saved_tensors_hooks``
pair, and the runner calls :meth:`~ActivationStore.offload`, :meth:`~ActivationStore.reload` and
:meth:`~ActivationStore.release` where the lowered schedule says so.

[Note: saved-tensor lifecycle]
- *pack*: a parameter (or a view of one) and a tensor of at most ``min_numel`` elements pass
  through untouched. Any other tensor is recorded by its storage: the first tensor on a storage
  registers the whole storage with the (stage, microbatch) entry, and every later tensor on the
  same storage (a view: ``q, k, v`` split from one matmul, a transpose) is kept as an alias
  (dtype, size, stride, offset) into it, so shared memory moves once.
- *offload* (state device -> host): every storage of the entry is copied into host memory and
  the device copy is dropped. On CUDA the copy runs on a side stream into a pinned buffer taken
  from a :class:`HostPool`; the device memory is handed back when the copy's event has completed
  (checked without blocking), so the compute stream never waits. On CPU the "host store" is a
  buffer from the same pool (not pinned), copied synchronously: the same state machine and the
  same pool, so CPU tests exercise every transition and the pool's bounds.
- *reload* (host -> device): the copy back, again on the side stream on CUDA; the compute stream
  waits on its event only when the backward unpacks the first tensor of the entry.
- *unpack*: the saved tensor rebuilt as a view of the device storage. A backward that finds its
  entry still on the host (no reload scheduled) reloads it on the spot and counts it in
  :attr:`ActivationStore.late_reloads`: correct, but the schedule missed a prefetch.
- *split*: after ``I`` of a split backward, every storage that ``W`` will not read is freed
  (the runner finds them by walking ``W``'s part of the autograd graph); what is left can be
  offloaded and reloaded on its own (``OFFLOAD_W``/``RELOAD_W``) like a whole entry. With
  ``verify=True`` the dropped storages are kept aside on the device (and counted: they are
  resident) until the release, and a ``W`` that reads one is recorded
  (:meth:`ActivationStore.missed`) instead of failing: the runner checks a stage's first
  splits this way before trusting the walk.
- *release*: after the last backward pass that needs the entry (``B``, or ``W`` of a split
  backward), its memory is freed.

Accounting: :attr:`ActivationStore.resident` holds the device-resident bytes per stage, changed
at pack, offload completion, reload and release; :attr:`ActivationStore.history` records every
change as ``(seq, perf_counter time, stage, resident bytes of that stage)`` so runners can plot and compare curves;
:meth:`~ActivationStore.total_peak` is the peak of all stages together.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from posttrain.device import on_stream

__all__ = ["ActivationStore", "HostPool"]


class HostPool:
    """Host buffers for offloaded activations, reused across steps, with a bound on what it keeps.

    A pool that only reused a buffer of the exact byte size (as this one did before) pins new
    memory for nearly every offload once packed variable-length microbatches change the size of
    their saved tensors every step, and keeps all of it: a long run exhausts host memory, and each
    allocation (a page-locking system call) inflates the offload's measured cost. Instead a request
    is rounded up to a *size class* and handed out as a view narrowed to the bytes asked for, and a
    returned buffer is kept for reuse only while the free buffers together stay within
    ``max_cached_bytes``; beyond it the least recently returned are dropped.

    Size classes: for pinned memory the powers of two, because torch's pinned-memory allocator
    rounds every allocation up to one anyway (a finer class would save nothing) and keeps freed
    blocks in its own cache for the next allocation of that size, so a buffer this pool drops is
    reused there; for pageable memory (the CPU) quarter steps between powers of two (at most 25%
    larger than asked). :meth:`size_class` gives the rule.

    Bound: the pool holds what is in use (:attr:`live_bytes`, the size classes of the requests
    handed out) plus at most ``max_cached_bytes`` free; ``None`` (default) makes that the peak of
    :attr:`live_bytes` so far, so a steady run keeps about one step's worth, and allocations stop
    once the buffers kept cover a step (:attr:`allocations`; :meth:`take` picks the best fit).

    Args:
        pin: allocate page-locked memory (for asynchronous copies from an accelerator).
        max_cached_bytes: the most the free buffers may hold together (``None``: the peak in use).
    """

    _MIN_CLASS = 4096

    def __init__(self, *, pin: bool, max_cached_bytes: int | None = None) -> None:
        if max_cached_bytes is not None and max_cached_bytes < 0:
            raise ValueError(f"max_cached_bytes={max_cached_bytes} must be >= 0 (or None: the peak in use)")
        self.pin = pin
        self.max_cached_bytes = max_cached_bytes
        self.steps = 1 if pin else 4  # classes per doubling (see size_class)
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)  # size class -> buffers
        self._order: dict[int, torch.Tensor] = {}  # id -> free buffer, least recently returned first
        self.allocations = 0  #: buffers allocated since the pool began
        self.allocated_bytes = 0  #: their bytes (freed ones included)
        self.live_bytes = 0  #: bytes of the buffers handed out now
        self.cached_bytes = 0  #: bytes of the free buffers kept
        self.peak_live_bytes = 0

    def size_class(self, nbytes: int) -> int:
        """The buffer size a request of ``nbytes`` gets (at least 4 KiB): the next power of two
        for pinned memory; else the smallest of 2^k, 1.25, 1.5 and 1.75 x 2^k that holds it."""
        if nbytes <= self._MIN_CLASS:
            return self._MIN_CLASS
        below = (nbytes - 1).bit_length() - 1  # 2^below < nbytes <= 2^(below + 1)
        step = (1 << below) // self.steps
        return -(-nbytes // step) * step

    @property
    def held_bytes(self) -> int:
        """Everything the pool holds: in use and free."""
        return self.live_bytes + self.cached_bytes

    def take(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` buffer of ``nbytes`` (a view of a pooled buffer); give it back with :meth:`give`.

        The smallest free buffer that holds the request's size class serves it (best fit: a step
        whose sizes shift reuses the last step's buffers, which a fit of one class alone would
        not, with the bound then evicting and allocating again); none: a new buffer of the class."""
        size = self.size_class(nbytes)
        fit = next((c for c in sorted(self._free) if c >= size and self._free[c]), None)
        if fit is not None:
            buf = self._free[fit].pop()
            del self._order[id(buf)]
            self.cached_bytes -= fit
            size = fit
        else:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.allocations += 1
            self.allocated_bytes += size
        self.live_bytes += size
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        return buf[:nbytes]

    def give(self, view: torch.Tensor) -> None:
        """Return a buffer :meth:`take` handed out (the caller no longer reads or writes it; on an
        accelerator, any copy reading it is ordered before later copies on the same stream)."""
        buf = view if view._base is None else view._base
        size = buf.numel()
        self.live_bytes -= size
        self._free[size].append(buf)
        self._order[id(buf)] = buf
        self.cached_bytes += size
        cap = self.peak_live_bytes if self.max_cached_bytes is None else self.max_cached_bytes
        while self.cached_bytes > cap:
            old = self._order.pop(next(iter(self._order)))
            bucket = self._free[old.numel()]
            del bucket[next(i for i, b in enumerate(bucket) if b is old)]
            self.cached_bytes -= old.numel()


@dataclass
class _Entry:
    storages: dict[int, torch.Tensor] = field(default_factory=dict)  # key -> flat uint8 tensor (device or host)
    nbytes: int = 0
    state: str = "device"  # device | offloading | host | reloading
    event: object = None  # CUDA event of the copy in flight
    pending_free: list = field(default_factory=list)  # device tensors kept alive until a D2H copy finishes
    aside: dict[int, torch.Tensor] = field(default_factory=dict)  # dropped by a verifying split, held to release
    aside_bytes: int = 0
    missed: bool = False  # W read a storage the split dropped
    stay: dict[int, torch.Tensor] = field(default_factory=dict)  # kept on the device by a partial offload
    moved: int = 0  # bytes of ``storages`` a partial offload moved (all of ``nbytes`` but ``stay``'s)


@dataclass(frozen=True)
class _Saved:
    key: tuple[int, int]
    storage: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class ActivationStore:
    """Saved activations per (stage, microbatch), with offload to host and exact byte accounting.

    Args:
        params: the parameters of the stages this store serves (saved as-is, never moved).
        device: where compute runs; an accelerator (``cuda``) enables the side-stream, pinned-buffer path
            (torch's generic stream and event API: ``torch.Stream``, ``torch.Event``).
        min_numel: tensors with at most this many elements stay where they are.
        max_cached_bytes: what the host pool keeps of buffers not in use (see :class:`HostPool`).
    """

    def __init__(self, params, device: torch.device | str = "cpu", min_numel: int = 1024, *,
                 max_cached_bytes: int | None = None) -> None:
        self.device = torch.device(device)
        self.min_numel = min_numel
        # (a sharded DTensor parameter by its local shard)
        self._param_storages = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
                                for p in params}
        #: Optional ``is_weight(tensor)``: tensors it accepts are saved as-is like parameters
        #: (weights a data-parallel engine gathers into buffers of its own during forward).
        self.is_weight = None
        self._entries: dict[tuple[int, int], _Entry] = {}
        self.resident: dict[int, int] = defaultdict(int)
        self.packed: dict[tuple[int, int], int] = {}  # bytes registered per (stage, microbatch)
        self.kept: dict[tuple[int, int], int] = {}  # bytes a split kept for W per (stage, microbatch)
        self._recording: set | None = None
        self.history: list[tuple[int, float, int, int]] = []
        self.late_reloads = 0
        self.offloaded_bytes = 0
        self._seq = 0
        self._async = self.device.type != "cpu"  # an accelerator: copies on a side stream (generic stream API)
        self._stream = torch.Stream(self.device) if self._async else None
        #: host buffers (pinned on an accelerator), reused across steps within a bound
        self.pool = HostPool(pin=self._async, max_cached_bytes=max_cached_bytes)

    # -- accounting -------------------------------------------------------------------------

    def reset_stats(self) -> None:
        """Start a new measurement window (a step): history, packed sizes and counters; the
        entries held and their resident bytes stay."""
        if self._entries:
            raise RuntimeError(f"saved activations still held: {self.held()}")
        self.packed.clear()
        self.kept.clear()
        self.history.clear()
        self.late_reloads = 0
        self.offloaded_bytes = 0


    def _account(self, stage: int, delta: int) -> None:
        self.resident[stage] += delta
        self._seq += 1
        self.history.append((self._seq, time.perf_counter(), stage, self.resident[stage]))

    def peak(self, stage: int) -> int:
        """Peak device-resident saved bytes of ``stage`` so far."""
        return max((b for _, _, s, b in self.history if s == stage), default=0)

    def total_peak(self) -> int:
        """Peak device-resident saved bytes of all stages together so far (a rank's true peak:
        its stages peak at different times, so this is at most the sum of their :meth:`peak`)."""
        level: dict[int, int] = {}
        total = peak = 0
        for _, _, s, b in self.history:
            total += b - level.get(s, 0)
            level[s] = b
            peak = max(peak, total)
        return peak

    # -- hooks ------------------------------------------------------------------------------

    def hooks(self, stage: int, microbatch: int):
        """Context manager: saved tensors of a forward go through this store as ``(stage, microbatch)``."""
        key = (stage, microbatch)
        if key in self._entries:
            raise RuntimeError(f"stage {stage} microbatch {microbatch}: saved activations already held "
                               f"(a forward ran twice without a release)")
        self.poll()  # account offloads that finished since the last look
        entry = self._entries[key] = _Entry()
        self.packed[key] = 0

        def pack(t: torch.Tensor):
            if t.numel() <= self.min_numel or t.device.type != self.device.type:
                return t
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in self._param_storages or (self.is_weight is not None and self.is_weight(t)):
                return t
            if ptr not in entry.storages:
                entry.storages[ptr] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                entry.nbytes += storage.nbytes()
                self.packed[key] += storage.nbytes()
                self._account(stage, storage.nbytes())
            return _Saved(key, ptr, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

        def unpack(saved):
            if not isinstance(saved, _Saved):
                return saved
            if self._recording is not None:
                self._recording.add((saved.key, saved.storage))
            return self._materialize(saved)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _materialize(self, s: _Saved) -> torch.Tensor:
        entry = self._entries.get(s.key)
        if entry is None:
            raise RuntimeError(f"stage {s.key[0]} microbatch {s.key[1]}: saved activations were released "
                               f"before a backward that needs them")
        if s.storage in entry.stay:  # kept on the device by a partial offload
            flat = entry.stay[s.storage]
            return torch.empty(0, dtype=s.dtype, device=flat.device).set_(
                flat.untyped_storage(), s.offset, s.size, s.stride)
        if entry.state in ("host", "offloading"):
            self.late_reloads += 1
            self.reload(*s.key)
        if entry.state == "reloading":
            torch.accelerator.current_stream(self.device).wait_event(entry.event)
            entry.state, entry.event = "device", None
        flat = entry.storages.get(s.storage)
        if flat is None:
            flat = entry.aside.get(s.storage)
            if flat is None:
                raise RuntimeError(f"stage {s.key[0]} microbatch {s.key[1]}: a saved tensor the weight-gradient "
                                   f"pass needs was freed after the input-gradient pass")
            entry.missed = True
        return torch.empty(0, dtype=s.dtype, device=flat.device).set_(
            flat.untyped_storage(), s.offset, s.size, s.stride)

    @contextmanager
    def recording(self) -> Iterator[set]:
        """Yields the set of ``((stage, microbatch), storage)`` unpacked inside the block."""
        self._recording = read = set()
        try:
            yield read
        finally:
            self._recording = None

    # -- transitions ------------------------------------------------------------------------

    def offload(self, stage: int, microbatch: int, fraction: float = 1.0) -> None:
        """Start moving ``(stage, microbatch)`` to host memory (synchronous on CPU).

        ``fraction`` < 1: move only the storages saved first (the earliest layers' tensors), in
        save order while each brings the total nearer that share of the entry's bytes (whole
        storages: the share moved is near ``fraction``, not exactly it), keeping the rest on the
        device; the reload brings the moved part back.
        """
        entry = self._get(stage, microbatch, "offload")
        if entry.state != "device":
            raise RuntimeError(f"stage {stage} microbatch {microbatch}: offload in state {entry.state}")
        if not 0 < fraction <= 1:
            raise ValueError(f"offload fraction={fraction} must be in (0, 1]")
        moving, entry.stay, target, moved = {}, {}, fraction * entry.nbytes, 0
        for k, flat in entry.storages.items():
            if not entry.stay and moved + flat.numel() / 2 <= target:
                moving[k] = flat
                moved += flat.numel()
            else:  # (the first that does not fit ends the prefix)
                entry.stay[k] = flat
        entry.moved = moved
        host = {}
        if self._async:
            self._stream.wait_stream(torch.accelerator.current_stream(self.device))
            with on_stream(self._stream):
                for k, flat in moving.items():
                    host[k] = self.pool.take(flat.numel())
                    host[k].copy_(flat, non_blocking=True)
                entry.event = torch.Event(self.device)
                entry.event.record(self._stream)
            # Free the device copy now: the allocator reuses its blocks only once the side stream
            # has passed this copy (record_stream), so nothing waits for the copy to finish.
            for flat in moving.values():
                flat.record_stream(self._stream)
            entry.pending_free = []
            entry.state = "offloading"
        else:
            for k, flat in moving.items():
                host[k] = self.pool.take(flat.numel())
                host[k].copy_(flat)
            entry.state = "host"
            self._account(stage, -moved)
        entry.storages = host
        self.offloaded_bytes += moved

    def reload(self, stage: int, microbatch: int) -> None:
        """Start moving ``(stage, microbatch)`` back to the device (synchronous on CPU)."""
        entry = self._get(stage, microbatch, "reload")
        self.poll()
        if entry.state == "offloading":  # the D2H copy must land before the H2D copy reads it
            entry.event.synchronize()
            self._finish_offload(stage, entry)
        if entry.state != "host":
            raise RuntimeError(f"stage {stage} microbatch {microbatch}: reload in state {entry.state}")
        dev = {}
        if self._async:
            with on_stream(self._stream):
                for k, host in entry.storages.items():
                    dev[k] = torch.empty_like(host, device=self.device)
                    dev[k].copy_(host, non_blocking=True)
                entry.event = torch.Event(self.device)
                entry.event.record(self._stream)
            for host in entry.storages.values():  # back to the pool: later copies on the stream follow this one
                self.pool.give(host)
            entry.state = "reloading"
        else:
            for k, host in entry.storages.items():
                dev[k] = host.clone()
                self.pool.give(host)
            entry.state = "device"
        entry.storages = {**dev, **entry.stay}  # (a prefix moved, the rest kept: the save order again)
        entry.stay = {}
        self._account(stage, entry.moved)

    def split(self, stage: int, microbatch: int, keep: set[int], *, verify: bool = False) -> None:
        """After ``I``: free every storage of ``(stage, microbatch)`` not in ``keep`` (storage keys
        as recorded by :meth:`recording`); ``verify``: keep them aside (still counted as resident,
        which they are, until :meth:`release`) and note a ``W`` that reads one (:meth:`missed`)."""
        entry = self._get(stage, microbatch, "split")
        if entry.state == "reloading":  # an I that read nothing
            torch.accelerator.current_stream(self.device).wait_event(entry.event)
            entry.state, entry.event = "device", None
        if entry.state == "offloading":
            entry.event.synchronize()
            self._finish_offload(stage, entry)
        on_device = entry.state == "device"  # else on the host: an I that read none of it
        if not on_device and entry.stay:  # what a partial offload kept: on the device (I may have read it)
            freed_stay = 0
            for k in [k for k in entry.stay if k not in keep]:
                flat = entry.stay.pop(k)
                entry.nbytes -= flat.numel()
                if verify:  # held aside like a device storage, counted as resident until the release
                    entry.aside[k] = flat
                    entry.aside_bytes += flat.numel()
                else:
                    freed_stay += flat.numel()
            if freed_stay:
                self._account(stage, -freed_stay)
        drop = [k for k in entry.storages if k not in keep]
        dropped = sum(entry.storages[k].numel() for k in drop)
        if not on_device:
            entry.moved -= dropped
        for k in drop:
            flat = entry.storages.pop(k)
            if not on_device:
                self.pool.give(flat)
                continue
            if self._async:  # reloaded on the side stream, read by the compute stream
                flat.record_stream(torch.accelerator.current_stream(self.device))
            if verify:
                entry.aside[k] = flat
                entry.aside_bytes += flat.numel()
        entry.nbytes -= dropped
        self.kept[(stage, microbatch)] = entry.nbytes
        freed = dropped - entry.aside_bytes if on_device else 0
        if freed:
            self._account(stage, -freed)

    def missed(self, stage: int, microbatch: int) -> bool:
        """Whether a ``W`` read a storage that a verifying :meth:`split` dropped."""
        return self._get(stage, microbatch, "missed").missed

    def release(self, stage: int, microbatch: int) -> None:
        """Free ``(stage, microbatch)``: its backward is complete."""
        entry = self._entries.pop((stage, microbatch), None)
        if entry is None:
            raise RuntimeError(f"stage {stage} microbatch {microbatch}: release without saved activations")
        if entry.state == "offloading":
            entry.event.synchronize()
            self._finish_offload(stage, entry)
        if entry.state in ("device", "reloading"):
            if self._async:
                for flat in entry.storages.values():  # the side stream may still be writing it
                    flat.record_stream(torch.accelerator.current_stream(self.device))
            self._account(stage, -entry.nbytes - entry.aside_bytes)
        else:
            if entry.state == "host":
                for host in entry.storages.values():
                    self.pool.give(host)
            kept = sum(flat.numel() for flat in entry.stay.values())  # a partial offload's device part
            if entry.aside_bytes or kept:
                self._account(stage, -entry.aside_bytes - kept)

    def poll(self) -> None:
        """Account finished CUDA offloads (non-blocking; a no-op on CPU)."""
        for (stage, _), entry in self._entries.items():
            if entry.state == "offloading" and entry.event.query():
                self._finish_offload(stage, entry)

    def _finish_offload(self, stage: int, entry: _Entry) -> None:
        entry.pending_free = []
        entry.state, entry.event = "host", None
        self._account(stage, -entry.moved)

    def _get(self, stage: int, microbatch: int, what: str) -> _Entry:
        entry = self._entries.get((stage, microbatch))
        if entry is None:
            raise RuntimeError(f"stage {stage} microbatch {microbatch}: {what} without saved activations "
                               f"(forward not run, or already released)")
        return entry

    def held(self) -> list[tuple[int, int]]:
        """Entries not yet released (empty after a complete step)."""
        return sorted(self._entries)
