"""The demo: FSDP2 and then ODC train the same tiny GPT on the same long-tail data, 2 CPU processes.

FSDP2 runs ``same_micro`` (the best balancing FSDP allows: every rank the same number of
microbatches) with gloo collectives; ODC runs ``diff_micro`` (each rank's whole-minibatch cost
balanced, microbatch counts free) with one-sided shared-memory transfers and one barrier per
minibatch. Both compute the same gradients, so their loss curves match; the table shows tokens/s,
utilization (compute share of step time) and the speedup, and the timeline PNG shows one step of
each run per rank: compute, communication, and waiting.
"""

from __future__ import annotations

import os
from dataclasses import replace

from posttrain.timeline import plot_timelines
from posttrain.train import TrainConfig, run_training, summarize

__all__ = ["DEMO", "run_demo"]

#: The embedded default: a few seconds per run on 2 CPU cores.
DEMO = TrainConfig(dp="odc", balance="diff_micro", profile="long_tail", steps=30, sequences=12,
                   max_len=192, max_tokens=192, dim=64, num_layers=4, lr=3e-3, progress=True)

VARIANTS = (("FSDP2 + same_micro", "fsdp", "same_micro"), ("ODC + diff_micro", "odc", "diff_micro"))


def run_demo(cfg: TrainConfig = DEMO, *, world_size: int = 2,
             timeline_path: str | None = "out/demo_timeline.png") -> dict[str, dict]:
    """Train ``cfg`` with FSDP2 and with ODC; print a comparison table and write the timeline.

    Returns:
        variant label -> :func:`posttrain.train.summarize` of that run.
    """
    results, summaries = {}, {}
    for label, dp, balance in VARIANTS:
        results[label] = run_training(replace(cfg, dp=dp, balance=balance), world_size=world_size)
        summaries[label] = summarize(results[label])
        print()
    base = summaries[VARIANTS[0][0]]["tokens_per_s"]
    print(f"{'':20} {'tokens/s':>9} {'utilization':>12} {'waiting':>8} {'final loss':>11} {'speedup':>8}")
    for label, s in summaries.items():
        print(f"{label:20} {s['tokens_per_s']:9.0f} {s['utilization']:12.2f} {s['wait_share']:8.2f} "
              f"{s['final_loss']:11.3f} {s['tokens_per_s'] / base:7.2f}x")
    print("(steps after the first; utilization: compute share of step time; waiting: communication and idle)")
    if timeline_path:
        last = cfg.steps - 1
        runs = {label: [r["events"] for r in res] for label, res in results.items()}
        os.makedirs(os.path.dirname(timeline_path) or ".", exist_ok=True)
        plot_timelines(runs, timeline_path, title=f"step {last}: per-rank compute, communication and waiting")
        print(f"wrote {timeline_path}")
    return summaries
