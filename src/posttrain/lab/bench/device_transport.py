"""ODC's device transport on a GPU: gather and scatter-accumulate beside a device-to-device copy.

    python -m posttrain.lab.bench.device_transport            # 2 ranks, 64 and 256 MiB regions
    (posttrain doctor runs it and puts the table in its report)

Two processes share the GPU(s) of this host through the device transport (CUDA IPC; [Note: the
device transport]) and a gloo group. For each region size S (fp32 elements, per rank), every
operation runs on both ranks at once (``both``) and on rank 0 alone while rank 1 waits
(``alone``), each timed by device events, median of ``iters`` after a warm-up, the slower rank's
median reported:

- ``copy``: a device-to-device copy of S bytes inside the rank's own memory (the yardstick);
- ``gather``: copy the peer's region (S bytes) into a local buffer: what a gather moves per peer;
- ``add (local)``: ``dst += src`` on own memory (the yardstick of a read-modify-write);
- ``slot add``: ``+=`` into this writer's own slot at the peer (deterministic mode: no race);
- ``atomic (triton)`` / ``atomic (index_add)``: device atomic adds into the peer's one accumulator;
- ``locked``: the host stripe locks held until each add finished.

GB/s count S bytes per operation for every row (the same bytes), so each ratio to ``copy`` (or,
for the adds, to ``add (local)``) is the transport's cost beside the device's own speed. On one GPU
the two processes' kernels time-share the device (no MPS), so ``both`` measures contention and
``alone`` the path itself.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

from posttrain.launch import run_ranks
from posttrain.odc._cuda import DeviceTransport, accumulate_atomic, triton_available

__all__ = ["bench_device_transport", "format_rows"]


def _time(fn: Callable[[], None], iters: int, device: torch.device, active: bool) -> float:
    """The slower rank's median seconds of ``fn`` (device events); ranks aligned before each call."""
    times = []
    stream = torch.accelerator.current_stream(device)
    for i in range(iters + 2):
        stream.synchronize()
        dist.barrier()
        if not active:
            continue
        start, end = torch.Event(device=device, enable_timing=True), torch.Event(device=device, enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 2:  # two warm-ups
            times.append(start.elapsed_time(end) / 1e3)
    med = torch.tensor([statistics.median(times) if times else 0.0], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med.item())


def _worker(rank: int, world_size: int, sizes_mib: list[int], iters: int) -> list[dict]:
    dev = torch.device("cuda", 0)  # both ranks on one GPU: the transport's setting (several GPUs: not written)
    torch.accelerator.set_device_index(dev.index)
    rows = []
    for mib in sizes_mib:
        n = mib * 2**20 // 4
        locked = DeviceTransport.create(dist.group.WORLD, {"params": n * 4, "grads": n * 4 * world_size}, device=dev,
                                        accumulate="locked", timeout_s=120)
        peer = (rank + 1) % world_size
        src = torch.randn(n, device=dev)
        local = torch.empty(n, device=dev)
        acc = torch.zeros(n, device=dev)
        locked.region(rank, "params", torch.float32).copy_(torch.randn(n, device=dev))
        peer_params = locked.region(peer, "params", torch.float32)
        peer_acc = locked.region(peer, "grads", torch.float32)[:n]
        peer_slot = locked.region(peer, "grads", torch.float32).view(world_size, n)[rank]
        locked.barrier(1)
        ops = {
            "copy": lambda: local.copy_(src),
            "gather": lambda: local.copy_(peer_params),
            "add (local)": lambda: acc.add_(src),
            "slot add": lambda: peer_slot.add_(src),
            "atomic (index_add)": lambda: accumulate_atomic(peer_acc, src, kernel="index_add"),
            "locked": lambda: locked.accumulate(peer_acc, src, owner=peer, byte_offset=0),
        }
        if triton_available():
            ops["atomic (triton)"] = lambda: accumulate_atomic(peer_acc, src, kernel="triton")
        for mode in ("alone", "both"):
            for name, fn in ops.items():
                seconds = _time(fn, iters, dev, active=rank == 0 or mode == "both")
                rows.append({"mib": mib, "mode": mode, "op": name, "s": seconds, "gb_s": n * 4 / seconds / 1e9})
        locked.barrier(2)
        locked.close()
    return rows


def format_rows(rows: list[dict]) -> list[str]:
    """Markdown table lines: GB/s and the ratio to the device's own copy (or local add)."""
    out = ["| MiB | ranks | operation | GB/s | / yardstick |", "|---|---|---|---|---|"]
    base = {(r["mib"], r["mode"], r["op"]): r["gb_s"] for r in rows}
    for r in rows:
        yard = "copy" if r["op"] in ("copy", "gather") else "add (local)"
        ratio = r["gb_s"] / base[(r["mib"], r["mode"], yard)]
        out.append(f"| {r['mib']} | {r['mode']} | {r['op']} | {r['gb_s']:.0f} | {ratio:.2f} (of {yard}) |")
    return out


def bench_device_transport(sizes_mib: tuple[int, ...] = (64, 256), iters: int = 20, *, log=print) -> list[dict]:
    """Run the measurement on 2 ranks of this host's GPU(s); log the table; return its rows."""
    rows = run_ranks(_worker, 2, list(sizes_mib), iters, start="spawn", timeout_s=600)[0]
    for line in format_rows(rows):
        log(line)
    return rows


if __name__ == "__main__":
    bench_device_transport()
