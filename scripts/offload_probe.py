"""Where selective offload's cost goes on one Llama-style stage: every step's time, not a median.

The doctor's offload section (posttrain.lab.offload_gpu.measure_offload) reports the median of a few
steps per variant. This probe runs the same stage, order and store with several shares of each
microbatch offloaded, the variants taking turns over rounds, and prints every step's time, the bytes
moved, the reloads that came late and the pool's pinned allocations, then profiles one step of a
chosen share (host-side calls by self time: synchronizations, pinned allocations, copies).

Usage (GPU): python scripts/offload_probe.py [--tokens 4096] [--fractions 0,1,0.05,0.1,0.15,0.25]
             [--rounds 5] [--microbatches 8] [--profile 0.15] [--fresh-store]
On the CPU (a dry run of the code): --device cpu --hidden 256 --tokens 256 --rounds 2
--fresh-store: a store of its own for each share (no host buffers left by another share's steps).
--doctor: instead, the doctor's offload section alone (measure_offload as `posttrain doctor` calls
it: 4,096 and 16,384 tokens, 8 microbatches, none, full and the planner's share), its two tables.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from posttrain.lab.offload_gpu import _Clock, _step, _zero_grads, build_llama_stage, offload_order
from posttrain.pipeline import ActivationStore


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--fractions", default="0,1,0.05,0.1,0.15,0.25")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", type=float, default=None, help="profile one step at this share")
    ap.add_argument("--fresh-store", action="store_true")
    ap.add_argument("--doctor", action="store_true", help="the doctor's offload section alone")
    a = ap.parse_args(argv)
    if a.doctor:
        from posttrain.lab.offload_gpu import format_offload, format_selective, measure_offload
        rows = measure_offload(torch.device(a.device), microbatches=8, **(
            {} if a.device != "cpu" else {"hidden": a.hidden, "tokens": (a.tokens,), "dtype": torch.float32}))
        print("\n".join([*format_offload(rows), "", *format_selective(rows)]))
        return 0
    fractions = [float(x) for x in a.fractions.split(",")]
    if any(not 0 <= f <= 1 for f in fractions) or 0.0 not in fractions:
        print("offload_probe: --fractions are shares in [0, 1] and include 0 (the baseline)", file=sys.stderr)
        return 2
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
    torch.manual_seed(0)
    stage, _ = build_llama_stage(a.hidden, a.layers, a.tokens, device, dtype)
    params = list(stage.parameters())
    inputs = [torch.randn(1, a.tokens, a.hidden, device=device, dtype=dtype).requires_grad_()
              for _ in range(a.microbatches)]
    leaves = params + inputs
    order = offload_order(a.microbatches)
    clock = _Clock(device)
    shared = ActivationStore(params, device)
    stores = {f: (ActivationStore(params, device) if a.fresh_store else shared) for f in fractions}

    def one(f: float) -> tuple[float, dict]:
        store = stores[f]
        _zero_grads(leaves)
        store.reset_stats()
        allocs = store.pool.allocations
        clock.start()
        _step(stage, inputs, store, order, f)
        t = clock.stop()
        return t, {"late": store.late_reloads, "moved": store.offloaded_bytes,
                   "allocs": store.pool.allocations - allocs}

    for f in fractions:  # warm-up: kernels, the pools' buffers
        one(f)
    times: dict[float, list[float]] = {f: [] for f in fractions}
    info: dict[float, dict] = {}
    for r in range(a.rounds):
        turn = fractions[r % len(fractions):] + fractions[:r % len(fractions)]
        for f in turn:
            t, info[f] = one(f)
            times[f].append(t)
            print(f"round {r + 1} share {f:.2f}: {1e3 * t:.1f} ms  late reloads {info[f]['late']}  "
                  f"moved {info[f]['moved'] / 2**30:.2f} GiB  pinned allocations {info[f]['allocs']}", flush=True)
    base = statistics.median(times[0.0])
    print(f"\n{a.tokens} tokens, {a.microbatches} microbatches, hidden {a.hidden}, {a.layers} layers, "
          f"{'a store per share' if a.fresh_store else 'one store'}:")
    print("| share | median ms | min-max ms | overhead (median) | GiB moved a step |")
    print("|---|---|---|---|---|")
    for f in fractions:
        med = statistics.median(times[f])
        print(f"| {f:.2f} | {1e3 * med:.1f} | {1e3 * min(times[f]):.1f}-{1e3 * max(times[f]):.1f} | "
              f"{100 * (med / base - 1):+.1f}% | {info[f]['moved'] / 2**30:.2f} |")
    if a.profile is not None:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        one(a.profile)
        with profile(activities=acts) as prof:
            one(a.profile)
        print(f"\none step at share {a.profile:.2f} under the profiler, by self CPU time:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=48))
        if device.type == "cuda":
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=48))
    return 0


if __name__ == "__main__":
    sys.exit(main())
