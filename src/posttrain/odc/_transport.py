"""Shared-memory transport for ranks on one host: one-sided reads and adds, and a barrier.

[Note: shm segments]
Every rank of a group owns one *segment*: a file in ``/dev/shm`` mapped by every rank of the
group with ``torch.from_file(shared=True)``. A segment is a small control header followed by
named *regions* whose byte sizes are agreed by all ranks at creation (for ODC: the exposed
parameter shards and the gradient accumulator). A peer reads from and adds into another rank's
regions directly; the owner does nothing.

Lifecycle: names carry a random token agreed through the process group and end with the pid of
the rank that created the file; files are created ``0600`` with ``O_EXCL``
(no other user or job can attach) and unlinked as soon as every rank of the group has mapped them,
so a crash after :meth:`ShmTransport.create` leaks nothing; the memory goes away when the last
process unmaps it. A rank killed inside ``create`` (its launcher killed outright, the ranks with
it) cannot unlink its name: the launcher's reaper removes the names of the ranks it killed, and
the next launch on the host removes those of creators no longer running
(:func:`posttrain._reaper.remove_shm_names`).

Concurrent adds into one accumulator race, so :meth:`ShmTransport.accumulate` takes a byte-range
``fcntl.lockf`` lock per stripe of the destination (it excludes other processes) plus a
``threading.Lock`` (``lockf`` does not exclude threads of one process).

The barrier is a generation counter in each rank's header. It never blocks on a socket, so
it can notice a peer that aborted (its header says so, with a message) or died (its pid is
gone) and fail within a bounded time instead of hanging. Header words are 8-byte aligned
stores; we rely on x86-64 total store order for data written before the generation bump to be
visible to a peer that sees the bump.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import platform
import secrets
import socket
import threading
import time
import warnings
from collections.abc import Callable, Mapping

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "posttrain-odc"


# Header layout (int64 words), then a message area for abort reasons. The barrier word holds
# ``generation << _TAG_BITS | tag`` so that a peer reads both in one aligned 8-byte load: written
# as two words, a reader could pair the previous generation with the next barrier's tag.
# _ARRIVED + (generation & 1): monotonic ns of the arrival at a barrier of that parity. Two words: a
# peer's stamp for generation g is overwritten only at g + 2, which it cannot reach before this rank
# has left g and arrived at g + 1, so a rank leaving g always reads its peers' stamps of g.
_PID, _BARRIER, _ABORT, _MSG_LEN, _ARRIVED = range(5)
_TAG_BITS = 8
_VALUES = 8  # words 8.._HEADER_WORDS-1: small integers published for peers
_HEADER_WORDS = 16
_MSG_OFFSET = _HEADER_WORDS * 8
_MSG_BYTES = 1024
_HEADER_BYTES = 4096
_ALIGN = 64
#: The longest nap between a barrier's checks of its peers once it has spun 400 times (seconds): the
#: wait ends up to this late after the last peer arrives.
_NAP_MAX_S = 1e-3
#: Every barrier this process passed, over all its transports: [barriers, nanoseconds waited,
#: nanoseconds left after the last peer had arrived].
_TOTALS = [0, 0, 0]


def barrier_totals() -> dict[str, float]:
    """What this process's barriers cost so far, over all its transports: ``barriers`` passed,
    seconds waited in them (``wait_s``), and seconds between the last peer's arrival and leaving
    (``late_s``: a barrier's reaction time, mostly the naps of a long wait; the arrival stamps
    come from the host's monotonic clock, shared by its processes). Differences of two calls give
    a step's share."""
    n, waited, late = _TOTALS
    return {"barriers": n, "wait_s": waited / 1e9, "late_s": late / 1e9}

#: Bytes per lock stripe of an accumulator (1 MiB), counted from the start of the segment region.
STRIPE_BYTES = 1 << 20


class PeerFailedError(RuntimeError):
    """A peer rank aborted, died, or did not reach a barrier within the timeout."""


class BarrierMismatchError(RuntimeError):
    """Ranks reached different barriers (e.g. unequal microbatch counts in collective mode)."""


def host_identity() -> str:
    """What must be equal for two processes to share ``/dev/shm`` and see each other's pids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pid_ns = 0
    return f"{socket.gethostname()}/{boot}/{pid_ns}"


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def region_offsets(regions: Mapping[str, int], *, start: int = 0, align: int = 256) -> tuple[dict[str, tuple[int, int]], int]:
    """``name -> (byte offset, bytes)`` of each region laid out in order from ``start``, each
    start aligned to ``align``; and the total bytes. Raises on a negative size."""
    offsets: dict[str, tuple[int, int]] = {}
    pos = start
    for name, nbytes in regions.items():
        if int(nbytes) < 0:
            raise ValueError(f"region {name!r} has negative size {nbytes}")
        pos = -(-pos // align) * align
        offsets[name] = (pos, int(nbytes))
        pos += int(nbytes)
    return offsets, -(-pos // align) * align


class ShmTransport:
    """One segment per rank of ``group``, all mapped by all ranks of the group.

    Create with :meth:`create` (a collective over ``group``); free with :meth:`close`.

    Args (of :meth:`create`):
        group: the ranks that share memory; all must be on this host.
        regions: name -> bytes, identical on every rank.
        timeout_s: how long :meth:`barrier` waits for a slow peer before failing.
    """

    def __init__(self) -> None:  # use create()
        raise TypeError("use ShmTransport.create(group, regions)")

    @classmethod
    def create(
        cls,
        group: dist.ProcessGroup,
        regions: Mapping[str, int],
        *,
        timeout_s: float = 1800.0,
    ) -> ShmTransport:
        if platform.machine() not in ("x86_64", "AMD64"):
            warnings.warn(
                f"posttrain's shm barrier relies on x86-64 store ordering; on {platform.machine()} "
                "data written before a barrier may not yet be visible to peers after it",
                RuntimeWarning,
                stacklevel=2,
            )
        self = object.__new__(cls)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.global_ranks = dist.get_process_group_ranks(group)
        self.timeout_s = float(timeout_s)
        self._gen = 0
        self._closed = False
        self._thread_lock = threading.Lock()
        self._fds: list[int] = []

        offsets, self.segment_bytes = region_offsets(regions, start=_HEADER_BYTES, align=_ALIGN)
        self._regions = offsets

        # One collective exchange agrees on the token and checks host and layout.
        token = secrets.token_hex(8) if self.rank == 0 else None
        mine = (token, host_identity(), sorted(offsets.items()), os.getpid())
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=group)
        token = everyone[0][0]
        hosts = {g: e[1] for g, e in zip(self.global_ranks, everyone)}
        if len(set(hosts.values())) != 1:
            raise ValueError(
                "the shared-memory ODC transport needs every rank of its shard group on one "
                f"host, but ranks are on different hosts: {hosts}. Shard within a node and "
                "replicate across nodes (HSDP: a 2-D mesh (replicate, shard) whose shard "
                "dimension stays inside a node)."
            )
        layouts = {e[2].__repr__() for e in everyone}
        if len(layouts) != 1:
            raise AssertionError(f"ranks disagree on the shm region layout: {everyone}")

        self.paths = [  # (the creator's pid last: see the note on the lifecycle)
            os.path.join(SHM_DIR, f"{NAME_PREFIX}-{token}-{g}-{e[3]}") for g, e in zip(self.global_ranks, everyone)
        ]
        own = self.paths[self.rank]
        try:
            fd = os.open(own, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, self.segment_bytes)
                try:  # reserve the pages now: a /dev/shm too small fails here, not as SIGBUS at a write
                    os.posix_fallocate(fd, 0, self.segment_bytes)
                except OSError as e:
                    free = os.statvfs(SHM_DIR)
                    raise RuntimeError(
                        f"cannot reserve {self.segment_bytes / 2**20:.0f} MiB in {SHM_DIR} for the ODC transport "
                        f"({e.strerror}; {free.f_bavail * free.f_frsize / 2**20:.0f} MiB free there): give "
                        f"{SHM_DIR} more room (e.g. docker --shm-size)") from None
            finally:
                os.close(fd)
            self._segments: list[torch.Tensor] = [None] * self.world_size  # type: ignore[list-item]
            self._segments[self.rank] = torch.from_file(
                own, shared=True, size=self.segment_bytes, dtype=torch.uint8
            )
            self._headers = [None] * self.world_size
            self._headers[self.rank] = self._segments[self.rank][:_HEADER_BYTES].numpy().view(np.int64)
            self._headers[self.rank][_PID] = os.getpid()
            dist.barrier(group=group)
            for r, path in enumerate(self.paths):
                # Open before mapping: the fd carries the lockf locks on this owner's stripes.
                self._fds.append(os.open(path, os.O_RDWR))
                if r != self.rank:
                    self._segments[r] = torch.from_file(
                        path, shared=True, size=self.segment_bytes, dtype=torch.uint8
                    )
                    self._headers[r] = self._segments[r][:_HEADER_BYTES].numpy().view(np.int64)
            dist.barrier(group=group)
        finally:
            # Every rank mapped (or we are failing): the name is no longer needed.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(own)
        self._pids = [int(h[_PID]) for h in self._headers]
        logger.debug("rank %d: mapped %d shm segments of %d bytes", self.rank, self.world_size, self.segment_bytes)
        return self

    # ------------------------------------------------------------------ views
    def region(self, rank: int, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The whole region ``name`` of ``rank``'s segment as a flat tensor of ``dtype``."""
        start, nbytes = self._regions[name]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if nbytes % itemsize:
            raise AssertionError(f"region {name!r} of {nbytes} bytes is not a multiple of {dtype}")
        return self._segments[rank][start : start + nbytes].view(dtype)

    # ------------------------------------------------------------- operations
    def accumulate(self, dst: torch.Tensor, src: torch.Tensor, *, owner: int, byte_offset: int) -> None:
        """``dst += src`` under the stripe locks of ``owner``'s segment.

        ``dst`` is a flat view that starts ``byte_offset`` bytes into ``owner``'s region. Stripes
        are fixed 1 MiB ranges of that region, so every writer of a byte takes the same lock
        whatever module or dtype it writes. Writers start at different stripes to spread contention.
        """
        self.locked_apply(dst, src, owner=owner, byte_offset=byte_offset, apply=torch.Tensor.add_)

    def locked_apply(self, dst: torch.Tensor, src: torch.Tensor, *, owner: int, byte_offset: int,
                     apply: Callable[[torch.Tensor, torch.Tensor], object]) -> None:
        """``apply(dst_piece, src_piece)`` stripe by stripe, each under ``owner``'s lock of that
        stripe (the pieces of :meth:`accumulate`; ``dst`` may live elsewhere, e.g. in device
        memory, as long as every writer of it goes through this owner's locks)."""
        numel = dst.numel()
        if numel == 0:
            return
        itemsize = dst.element_size()
        if byte_offset % itemsize:
            raise AssertionError(f"{byte_offset=} is not aligned to {dst.dtype}")
        end = byte_offset + numel * itemsize
        stripes = list(range(byte_offset // STRIPE_BYTES, (end - 1) // STRIPE_BYTES + 1))
        shift = self.rank % len(stripes)
        stripes = stripes[shift:] + stripes[:shift]
        fd = self._fds[owner]
        with self._thread_lock:
            for s in stripes:
                a = (max(s * STRIPE_BYTES, byte_offset) - byte_offset) // itemsize
                b = (min((s + 1) * STRIPE_BYTES, end) - byte_offset) // itemsize
                fcntl.lockf(fd, fcntl.LOCK_EX, 1, s, os.SEEK_SET)
                try:
                    apply(dst[a:b], src[a:b])
                finally:
                    fcntl.lockf(fd, fcntl.LOCK_UN, 1, s, os.SEEK_SET)

    def set_value(self, slot: int, value: int) -> None:
        """Publish an integer in ``slot`` of this rank's header, for peers to read after a barrier.

        A slot must not be rewritten before every peer has read it: use a different slot for
        values published at consecutive barriers.
        """
        if not 0 <= slot < _HEADER_WORDS - _VALUES:
            raise AssertionError(f"value {slot=} out of range")
        self._headers[self.rank][_VALUES + slot] = int(value)

    def values(self, slot: int) -> list[int]:
        """Every rank's value in ``slot``; meaningful after a barrier that follows the writes."""
        return [int(h[_VALUES + slot]) for h in self._headers]

    def barrier(self, tag: int, watch: Callable[[], str | None] | None = None) -> None:
        """Wait until every rank of the group reached its barrier of the same generation.

        ``watch``, where given, is asked every 0.2 s of waiting whether a failure elsewhere ends
        the wait (a message, e.g. an engine's own transport naming a failed peer; ``None``: go on).

        Raises:
            BarrierMismatchError: a peer reached a barrier with a different ``tag``.
            PeerFailedError: a peer aborted, died, ``watch`` said so, or ``timeout_s`` passed.
        """
        if self._closed:
            raise RuntimeError("the ODC transport is closed")
        if not 0 <= tag < 1 << _TAG_BITS:
            raise ValueError(f"barrier tag {tag} must be in [0, {1 << _TAG_BITS})")
        self._gen += 1
        gen = self._gen
        arrived = time.monotonic_ns()
        self._headers[self.rank][_ARRIVED + (gen & 1)] = arrived  # (stored before the generation: seen with it)
        self._headers[self.rank][_BARRIER] = gen << _TAG_BITS | tag
        pending = [r for r in range(self.world_size) if r != self.rank]
        start = arrived / 1e9  # (time.monotonic's clock)
        next_check = start + 0.2
        spins = 0
        while pending:
            still = []
            for r in pending:
                h = self._headers[r]
                if h[_ABORT]:
                    raise PeerFailedError(self._abort_message(r))
                word = int(h[_BARRIER])
                peer_gen, peer_tag = word >> _TAG_BITS, word & ((1 << _TAG_BITS) - 1)
                if peer_gen < gen:
                    still.append(r)
                elif peer_gen == gen and peer_tag != tag:
                    raise BarrierMismatchError(
                        f"rank {self.global_ranks[self.rank]} is at barrier {tag=} but rank "
                        f"{self.global_ranks[r]} is at barrier tag={peer_tag} (generation {gen}); "
                        "ranks issued different sequences of synchronizations"
                    )
            pending = still
            if not pending:
                break
            spins += 1
            if spins < 200:
                continue
            time.sleep(0 if spins < 400 else min(_NAP_MAX_S, 1e-5 * (spins - 400) + 1e-5))
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.2
                for r in pending:
                    # (a peer that arrived during the nap and then exited is not a failure: its
                    # generation, read again after its death, says it got here)
                    if not _pid_alive(self._pids[r]) and int(self._headers[r][_BARRIER]) >> _TAG_BITS < gen:
                        raise PeerFailedError(
                            f"rank {self.global_ranks[r]} (pid {self._pids[r]}) exited while "
                            f"rank {self.global_ranks[self.rank]} waited for it at a barrier"
                        )
                if watch is not None and (msg := watch()) is not None:
                    raise PeerFailedError(msg)
                if now - start > self.timeout_s:
                    raise PeerFailedError(
                        f"ranks {[self.global_ranks[r] for r in pending]} did not reach the "
                        f"barrier within timeout_s={self.timeout_s:g}s"
                    )
        self._count(gen, arrived)

    def _count(self, gen: int, arrived: int) -> None:
        """Add a passed barrier to :func:`barrier_totals`: the wait, and the time since the last
        arrival (the peers' stamps of this generation: see ``_ARRIVED``)."""
        left = time.monotonic_ns()
        last = max(arrived, *(int(self._headers[r][_ARRIVED + (gen & 1)]) for r in range(self.world_size)))
        _TOTALS[0] += 1
        _TOTALS[1] += left - arrived
        _TOTALS[2] += max(0, left - last)

    def abort(self, message: str) -> None:
        """Tell peers this rank failed; their barriers raise :class:`PeerFailedError`."""
        if self._closed:
            return
        data = message.encode(errors="replace")[:_MSG_BYTES]
        seg = self._segments[self.rank]
        seg[_MSG_OFFSET : _MSG_OFFSET + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        me = self._headers[self.rank]
        me[_MSG_LEN] = len(data)
        me[_ABORT] = 1

    def failed_peer(self) -> str | None:
        """What the first peer that aborted or died says (as :class:`PeerFailedError` would), else
        ``None``; for a rank whose wait outside this transport (another process group's collective)
        broke: it tells a peer's failure from its own."""
        if self._closed:
            return None
        for r in range(self.world_size):
            if r == self.rank:
                continue
            if self._headers[r][_ABORT]:
                return self._abort_message(r)
            if not _pid_alive(self._pids[r]):
                return f"rank {self.global_ranks[r]} (pid {self._pids[r]}) exited"
        return None

    def _abort_message(self, r: int) -> str:
        n = int(self._headers[r][_MSG_LEN])
        msg = bytes(self._segments[r][_MSG_OFFSET : _MSG_OFFSET + n].numpy()).decode(errors="replace")
        return f"rank {self.global_ranks[r]} failed: {msg}"

    def close(self) -> None:
        """Unmap every segment and close the lock files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
        self._headers = []
        self._segments = []
        # Names were unlinked at creation; make sure of it if creation was cut short.
        own = self.paths[self.rank]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(own)
