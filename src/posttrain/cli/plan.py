"""``posttrain plan ...``: recommendations from the simulator."""

from __future__ import annotations

import argparse

from .simulate import add_dp_arguments, add_pipeline_arguments, dp_inputs, workload

__all__ = ["add_parser"]


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
    from posttrain.sim.planner import plan_pipeline

    if args.top < 1:
        raise ValueError(f"--top={args.top} must be at least 1")
    w = workload(args)
    fits, tried = plan_pipeline(num_ranks=args.num_ranks, num_microbatches=args.num_microbatches, workload=w,
                                memory_budget=args.memory_gib * 2**30)
    print(f"{tried} configurations simulated; {len(fits)} fit {args.memory_gib} GiB of activations per device "
          f"(workload: one chunk per rank; v chunks divide it by v)")
    if not fits:
        print("none fits: raise --memory-gib, add ranks, or shrink microbatches")
        return 1
    print(f"{'#':>2} {'schedule':20} {'v':>2} {'g':>3} {'offload':>7} {'step ms':>9} {'microbatches/s':>14} "
          f"{'peak GiB':>9} {'bubble':>7}")
    for i, r in enumerate(fits[:args.top], 1):
        print(f"{i:>2} {r.schedule:20} {r.num_chunks:>2} {r.group_size or '-'!s:>3} {r.offload_chunks:>7} "
              f"{r.makespan * 1e3:9.2f} {args.num_microbatches / r.makespan:14.1f} {r.peak_bytes / 2**30:9.2f} "
              f"{r.bubble_fraction:7.1%}")
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
    pp = ps.add_parser("pipeline", help="schedule, group size and offload chunks for a memory budget")
    add_pipeline_arguments(pp)
    pp.add_argument("--memory-gib", type=float, required=True, help="activation memory budget per device, GiB")
    pp.add_argument("--top", type=int, default=5, help="rows shown (default 5)")
    pp.set_defaults(func=_pipeline)
