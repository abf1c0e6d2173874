"""``posttrain plan ...``: recommendations from the simulator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from posttrain.pipeline import GROUPED_SCHEDULES
from posttrain.text import count

from .options import add_command, field_flags, name_flags
from .simulate import DPSetting, ScheduleOptions, WorkloadOptions

__all__ = ["PlanODC", "PlanPipeline", "add_parser"]


@dataclass(frozen=True)
class PlanODC(DPSetting):
    """``posttrain plan odc``: the balancing method and microbatch budget for a dataset and cluster.

    Attributes:
        max_tokens: microbatch budgets to choose from, up to what activation memory fits
            (default: the longest sequence rounded up to a power of 2, and twice that).
        context_parallel: also ODC whose plan splits the costliest sequences across ranks
            (``auto``: 2 up to every rank, or a shard count; ``off``: whole sequences only), planned
            as the trainer plans (a split must save 5% of the step), at every budget a split fits
            (``max_tokens`` below the longest sequence too, where given); a shard's keys and values
            cross the intra-node link (20 microseconds a collective).
        top: rows shown.
    """

    max_tokens: tuple[int, ...] | None = None
    context_parallel: int | Literal["off", "auto"] = "auto"
    top: int = 8

    def __post_init__(self) -> None:
        if self.top < 1:
            raise ValueError(f"top={self.top} must be at least 1")
        from posttrain.balance import check_context_parallel

        check_context_parallel(self.context_parallel, self.cluster.world_size)
        if self.max_tokens is not None and (not self.max_tokens or min(self.max_tokens) < 1):
            raise ValueError(f"max_tokens={','.join(map(str, self.max_tokens))} needs positive budgets")


@dataclass(frozen=True)
class PlanPipeline:
    """``posttrain plan pipeline``: one schedule, group size and offload for a memory budget, and why.

    Attributes:
        schedule: the pipeline's ranks and microbatches (the schedule and chunks are what the
            planner chooses).
        workload: the costs of one chunk-microbatch.
        memory_gib: activation memory budget per device, GiB.
        top: rows shown.
        calibrate: take F, I, W, saved bytes and (if it offloaded) the host link from a run written
            by posttrain pipeline --calibration-out FILE, in place of the workload's costs.
    """

    schedule: ScheduleOptions = field(default_factory=ScheduleOptions,
                                      metadata={"fields": ("num_ranks", "num_microbatches")})
    workload: WorkloadOptions = field(default_factory=WorkloadOptions)
    memory_gib: float = field(default=0.0, metadata={"required": True})
    top: int = 5
    calibrate: str | None = None

    def __post_init__(self) -> None:
        if not self.memory_gib > 0:
            raise ValueError(f"memory_gib={self.memory_gib} must be positive (the activation budget to plan for)")
        if self.top < 1:
            raise ValueError(f"top={self.top} must be at least 1")
        if self.calibrate:
            given = [f"`{f}`" for f in ("forward_ms", "backward_ms", "weight_ms", "activation_mib")
                     if getattr(self.workload, f) != getattr(WorkloadOptions, f)]
            if given:
                raise ValueError(f"`calibrate` measures what {', '.join(given)} would set: drop one or the other")


def _odc(o: PlanODC) -> int:
    from posttrain.sim import MODEL_SHAPES, exchange_seconds
    from posttrain.sim.planner import plan_odc
    from posttrain.train.core.context import MIN_SPLIT_GAIN

    cluster, model, batches, _ = o.inputs()
    longest = max(max(b) for b in batches)  # what was drawn, not the profile's bound
    if o.max_tokens:
        options = list(o.max_tokens)
    else:
        base = 1 << (longest - 1).bit_length()
        options = [base, 2 * base]
    rows = plan_odc(batches, model=model, cluster=cluster, max_tokens_options=options, hsdp=o.cluster.hsdp,
                    context_parallel=o.context_parallel, min_gain=MIN_SPLIT_GAIN,
                    exchange=exchange_seconds(MODEL_SHAPES[o.cost.cost_model], cluster))
    print(f"{'#':>2} {'engine':6} {'balance':12} {'split':>5} {'max_tokens':>10} {'tokens/s':>12} {'bubble':>7} "
          f"{'vs fsdp+same':>12}")
    for i, r in enumerate(rows[:o.top], 1):
        split = "-" if r["context_parallel"] == "off" else str(r["split"])
        print(f"{i:>2} {r['strategy']:6} {r['method']:12} {split:>5} {r['max_tokens']:>10} {r['throughput']:12,.0f} "
              f"{r['bubble']:7.2f} {r['vs_fsdp']:12.2f}")
    print("(split: sequences split across ranks over the minibatches, '-' without context parallelism, which gets a row "
          "only where it splits; vs fsdp+same: FSDP+same_micro at the same max_tokens, or at the least that holds the "
          "longest sequence)")
    best = rows[0]
    cp = f" --context-parallel {best['context_parallel']}" if best["split"] else ""
    if o.context_parallel != "off" and not any(r["split"] for r in rows):
        print(f"context parallelism ({o.context_parallel}) splits no sequence here: whole sequences balance as well")
    print(f"recommended: {best['strategy']} with --balance {best['method']} --max-tokens {best['max_tokens']}{cp} "
          "(a larger max_tokens packs more per microbatch; offer only what activation memory fits)")
    if best["split"]:
        print("  context parallelism above 2 ranks or on GPUs is a prediction: it has run on 2 CPU processes "
              "(docs/odc.md)")
    return 0


def _pipeline(o: PlanPipeline) -> int:
    from posttrain.sim.planner import plan_pipeline, recommend_pipeline

    num_ranks, num_microbatches = o.schedule.num_ranks, o.schedule.num_microbatches
    w = o.workload.build()
    notes = ["from the workload flags"]
    if o.calibrate:
        from posttrain.lab.calibrate import pipeline_workload_from_metrics

        w, notes = pipeline_workload_from_metrics(o.calibrate, num_ranks=num_ranks, host_bandwidth=w.host_bandwidth)
    fits, tried = plan_pipeline(num_ranks=num_ranks, num_microbatches=num_microbatches, workload=w,
                                memory_budget=o.memory_gib * 2**30)
    ms = 1e3
    print("assumptions (" + notes[0] + "):")
    as_flags = field_flags(PlanPipeline)
    for line in notes[1:]:  # (the library names parameters; here they are flags)
        print(f"  {name_flags(line, as_flags)}")
    print(f"  per chunk-microbatch at one chunk per rank (v chunks per rank divide each by v): F {w.forward_s * ms:.2f} ms, "
          f"I {w.input_grad_s * ms:.2f} ms, W {w.weight_grad_s * ms:.2f} ms, saved activations "
          f"{w.activation_bytes / 2**20:.2f} MiB, of which W keeps {w.weight_keep:.2f} after I under a split backward")
    print(f"  host link {w.host_bandwidth / 1e9:.2f} GB/s per direction, one copy of a direction at a time: "
          f"{w.copy_s * ms:.2f} ms per chunk-microbatch; k = (D2H + H2D) / (F + I + W) = {w.k:.2f}")
    print(f"  {num_ranks} ranks, {num_microbatches} microbatches per step, {o.memory_gib} GiB of saved "
          "activations per device")
    print(f"{tried} configurations simulated; {len(fits)} fit")
    if not fits:
        print("none fits: raise --memory-gib, add ranks, or shrink microbatches")
        return 1
    best, why = recommend_pipeline(fits)
    bw = best.workload  # per chunk-microbatch at the recommended chunk count
    flags = (f"--schedule {best.schedule} --pp-size {num_ranks} --chunks {best.num_chunks}"
             + (f" --group-size {best.group_size}" if best.schedule in GROUPED_SCHEDULES else "")
             + f" --microbatches {num_microbatches} --offload {best.offload_chunks}"
             f" --forward-ms {bw.forward_s * ms:.6g} --backward-ms {bw.input_grad_s * ms:.6g}"
             f" --weight-ms {bw.weight_grad_s * ms:.6g} --activation-mib {bw.activation_bytes / 2**20:.6g}"
             f" --host-gbps {bw.host_bandwidth / 1e9:.6g}"
             + (f" --weight-keep {bw.weight_keep:.6g}" if bw.weight_keep != 1 else ""))
    print(f"recommended: {best.schedule}, {count(best.num_chunks, 'chunk')} per rank"
          + (f", group size {best.group_size}" if best.schedule in GROUPED_SCHEDULES else "")
          + f", offload {count(best.offload_chunks, 'chunk')} per rank: step {best.makespan * ms:.2f} ms, peak "
          f"{best.peak_bytes / 2**30:.2f} GiB")
    print(f"  why: {why}")
    print(f"  see it: posttrain simulate pipeline {flags}")
    print("fastest that fit (* recommended):")
    print(f"{'#':>3} {'schedule':20} {'v':>2} {'g':>3} {'offload':>7} {'step ms':>9} {'microbatches/s':>14} "
          f"{'peak GiB':>9} {'to host GiB':>11} {'bubble':>7}")
    at = next(i for i, r in enumerate(fits) if r is best)
    for i in [*range(min(o.top, len(fits))), *([at] if at >= o.top else [])]:
        r = fits[i]
        print(f"{('*' if r is best else '') + str(i + 1):>3} {r.schedule:20} {r.num_chunks:>2} "
              f"{r.group_size if r.schedule in GROUPED_SCHEDULES else '-'!s:>3} {r.offload_chunks:>7} "
              f"{r.makespan * ms:9.2f} {num_microbatches / r.makespan:14.1f} {r.peak_bytes / 2**30:9.2f} "
              f"{r.offloaded_bytes / 2**30:11.2f} {r.bubble_fraction:7.1%}")
    return 0


def add_parser(sub) -> None:
    plan = sub.add_parser("plan", help="recommendations from the simulator")
    ps = plan.add_subparsers(dest="plan", required=True)
    add_command(ps, "odc", PlanODC, _odc, help="the balancing method and microbatch token budget for a dataset and cluster")
    add_command(ps, "pipeline", PlanPipeline, _pipeline,
                help="one schedule, group size and offload for a memory budget, and why")
