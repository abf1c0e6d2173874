"""ODC's transports behind one contract, and flat ODC on a GPU against the single-process reference.

The contract (peer views see what the owner wrote before a barrier, concurrent accumulates lose
nothing, published values, abort reaching a waiting peer) runs on every transport: the shm one
always, the device one (CUDA IPC, [Note: the device transport]) where CUDA is available, two
processes on one GPU. A failure pinpoints a transport that breaks the interface the minibatch
protocol relies on; the flat-ODC tests then show the engine on device memory takes the reference's
steps (atomic and locked accumulation, deterministic slots, bf16 mixed precision).
"""

from __future__ import annotations

import pytest
import torch

import posttrain.odc as odc_mod
from odc_helpers import LR, STEPS, assert_states_close, loss_of, make_gpt, step_data, train_reference
from posttrain.launch import run_ranks
from posttrain.odc import PeerFailedError, ShmTransport
from posttrain.odc._cuda import DeviceTransport, accumulate_atomic, check_visible, open_handle, region_offsets

NUMEL = (1 << 20) + 4099  # fp32: more than one index chunk and one lock stripe, not a multiple of either
REPEATS = 8


def test_regions_are_laid_out_in_order_aligned_and_refuse_negative_sizes():
    offsets, total = region_offsets({"params": 10, "grads": 300, "empty": 0}, align=256)
    assert offsets == {"params": (0, 10), "grads": (256, 300), "empty": (768, 0)} and total == 768
    assert region_offsets({"a": 1}, start=4096, align=64) == ({"a": (4096, 1)}, 4160)
    with pytest.raises(ValueError, match="region 'x' has negative size -1"):
        region_offsets({"x": -1})


def test_index_add_accumulate_equals_an_add_with_the_dtype_conversion():
    dst = torch.randn(NUMEL)
    src = torch.randn(NUMEL, dtype=torch.bfloat16)
    want = dst + src.float()
    accumulate_atomic(dst, src, kernel="index_add")
    assert torch.equal(dst, want)
    with pytest.raises(RuntimeError, match="needs Triton and a contiguous fp32 accumulator on a CUDA device"):
        accumulate_atomic(dst, src, kernel="triton")
    with pytest.raises(AssertionError, match="flat tensors of one length"):
        accumulate_atomic(dst[:5], src[:4])


def test_the_device_transport_refuses_the_cpu_in_one_line():
    with pytest.raises(ValueError, match="on the CPU ODC uses ShmTransport"):
        DeviceTransport.create(None, {"x": 8}, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="accumulate='sum' is not one of atomic, locked"):
        DeviceTransport.create(None, {"x": 8}, device=torch.device("cpu"), accumulate="sum")
    with pytest.raises(TypeError, match=r"use DeviceTransport\.create"):
        DeviceTransport()
    with pytest.raises(ValueError, match="device_accumulate='x' is not one of 'atomic', 'locked'"):
        odc_mod.ODCConfig(device_accumulate="x")


def test_a_peer_handle_opens_on_this_processs_number_for_its_gpu():
    """A handle carries the producer's device index; the consumer opens it on its own index for
    that GPU (found by UUID), everything else passed through as torch's rebuild takes it."""
    seen = []

    def rebuild(*args):
        seen.append(args)
        return "tensor"

    args = ("cls", (4,), (1,), 0, "storage", torch.float32, 3, b"handle", 16, 0, False, b"ref", 0, b"event", True)
    assert open_handle((rebuild, args), 1) == "tensor"
    assert seen == [(*args[:6], 1, *args[7:])]


def test_a_peer_on_a_gpu_this_rank_cannot_see_is_refused_in_one_line():
    check_visible(["cuda:GPU-a", "cuda:GPU-b"], [0, 1], [0, 1])
    with pytest.raises(ValueError) as e:
        check_visible(["cuda:GPU-a", "cuda:GPU-b"], [0, None], [0, 2])
    assert "cannot see the GPU of rank 2 (cuda:GPU-b)" in str(e.value) and "\n" not in str(e.value)


def _contract_worker(rank, world_size, kind, accumulate, gpus=1):
    import torch.distributed as dist

    group = dist.group.WORLD
    regions = {"params": 4 * 1000 + 4, "grads": 4 * NUMEL}
    if kind == "shm":
        dev = torch.device("cpu")
        t = ShmTransport.create(group, regions, timeout_s=20)
    else:
        dev = torch.device("cuda", rank % gpus)  # ranks sharing one GPU, or one GPU each
        torch.accelerator.set_device_index(dev.index)
        t = DeviceTransport.create(group, regions, device=dev, timeout_s=20, accumulate=accumulate)
    out = {}
    try:
        t.region(rank, "params", torch.float32).copy_(torch.arange(1001, dtype=torch.float32, device=dev) + 1000 * rank)
        t.set_value(0, 10 + rank)
        t.barrier(1)
        out["views"] = [torch.equal(t.region(q, "params", torch.float32).cpu(), torch.arange(1001.0) + 1000 * q)
                        for q in range(world_size)]
        out["values"] = t.values(0)
        src = torch.full((NUMEL,), float(rank + 1), device=dev)
        dst = t.region(0, "grads", torch.float32)
        for _ in range(REPEATS):
            t.accumulate(dst, src, owner=0, byte_offset=0)
        t.barrier(2)
        out["sum"] = t.region(0, "grads", torch.float32).cpu().unique().tolist()
        if rank == 1:
            t.abort("rank 1 gives up on purpose")  # instead of reaching barrier 3
            out["abort"] = "sent"
        else:
            try:
                t.barrier(3)
                out["abort"] = "passed"
            except PeerFailedError as e:
                out["abort"] = str(e)
    finally:
        t.close()
    return out


