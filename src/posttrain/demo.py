"""The ODC demo: a tiny GPT trained on CPU processes with ODC on long-tail sequence lengths.

It is :func:`posttrain.train.train_worker` with ``dp="odc"`` and ``balance="diff_micro"`` on the
embedded ``long_tail`` profile: every rank gets about the same cost (FLOPs cost model), packed
into microbatches of at most ``max_len`` tokens, so ranks may run *different numbers of
microbatches* - something FSDP's per-layer collectives cannot do and ODC can. The task is
learnable (counting with a per-sequence stride), so the loss falls visibly within a few dozen steps.
"""

from __future__ import annotations

from posttrain.train import TrainConfig, run_training

__all__ = ["DEMO", "run_demo"]

#: The embedded default: runs in a few seconds on 2 CPU cores.
DEMO = TrainConfig(dp="odc", balance="diff_micro", profile="long_tail", steps=30, sequences=12,
                   max_len=192, max_tokens=192, dim=64, num_layers=4, lr=3e-3)


def run_demo(cfg: TrainConfig = DEMO, *, world_size: int = 2) -> list[list[dict]]:
    """Train the demo configuration (or a variant of it); see :func:`posttrain.train.run_training`."""
    return run_training(cfg, world_size=world_size)
