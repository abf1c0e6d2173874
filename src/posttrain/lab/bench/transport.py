"""Bandwidth of ODC's shared-memory transport against gloo collectives, 2 ranks, side by side.

    posttrain bench transport                 # sizes 1, 4, 16, 64 MiB per rank shard
    posttrain bench transport --sizes-mib 8,32 --iters 10 --json out/bench_transport.json

For each shard size S (fp32, per rank), one run measures on the same processes:
  gather:  gloo ``all_gather_single`` (= all_gather_into_tensor) (S in, 2S out)  vs  ODC gather (copy the peer's
           exposed shard out of its shm segment into the output);
  reduce:  gloo ``reduce_scatter_single`` (= reduce_scatter_tensor) (2S in, S out)   vs  ODC scatter-accumulate (add each
           owner's slice into its shm accumulator under stripe locks).
Each timing is the slowest rank's median over ``iters`` calls, ranks aligned by a barrier before
every call. Printed ratios are gloo time / shm time (higher is better for ODC).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from posttrain._compat import all_gather_single, reduce_scatter_single
from posttrain.launch import run_ranks
from posttrain.odc import ShmTransport

__all__ = ["TransportBench", "bench_transport"]


def _time(fn, iters: int, group) -> float:
    times = []
    for _ in range(iters + 1):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times[1:])], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _worker(rank: int, world_size: int, sizes_mib: list[float], iters: int) -> list[dict]:
    group = dist.group.WORLD
    rows = []
    for mib in sizes_mib:
        n = int(mib * 2**20) // 4
        t = ShmTransport.create(group, {"params": n * 4, "grads": n * 4})
        shard = torch.randn(n)
        t.region(rank, "params", torch.float32).copy_(shard)
        out = torch.empty(world_size * n)
        full_grad = torch.randn(world_size * n)
        rs_out = torch.empty(n)
        dist.barrier(group=group)

        def gloo_gather():
            all_gather_single(out, shard, group=group)

        def shm_gather():
            view = out.view(world_size, n)
            view[rank].copy_(shard)
            for q in range(world_size):
                if q != rank:
                    view[q].copy_(t.region(q, "params", torch.float32))

        def gloo_reduce():
            reduce_scatter_single(rs_out, full_grad, group=group)

        def shm_reduce():
            rows_ = full_grad.view(world_size, n)
            for i in range(world_size):
                owner = (rank + 1 + i) % world_size
                t.accumulate(t.region(owner, "grads", torch.float32), rows_[owner], owner=owner, byte_offset=0)

        row = {"shard_mib": mib}
        for name, fn in [("gloo_gather", gloo_gather), ("shm_gather", shm_gather),
                         ("gloo_reduce", gloo_reduce), ("shm_reduce", shm_reduce)]:
            row[name + "_s"] = _time(fn, iters, group)
        # bytes that cross between ranks per rank: (world_size - 1) shards either way
        moved = (world_size - 1) * n * 4
        for name in ("gloo_gather", "shm_gather", "gloo_reduce", "shm_reduce"):
            row[name + "_gib_s"] = moved / row[name + "_s"] / 2**30
        row["gather_ratio"] = row["gloo_gather_s"] / row["shm_gather_s"]
        row["reduce_ratio"] = row["gloo_reduce_s"] / row["shm_reduce_s"]
        rows.append(row)
        t.close()
    return rows


@dataclass(frozen=True)
class TransportBench:
    """``posttrain bench transport``: the sizes measured, and where the result goes.

    Attributes:
        sizes_mib: per-rank shard sizes in MiB (fp32).
        iters: timed calls per measurement.
        json: results file ('' for none).
    """

    sizes_mib: tuple[float, ...] = (1.0, 4.0, 16.0, 64.0)
    iters: int = 10
    json: str = "out/bench_transport.json"

    def __post_init__(self) -> None:
        if self.iters < 1:
            raise ValueError(f"iters={self.iters} must be at least 1")
        if not self.sizes_mib or not all(s > 0 for s in self.sizes_mib):
            raise ValueError(f"sizes_mib={','.join(map(str, self.sizes_mib))} needs positive sizes")

    def run(self, log=print) -> dict:
        """:func:`bench_transport` of these options, written to ``json``."""
        from .split import write_result

        result = {"world_size": 2, "iters": self.iters, "rows": bench_transport(self.sizes_mib, self.iters, log=log)}
        write_result(result, self.json, log)
        return result


def bench_transport(sizes_mib=(1, 4, 16, 64), iters: int = 10, *, log=print) -> list[dict]:
    """Run the measurement on 2 ranks; print a table of bandwidths and ratios; return its rows.

    Args:
        sizes_mib: per-rank shard sizes (fp32).
        iters: timed calls per measurement.
    """
    TransportBench(tuple(sizes_mib), iters, json="")  # checks them
    rows = run_ranks(_worker, 2, list(sizes_mib), iters, timeout_s=900)[0]
    log("ODC shm transport vs gloo, 2 ranks, fp32; GiB/s = bytes from/to the peer per rank")
    log(f"{'shard MiB':>9} | {'gloo AG':>8} {'shm gather':>10} {'ratio':>6} | {'gloo RS':>8} {'shm s-acc':>9} {'ratio':>6}")
    for r in rows:
        log(f"{r['shard_mib']:>9g} | {r['gloo_gather_gib_s']:>8.2f} {r['shm_gather_gib_s']:>10.2f} "
            f"{r['gather_ratio']:>5.1f}x | {r['gloo_reduce_gib_s']:>8.2f} {r['shm_reduce_gib_s']:>9.2f} "
            f"{r['reduce_ratio']:>5.1f}x")
    return rows
