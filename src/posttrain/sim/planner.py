"""``posttrain plan``: recommendations from the simulator.

- :func:`plan_odc`: for a dataset and cluster, every balancing method x ``max_tokens`` candidate
  under FSDP and ODC, and ODC splitting the costliest sequences across ranks (context
  parallelism), ranked by simulated throughput.
- :func:`plan_pipeline`: every schedule, group size and offload count that fits a memory budget,
  ranked by simulated step time; :func:`recommend_pipeline` picks one: the least offload among
  those within 1% of the fastest that fits (no offload when something fits without it that fast).
- :func:`plan_offload_fraction`: selective offload within a chunk where full offload cannot hide:
  the largest share of each offloaded chunk-microbatch whose predicted cost stays within a bound.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from posttrain.balance import METHODS, ExchangeCost, check_context_parallel, plan_context, plan_minibatch
from posttrain.pipeline import ONE_CHUNK_SCHEDULES, SCHEDULES, build_schedule
from posttrain.text import count

from .cluster import Cluster
from .costs import SimModel
from .dp import simulate_dp
from .pipeline import PipelineSimResult, PipelineWorkload, simulate_pipeline

__all__ = ["pipeline_candidates", "plan_odc", "plan_offload_fraction", "plan_pipeline", "recommend_pipeline"]

_FSDP_METHODS = ("round_robin", "local_sort", "same_micro")  # diff_micro needs ODC


def plan_odc(batches: Sequence[Sequence[int]], *, model: SimModel, cluster: Cluster,
             max_tokens_options: Sequence[int], hsdp: bool = False, context_parallel: str | int = "off",
             exchange: ExchangeCost | None = None, min_gain: float = 0.0,
             progress: Callable[[str], None] | None = None) -> list[dict]:
    """Rows ``{"strategy", "method", "context_parallel", "max_tokens", "throughput", "bubble",
    "vs_fsdp", "split"}`` sorted by throughput, best first.

    Every balancing method under FSDP and ODC at every ``max_tokens`` option that holds the
    longest sequence; with ``context_parallel`` (``auto`` or a shard count) also ODC+diff_micro
    whose plan splits the costliest sequences across ranks
    (:func:`posttrain.balance.plan_context`, the exchange priced by ``exchange`` in seconds:
    :func:`~posttrain.sim.exchange_seconds`), at every option, including those below the longest
    sequence that a split fits (a smaller microbatch: less activation memory). ``vs_fsdp`` is over
    FSDP+same_micro at the same ``max_tokens``, or, where that cannot hold the longest sequence, at
    the smallest option that can (where no option can: at the least power of 2 that holds it, a
    budget not offered); ``split`` counts the split sequences (0 without splitting; a budget where
    the plan splits nothing gets no row of its own). ``min_gain``: the plan's margin
    (:func:`~posttrain.balance.plan_context`; the trainer's is
    ``posttrain.train.core.context.MIN_SPLIT_GAIN``).

    Raises:
        ValueError: no option holds the longest sequence (whole, or split where
            ``context_parallel`` allows); a bad ``context_parallel`` (not ``off``, ``auto`` or a shard
            count from 2 to the ranks), or one without an ``exchange`` to price it.
    """
    check_context_parallel(context_parallel, cluster.num_gpus)  # (before any planning)
    if context_parallel != "off":
        if exchange is None:
            raise ValueError("context_parallel needs `exchange`, the price of a split's keys and values "
                             "(posttrain.sim.exchange_seconds)")
    longest = max(max(b) for b in batches)
    options = sorted(set(max_tokens_options))
    whole = [o for o in options if o >= longest]
    rows, ref = [], {}
    for mt in whole:
        for strategy, methods in (("fsdp", _FSDP_METHODS), ("odc", METHODS)):
            for method in methods:
                plans = [plan_minibatch(b, world_size=cluster.num_gpus, max_tokens=mt, method=method,
                                        cost=model.sequence_cost) for b in batches]
                res = simulate_dp(plans, strategy=strategy, model=model, cluster=cluster, hsdp=hsdp)
                rows.append({"strategy": strategy, "method": method, "context_parallel": "off", "max_tokens": mt,
                             "throughput": res.throughput, "bubble": res.bubble_fraction, "split": 0})
                if strategy == "fsdp" and method == "same_micro":
                    ref[mt] = res.throughput
                if progress:
                    progress(f"max_tokens={mt} {strategy}+{method}: {res.throughput:,.0f} tokens/s")
    refused = []
    if context_parallel != "off":
        for mt in options:
            try:
                plans = [plan_context(b, world_size=cluster.num_gpus, max_tokens=mt, cost=model.sequence_cost,
                                      exchange=exchange, context_parallel=context_parallel, min_gain=min_gain)
                         for b in batches]
            except ValueError as e:  # a sequence no allowed split fits into this budget
                refused.append((mt, e))
                continue
            split = sum(len(p.split) for p in plans)
            if not split:  # the whole sequences again, placed another way: not a row of its own
                continue
            res = simulate_dp(plans, strategy="odc", model=model, cluster=cluster, hsdp=hsdp)
            rows.append({"strategy": "odc", "method": "diff_micro", "context_parallel": context_parallel,
                         "max_tokens": mt, "throughput": res.throughput, "bubble": res.bubble_fraction,
                         "split": split})
            if progress:
                progress(f"max_tokens={mt} odc+diff_micro, context_parallel={context_parallel}: "
                         f"{res.throughput:,.0f} tokens/s")
    if not rows:
        why = f" (context_parallel={context_parallel}: {refused[0][1]})" if refused else ""
        raise ValueError(f"no max_tokens option holds the longest sequence ({longest} tokens){why}; "
                         f"raise `max_tokens` (got {list(options)})")
    if not ref:  # no option holds the longest sequence whole: FSDP's reference at the least power of 2 that does
        least = 1 << (longest - 1).bit_length()
        plans = [plan_minibatch(b, world_size=cluster.num_gpus, max_tokens=least, method="same_micro",
                                cost=model.sequence_cost) for b in batches]
        ref[least] = simulate_dp(plans, strategy="fsdp", model=model, cluster=cluster, hsdp=hsdp).throughput
    for row in rows:
        at = row["max_tokens"] if row["max_tokens"] in ref else min(ref)
        row["vs_fsdp"] = row["throughput"] / ref[at]
    return sorted(rows, key=lambda r: -r["throughput"])


def pipeline_candidates(num_ranks: int, chunk_options: Sequence[int] = (2, 4)) -> list[dict]:
    """Schedules worth trying at ``num_ranks``: one-chunk schedules, ZB-V, interleaved 1F1B, and
    the three group-interleaved constructions with every group size dividing ``num_ranks``, each
    with 0..v chunks offloaded."""
    out = []
    for name in SCHEDULES:
        if name in ("gpipe",):
            continue
        if name in ONE_CHUNK_SCHEDULES:
            out += [{"schedule": name, "num_chunks": 1, "group_size": None, "offload_chunks": k} for k in (0, 1)]
        elif name == "zbv":
            out += [{"schedule": name, "num_chunks": 2, "group_size": None, "offload_chunks": k} for k in (0, 1, 2)]
        else:
            for v in chunk_options:
                # group_interleaved at g = p is interleaved_1f1b; the split-backward ones at g = p are
                # their own
                top = num_ranks if name == "group_interleaved" else num_ranks + 1
                groups = [None] if name == "interleaved_1f1b" else [g for g in range(1, top) if num_ranks % g == 0]
                out += [{"schedule": name, "num_chunks": v, "group_size": g, "offload_chunks": k}
                        for g in groups for k in range(v + 1)]
    return out


def plan_pipeline(*, num_ranks: int, num_microbatches: int, workload: PipelineWorkload, memory_budget: float,
                  chunk_options: Sequence[int] = (2, 4)) -> tuple[list[PipelineSimResult], int]:
    """Simulate every candidate; return those whose peak activation bytes fit ``memory_budget``
    (bytes, per device), fastest first (at equal time the one offloading less, then the one
    holding less), and how many candidates were tried.

    ``workload`` is per chunk-microbatch at one chunk per rank; with ``v`` chunks each chunk holds
    ``1/v`` of a rank's layers, so its times and activation bytes are divided by ``v``."""
    for name, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches)):
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    if not memory_budget > 0:
        raise ValueError(f"memory_budget={memory_budget} must be positive")
    fits, tried = [], 0
    for c in pipeline_candidates(num_ranks, chunk_options):
        v = c["num_chunks"]
        w = PipelineWorkload(forward_s=workload.forward_s / v, input_grad_s=workload.input_grad_s / v,
                             weight_grad_s=workload.weight_grad_s / v, activation_bytes=workload.activation_bytes / v,
                             host_bandwidth=workload.host_bandwidth, weight_keep=workload.weight_keep)
        try:
            res = simulate_pipeline(c["schedule"], num_ranks=num_ranks, num_microbatches=num_microbatches,
                                    num_chunks=v, group_size=c["group_size"], offload_chunks=c["offload_chunks"],
                                    workload=w)
        except ValueError:  # e.g. too few microbatches for this schedule
            continue
        tried += 1
        if res.peak_bytes <= memory_budget:
            fits.append(res)
    fits.sort(key=lambda r: (r.makespan, r.offloaded_bytes, r.peak_bytes))
    return fits, tried


