"""Per-step timing of a data-parallel run: what each rank measured, and their summary."""

from __future__ import annotations

import torch

from posttrain._compat import all_gather_single

__all__ = ["STAT_FIELDS", "gather_step_stats", "summarize"]

#: What every rank measures per step and shares after it (one small all-gather, outside the timed step).
STAT_FIELDS = ("loss", "compute_s", "comm_s", "gather_s", "reduce_s", "sync_s", "optimizer_s", "busy_s", "microbatches",
               "rank_tokens", "peak_memory_gib", "barriers", "barrier_wait_s", "barrier_late_s", "sys_s", "page_faults")


def gather_step_stats(mine: dict[str, float], world_size: int) -> dict[str, torch.Tensor]:
    """Every rank's :data:`STAT_FIELDS` values: field -> tensor of one value per rank (a collective)."""
    local = torch.tensor([float(mine[k]) for k in STAT_FIELDS], dtype=torch.float64)
    every = torch.empty(world_size * len(STAT_FIELDS), dtype=torch.float64)
    all_gather_single(every, local)
    every = every.view(world_size, len(STAT_FIELDS))
    return {name: every[:, i] for i, name in enumerate(STAT_FIELDS)}


def summarize(results: list[dict]) -> dict:
    """Aggregate ranks' metrics over the steps after the first (warm-up).

    Returns tokens/s in the steps' own time (``tokens_per_s``: from each step's start barrier to
    its update, what the benchmarks compare engines by), tokens/s as a stopwatch sees them
    (``wall_tokens_per_s``: over the wall time between steps, data, metrics and checkpoints
    included; rows without ``wall_s`` count their step time), utilization (compute share of
    step time averaged over ranks), wait share,
    compute seconds per step summed over ranks, the busiest rank's compute seconds per step
    (``busiest_compute_s``: per step the largest of the ranks', averaged over the steps), first and
    final loss, and mean step time.
    """
    steps = list(zip(*(r["metrics"] for r in results)))
    steady = steps[1:] or steps
    step_times = [s[0]["step_time_s"] for s in steady]
    util = [sum(r["utilization"] for r in s) / len(s) for s in steady]
    return {
        "tokens_per_s": sum(s[0]["tokens"] for s in steady) / sum(step_times),
        "wall_tokens_per_s": sum(s[0]["tokens"] for s in steady) / sum(s[0].get("wall_s", s[0]["step_time_s"])
                                                                      for s in steady),
        "utilization": sum(util) / len(util),
        "wait_share": sum(sum(r["wait_s"] for r in s) / (len(s) * s[0]["step_time_s"]) for s in steady) / len(steady),
        "compute_s": sum(sum(r["compute_s"] for r in s) for s in steady) / len(steady),
        "busiest_compute_s": sum(max(r["compute_s"] for r in s) for s in steady) / len(steady),
        "final_loss": steps[-1][0]["loss"],
        "first_loss": steps[0][0]["loss"],
        "step_time_s": sum(step_times) / len(step_times),
    }
