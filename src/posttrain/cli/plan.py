"""``posttrain plan ...``: recommendations from the simulator."""

from __future__ import annotations

import argparse

from posttrain.pipeline import GROUPED_SCHEDULES

from .simulate import add_dp_arguments, add_pipeline_arguments, dp_inputs, workload

__all__ = ["add_parser"]


def _positive_gib(value: float) -> float:
    if not value > 0:
        raise ValueError(f"--memory-gib={value} must be positive")
    return value


def _odc(args: argparse.Namespace) -> int:
    from posttrain.sim.planner import plan_odc

    if args.top < 1:
        raise ValueError(f"--top={args.top} must be at least 1")
    cluster, model, batches, _ = dp_inputs(args)
    longest = max(max(b) for b in batches)  # what was drawn, not the profile's bound
    if args.max_tokens:
        options = [int(x) for x in args.max_tokens.split(",")]
    else:
        base = 1 << (longest - 1).bit_length()
        options = [base, 2 * base]
    rows = plan_odc(batches, model=model, cluster=cluster, max_tokens_options=options, hsdp=args.hsdp)
    print(f"{'#':>2} {'engine':6} {'balance':12} {'max_tokens':>10} {'tokens/s':>12} {'bubble':>7} {'vs fsdp+same':>12}")
    for i, r in enumerate(rows[:args.top], 1):
        print(f"{i:>2} {r['strategy']:6} {r['method']:12} {r['max_tokens']:>10} {r['throughput']:12,.0f} "
              f"{r['bubble']:7.2f} {r['vs_fsdp']:12.2f}")
    best = rows[0]
    print(f"recommended: {best['strategy']} with --balance {best['method']} --max-tokens {best['max_tokens']} "
          "(a larger max_tokens packs more per microbatch; offer only what activation memory fits)")
    return 0


def _pipeline(args: argparse.Namespace) -> int:
    from posttrain.sim.planner import plan_pipeline, recommend_pipeline

    from .simulate import WorkloadOptions

    if args.top < 1:
        raise ValueError(f"--top={args.top} must be at least 1")
    w = workload(args)
    notes = ["from the workload flags"]
    if args.calibrate:
        from posttrain.lab.calibrate import pipeline_workload_from_metrics

        given = [f"--{f.replace('_', '-')}" for f in ("forward_ms", "backward_ms", "weight_ms", "activation_mib")
                 if getattr(args, f) != getattr(WorkloadOptions, f)]
        if given:
            raise ValueError(f"--calibrate measures what {', '.join(given)} would set: drop one or the other")
        w, notes = pipeline_workload_from_metrics(args.calibrate, num_ranks=args.num_ranks,
                                                  host_bandwidth=w.host_bandwidth)
    fits, tried = plan_pipeline(num_ranks=args.num_ranks, num_microbatches=args.num_microbatches, workload=w,
                                memory_budget=_positive_gib(args.memory_gib) * 2**30)
    ms = 1e3
    print("assumptions (" + notes[0] + "):")
    for line in notes[1:]:
        print(f"  {line}")
    print(f"  per chunk-microbatch at one chunk per rank (v chunks per rank divide each by v): F {w.forward_s * ms:.2f} ms, "
          f"I {w.input_grad_s * ms:.2f} ms, W {w.weight_grad_s * ms:.2f} ms, saved activations "
          f"{w.activation_bytes / 2**20:.2f} MiB, of which W keeps {w.weight_keep:.2f} after I under a split backward")
    print(f"  host link {w.host_bandwidth / 1e9:.2f} GB/s per direction, one copy of a direction at a time: "
          f"{w.copy_s * ms:.2f} ms per chunk-microbatch; k = (D2H + H2D) / (F + I + W) = {w.k:.2f}")
    print(f"  {args.num_ranks} ranks, {args.num_microbatches} microbatches per step, {args.memory_gib} GiB of saved "
          "activations per device")
    print(f"{tried} configurations simulated; {len(fits)} fit")
    if not fits:
        print("none fits: raise --memory-gib, add ranks, or shrink microbatches")
        return 1
    best, why = recommend_pipeline(fits)
    bw = best.workload  # per chunk-microbatch at the recommended chunk count
    flags = (f"--schedule {best.schedule} --ranks {args.num_ranks} --chunks {best.num_chunks}"
             + (f" --group-size {best.group_size}" if best.schedule in GROUPED_SCHEDULES else "")
             + f" --microbatches {args.num_microbatches} --offload-chunks {best.offload_chunks}"
             f" --forward-ms {bw.forward_s * ms:.6g} --backward-ms {bw.input_grad_s * ms:.6g}"
             f" --weight-ms {bw.weight_grad_s * ms:.6g} --activation-mib {bw.activation_bytes / 2**20:.6g}"
             f" --host-gbps {bw.host_bandwidth / 1e9:.6g}"
             + (f" --weight-keep {bw.weight_keep:.6g}" if bw.weight_keep != 1 else ""))
    print(f"recommended: {best.schedule}, {best.num_chunks} chunk(s) per rank"
          + (f", group size {best.group_size}" if best.schedule in GROUPED_SCHEDULES else "")
          + f", offload {best.offload_chunks} chunk(s) per rank: step {best.makespan * ms:.2f} ms, peak "
          f"{best.peak_bytes / 2**30:.2f} GiB")
    print(f"  why: {why}")
    print(f"  see it: posttrain simulate pipeline {flags}")
    print("fastest that fit (* recommended):")
    print(f"{'#':>3} {'schedule':20} {'v':>2} {'g':>3} {'offload':>7} {'step ms':>9} {'microbatches/s':>14} "
          f"{'peak GiB':>9} {'to host GiB':>11} {'bubble':>7}")
    at = next(i for i, r in enumerate(fits) if r is best)
    for i in [*range(min(args.top, len(fits))), *([at] if at >= args.top else [])]:
        r = fits[i]
        print(f"{('*' if r is best else '') + str(i + 1):>3} {r.schedule:20} {r.num_chunks:>2} "
              f"{r.group_size if r.schedule in GROUPED_SCHEDULES else '-'!s:>3} {r.offload_chunks:>7} "
              f"{r.makespan * ms:9.2f} {args.num_microbatches / r.makespan:14.1f} {r.peak_bytes / 2**30:9.2f} "
              f"{r.offloaded_bytes / 2**30:11.2f} {r.bubble_fraction:7.1%}")
    return 0


def add_parser(sub) -> None:
    plan = sub.add_parser("plan", help="recommendations from the simulator")
    ps = plan.add_subparsers(dest="plan", required=True)
    po = ps.add_parser("odc", help="balancing method and max_tokens for a dataset and cluster")
    add_dp_arguments(po)
    po.add_argument("--max-tokens", default=None,
                    help="comma-separated candidates, up to what activation memory fits (default: the longest "
                         "sequence rounded up to a power of 2, and twice that)")
    po.add_argument("--top", type=int, default=8, help="rows shown (default 8)")
    po.set_defaults(func=_odc)
    pp = ps.add_parser("pipeline", help="one schedule, group size and offload for a memory budget, and why")
    add_pipeline_arguments(pp)
    pp.add_argument("--memory-gib", type=float, required=True, help="activation memory budget per device, GiB")
    pp.add_argument("--top", type=int, default=5, help="rows shown (default 5)")
    pp.add_argument("--calibrate", default=None, metavar="FILE",
                    help="take F, I, W, saved bytes and (if it offloaded) the host link from a run written by "
                         "posttrain pipeline --calibration-out FILE, in place of the workload flags")
    pp.set_defaults(func=_pipeline)
