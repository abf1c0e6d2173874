"""The demo: FSDP2 and ODC train the same tiny GPT on the same long-tail data, 2 CPU processes,
and the speedup is split into where it comes from.

Four runs, each computing the same gradients (their loss curves match):

- ``FSDP2 + same_micro``: gloo collectives, the best balancing FSDP allows (every rank the same
  number of microbatches);
- ``ODC-on-FSDP2 collective``: FSDP2 with ODC's shared-memory transport but FSDP's rendezvous at
  every gather and reduce, same plans: the gain over the first is the **transport**;
- ``flat ODC collective``: ODC's own flat engine, still with the rendezvous and the same plans:
  the gain over the second is the **engine**;
- ``flat ODC + diff_micro``: one synchronization per minibatch and minibatch-level balancing:
  the gain over the third is ODC's **mechanism**, the paper's idea.

The table shows tokens/s, utilization (compute share of step time), waiting and the speedups;
the timeline PNG shows one step of the first, third and fourth run per rank: compute,
communication, and waiting. docs/results.md has the measured factors; ``posttrain bench odc``
measures the same factors with bounds, over rounds.
"""

from __future__ import annotations

import os
from dataclasses import replace

from posttrain.dp import EngineConfig
from posttrain.lab.plots import plot_timelines
from posttrain.train.core import OptimConfig
from posttrain.train.sft import TrainConfig, run_training, summarize

__all__ = ["DEMO", "VARIANTS", "run_demo"]

#: The embedded default: small enough for a short run of every variant on 2 CPU processes.
DEMO = TrainConfig(balance="diff_micro", profile="long_tail", steps=30, sequences=12, max_len=192, max_tokens=192,
                   dim=64, num_layers=4, optim=OptimConfig(lr=3e-3), progress=True)

#: (label, engine, odc mode, balancing method, drawn in the timeline)
VARIANTS = (
    ("FSDP2 + same_micro", "fsdp", "one-sided", "same_micro", True),
    ("ODC-on-FSDP2 collective", "odc-fsdp2", "collective", "same_micro", False),
    ("flat ODC collective", "odc", "collective", "same_micro", True),
    ("flat ODC + diff_micro", "odc", "one-sided", "diff_micro", True),
)
#: factor -> (numerator run, denominator run, what differs)
FACTORS = {
    "transport": (1, 0, "shared-memory copies instead of gloo collectives (same FSDP2 engine, plans, rendezvous)"),
    "engine": (2, 1, "flat buffers instead of FSDP2's per-parameter work (same transport, plans, rendezvous)"),
    "mechanism": (3, 2, "ODC: one sync per minibatch, minibatch balancing (same engine and transport)"),
}


def run_demo(cfg: TrainConfig = DEMO, *, world_size: int = 2,
             timeline_path: str | None = "out/demo_timeline.png") -> dict[str, dict]:
    """Train ``cfg`` with every variant; print the table and the factors, write the timeline.

    Returns:
        variant label -> :func:`posttrain.train.sft.summarize` of that run.
    """
    results, summaries = {}, {}
    for label, dp, mode, balance, _ in VARIANTS:
        results[label] = run_training(replace(cfg, engine=EngineConfig(dp, mode=mode), balance=balance), world_size=world_size)
        summaries[label] = summarize(results[label])
        print()
    labels = [v[0] for v in VARIANTS]
    base = summaries[labels[0]]["tokens_per_s"]
    print(f"{'':24} {'tokens/s':>9} {'utilization':>12} {'waiting':>8} {'final loss':>11} {'vs FSDP2':>9}")
    for label, s in summaries.items():
        print(f"{label:24} {s['tokens_per_s']:9.0f} {s['utilization']:12.2f} {s['wait_share']:8.2f} "
              f"{s['final_loss']:11.3f} {s['tokens_per_s'] / base:8.2f}x")
    print("(steps after the first; utilization: compute share of step time; waiting: communication and idle)")
    tp = [summaries[label]["tokens_per_s"] for label in labels]
    print(f"\nwhere flat ODC + diff_micro's {tp[3] / tp[0]:.2f}x over FSDP2 comes from (one run each; "
          "`posttrain bench odc` repeats and bounds them):")
    for name, (num, den, what) in FACTORS.items():
        print(f"  {name:10} {tp[num] / tp[den]:5.2f}x  {what}")
    if timeline_path:
        last = cfg.steps - 1
        runs = {label: [s for r in results[label] for s in r["spans"]] for label, *_, drawn in VARIANTS if drawn}
        os.makedirs(os.path.dirname(timeline_path) or ".", exist_ok=True)
        plot_timelines(runs, timeline_path, title=f"step {last}: per-rank compute, communication and waiting")
        print(f"wrote {timeline_path}")
    return summaries