TWO_GPUS = [pytest.mark.cuda, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
TRANSPORTS = [pytest.param("shm", None, 1, id="shm"),
              pytest.param("cuda", "atomic", 1, id="cuda-ipc-atomic", marks=pytest.mark.cuda),
              pytest.param("cuda", "locked", 1, id="cuda-ipc-locked", marks=pytest.mark.cuda),
              pytest.param("cuda", "atomic", 2, id="two-gpus-atomic", marks=TWO_GPUS),
              pytest.param("cuda", "locked", 2, id="two-gpus-locked", marks=TWO_GPUS)]


@pytest.mark.parametrize(("kind", "accumulate", "gpus"), TRANSPORTS)
def test_every_transport_keeps_the_contract(kind, accumulate, gpus):
    """Two ranks (on one GPU, or on two: the adds into rank 0's memory then run on rank 0's GPU):
    each sees the other's region after a barrier, concurrent adds into one owner sum exactly,
    published values are read back, and an abort reaches the waiting peer."""
    results = run_ranks(_contract_worker, 2, kind, accumulate, gpus, start="spawn" if kind == "cuda" else None,
                        timeout_s=240)
    want = float(REPEATS * (1 + 2))
    for got in results:
        assert got["views"] == [True, True] and got["values"] == [10, 11], got
        assert got["sum"] == [want], got["sum"][:5]
    assert results[0]["abort"] == "rank 1 failed: rank 1 gives up on purpose"


def _flat_worker(rank, world_size, kind, counts, overrides):
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dev = torch.device("cpu")
    gpus = overrides.pop("gpus", 1)
    if kind == "cuda":
        dev = torch.device("cuda", rank % gpus)
        torch.accelerator.set_device_index(dev.index)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if overrides.pop("bf16") else None
    model = odc_mod.flat_shard(make_gpt().to(dev), mp_policy=mp, **overrides)
    handle = model.odc
    opt = torch.optim.SGD(handle.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        data, total = step_data(step, counts)
        mine = [x.to(dev) for x in data[rank]]
        with handle.minibatch(num_tokens=sum(x.shape[1] - 1 for x in mine)) as mb:
            assert mb.global_tokens == total
            for x in mine:
                (loss_of(model, x) / mb.global_tokens).backward()
        opt.step()
        opt.zero_grad()
    state = {}
    for u in handle.layouts:  # every rank's shards, through gloo objects (two ranks on one GPU: no NCCL)
        shards: list = [None] * world_size
        dist.all_gather_object(shards, u.shard.detach().cpu(), group=dist.group.WORLD)
        flat = torch.cat(shards)[: u.numel]
        for name, value, p in zip(u.param_names, flat.split(u.sizes[: u.num_trainable]), u.params):
            state[name] = value.view(p.shape)
    on_device = all(p.device == dev for p in handle.parameters())
    handle.close(restore=False)
    return state, on_device


@pytest.mark.parametrize(("kind", "overrides"), [
    pytest.param("cpu", {}, id="cpu"),
    *[pytest.param("cuda", o, id=f"cuda-{name}", marks=pytest.mark.cuda) for name, o in [
        ("atomic", {}), ("locked", {"device_accumulate": "locked"}), ("deterministic", {"deterministic": True}),
        ("bf16", {"bf16": True})]],
    *[pytest.param("cuda", o, id=f"two-gpus-{name}", marks=TWO_GPUS) for name, o in [
        ("atomic", {"gpus": 2}), ("deterministic", {"gpus": 2, "deterministic": True})]]])
def test_flat_odc_on_a_gpu_matches_the_single_process_reference(kind, overrides):
    """Two processes on the GPU(s) (the CPU: the same code on host memory), unequal microbatch
    counts, regions in device memory."""
    counts = [2, 1]
    want = train_reference(counts)
    tol = {"rtol": 2e-2, "atol": 2e-3} if overrides.get("bf16") else {"rtol": 1e-4, "atol": 1e-5}
    for state, on_device in run_ranks(_flat_worker, 2, kind, counts, {"bf16": False, **overrides},
                                      start="spawn" if kind == "cuda" else None, timeout_s=300):
        assert on_device
        assert_states_close(state, {k: v for k, v in want.items() if k in state}, **tol)
        assert set(state) == set(want)


def test_the_engine_overhead_benchmark_runs_the_same_steps_on_cpu_processes():
    """``posttrain doctor``'s Llama step (one unsharded process against flat ODC on two) on the CPU
    at a tiny size: both variants take the same losses, so on a GPU the ratio compares equal work."""
    from posttrain.lab.bench.gpu_step import bench_gpu_step

    cfg = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
           "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": False}
    lines = []
    got = bench_gpu_step(cfg, microbatches=3, seq_len=16, steps=2, warmup=1, rounds=1, kind="cpu", log=lines.append)
    assert got["odc_losses"] == pytest.approx(got["single_losses"], rel=2e-3) and len(got["odc_losses"]) == 3
    assert got["ratio"] > 0 and lines[0].startswith("Llama 0M bf16, 3 x 16 tokens a step")
