"""Bounds on a training step: what the same microbatches cost with no communication at all."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from posttrain.balance import FlopsCost
from posttrain.models import build_model

from .config import TrainConfig
from .loop import microbatch_loss, plan_step
from .minibatches import TrainData

__all__ = ["ideal_compute_worker"]


def ideal_compute_worker(rank: int, world_size: int, cfg: TrainConfig) -> list[float]:
    """Per step, this rank's time to run forward+backward of *every* microbatch of the plan on
    an unsharded model with no communication at all. Run on ``world_size`` processes at once, so
    each measures under the same core and memory contention as training; the ideal bound is
    that time divided evenly over the ranks."""
    data = TrainData(cfg, world_size)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.model_config(data.vocab_size))
    if cfg.precision == "bf16":
        model = model.to(torch.bfloat16)
    cost = FlopsCost.from_config(cfg.model_config(data.vocab_size))
    out = []
    for step in range(cfg.steps):
        seqs = data.minibatch(step)
        plan = plan_step(cfg, seqs, world_size, cost)
        dist.barrier()
        t0 = time.perf_counter()
        for mbs in plan.ranks:
            for m in mbs:
                if m.sequence_ids:
                    microbatch_loss(model, seqs, m.sequence_ids, 1.0).backward()
        model.zero_grad()
        out.append(time.perf_counter() - t0)
    return out
