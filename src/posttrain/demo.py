"""The ODC demo: a tiny GPT trained on CPU processes with ODC on long-tail sequence lengths.

It is :func:`posttrain.train.train_worker` with ``dp="odc"`` and ``balance="diff_micro"`` on the
embedded ``long_tail`` profile: every rank gets about the same cost (FLOPs cost model), packed
into microbatches of at most ``max_len`` tokens, so ranks may run *different numbers of
microbatches* - something FSDP's per-layer collectives cannot do and ODC can. The task is
learnable (counting with a per-sequence stride), so the loss falls visibly within a few dozen steps.
"""

from __future__ import annotations

import json
import os

from posttrain._launch import run_ranks
from posttrain.train import TrainConfig, train_worker

__all__ = ["DEMO", "run_demo"]


#: The embedded default: runs in a few seconds on 2 CPU cores.
DEMO = TrainConfig(dp="odc", balance="diff_micro", profile="long_tail", steps=30, sequences=12,
                   max_len=192, max_tokens=192, dim=64, num_layers=4, lr=3e-3)


def run_demo(cfg: TrainConfig = DEMO, *, world_size: int = 2, metrics_path: str | None = None) -> list[list[dict]]:
    """Train ``cfg`` on ``world_size`` CPU processes, printing one line per step.

    Args:
        cfg: the run (default: the embedded demo).
        world_size: CPU processes.
        metrics_path: if given, every rank's per-step metrics are written there as JSON lines.

    Returns:
        Every rank's per-step metrics.
    """
    if world_size < 1:
        raise ValueError(f"--world-size={world_size} must be at least 1")
    if cfg.sequences < world_size:
        raise ValueError(f"--sequences={cfg.sequences} is fewer than --world-size={world_size}")
    print(
        f"posttrain: {cfg.dp} on {world_size} CPU processes, GPT {cfg.num_layers}x{cfg.dim}, "
        f"{cfg.sequences} {cfg.profile} sequences per minibatch ({cfg.balance}, packed), {cfg.steps} steps",
        flush=True,
    )
    per_rank = run_ranks(train_worker, world_size, cfg, timeout_s=24 * 3600)
    steps = list(zip(*per_rank))
    for s in steps:
        step_time = max(r["step_time_s"] for r in s)
        print(
            f"step {s[0]['step']:3d}  loss {sum(r['loss'] for r in s):.3f}  {s[0]['tokens']:5d} tokens  "
            f"{s[0]['tokens'] / step_time:8.0f} tokens/s  microbatches per rank {[r['microbatches'] for r in s]}"
        )
    steady = steps[len(steps) // 3 :] or steps
    tps = sum(s[0]["tokens"] for s in steady) / sum(max(r["step_time_s"] for r in s) for s in steady)
    first, last = (sum(r["loss"] for r in s) for s in (steps[0], steps[-1]))
    print(f"loss {first:.3f} -> {last:.3f}; {tps:.0f} tokens/s after warm-up")
    if metrics_path:
        os.makedirs(os.path.dirname(metrics_path) or ".", exist_ok=True)
        with open(metrics_path, "w") as f:
            for s in steps:
                for r in s:
                    f.write(json.dumps(r) + "\n")
        print(f"wrote {metrics_path}")
    return per_rank
