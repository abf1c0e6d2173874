"""The minibatch protocol: who synchronizes when, and what happens on misuse and failure.

A failure here pinpoints an unexpected rendezvous inside a minibatch, a rank waiting for a slow
peer, a misuse that is not reported clearly, or a failure that hangs or leaks shared memory.
"""

from __future__ import annotations

import os
import time
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import posttrain.odc as odc_mod
import posttrain.odc._transport as transport_mod
from odc_helpers import CFG, batches, loss_of, make_gpt, shard
from posttrain.launch import RanksFailedError, run_ranks
from posttrain.models import GPT

COLLECTIVES = [
    "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_reduce", "barrier", "broadcast", "all_gather", "all_gather_object", "reduce_scatter",
    "all_to_all", "all_to_all_single", "broadcast_object_list", "monitored_barrier", "send", "recv",
]


class _Counter:
    """Counts torch.distributed calls, by name, while ``active``."""

    def __init__(self):
        self.active = False
        self.calls: list[str] = []
        self._patches = []

    def __enter__(self):
        for name in COLLECTIVES:
            for ns in (dist, c10d):
                orig = getattr(ns, name, None)
                if orig is None:
                    continue

                def wrapped(*a, _orig=orig, _name=name, **k):
                    if self.active:
                        self.calls.append(_name)
                    return _orig(*a, **k)

                p = mock.patch.object(ns, name, wrapped)
                p.start()
                self._patches.append(p)
        return self

    def __exit__(self, *exc):
        for p in self._patches:
            p.stop()