def recommend_pipeline(fits: Sequence[PipelineSimResult], *, tolerance: float = 0.01
                       ) -> tuple[PipelineSimResult, str]:
    """The one configuration to run among ``fits`` (as :func:`plan_pipeline` returns them), and why.

    The least offload (bytes copied to host memory per step) among those within ``tolerance`` of
    the fastest step time that fits, then the fastest of those: no offload when a configuration
    without it is that fast; offload only where it buys speed (or is the only way to fit), and
    no more of it than needed, since every offloaded byte costs host-link time and host memory and
    hides only as well as the simulator's copy model holds.

    Raises:
        ValueError: ``fits`` is empty.
    """
    if not fits:
        raise ValueError("no configuration fits")
    fastest = min(r.makespan for r in fits)
    near = [r for r in fits if r.makespan <= fastest * (1 + tolerance)]
    best = min(near, key=lambda r: (r.offloaded_bytes, r.makespan, r.peak_bytes))
    plain = [r for r in fits if r.offloaded_bytes == 0]
    if best.offloaded_bytes == 0:
        return best, (f"fits without offload, and no configuration that fits is more than {tolerance:.0%} faster "
                      f"({len(plain)} fit without offload; this is the fastest)")
    if plain:
        alt = min(plain, key=lambda r: r.makespan)
        need = (f"without offload the fastest that fits ({alt.schedule}, {count(alt.num_chunks, 'chunk')}) takes "
                f"{alt.makespan / best.makespan - 1:+.1%} longer")
    else:
        need = "nothing fits without offload"
    return best, (f"{need}; this offloads the least ({best.offloaded_bytes / 2**30:.2f} GiB to host memory per step, "
                  f"all ranks) of those within {tolerance:.0%} of the fastest that fits; predicted cost of its "
                  f"offload: {best.overhead:+.1%} step time over the same schedule without it")


