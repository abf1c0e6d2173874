"""The shared-memory row exchange of a split sequence's ranks (posttrain.odc.ShmRowExchange):
each range of the members' rows gathered into its place and each range of their gradient summed
back to its owner, call after call.

A failure pinpoints a half of the double buffer overwritten before a member read it (a later
call's results differ), a segment that did not grow with a larger call, a sum that is not the
same on every member, or a failed member that leaves the others waiting."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
import torch.distributed as dist

from posttrain.launch import run_ranks
from posttrain.odc import PeerFailedError, ShmRowExchange, row_exchange


def _span_calls(world):
    """Calls of gather_spans / reduce_spans as a split sequence's layers make them, the same on
    every member: members of unequal lengths, each member's rows cut into ranges and the ranges
    shuffled (the order a gather puts them in), growing mid-way, fp32 and bf16."""
    g = torch.Generator().manual_seed(7)
    calls = []
    for i, (rows, channels) in enumerate([(5, 3), (300, 2), (7, 3), (2000, 4), (3, 1)]):
        lengths = [rows + int(torch.randint(0, 3, (), generator=g)) for _ in range(world)]
        spans = []
        for r, n in enumerate(lengths):
            cuts = sorted({0, n, *torch.randint(0, n + 1, (3,), generator=g).tolist()})
            spans += [(r, a, b) for a, b in itertools.pairwise(cuts)]
        spans = [spans[j] for j in torch.randperm(len(spans), generator=g).tolist()]
        calls.append((lengths, spans, channels, torch.bfloat16 if i % 2 else torch.float32))
    return calls


def _span_tensors(rank, world, lengths, channels, dtype, i):
    g = torch.Generator().manual_seed(1000 * i + rank)
    x = torch.randn(1, channels, lengths[rank], 4, generator=g).to(dtype)
    grad = torch.randn(1, channels, sum(lengths), 4, generator=g).to(dtype)
    return x, grad


def _span_worker(rank, world):
    ex = row_exchange(dist.group.WORLD)
    assert isinstance(ex, ShmRowExchange) and (ex.rank, ex.size) == (rank, world)
    got = []
    for i, (lengths, spans, channels, dtype) in enumerate(_span_calls(world)):
        x, grad = _span_tensors(rank, world, lengths, channels, dtype, i)
        got.append((ex.gather_spans(x, lengths, spans, dim=2), ex.reduce_spans(grad, lengths, spans, dim=2)))
    ex.close()
    return got


@pytest.mark.parametrize("world", [2, 3])
def test_ranges_go_straight_into_place_and_their_gradients_back_to_their_owners(world):
    """gather_spans: the members' row ranges in the order given; reduce_spans: each member's rows,
    the sum over the members of the gradient rows that came from them (fp32, member order)."""
    got = run_ranks(_span_worker, world, timeout_s=120)
    for i, (lengths, spans, channels, dtype) in enumerate(_span_calls(world)):
        xs, grads = zip(*(_span_tensors(r, world, lengths, channels, dtype, i) for r in range(world)))
        gathered = torch.cat([xs[r][:, :, a:b] for r, a, b in spans], dim=2)
        for r in range(world):
            back = []
            for grad in grads:  # what each member's gradient holds for member r, in r's row order
                mine = torch.empty_like(xs[r])
                at = 0
                for owner, a, b in spans:
                    if owner == r:
                        mine[:, :, a:b] = grad[:, :, at:at + b - a]
                    at += b - a
                back.append(mine)
            want = sum(t.float() for t in back).to(dtype)
            assert torch.equal(got[r][i][0], gathered), (i, r)
            assert got[r][i][1].dtype == dtype and torch.equal(got[r][i][1], want), (i, r)


def test_spans_that_do_not_cover_every_row_once_are_refused():
    ex = ShmRowExchange.__new__(ShmRowExchange)
    x = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="do not cover"):
        ex._check_spans(x, [3, 3], [(0, 0, 3), (1, 0, 2)], 2, 3)
    with pytest.raises(ValueError, match="do not cover"):  # (the right total, a row twice and one left out)
        ex._check_spans(x, [3, 3], [(0, 0, 3), (1, 0, 2), (1, 1, 2)], 2, 3)
    with pytest.raises(ValueError, match="outside"):
        ex._check_spans(x, [3, 3], [(0, 0, 3), (1, 0, 4)], 2, 3)
    with pytest.raises(ValueError, match="rows along dim 2"):
        ex._check_spans(x, [2, 3], [(0, 0, 2), (1, 0, 3)], 2, 2)


def _failing(rank, world):
    deadline = [float("inf")]
    watch = (lambda: "the engine saw rank 1 fail" if time.monotonic() > deadline[0] else None) if rank == 0 else None
    ex = row_exchange(dist.group.WORLD, watch=watch)
    x = torch.ones(1, 2, 3, 4)
    spans = [(0, 0, 3), (1, 0, 3)]
    ex.gather_spans(x, [3, 3], spans, dim=2)  # together once
    if rank == 1:
        time.sleep(4)  # alive, but not at the next call: only ``watch`` can end rank 0's wait sooner
        return None
    deadline[0] = time.monotonic() + 1.0
    t0 = time.monotonic()
    try:
        ex.gather_spans(x, [3, 3], spans, dim=2)
    except PeerFailedError as exc:
        return str(exc), time.monotonic() - t0
    return "no failure", time.monotonic() - t0


def test_a_member_that_never_comes_ends_the_wait_through_watch():
    """Rank 1 stays alive but away: rank 0's wait ends when its watch (in the trainer, the ODC
    engine's view of its peers) reports a failure, within a fraction of a second of it."""
    (msg, waited), _ = run_ranks(_failing, 2, timeout_s=60)
    assert msg == "the engine saw rank 1 fail" and 0.9 < waited < 2.0, (msg, waited)