def _count_worker(rank, world_size, counts, mesh_shape):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = None
    if mesh_shape:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    model = make_gpt()
    shard(model, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step = []
    with _Counter() as counter, odc_mod.enable(model) as odc:
        for step in range(2):
            counter.calls.clear()
            counter.active = True
            with odc.minibatch(num_tokens=5) as mb:
                for x in batches(step, rank, counts[rank]):
                    (loss_of(model, x) / mb.global_tokens).backward()
            counter.active = False
            per_step.append(list(counter.calls))
            opt.step()
            opt.zero_grad()
        gathers = odc.stats["gathers"]
    return per_step, gathers


def test_no_collective_inside_a_minibatch():
    """1-D ODC: zero torch.distributed calls from entering to leaving a minibatch (shm barriers only)."""
    results = run_ranks(_count_worker, 4, [3, 1, 0, 2], None)
    for per_step, _ in results:
        assert per_step == [[], []]
    assert results[0][1] > 0


def test_hsdp_names_its_replica_all_reduces():
    """HSDP: only the design's all-reduces across replicas (token count, push count, gradients)."""
    for per_step, _ in run_ranks(_count_worker, 4, [2, 1, 0, 2], (2, 2)):
        assert per_step == [["all_reduce"] * 3] * 2


def _slow_rank_worker(rank, world_size, mode):
    model = make_gpt()
    shard(model)
    odc = odc_mod.enable(model, mode=mode)
    start = time.monotonic()
    with odc.minibatch():
        for x in batches(0, 0, 3):
            if rank == 1:
                time.sleep(0.4)
            loss_of(model, x).backward()
        done = time.monotonic() - start
    odc.close()
    return done


def test_fast_rank_does_not_wait_for_slow_rank():
    """Rank 1 sleeps 0.4 s per microbatch. Under ODC rank 0 finishes its microbatches long before
    rank 1; in collective mode (FSDP semantics) it is held back at every gather."""
    fast, slow = run_ranks(_slow_rank_worker, 2, "one-sided")
    assert slow > 1.1 and fast < 0.5, (fast, slow)
    fast_c, slow_c = run_ranks(_slow_rank_worker, 2, "collective")
    assert fast_c > 0.8, (fast_c, slow_c)


def test_enable_without_fully_shard_is_a_clear_error():
    with pytest.raises(ValueError, match="fully_shard"):
        odc_mod.enable(GPT(CFG))


def test_bad_config_values():
    with pytest.raises(ValueError, match="mode"):
        odc_mod.ODCConfig(mode="fast")
    with pytest.raises(ValueError, match="grad_divide_factor"):
        odc_mod.ODCConfig(grad_divide_factor=0)
    with pytest.raises(ValueError, match="timeout_s"):
        odc_mod.ODCConfig(timeout_s=-1)


def _spanning_hosts_worker(rank, world_size):
    model = make_gpt()
    shard(model)
    with mock.patch.object(transport_mod, "host_identity", lambda: f"host-{rank}"):
        try:
            odc_mod.enable(model)
        except ValueError as e:
            return str(e)
    return "no error"


def test_shard_group_spanning_hosts_is_refused():
    for msg in run_ranks(_spanning_hosts_worker, 2):
        assert "different hosts" in msg and "HSDP" in msg


def _misuse_worker(rank, world_size):
    model = make_gpt()
    shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    odc = odc_mod.enable(model)
    errors = {}
    x = batches(0, rank, 1)[0]
    # forward outside a minibatch works like FSDP (collective gather) but backward does not
    loss = loss_of(model, x)
    try:
        loss.backward()
    except RuntimeError as e:
        errors["backward_outside"] = str(e)
    opt.zero_grad()
    with odc.minibatch():
        loss_of(model, x).backward()
        try:
            opt.step()
        except RuntimeError as e:
            errors["step_inside"] = str(e)
        try:
            with odc.minibatch():
                pass
        except RuntimeError as e:
            errors["nested"] = str(e)
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    opt.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with odc.minibatch():
            pass  # every rank: zero microbatches
    errors["zero_warning"] = " ".join(str(w.message) for w in caught)
    errors["zero_grads_none"] = all(p.grad is None for p in model.parameters())
    opt.step()
    after = {k: v.full_tensor() for k, v in model.state_dict().items()}
    errors["zero_step_noop"] = all(torch.equal(before[k], after[k]) for k in before)
    odc.close()
    try:
        with odc.minibatch():
            pass
    except RuntimeError as e:
        errors["closed"] = str(e)
    return errors


def test_misuse_gives_clear_errors():
    """Backward outside a minibatch, optimizer.step() inside one, nesting, use after close;
    all ranks with zero microbatches is a documented no-op (grads None, step skips)."""
    for errors in run_ranks(_misuse_worker, 2):
        assert "outside `with odc.minibatch():`" in errors["backward_outside"]
        assert "optimizer.step() inside odc.minibatch()" in errors["step_inside"]
        assert "do not nest" in errors["nested"]
        assert "no rank ran a backward" in errors["zero_warning"]
        assert errors["zero_grads_none"] and errors["zero_step_noop"]
        assert "closed" in errors["closed"]


def _failing_worker(rank, world_size, how):
    model = make_gpt()
    shard(model)
    odc = odc_mod.enable(model, timeout_s=600)
    with odc:
        with odc.minibatch():
            for i, x in enumerate(batches(0, rank, 3)):
                if rank == 1 and i == 1:
                    if how == "raise":
                        raise ValueError("bad batch in rank 1")
                    os._exit(3)
                loss_of(model, x).backward()
    return "finished"


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_failing_rank_fails_peers_fast_and_leaks_nothing(how):
    """A rank that raises (or dies) mid-minibatch: the others fail with PeerFailedError in
    seconds, not after the 600 s timeout, and /dev/shm holds nothing of the job (fixture)."""
    start = time.monotonic()
    with pytest.raises(RanksFailedError) as info:
        run_ranks(_failing_worker, 3, how, timeout_s=60)
    assert time.monotonic() - start < 20
    errors = info.value.errors
    assert set(errors) == {0, 1, 2}
    for r in (0, 2):
        assert "PeerFailedError" in errors[r] and "rank 1" in errors[r], errors[r]
    if how == "raise":
        assert "bad batch in rank 1" in errors[1]
        assert "bad batch in rank 1" in errors[0]  # the peer's message travels
    else:
        assert "exited" in errors[0]


def _unequal_collective_worker(rank, world_size):
    model = make_gpt()
    shard(model)
    with odc_mod.enable(model, mode="collective", timeout_s=30) as odc:
        with odc.minibatch():
            for x in batches(0, rank, 2 if rank == 0 else 1):
                loss_of(model, x).backward()


def test_collective_mode_with_unequal_counts_is_detected():
    with pytest.raises(RanksFailedError) as info:
        run_ranks(_unequal_collective_worker, 2, timeout_s=60)
    assert any("BarrierMismatchError" in e for e in info.value.errors.values())
