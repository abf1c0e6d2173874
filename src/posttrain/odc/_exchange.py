"""Row exchanges for a sequence split across ranks of one host, through shared memory.

[Note: the split sequence's exchange in shared memory]
Attention over a split sequence all-gathers every shard's keys and values at each layer and
reduce-scatters their gradients back (``posttrain.models.split_attention``). Over gloo each call
costs about a millisecond before any byte moves and the bytes go at about 1.2 GiB/s on this
machine's kind; ranks on one host can instead copy through memory they all map (9-13 GB/s) and
meet at a barrier of spinning reads (microseconds). :class:`ShmRowExchange` does that for one
group: each rank owns a segment (:class:`~posttrain.odc.ShmTransport`) of two halves, and call
``i`` (forward or backward, in the order every member makes them: the same layers of the same
split sequence) uses half ``i % 2``:

- all-gather (``gather_spans``): write my rows into my half, barrier, copy every member's rows
  from its half into the output;
- reduce-scatter (``reduce_spans``): write all my pieces (one per member) into my half, barrier,
  sum (in fp32, in member order: the same on every rank) the pieces the members wrote for me.

Two halves make one barrier a call enough: I write half ``h`` again at call ``i + 2``, after the
barrier of call ``i + 1``, which no member reaches before it has finished reading call ``i``.

The segments grow (re-created, a collective among the members, which all ask for the same size at
the same call) when a call needs more than they hold. A member that fails ends the others' wait
within a fraction of a second: its own abort, its exit, or ``watch`` (the engine's view of its peers).

A split sequence's attention wants the gathered rows in position order, not member order, and
hands back their gradients in that order: :meth:`ShmRowExchange.gather_spans` copies each range
of a member's rows straight from its half into its place in the output, and
:meth:`ShmRowExchange.reduce_spans` writes each range of the gradient straight into the piece of
my half that its owner reads. Neither pads the members' rows to the longest nor goes through a
buffer in member order: against an all-gather and a reorder (what a process group's collectives
do, ``posttrain.models.split_attention``), a layer copies the whole sequence's keys and values
once fewer forward and once fewer backward (and, where the members' lengths differ, pads and
zero-fills nothing).
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ._transport import ShmTransport, host_identity

__all__ = ["ShmRowExchange", "row_exchange"]

_GATHER, _REDUCE = 1, 2  # barrier tags


class ShmRowExchange:
    """All-gather and reduce-scatter along dim 0 among the ranks of ``group`` on one host (see
    [Note: the split sequence's exchange in shared memory]). Create with :func:`row_exchange`.

    Attributes:
        process_group: the members' process group (what anything else exchanged among them uses).
        rank, size: this rank's index in the group and the group's size.
    """

    def __init__(self, group: dist.ProcessGroup, *, watch: Callable[[], str | None] | None = None,
                 timeout_s: float = 1800.0) -> None:
        self.process_group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.watch = watch
        self.timeout_s = timeout_s
        self._transport: ShmTransport | None = None
        self._half_bytes = 0
        self._calls = 0

    def _half(self, nbytes: int, dtype: torch.dtype, numel: int, rank: int | None = None) -> torch.Tensor:
        """This call's half of ``rank``'s segment (default: mine) as ``numel`` values of ``dtype``."""
        start = (self._calls % 2) * self._half_bytes
        t = self._transport.region(self.rank if rank is None else rank, "rows", torch.uint8)
        return t[start:start + nbytes].view(dtype)[:numel]

    def _reserve(self, nbytes: int) -> None:
        if nbytes <= self._half_bytes:
            return
        if self._transport is not None:
            self._transport.close()
        half = max(nbytes, 2 * self._half_bytes, 1 << 20)
        half = -(-half // 4096) * 4096
        self._transport = ShmTransport.create(self.process_group, {"rows": 2 * half}, timeout_s=self.timeout_s)
        self._half_bytes = half

    def _post(self, x: torch.Tensor, tag: int, reserve: int = 0) -> None:
        """Write ``x`` into my half of this call and wait for every member's (the halves hold at
        least ``reserve`` bytes: every member must ask for the same size at the same call)."""
        nbytes = x.numel() * x.element_size()
        self._reserve(max(nbytes, reserve))
        self._half(nbytes, x.dtype, x.numel()).copy_(x.reshape(-1))
        self._transport.barrier(tag, watch=self.watch)

    @staticmethod
    def _check_spans(x: torch.Tensor, lengths: Sequence[int], spans: Sequence[tuple[int, int, int]], dim: int,
                     rows: int) -> None:
        if x.shape[dim] != rows:
            raise ValueError(f"{x.shape[dim]} rows along dim {dim}, expected {rows}")
        for r, a, b in spans:
            if not (0 <= r < len(lengths) and 0 <= a <= b <= lengths[r]):
                raise ValueError(f"span {(r, a, b)} is outside the members' rows {list(lengths)}")
        ends = [0] * len(lengths)  # (each member's ranges, in order, must tile its rows: a row left out
        for r, a, b in sorted(spans):  # would take a stale gradient, one taken twice a doubled one)
            if a != ends[r]:
                raise ValueError(f"spans {list(spans)} do not cover the members' rows {list(lengths)} once")
            ends[r] = b
        if ends != list(lengths):
            raise ValueError(f"spans {list(spans)} do not cover the members' rows {list(lengths)} once")

    def _pieces(self, owner: int, like: torch.Tensor, lengths: Sequence[int], dim: int) -> list[torch.Tensor]:
        """``owner``'s half of this call as one piece per member, member ``r``'s shaped as ``like``
        with ``lengths[r]`` rows along ``dim``, back to back."""
        row = like.numel() // like.shape[dim]
        shapes = [(*like.shape[:dim], n, *like.shape[dim + 1:]) for n in lengths]
        flat = self._half(sum(lengths) * row * like.element_size(), like.dtype, sum(lengths) * row, owner)
        return [t.view(shape) for t, shape in zip(flat.split([n * row for n in lengths]), shapes)]

    def gather_spans(self, x: torch.Tensor, lengths: Sequence[int], spans: Sequence[tuple[int, int, int]],
                     dim: int) -> torch.Tensor:
        """The members' rows along ``dim`` (member ``r`` holds ``lengths[r]``; ``x`` is mine), the
        ranges ``spans`` (``(member, start, end)``, together every row once) concatenated in
        that order: each range copied once, from its member's half into the output."""
        self._check_spans(x, lengths, spans, dim, lengths[self.rank])
        x = x.contiguous()
        row_bytes = x.numel() // max(1, x.shape[dim]) * x.element_size()
        self._post(x, _GATHER, reserve=max(lengths) * row_bytes)
        views = [x if r == self.rank else self._pieces(r, x, [lengths[r]], dim)[0] for r in range(self.size)]
        out = x.new_empty((*x.shape[:dim], sum(lengths), *x.shape[dim + 1:]))
        at = 0
        for r, a, b in spans:
            out.narrow(dim, at, b - a).copy_(views[r].narrow(dim, a, b - a))
            at += b - a
        self._calls += 1
        return out

    def reduce_spans(self, grad: torch.Tensor, lengths: Sequence[int], spans: Sequence[tuple[int, int, int]],
                     dim: int) -> torch.Tensor:
        """The backward of :meth:`gather_spans`: ``grad`` (its output's shape) back to the members,
        summed; returns my rows, the sum over the members of what each held for them (in fp32,
        in member order: the same on every member). Each range
        of ``grad`` is copied once, into the piece of my half its owner reads."""
        self._check_spans(grad, lengths, spans, dim, sum(lengths))
        self._reserve(grad.numel() * grad.element_size())
        mine = self._pieces(self.rank, grad, lengths, dim)
        at = 0
        for r, a, b in spans:
            mine[r].narrow(dim, a, b - a).copy_(grad.narrow(dim, at, b - a))
            at += b - a
        self._transport.barrier(_REDUCE, watch=self.watch)
        acc = None
        for m in range(self.size):
            piece = (mine if m == self.rank else self._pieces(m, grad, lengths, dim))[self.rank]
            acc = piece.to(torch.float32, copy=True) if acc is None else acc.add_(piece)
        self._calls += 1
        return acc if grad.dtype == torch.float32 else acc.to(grad.dtype)

    def close(self) -> None:
        """Unmap the segments (idempotent)."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None
            self._half_bytes = 0


def row_exchange(group: dist.ProcessGroup, *, watch: Callable[[], str | None] | None = None
                 ) -> ShmRowExchange | dist.ProcessGroup:
    """The exchange a split sequence's ranks use: shared memory where they are all on this host,
    an x86-64 one (:class:`ShmRowExchange`), else ``group`` itself (its collectives). A collective over
    ``group``'s members (one object all-gather, to compare hosts)."""
    hosts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, host_identity(), group=group)
    if len(set(hosts)) != 1 or platform.machine() not in ("x86_64", "AMD64"):
        return group  # (the shared-memory barrier relies on x86-64's store order)
    return ShmRowExchange(group, watch=watch)
