"""``posttrain simulate ...`` and ``posttrain plan ...`` (wired into :mod:`posttrain.cli`)."""

from __future__ import annotations

import argparse
import json
import os


def _add_dp_args(p: argparse.ArgumentParser) -> None:
    from posttrain.sim import LENGTH_PROFILES, MODEL_SHAPES

    p.add_argument("--gpus", type=int, default=32, help="data-parallel GPUs (default 32)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="(default 8)")
    p.add_argument("--lengths", choices=LENGTH_PROFILES, default="longalign", help="length profile (default longalign)")
    p.add_argument("--lengths-file", default=None, help="sequence lengths to use instead: JSON list, integers, or JSONL")
    p.add_argument("--model", choices=tuple(MODEL_SHAPES), default="7b", help="cost preset (default 7b)")
    p.add_argument("--achieved-tflops", type=float, default=400.0, help="per-GPU achieved TFLOP/s (default 400)")
    p.add_argument("--sequences-per-gpu", type=int, default=8, help="minibatch size per GPU (default 8)")
    p.add_argument("--minibatches", type=int, default=2, help="minibatches simulated (default 2)")
    p.add_argument("--intra-gbps", type=float, default=360.0, help="GB/s per GPU inside a node (default 360)")
    p.add_argument("--inter-gbps", type=float, default=40.0, help="GB/s per GPU between nodes (default 40)")
    p.add_argument("--hsdp", action="store_true", help="shard per node, all-reduce across nodes per minibatch")
    p.add_argument("--seed", type=int, default=0, help="length sampling seed (default 0)")


def _dp_inputs(args):
    from posttrain.sim import Cluster, SimModel, draw_lengths, load_lengths
    from posttrain.sim.lengths import profile_max_len

    for flag in ("sequences_per_gpu", "minibatches"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be at least 1")
    cluster = Cluster(num_gpus=args.gpus, gpus_per_node=args.gpus_per_node, intra_bandwidth=args.intra_gbps * 1e9,
                      inter_bandwidth=args.inter_gbps * 1e9)
    model = SimModel.preset(args.model, achieved_flops=args.achieved_tflops * 1e12)
    per_batch = args.sequences_per_gpu * args.gpus
    if args.lengths_file:
        lengths = load_lengths(args.lengths_file)
        need = per_batch * args.minibatches
        if len(lengths) < need:
            raise ValueError(f"{args.lengths_file} holds {len(lengths)} lengths; {args.minibatches} minibatches of "
                             f"{per_batch} need {need}: lower --sequences-per-gpu or --minibatches")
        batches = [lengths[k * per_batch:(k + 1) * per_batch] for k in range(args.minibatches)]
        longest = max(lengths)
    else:
        batches = [draw_lengths(args.lengths, per_batch, seed=args.seed * 1000 + k) for k in range(args.minibatches)]
        longest = profile_max_len(args.lengths)
    return cluster, model, batches, longest


def _simulate_odc(args) -> int:
    from posttrain.balance import plan_minibatch
    from posttrain.sim import simulate_dp
    from posttrain.sim.trace import plot_dp_timelines, write_chrome_trace

    cluster, model, batches, longest = _dp_inputs(args)
    max_tokens = args.max_tokens or longest
    runs = []
    for strategy, method in (("fsdp", args.fsdp_balance), ("odc", args.balance)):
        if strategy == "fsdp" and method == "diff_micro":
            raise ValueError("--fsdp-balance=diff_micro: FSDP needs equal microbatch counts; use same_micro")
        plans = [plan_minibatch(b, world_size=cluster.num_gpus, max_tokens=max_tokens, method=method,
                                cost=model.sequence_cost) for b in batches]
        trace = bool(args.trace or args.png)
        res = simulate_dp(plans, strategy=strategy, model=model, cluster=cluster, hsdp=args.hsdp, trace=trace)
        res.strategy = f"{res.strategy}+{method}"
        runs.append(res)
    print(f"{args.model} on {cluster.num_gpus} GPUs ({cluster.num_nodes} nodes), {args.minibatches} minibatches of "
          f"{args.sequences_per_gpu * cluster.num_gpus} sequences ({args.lengths_file or args.lengths}), "
          f"max_tokens {max_tokens}")
    print(f"{'run':28} {'tokens/s':>12} {'step s':>8} {'util min/mean':>14} {'bubble':>7}")
    for r in runs:
        u = r.utilization
        print(f"{r.strategy:28} {r.throughput:12,.0f} {r.time / len(r.minibatch_times):8.3f} "
              f"{min(u):6.2f}/{sum(u) / len(u):<6.2f} {r.bubble_fraction:7.2f}")
    print(f"speedup {runs[1].strategy} / {runs[0].strategy}: {runs[1].throughput / runs[0].throughput:.2f}")
    if args.trace:
        write_chrome_trace(runs, args.trace)
        print(f"wrote {args.trace} (chrome://tracing or ui.perfetto.dev)")
    if args.png:
        plot_dp_timelines(runs, args.png)
        print(f"wrote {args.png}")
    return 0


def _workload(args):
    from posttrain.sim.pipeline import PipelineWorkload

    return PipelineWorkload(forward_s=args.forward_ms / 1e3, input_grad_s=args.backward_ms / 1e3,
                            weight_grad_s=args.weight_ms / 1e3, activation_bytes=args.activation_mib * 2**20,
                            host_bandwidth=args.host_gbps * 1e9 if args.host_gbps > 0 else -1.0)


def _add_pipeline_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=int, default=8, help="pipeline ranks (default 8)")
    p.add_argument("--microbatches", type=int, default=32, help="(default 32)")
    p.add_argument("--forward-ms", type=float, default=10.0, help="F of one chunk-microbatch (default 10)")
    p.add_argument("--backward-ms", type=float, default=10.0, help="input-gradient backward I (default 10)")
    p.add_argument("--weight-ms", type=float, default=10.0, help="weight-gradient backward W (default 10)")
    p.add_argument("--activation-mib", type=float, default=256.0,
                   help="saved activations of one chunk-microbatch (default 256)")
    p.add_argument("--host-gbps", type=float, default=21.0, help="device-host GB/s per direction (default 21: H100)")


def _simulate_pipeline(args) -> int:
    from posttrain.sim.pipeline import format_pipeoffload_table, pipeoffload_table, simulate_pipeline
    from posttrain.sim.trace import plot_pipeline_sim

    if args.paper_table:
        print(format_pipeoffload_table(pipeoffload_table()))
        return 0
    w = _workload(args)
    res = simulate_pipeline(args.schedule, num_ranks=args.stages, num_microbatches=args.microbatches,
                            num_chunks=args.chunks, group_size=args.group_size, offload_chunks=args.offload_chunks,
                            workload=w)
    ms = 1e3
    print(f"{args.schedule}: {args.stages} ranks x {res.num_chunks} chunks, {args.microbatches} microbatches, "
          f"offload {args.offload_chunks} chunk(s) per rank")
    print(f"makespan {res.makespan * ms:.2f} ms (without offload {res.base_makespan * ms:.2f} ms, overhead "
          f"{res.overhead:+.1%}); bubble {res.bubble_fraction:.1%}")
    print(f"k = (D2H + H2D) / (F + I + W) = {w.k:.2f} ({'<= 1: offload can hide fully' if w.k <= 1 else '> 1: not fully hidden'}); "
          f"hidden here: {'yes' if res.hidden else 'no'}")
    print(f"{'rank':>4} {'peak units':>10} {'peak GiB':>9} {'copy util':>9}")
    for r in range(res.num_ranks):
        print(f"{r:>4} {res.peaks[r]:>10} {res.peaks[r] * w.activation_bytes / 2**30:>9.2f} {res.copy_utilization(r):>9.1%}")
    if args.chart:
        plot_pipeline_sim(res, args.chart)
        print(f"wrote {args.chart}")
    return 0


def _simulate_table(args) -> int:
    from posttrain.sim.table import format_table, scale_table

    try:
        gpus = [int(x) for x in args.gpus.split(",")]
    except ValueError:
        raise ValueError(f"--gpus={args.gpus!r} is not a comma-separated list of GPU counts") from None
    rows = scale_table(gpus=gpus, profiles=args.profiles.split(","), models=args.models.split(","),
                       sequences_per_gpu=args.sequences_per_gpu, minibatches=args.minibatches, seed=args.seed,
                       progress=lambda s: print("  " + s, flush=True))
    print(format_table(rows))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _simulate_calibrate(args) -> int:
    from posttrain.calibrate import calibrate_odc, calibrate_pipeline
    from posttrain.pipeline.train import PipelineConfig
    from posttrain.train import TrainConfig

    cfg = TrainConfig(profile=args.profile, steps=args.steps, sequences=args.sequences, max_len=args.max_len,
                      max_tokens=args.max_len, dim=args.dim, num_layers=args.layers, seed=args.seed)
    out = calibrate_odc(cfg, repeats=args.repeats, measured_json=args.measured_json)
    out["pipeline"] = [calibrate_pipeline(PipelineConfig(schedule=s, stages=p, chunks=v, microbatches=m, offload=o,
                                                         layers=p * v, steps=1))
                       for s, p, v, m, o in (("1f1b", 2, 1, 4, "none"), ("interleaved_1f1b", 2, 2, 4, "1"),
                                             ("group_interleaved", 4, 2, 8, "1"), ("zbv", 2, 2, 4, "full"))]
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
        print(f"wrote {args.json}")
    ok = abs(out["error"]) <= 0.10 and all(p["predicted"] == p["measured"] for p in out["pipeline"])
    return 0 if ok else 1


def _plan_odc(args) -> int:
    from posttrain.sim.planner import plan_odc

    cluster, model, batches, _ = _dp_inputs(args)
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


def _plan_pipeline(args) -> int:
    from posttrain.sim.planner import plan_pipeline

    w = _workload(args)
    fits, tried = plan_pipeline(num_ranks=args.stages, num_microbatches=args.microbatches, workload=w,
                                memory_budget=args.memory_gib * 2**30)
    print(f"{tried} configurations simulated; {len(fits)} fit {args.memory_gib} GiB of activations per device "
          f"(workload: one chunk per rank; v chunks divide it by v)")
    if not fits:
        print("none fits: raise --memory-gib, add stages, or shrink microbatches")
        return 1
    print(f"{'#':>2} {'schedule':20} {'v':>2} {'g':>3} {'offload':>7} {'step ms':>9} {'microbatches/s':>14} {'peak GiB':>9} {'bubble':>7}")
    for i, r in enumerate(fits[:args.top], 1):
        print(f"{i:>2} {r.schedule:20} {r.num_chunks:>2} {str(r.group_size or '-'):>3} {r.offload_chunks:>7} "
              f"{r.makespan * 1e3:9.2f} {args.microbatches / r.makespan:14.1f} {r.peak_bytes / 2**30:9.2f} "
              f"{r.bubble_fraction:7.1%}")
    return 0


def add_parsers(sub) -> None:
    from posttrain.balance import METHODS
    from posttrain.data import PROFILES
    from posttrain.pipeline import SCHEDULES

    sim = sub.add_parser("simulate", help="discrete-event simulation at cluster scale (FSDP vs ODC, pipeline)")
    ss = sim.add_subparsers(dest="simulate", required=True)
    odc = ss.add_parser("odc", help="FSDP vs ODC on a simulated cluster: throughput, utilization, timeline")
    _add_dp_args(odc)
    odc.add_argument("--balance", choices=METHODS, default="diff_micro", help="ODC's balancing (default diff_micro)")
    odc.add_argument("--fsdp-balance", choices=METHODS, default="same_micro", help="FSDP's (default same_micro)")
    odc.add_argument("--max-tokens", type=int, default=None, help="tokens per microbatch (default: longest possible)")
    odc.add_argument("--trace", default="out/sim_odc_trace.json", help="Chrome trace JSON ('' for none)")
    odc.add_argument("--png", default="out/sim_odc.png", help="timeline PNG, first 16 ranks ('' for none)")
    odc.set_defaults(func=_simulate_odc)

    pipe = ss.add_parser("pipeline", help="a pipeline schedule with activation offload: makespan, memory, copies")
    pipe.add_argument("--schedule", choices=SCHEDULES, default="group_interleaved", help="(default group_interleaved)")
    pipe.add_argument("--chunks", type=int, default=2, help="chunks per rank (default 2)")
    pipe.add_argument("--group-size", type=int, default=None, help="group size of group_interleaved, group_interleaved_zb and interleaved_zb (default: stages)")
    pipe.add_argument("--offload-chunks", type=int, default=0, help="offload each rank's first this many chunks")
    _add_pipeline_workload_args(pipe)
    pipe.add_argument("--chart", default="out/sim_pipeline.png", help="chart PNG ('' for none)")
    pipe.add_argument("--paper-table", action="store_true", help="only print ours vs design/pipeoffload.md's unit-cost table")
    pipe.set_defaults(func=_simulate_pipeline)

    table = ss.add_parser("table", help="predicted ODC/FSDP speedup per balancing method, 8-256 GPUs")
    table.add_argument("--gpus", default="8,16,32,64,128,256", help="comma-separated GPU counts")
    table.add_argument("--models", default="1.5b,7b", help="comma-separated cost presets")
    table.add_argument("--profiles", default="longalign,swe_smith", help="comma-separated length profiles")
    table.add_argument("--sequences-per-gpu", type=int, default=8, help="(default 8)")
    table.add_argument("--minibatches", type=int, default=2, help="(default 2)")
    table.add_argument("--seed", type=int, default=0, help="(default 0)")
    table.add_argument("--json", default="out/sim_table.json", help="results file")
    table.set_defaults(func=_simulate_table)

    cal = ss.add_parser("calibrate", help="simulator vs the real 2-rank benchmark and pipeline runner, side by side")
    cal.add_argument("--profile", choices=PROFILES, default="long_tail", help="(default long_tail, as bench odc)")
    cal.add_argument("--steps", type=int, default=8, help="(default 8, as bench odc)")
    cal.add_argument("--sequences", type=int, default=16, help="(default 16)")
    cal.add_argument("--max-len", type=int, default=1024, help="(default 1024)")
    cal.add_argument("--dim", type=int, default=128, help="(default 128)")
    cal.add_argument("--layers", type=int, default=4, help="(default 4)")
    cal.add_argument("--seed", type=int, default=0, help="(default 0)")
    cal.add_argument("--repeats", type=int, default=3, help="rounds of the real trainings (default 3)")
    cal.add_argument("--measured-json", default=None, help="take the measured speedup from a bench odc JSON instead")
    cal.add_argument("--json", default="out/sim_calibrate.json", help="results file")
    cal.set_defaults(func=_simulate_calibrate)

    plan = sub.add_parser("plan", help="recommendations from the simulator")
    ps = plan.add_subparsers(dest="plan", required=True)
    po = ps.add_parser("odc", help="balancing method and max_tokens for a dataset and cluster")
    _add_dp_args(po)
    po.add_argument("--max-tokens", default=None,
                    help="comma-separated candidates, up to what activation memory fits (default: the longest "
                         "sequence rounded up to a power of 2, and twice that)")
    po.add_argument("--top", type=int, default=8, help="rows shown (default 8)")
    po.set_defaults(func=_plan_odc)
    pp = ps.add_parser("pipeline", help="schedule, group size and offload chunks for a memory budget")
    _add_pipeline_workload_args(pp)
    pp.add_argument("--memory-gib", type=float, required=True, help="activation memory budget per device, GiB")
    pp.add_argument("--top", type=int, default=5, help="rows shown (default 5)")
    pp.set_defaults(func=_plan_pipeline)
