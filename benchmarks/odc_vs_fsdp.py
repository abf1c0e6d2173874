"""FSDP2 vs ODC training throughput on this machine, side by side in one run, 2 ranks.

    python benchmarks/odc_vs_fsdp.py                       # long-tail profile
    python benchmarks/odc_vs_fsdp.py --profile uniform     # near-equal lengths: the control

Same model, data and steps for every variant: FSDP2 (gloo) with round_robin and with
same_micro; ODC in collective mode (same_micro); ODC with round_robin and with diff_micro; and
the ideal bound (single-process compute time of all microbatches divided evenly over the ranks,
no communication). Prints tokens/s, utilization and ratios; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace

from posttrain._launch import run_ranks
from posttrain.train import (
    TrainConfig, microbatch_compute_times, minibatch_sequences, summarize, train_worker,
)

VARIANTS = [
    ("fsdp", "round_robin"),
    ("fsdp", "same_micro"),
    ("odc-collective", "same_micro"),
    ("odc", "round_robin"),
    ("odc", "diff_micro"),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="long_tail", help="length profile (default long_tail)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--sequences", type=int, default=16, help="sequences per minibatch")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--json", default="out/odc_vs_fsdp.json")
    a = p.parse_args(argv)
    base = TrainConfig(profile=a.profile, steps=a.steps, sequences=a.sequences, max_len=a.max_len,
                       max_tokens=a.max_len, dim=a.dim, num_layers=a.layers)
    world_size = 2
    results = {}
    for dp, balance in VARIANTS:
        cfg = replace(base, dp=dp, balance=balance)
        results[f"{dp}+{balance}"] = summarize(run_ranks(train_worker, world_size, cfg, timeout_s=1800))
        r = results[f"{dp}+{balance}"]
        print(f"  ran {dp}+{balance}: {r['tokens_per_s']:.0f} tokens/s", flush=True)
    compute = microbatch_compute_times(replace(base, balance="diff_micro"), world_size)[1:]
    ref = results["fsdp+same_micro"]["tokens_per_s"]
    # ideal: same tokens, compute split evenly over ranks, no communication, steps after the first
    ideal_tokens = sum(sum(len(s) - 1 for s in minibatch_sequences(base, k)) for k in range(1, base.steps))
    results["ideal"] = {"tokens_per_s": ideal_tokens / (sum(compute) / world_size), "utilization": 1.0}
    print(f"\nFSDP2 vs ODC, {world_size} ranks, profile {a.profile}, GPT {a.layers}x{a.dim}, "
          f"{a.sequences} sequences/step up to {a.max_len} tokens, {a.steps} steps (first excluded)")
    print(f"{'variant':28} {'tokens/s':>9} {'util':>6} {'vs fsdp+same_micro':>19}")
    for name, r in results.items():
        print(f"{name:28} {r['tokens_per_s']:9.0f} {r['utilization']:6.2f} {r['tokens_per_s'] / ref:18.2f}x")
    odc = results["odc+diff_micro"]["tokens_per_s"]
    print(f"\nodc+diff_micro / fsdp+same_micro = {odc / ref:.2f}x; odc+diff_micro / ideal = "
          f"{odc / results['ideal']['tokens_per_s']:.2f}")
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"config": asdict(base), "world_size": world_size, "results": results}, f, indent=2)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
