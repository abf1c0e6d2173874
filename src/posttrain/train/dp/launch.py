"""Starting a training run: forked CPU processes on this machine, or one rank under torchrun."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from posttrain.launch import RanksFailedError, run_ranks

from .checkpoint import check_resumable
from .config import TrainConfig
from .loop import train_worker
from .metrics import summarize, write_metrics
from .minibatches import TrainData

__all__ = ["run_training", "under_torchrun"]


def under_torchrun() -> bool:
    """Whether this process is a rank started by ``torchrun``."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                    and "MASTER_ADDR" in os.environ)


def _torchrun_results(cfg: TrainConfig) -> list[dict] | None:
    """Run this process's rank under torchrun; rank 0 gets every rank's results, others None."""
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group("gloo")
    try:
        mine = train_worker(dist.get_rank(), dist.get_world_size(), cfg)
        every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, every, dst=0)
        return every
    finally:
        dist.destroy_process_group()


def run_training(cfg: TrainConfig, *, world_size: int = 2, metrics_path: str | None = None,
                 quiet: bool = False) -> list[dict] | None:
    """Train ``cfg`` on ``world_size`` forked CPU processes, or on this process's rank when
    launched by ``torchrun`` (then ``world_size`` comes from torchrun and only rank 0 returns
    results and prints).

    Args:
        cfg: the run.
        world_size: CPU processes (ignored under torchrun).
        metrics_path: every rank's per-step metrics, as CSV (``.csv``) or JSON lines.
        quiet: print nothing.

    Returns:
        Every rank's :func:`~posttrain.train.train_worker` result (None on torchrun ranks other than 0).
    """
    if world_size < 1:
        raise ValueError(f"--world-size={world_size} must be at least 1")
    if under_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
        lead = int(os.environ["RANK"]) == 0
    else:
        lead = True
    if world_size % cfg.replicas:
        raise ValueError(f"--replicas={cfg.replicas} does not divide --world-size={world_size}")
    TrainData(cfg, world_size)  # validate data against the world size before starting ranks
    check_resumable(cfg)  # an unreadable or mismatched checkpoint fails here, in one line
    say = print if (lead and not quiet) else (lambda *a, **k: None)
    source = cfg.data or f"{cfg.profile} synthetic"
    say(f"posttrain: {cfg.dp_label}+{cfg.balance} on {world_size} CPU processes, {cfg.model} {cfg.num_layers}x{cfg.dim} "
        f"{cfg.precision}, {cfg.sequences} {source} sequences per step, {cfg.steps} steps", flush=True)
    if under_torchrun():
        results = _torchrun_results(cfg)
        if results is None:
            return None
    else:
        try:
            results = run_ranks(train_worker, world_size, cfg, timeout_s=24 * 3600)
        except RanksFailedError as e:
            if e.value_error() is None:
                raise
            raise ValueError(e.value_error()) from None
    if not results[0]["metrics"]:
        say(f"nothing to do: the checkpoint in {cfg.checkpoint_dir} already holds {results[0]['resumed_from']} steps")
        return results
    s = summarize(results)
    say(f"loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}; {s['tokens_per_s']:.0f} tokens/s, "
        f"utilization {s['utilization']:.2f} after the first step")
    if metrics_path:
        write_metrics(results, metrics_path)
        say(f"wrote {metrics_path}")
    return results
