"""Bounds on a training step: what the same sequences cost with no communication at all.

- **Even bound** (:func:`ideal_compute_worker`): all the step's compute divided evenly over the
  ranks. Whole sequences cannot always be divided that evenly, so no scheduler reaches it when a
  step holds few sequences of very different lengths.
- **Partition bound** (:func:`partition_shares`, :func:`partition_bound_worker`): the best
  assignment of whole sequences to ranks under their measured compute times (exact search for
  small steps, Karmarkar-Karp and refinement otherwise), each rank running its share packed into
  microbatches back to back, no communication; the step lasts as long as its slowest rank. What
  any scheduling of whole sequences could still win over a run is its distance to this bound.

Every worker runs on ``world_size`` processes at once, so each measures under the same core and
memory contention as training.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from posttrain.balance import FlopsCost
from posttrain.balance.exact import min_max_partition
from posttrain.models import build_model

from .config import TrainConfig
from .loop import microbatch_loss, plan_step
from .minibatches import TrainData

__all__ = ["ideal_compute_worker", "pack_share", "partition_bound_worker", "partition_shares",
           "sequence_times_worker"]


def _model(cfg: TrainConfig, vocab_size: int) -> torch.nn.Module:
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.model_config(vocab_size))
    return model.to(torch.bfloat16) if cfg.precision == "bf16" else model


def ideal_compute_worker(rank: int, world_size: int, cfg: TrainConfig) -> list[float]:
    """Per step, this rank's time to run forward+backward of *every* microbatch of the plan on
    an unsharded model with no communication at all; the even bound is that time divided evenly
    over the ranks."""
    data = TrainData(cfg, world_size)
    model = _model(cfg, data.vocab_size)
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


def sequence_times_worker(rank: int, world_size: int, cfg: TrainConfig) -> dict[tuple[int, int], float]:
    """Seconds of forward+backward of each sequence alone, ``(step, index) -> seconds``, for the
    steps after the first. The ranks split the sequences and measure at the same time; the caller
    merges their dicts."""
    data = TrainData(cfg, world_size)
    model = _model(cfg, data.vocab_size)
    jobs = [(step, i) for step in range(1, cfg.steps) for i in range(cfg.sequences)]
    seqs = {step: data.minibatch(step) for step in range(1, cfg.steps)}
    microbatch_loss(model, seqs[1], [0], 1.0).backward()  # warm-up
    out = {}
    dist.barrier()
    for step, i in jobs[rank::world_size]:
        t0 = time.perf_counter()
        microbatch_loss(model, seqs[step], [i], 1.0).backward()
        out[(step, i)] = time.perf_counter() - t0
    model.zero_grad()
    dist.barrier()
    return out


def partition_shares(cfg: TrainConfig, world_size: int,
                     times: dict[tuple[int, int], float]) -> tuple[list[list[list[int]]], bool]:
    """Per step after the first, the best assignment of its sequences to ranks under ``times``
    (a :func:`sequence_times_worker` result, merged); and whether every step's is proven optimal."""
    shares, exact = [], True
    for step in range(1, cfg.steps):
        parts, proven = min_max_partition([times[(step, i)] for i in range(cfg.sequences)], world_size)
        shares.append(parts)
        exact &= proven
    return shares, exact


def pack_share(lengths: Sequence[int], ids: Sequence[int], max_tokens: int) -> list[list[int]]:
    """A rank's sequences packed longest first, each into the first microbatch with room (as
    ``diff_micro`` packs a rank's share)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(ids, key=lambda i: -lengths[i]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return bins


def partition_bound_worker(rank: int, world_size: int, cfg: TrainConfig,
                           shares: list[list[list[int]]]) -> list[float]:
    """Per step after the first, this rank's seconds to run its share of ``shares`` packed into
    microbatches, back to back, with no communication (the step's bound is the ranks' maximum)."""
    data = TrainData(cfg, world_size)
    model = _model(cfg, data.vocab_size)
    microbatch_loss(model, data.minibatch(0), [0], 1.0).backward()  # warm-up
    out = []
    for step in range(1, cfg.steps):
        seqs = data.minibatch(step)
        mine = pack_share([len(s) - 1 for s in seqs], shares[step - 1][rank], cfg.max_tokens)
        dist.barrier()
        t0 = time.perf_counter()
        for ids in mine:
            microbatch_loss(model, seqs, ids, 1.0).backward()
        out.append(time.perf_counter() - t0)
    model.zero_grad()
    return out
