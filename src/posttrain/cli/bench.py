"""``posttrain bench ...``: benchmarks that print ratios measured side by side in one run.

Each benchmark's options are the fields of its configuration in :mod:`posttrain.lab.bench`,
which runs it (``config.run()``) and writes its JSON.
"""

from __future__ import annotations

import importlib

from .options import add_command

__all__ = ["BENCHMARKS", "add_parser"]

#: name -> (module of posttrain.lab.bench, its configuration class, one-line help)
BENCHMARKS = {
    "odc": ("odc", "ODCBench", "FSDP2 vs ODC vs the bounds, side by side, and where the gain comes from"),
    "rl": ("rl", "RLBench", "the RL update on the same rollouts: ODC+diff_micro vs FSDP2 vs ODC collective"),
    "rl-e2e": ("rl_e2e", "RLE2EBench", "whole GRPO steps by stopwatch: batched vs per-prompt sampling, engines, TRL"),
    "balance": ("balance", "BalanceBench", "plan time and imbalance of every balancing method, 2-1024 ranks"),
    "transport": ("transport", "TransportBench", "ODC's shared-memory gather and scatter-accumulate vs gloo, 2 ranks"),
    "overhead": ("overhead", "OverheadBench", "one microbatch under FSDP2 and flat ODC against the plain model"),
    "pipeline": ("pipeline", "PipelineBench", "saved-activation peaks per schedule and offload; our runner vs torch's"),
    "pipeline-dp": ("pipeline_dp", "PipelineDPBench",
                    "pipeline x data parallelism on long-tail data: ODC+diff_micro vs FSDP2"),
    "lora": ("lora", "LoraBench", "LoRA adapters vs full fine-tuning: optimizer state, bytes pushed, step time"),
}


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: ratios measured side by side in one run")
    bs = bench.add_subparsers(dest="bench", required=True)
    for name, (module, cls, text) in BENCHMARKS.items():
        config = getattr(importlib.import_module(f"posttrain.lab.bench.{module}"), cls)
        add_command(bs, name, config, lambda cfg: cfg.run(), help=text)