def plan_offload_fraction(schedule: str, *, num_ranks: int, num_microbatches: int, workload: PipelineWorkload,
                          num_chunks: int | None = None, group_size: int | None = None,
                          offload_chunks: int | None = None, max_overhead: float = 0.02, step: float = 0.05,
                          min_lifespan: float | None = None) -> PipelineSimResult | None:
    """Selective offload within a chunk: the largest share of each offloaded chunk-microbatch, a
    multiple of ``step`` up to 1, whose simulated cost (step time over the same schedule without
    offload, minus one) is at most ``max_overhead``; ``None`` where even ``step`` costs more.

    With ``k = (D2H + H2D) / (F + B)`` above what the schedule can hide, full offload stretches
    the step (the copy stream becomes the critical path); moving a share ``f`` of each
    chunk-microbatch shrinks every copy by ``f`` and saves ``f`` of the memory offload would,
    so the share that just hides is the most memory saved for (almost) nothing. ``offload_chunks``
    defaults to every chunk; the rest as :func:`~posttrain.sim.pipeline.simulate_pipeline`, whose
    default ``min_lifespan`` (one round trip of the copies at each share) lets a smaller share
    offload chunk-microbatches with shorter lifespans too; give ``min_lifespan`` to hold that fixed
    (0: every chunk-microbatch of the offloaded chunks, as the runtime's ``--offload`` does).
    """
    if not 0 < step <= 1:
        raise ValueError(f"step={step} must be in (0, 1]")
    if max_overhead < 0:
        raise ValueError(f"max_overhead={max_overhead} must be non-negative")
    if offload_chunks is None:
        offload_chunks = build_schedule(schedule, num_ranks=num_ranks, num_microbatches=num_microbatches,
                                        num_chunks=num_chunks, group_size=group_size).layout.num_chunks
    best = None
    for i in range(1, round(1 / step) + 1):
        res = simulate_pipeline(schedule, num_ranks=num_ranks, num_microbatches=num_microbatches,
                                num_chunks=num_chunks, group_size=group_size, offload_chunks=offload_chunks,
                                workload=workload, min_lifespan=min_lifespan, offload_fraction=min(1.0, i * step))
        if res.overhead <= max_overhead:
            best = res
    return best
