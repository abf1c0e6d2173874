"""The shared-memory row exchange of a split sequence's ranks (posttrain.odc.ShmRowExchange):
the same results as the process group's all-gather and reduce-scatter, call after call.

A failure pinpoints a half of the double buffer overwritten before a member read it (a later
call's results differ), a segment that did not grow with a larger call, a sum that is not the
same on every member, or a failed member that leaves the others waiting."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from posttrain.launch import run_ranks
from posttrain.odc import PeerFailedError, ShmRowExchange, row_exchange


def _calls(rank, world):
    """A sequence of calls as a split sequence's layers make them: gathers, then reduce-scatters
    in reverse, of growing sizes (the segment grows mid-way), fp32 and bf16."""
    g = torch.Generator().manual_seed(100 + rank)
    shapes = [(1, 3, 5, 4), (1, 3, 5, 4), (1, 2, 700, 64), (1, 3, 5, 4), (1, 2, 900, 128), (1, 1, 1, 1)]
    out = []
    for i, shape in enumerate(shapes):
        dtype = torch.bfloat16 if i % 3 == 2 else torch.float32
        out.append(("gather", torch.randn(shape, generator=g).to(dtype)))
    for i, shape in enumerate(reversed(shapes)):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        out.append(("reduce", torch.randn((world * shape[0], *shape[1:]), generator=g).to(dtype)))
    return out


def _run(ex, rank, world):
    got = []
    for op, x in _calls(rank, world):
        if op == "gather":
            o = x.new_empty((world * x.shape[0], *x.shape[1:]))
            ex.all_gather_into(o, x)
        else:
            o = x.new_empty((x.shape[0] // world, *x.shape[1:]))
            ex.reduce_scatter_into(o, x)
        got.append(o)
    return got


def _worker(rank, world):
    ex = row_exchange(dist.group.WORLD)
    assert isinstance(ex, ShmRowExchange) and (ex.rank, ex.size) == (rank, world)
    got = _run(ex, rank, world)
    ex.close()
    return got


@pytest.mark.parametrize("world", [2, 3])
def test_the_exchange_gives_every_member_the_gathered_rows_and_its_summed_piece(world):
    got = run_ranks(_worker, world, timeout_s=120)
    calls = [_calls(r, world) for r in range(world)]
    for i, (op, _) in enumerate(calls[0]):
        xs = [c[i][1] for c in calls]
        for r in range(world):
            if op == "gather":
                assert torch.equal(got[r][i], torch.cat(xs)), (i, r)
            else:
                n = xs[0].shape[0] // world
                want = sum(x[r * n:(r + 1) * n].float() for x in xs).to(xs[0].dtype)  # fp32, member order
                assert got[r][i].dtype == xs[0].dtype and torch.equal(got[r][i], want), (i, r)


def _failing(rank, world):
    deadline = [float("inf")]
    watch = (lambda: "the engine saw rank 1 fail" if time.monotonic() > deadline[0] else None) if rank == 0 else None
    ex = row_exchange(dist.group.WORLD, watch=watch)
    x = torch.ones(1, 2, 3, 4)
    o = x.new_empty((2, 2, 3, 4))
    ex.all_gather_into(o, x)  # together once
    if rank == 1:
        time.sleep(4)  # alive, but not at the next call: only ``watch`` can end rank 0's wait sooner
        return None
    deadline[0] = time.monotonic() + 1.0
    t0 = time.monotonic()
    try:
        ex.all_gather_into(o, x)
    except PeerFailedError as exc:
        return str(exc), time.monotonic() - t0
    return "no failure", time.monotonic() - t0


def test_a_member_that_never_comes_ends_the_wait_through_watch():
    """Rank 1 stays alive but away: rank 0's wait ends when its watch (in the trainer, the ODC
    engine's view of its peers) reports a failure, within a fraction of a second of it."""
    (msg, waited), _ = run_ranks(_failing, 2, timeout_s=60)
    assert msg == "the engine saw rank 1 fail" and 0.9 < waited < 2.0, (msg, waited)
