"""Where a split sequence's extra time goes: one sequence of N tokens (posttrain's GPT, the default
shape, fp32, the CPU) forward and backward whole on each of 2 ranks at once, then split over them
through the shared-memory exchange the ODC trainers use, each 3 times under ``torch.profiler``
after 2 warm-up runs; per rank, the step times and the operators with the most self time a step
(the exchange's calls as ``EX_all_gather_into`` / ``EX_reduce_scatter_into``: their time is mostly
waiting for the other rank).

    python scripts/split_profile.py 4096
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from posttrain.launch import run_ranks


def _labelled(exchange) -> None:
    """The exchange's calls as profiler ranges of their own."""
    cls = type(exchange)

    def labelled(name: str):
        plain = getattr(cls, name)

        def call(self, *args):
            with torch.profiler.record_function("EX_" + name):
                return plain(self, *args)
        return call

    for name in ("all_gather_into", "reduce_scatter_into"):
        setattr(cls, name, labelled(name))


def worker(rank: int, world: int, n: int, reps: int) -> dict:
    from posttrain.balance.context import Shard, shard_lengths
    from posttrain.lab.bench.cp_exchange import measured_config
    from posttrain.models import GPT
    from posttrain.odc import row_exchange
    from posttrain.train.sft.loop import microbatch_loss, shard_loss

    torch.manual_seed(0)
    model = GPT(measured_config([n]).model_config())
    exchange = row_exchange(dist.new_group(list(range(world))))
    _labelled(exchange)
    seq = torch.randint(0, model.cfg.vocab_size, (n + 1,))
    shard = Shard(0, rank, 2, (0, 1), shard_lengths(n, 2)[rank], 0.0)

    def run(mode: str) -> None:
        if mode == "whole":
            microbatch_loss(model, [seq], [0], 1.0).backward()
        else:
            shard_loss(model, seq, shard, exchange).backward()

    out = {}
    try:
        for mode in ("whole", "split"):
            for _ in range(2):
                dist.barrier()
                run(mode)
            times = []
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(reps):
                    dist.barrier()
                    t = time.perf_counter()
                    run(mode)
                    times.append(time.perf_counter() - t)
            rows = [(e.key, e.self_cpu_time_total / reps / 1e3, e.count // reps) for e in prof.key_averages()]
            out[mode] = (times, sorted(rows, key=lambda r: -r[1])[:18])
    finally:
        exchange.close()
    return out


def main() -> int:
    if len(sys.argv) != 2 or not sys.argv[1].isdigit() or int(sys.argv[1]) < 4:
        raise SystemExit("usage: python scripts/split_profile.py TOKENS (at least 4)")
    torch.set_num_threads(1)
    for rank, got in enumerate(run_ranks(worker, 2, int(sys.argv[1]), 3, timeout_s=1800)):
        for mode, (times, rows) in got.items():
            print(f"rank {rank} {mode}: step ms {[round(t * 1e3, 1) for t in times]}")
            for key, ms, count in rows:
                print(f"    {key:60} {ms:8.2f} ms  x{count}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
