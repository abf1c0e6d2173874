"""Do ODC's gathers and adds cost more when every rank runs them at the same moment?

Issue 47, part 4: the 4- and 8-rank demos on the 16-core GPU machine showed the collective run (a
barrier before every gather and after every push) spending 20-40 ms a step in gathers and adds
outside its barriers, against 0.6-1.7 ms for the same copies in the one-sided run. This probe takes
the engine out of it: N pinned processes over the real shared-memory transport (``ShmTransport``),
one unit's gather (copy every owner's shard into a full vector) and push (add each owner's row into
its accumulator under the stripe locks, owners in the engine's rotated order), each timed alone in
three arrangements:

  sync     a barrier, then every rank at once (what the collective run does)
  serial   a barrier, then one rank after another (the same data, nobody beside it)
  stagger  no barrier; a random stretch of compute before each (what the one-sided run sees)

plus ``sync-fresh``: the gather into a new vector each time, as the engine allocates one; and two
pushes with one lock per row taken by a try first, counting how often a peer held it
(``sync-counted``: then waited for in the kernel, as the transport waits; ``sync-spin``: spun for).
Between two operations every rank runs the same small compute (a matmul over a working set larger
than a core's L2), so caches are as disturbed as in training. Printed: the slowest rank's median ms
per operation, each arrangement's against ``serial``, and the slowest rank's mean and 99th
percentile (a rare long stall shows there, not in the median).

What it found there (docs/results.md, "fourth session"): all ranks at once cost at most 1.42x one at
a time, under 0.1 ms an operation, so the copies were not it; the demos had put every rank on the
machine's GPU (the demo now runs on CPU processes).

    python scripts/shm_contention_probe.py                       # N = 2 (and 4, 8 where there are cores)
    python scripts/shm_contention_probe.py --world-sizes 4,8 --cores 0-15 --unit-mib 0.75,6 --json out/shm.json
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from posttrain.launch import run_ranks
from posttrain.odc import ShmTransport

_TURN = 7  # a value slot of the transport's header: "rank r has had its turn in round k"


def _try(fd: int) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0, os.SEEK_SET)
        return True
    except OSError:
        return False


def _cores(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def _worker(rank: int, world: int, cores: list[int], unit_bytes: int, iters: int, seed: int, pin: bool) -> list[dict]:
    os.sched_setaffinity(0, {cores[rank]} if pin else set(cores[:world]))
    torch.set_num_threads(1)
    group = dist.group.WORLD
    shard = -(-unit_bytes // (4 * world))  # fp32 elements per owner
    t = ShmTransport.create(group, {"params": shard * 4, "grads": shard * 4})
    t.region(rank, "params", torch.float32).copy_(torch.randn(shard))
    t.region(rank, "grads", torch.float32).zero_()
    params = [t.region(q, "params", torch.float32) for q in range(world)]
    grads = [t.region(q, "grads", torch.float32) for q in range(world)]
    full = torch.empty(world * shard)
    rows = torch.randn(world, shard)
    a = torch.randn(384, 384)  # ~1.7 MiB of operands: more than a core's L2
    b = torch.randn(384, 384)
    rng = random.Random(seed + rank)

    def compute(reps: int = 1) -> None:
        for _ in range(reps):
            torch.mm(a, b)

    def gather(dst: torch.Tensor | None = None) -> None:
        v = (full if dst is None else dst).view(world, shard)
        for q in range(world):
            v[q].copy_(params[q])

    def gather_fresh() -> None:
        gather(torch.empty(world * shard))

    def push() -> None:
        for i in range(world):
            owner = (rank + 1 + i) % world
            t.accumulate(grads[owner], rows[owner], owner=owner, byte_offset=0)

    contended = [0]

    def push_with(spin: bool) -> None:
        # an add under one lock per row (the owner's first stripe: a row of the default unit fits
        # in one), taken by a try first: counted when a peer holds it, then either waited for in the
        # kernel (as ShmTransport.accumulate waits) or spun for
        for i in range(world):
            owner = (rank + 1 + i) % world
            fd = t._fds[owner]
            if not _try(fd):
                contended[0] += 1
                if spin:
                    while not _try(fd):
                        pass
                else:
                    fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0, os.SEEK_SET)
            try:
                grads[owner].add_(rows[owner])
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, 0, os.SEEK_SET)

    turn = [0]

    def timed(op, mode: str) -> float:
        compute()
        if mode == "stagger":
            compute(rng.randrange(0, 4))
        else:
            t.barrier(1)
        if mode == "serial":
            turn[0] += 1
            while rank > 0 and t.values(_TURN)[rank - 1] < turn[0]:
                pass
        t0 = time.perf_counter()
        op()
        dt = time.perf_counter() - t0
        if mode == "serial":
            t.set_value(_TURN, turn[0])
        return dt

    cases = [("gather", gather, "sync"), ("gather", gather, "serial"), ("gather", gather, "stagger"),
             ("gather", gather_fresh, "sync-fresh"),
             ("push", push, "sync"), ("push", push, "serial"), ("push", push, "stagger"),
             ("push", lambda: push_with(False), "sync-counted"), ("push", lambda: push_with(True), "sync-spin")]
    out = []
    for op, fn, mode in cases:
        m = "sync" if mode.startswith("sync") else mode
        contended[0] = 0
        for _ in range(5):
            timed(fn, m)
        times = [timed(fn, m) for _ in range(iters)]
        t.barrier(2)
        times.sort()
        stat = torch.tensor([statistics.median(times), statistics.fmean(times), times[int(0.99 * (len(times) - 1))]],
                            dtype=torch.float64)
        dist.all_reduce(stat, op=dist.ReduceOp.MAX, group=group)
        med, mean, p99 = (float(x) * 1e3 for x in stat)
        out.append({"world_size": world, "unit_bytes": unit_bytes, "op": op, "mode": mode,
                    "ms": med, "mean_ms": mean, "p99_ms": p99, "contended": contended[0] / (iters + 5)})
    t.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    n_cores = len(os.sched_getaffinity(0))
    default_ws = ",".join(str(w) for w in (2, 4, 8) if w <= n_cores)
    ap.add_argument("--world-sizes", default=default_ws, help=f"ranks, each run in turn (default {default_ws})")
    ap.add_argument("--cores", default=f"0-{n_cores - 1}", help="cores, rank i pinned to the i-th (default all)")
    ap.add_argument("--unit-mib", default="0.75,6",
                    help="one unit's full fp32 size in MiB (default 0.75: the demo's block, dim 128; and 6)")
    ap.add_argument("--iters", type=int, default=200, help="timed operations per case (default 200)")
    ap.add_argument("--no-pin", action="store_true",
                    help="let the ranks share the first N of --cores as the scheduler likes (default: one core each)")
    ap.add_argument("--json", default="", help="the rows as JSON ('' for none)")
    args = ap.parse_args()
    cores = _cores(args.cores)
    sizes = [int(float(s) * 2**20) for s in args.unit_mib.split(",")]
    worlds = [int(w) for w in args.world_sizes.split(",")]
    if max(worlds) > len(cores):
        ap.error(f"--world-sizes {max(worlds)} needs as many cores, --cores gives {len(cores)}")
    rows = []
    for w in worlds:
        for size in sizes:
            res = run_ranks(_worker, w, cores, size, args.iters, 0, not args.no_pin, timeout_s=600)
            got = res[0]
            serial = {r["op"]: r["ms"] for r in got if r["mode"] == "serial"}
            for r in got:
                r["vs_serial"] = r["ms"] / serial[r["op"]]
                pin = " unpinned" if args.no_pin else ""
                print(f"N={w:2d}{pin} unit {size / 2**20:5.2f} MiB  {r['op']:6s} {r['mode']:10s} {r['ms']:8.3f} ms"
                      f"  {r['vs_serial']:5.2f}x serial  mean {r['mean_ms']:7.3f}  p99 {r['p99_ms']:7.3f}"
                      + (f"  {r['contended']:.2f} waits/op" if r["mode"].startswith("sync-") and r["op"] == "push" else ""),
                      flush=True)
            rows += got
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
