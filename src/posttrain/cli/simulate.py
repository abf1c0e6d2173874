"""``posttrain simulate ...``: the discrete-event simulator at cluster scale, and its calibration."""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field

from .options import add_config_arguments, config_from_args, int_list

__all__ = ["ClusterOptions", "CostOptions", "LengthOptions", "WorkloadOptions", "add_parser", "dp_inputs", "workload"]


def _profiles():
    from posttrain.sim import LENGTH_PROFILES

    return LENGTH_PROFILES


def _cost_models():
    from posttrain.sim import MODEL_SHAPES

    return tuple(MODEL_SHAPES)


@dataclass(frozen=True)
class LengthOptions:
    """The sequence lengths of the simulated minibatches.

    Attributes:
        profile: length profile (longalign and swe_smith at their published scale).
        lengths_file: sequence lengths to use instead: a JSON list, integers, or JSON lines.
        sequences_per_gpu: sequences per GPU in each minibatch.
        minibatches: minibatches simulated.
        seed: length sampling seed.
    """

    profile: str = field(default="longalign", metadata={"choices": _profiles})
    lengths_file: str | None = None
    sequences_per_gpu: int = 8
    minibatches: int = 2
    seed: int = 0


@dataclass(frozen=True)
class ClusterOptions:
    """The simulated cluster.

    Attributes:
        gpus: data-parallel GPUs.
        gpus_per_node: GPUs per node.
        intra_gbps: GB/s per GPU inside a node.
        inter_gbps: GB/s per GPU between nodes.
        hsdp: shard per node, all-reduce across nodes once per minibatch.
    """

    gpus: int = 32
    gpus_per_node: int = 8
    intra_gbps: float = 360.0
    inter_gbps: float = 40.0
    hsdp: bool = False


@dataclass(frozen=True)
class CostOptions:
    """The simulated model's compute.

    Attributes:
        cost_model: cost preset (Qwen2.5 shapes).
        achieved_tflops: per-GPU achieved TFLOP/s.
    """

    cost_model: str = field(default="7b", metadata={"choices": _cost_models})
    achieved_tflops: float = 400.0


@dataclass(frozen=True)
class WorkloadOptions:
    """Per chunk-microbatch costs of a simulated pipeline.

    Attributes:
        forward_ms: forward F of one chunk-microbatch.
        backward_ms: input-gradient backward I.
        weight_ms: weight-gradient backward W.
        activation_mib: saved activations of one chunk-microbatch.
        host_gbps: device-host GB/s per direction (21: H100).
        weight_keep: under a split backward, the fraction of a chunk-microbatch's saved
            activations W still needs after I (1: all; posttrain pipeline prints what it measured).
    """

    forward_ms: float = 10.0
    backward_ms: float = 10.0
    weight_ms: float = 10.0
    activation_mib: float = 256.0
    host_gbps: float = 21.0
    weight_keep: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.weight_keep <= 1:
            raise ValueError(f"--weight-keep={self.weight_keep} must be between 0 and 1")
        for name in ("forward_ms", "backward_ms", "weight_ms", "activation_mib"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"--{name.replace('_', '-')}={v} must be a non-negative number")
        if not self.host_gbps > 0:  # inf (free copies) is allowed; nan is not
            raise ValueError(f"--host-gbps={self.host_gbps} must be a positive number of GB/s")


def workload(args: argparse.Namespace):
    """The :class:`~posttrain.sim.pipeline.PipelineWorkload` of parsed :class:`WorkloadOptions`."""
    from posttrain.sim.pipeline import PipelineWorkload

    w = config_from_args(WorkloadOptions, args)
    return PipelineWorkload(forward_s=w.forward_ms / 1e3, input_grad_s=w.backward_ms / 1e3,
                            weight_grad_s=w.weight_ms / 1e3, activation_bytes=w.activation_mib * 2**20,
                            host_bandwidth=w.host_gbps * 1e9, weight_keep=w.weight_keep)


def dp_inputs(args: argparse.Namespace):
    """``(cluster, model, batches of lengths, longest possible length)`` of parsed length, cluster
    and cost options."""
    from posttrain.sim import Cluster, SimModel, draw_lengths, load_lengths
    from posttrain.sim.lengths import profile_max_len

    lengths = config_from_args(LengthOptions, args)
    c = config_from_args(ClusterOptions, args)
    cost = config_from_args(CostOptions, args)
    for name, flag in (("sequences_per_gpu", "--sequences-per-gpu"), ("minibatches", "--minibatches")):
        if getattr(lengths, name) < 1:
            raise ValueError(f"{flag}={getattr(lengths, name)} must be at least 1")
    # (in the units the flags take: the library checks its own in bytes/s and FLOP/s)
    for value, flag in ((c.intra_gbps, "--intra-gbps"), (c.inter_gbps, "--inter-gbps"),
                        (cost.achieved_tflops, "--achieved-tflops")):
        if not value > 0:
            raise ValueError(f"{flag}={value} must be positive")
    cluster = Cluster(num_gpus=c.gpus, gpus_per_node=c.gpus_per_node, intra_bandwidth=c.intra_gbps * 1e9,
                      inter_bandwidth=c.inter_gbps * 1e9)
    model = SimModel.preset(cost.cost_model, achieved_flops=cost.achieved_tflops * 1e12)
    per_batch = lengths.sequences_per_gpu * c.gpus
    if lengths.lengths_file:
        found = load_lengths(lengths.lengths_file)
        need = per_batch * lengths.minibatches
        if len(found) < need:
            raise ValueError(f"{lengths.lengths_file} holds {len(found)} lengths; {lengths.minibatches} minibatches of "
                             f"{per_batch} need {need}: lower --sequences-per-gpu or --minibatches")
        batches = [found[k * per_batch:(k + 1) * per_batch] for k in range(lengths.minibatches)]
        longest = max(found)
    else:
        batches = [draw_lengths(lengths.profile, per_batch, seed=lengths.seed * 1000 + k)
                   for k in range(lengths.minibatches)]
        longest = profile_max_len(lengths.profile)
    return cluster, model, batches, longest


def add_dp_arguments(p: argparse.ArgumentParser) -> None:
    """Length, cluster and cost options (``simulate odc``, ``plan odc``)."""
    add_config_arguments(p.add_argument_group("lengths"), LengthOptions)
    add_config_arguments(p.add_argument_group("cluster"), ClusterOptions)
    add_config_arguments(p.add_argument_group("cost"), CostOptions)


def add_pipeline_arguments(p: argparse.ArgumentParser, **defaults) -> None:
    """Pipeline shape (from :class:`~posttrain.train.sft.pipeline.PipelineConfig`) and workload options."""
    from posttrain.train.sft.pipeline import PipelineConfig

    fields = ("num_ranks", "num_microbatches", *defaults.pop("extra_fields", ()))
    add_config_arguments(p, PipelineConfig, fields=fields,
                         defaults={"num_ranks": 8, "num_microbatches": 32, **defaults})
    add_config_arguments(p.add_argument_group("workload"), WorkloadOptions)


def _odc(args) -> int:
    from posttrain.balance import plan_minibatch
    from posttrain.lab.plots import plot_dp_timelines
    from posttrain.sim import simulate_dp
    from posttrain.spans import write_chrome_trace

    cluster, model, batches, longest = dp_inputs(args)
    max_tokens = args.max_tokens or longest
    runs = []
    for strategy, method in (("fsdp", args.fsdp_balance), ("odc", args.balance)):
        if strategy == "fsdp" and method == "diff_micro":
            raise ValueError("--fsdp-balance=diff_micro: FSDP needs equal microbatch counts; use same_micro")
        plans = [plan_minibatch(b, world_size=cluster.num_gpus, max_tokens=max_tokens, method=method,
                                cost=model.sequence_cost) for b in batches]
        trace = bool(args.trace or args.plot)
        res = simulate_dp(plans, strategy=strategy, model=model, cluster=cluster, hsdp=args.hsdp, trace=trace)
        res.strategy = f"{res.strategy}+{method}"
        runs.append(res)
    print(f"{args.cost_model} on {cluster.num_gpus} GPUs ({cluster.num_nodes} nodes), {args.minibatches} minibatches "
          f"of {args.sequences_per_gpu * cluster.num_gpus} sequences ({args.lengths_file or args.profile}), "
          f"max_tokens {max_tokens}")
    print(f"{'run':28} {'tokens/s':>12} {'step s':>8} {'util min/mean':>14} {'bubble':>7}")
    for r in runs:
        u = r.utilization
        print(f"{r.strategy:28} {r.throughput:12,.0f} {r.time / len(r.minibatch_times):8.3f} "
              f"{min(u):6.2f}/{sum(u) / len(u):<6.2f} {r.bubble_fraction:7.2f}")
    print(f"speedup {runs[1].strategy} / {runs[0].strategy}: {runs[1].throughput / runs[0].throughput:.2f}")
    if args.trace:
        write_chrome_trace({r.strategy: r.spans for r in runs}, args.trace)
        print(f"wrote {args.trace} (chrome://tracing or ui.perfetto.dev)")
    if args.plot:
        plot_dp_timelines(runs, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _pipeline(args) -> int:
    from posttrain.lab.paper import format_pipeoffload_table, pipeoffload_table
    from posttrain.lab.plots import plot_pipeline_sim
    from posttrain.sim.pipeline import simulate_pipeline

    if args.paper_table:
        print(format_pipeoffload_table(pipeoffload_table()))
        return 0
    w = workload(args)
    res = simulate_pipeline(args.schedule, num_ranks=args.num_ranks, num_microbatches=args.num_microbatches,
                            num_chunks=args.chunks, group_size=args.group_size, offload_chunks=args.offload_chunks,
                            workload=w)
    ms = 1e3
    print(f"{args.schedule}: {args.num_ranks} ranks x {res.num_chunks} chunks, {args.num_microbatches} microbatches, "
          f"offload {args.offload_chunks} chunk(s) per rank")
    print(f"makespan {res.makespan * ms:.2f} ms (without offload {res.base_makespan * ms:.2f} ms, overhead "
          f"{res.overhead:+.1%}); bubble {res.bubble_fraction:.1%}")
    print(f"k = (D2H + H2D) / (F + I + W) = {w.k:.2f} "
          f"({'<= 1: offload can hide fully' if w.k <= 1 else '> 1: not fully hidden'}); "
          f"hidden here: {'yes' if res.hidden else 'no'}")
    print(f"{'rank':>4} {'peak units':>10} {'peak GiB':>9} {'copy util':>9}")
    for r in range(res.num_ranks):
        print(f"{r:>4} {res.peaks[r]:>10.2f} {res.peaks[r] * w.activation_bytes / 2**30:>9.2f} "
              f"{res.copy_utilization(r):>9.1%}")
    if args.plot:
        plot_pipeline_sim(res, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _table(args) -> int:
    from posttrain.lab.scale_table import format_table, scale_table

    rows = scale_table(gpus=int_list(args.gpus, "--gpus"), profiles=args.profiles.split(","),
                       models=args.cost_models.split(","), sequences_per_gpu=args.sequences_per_gpu,
                       minibatches=args.minibatches, seed=args.seed, progress=lambda s: print("  " + s, flush=True))
    print(format_table(rows))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _calibrate(args) -> int:
    from posttrain.lab.calibrate import calibrate_odc, calibrate_pipeline
    from posttrain.train.sft.pipeline import PipelineConfig

    from .train import train_config

    cfg = train_config(args, max_tokens=args.max_len)
    out = calibrate_odc(cfg, repeats=args.repeats, measured_json=args.measured_json)
    out["pipeline"] = [calibrate_pipeline(PipelineConfig(schedule=s, num_ranks=p, chunks=v, num_microbatches=m,
                                                         offload=o, num_layers=p * v, steps=2))
                       for s, p, v, m, o in (("1f1b", 2, 1, 4, "none"), ("interleaved_1f1b", 2, 2, 4, "1"),
                                             ("group_interleaved", 4, 2, 8, "1"), ("zbv", 2, 2, 4, "full"))]
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
        print(f"wrote {args.json}")
    ok = abs(out["error"]) <= 0.10 and all(p["predicted"] == p["measured"] for p in out["pipeline"])
    return 0 if ok else 1


def add_parser(sub) -> None:
    from posttrain.train.sft import TrainConfig

    sim = sub.add_parser("simulate", help="discrete-event simulation at cluster scale (FSDP vs ODC, pipeline)")
    ss = sim.add_subparsers(dest="simulate", required=True)

    odc = ss.add_parser("odc", help="FSDP vs ODC on a simulated cluster: throughput, utilization, timeline")
    add_dp_arguments(odc)
    add_config_arguments(odc, TrainConfig, fields=("balance",))
    odc.add_argument("--fsdp-balance", choices=("round_robin", "local_sort", "same_micro"), default="same_micro",
                     help="FSDP's balancing method (default same_micro)")
    odc.add_argument("--max-tokens", type=int, default=None, help="tokens per microbatch (default: longest possible)")
    odc.add_argument("--trace", default="out/sim_odc_trace.json", help="Chrome trace JSON ('' for none)")
    odc.add_argument("--plot", default="out/sim_odc.png", help="timeline PNG, first 16 ranks ('' for none)")
    odc.set_defaults(func=_odc)

    pipe = ss.add_parser("pipeline", help="a pipeline schedule with activation offload: makespan, memory, copies")
    add_pipeline_arguments(pipe, extra_fields=("schedule", "chunks", "group_size"), schedule="group_interleaved")
    pipe.add_argument("--offload-chunks", type=int, default=0, help="offload each rank's first this many chunks")
    pipe.add_argument("--plot", default="out/sim_pipeline.png", help="chart PNG ('' for none)")
    pipe.add_argument("--paper-table", action="store_true", help="only print ours vs the PipeOffload unit-cost table")
    pipe.set_defaults(func=_pipeline)

    table = ss.add_parser("table", help="predicted ODC/FSDP speedup per balancing method, 8-256 GPUs")
    table.add_argument("--gpus", default="8,16,32,64,128,256", help="comma-separated GPU counts")
    table.add_argument("--cost-models", default="1.5b,7b", help="comma-separated cost presets (default 1.5b,7b)")
    table.add_argument("--profiles", default="longalign,swe_smith", help="comma-separated length profiles")
    add_config_arguments(table, LengthOptions, fields=("sequences_per_gpu", "minibatches", "seed"))
    table.add_argument("--json", default="out/sim_table.json", help="results file")
    table.set_defaults(func=_table)

    cal = ss.add_parser("calibrate", help="simulator vs the real 2-rank benchmark and pipeline runner, side by side")
    add_config_arguments(cal, TrainConfig, fields=("profile", "steps", "sequences", "max_len", "dim", "num_layers",
                                                   "seed"),
                         defaults={"steps": 8, "sequences": 16, "max_len": 1024})
    cal.add_argument("--repeats", type=int, default=3, help="rounds of the real trainings (default 3)")
    cal.add_argument("--measured-json", default=None, help="take the measured speedup from a bench odc JSON instead")
    cal.add_argument("--json", default="out/sim_calibrate.json", help="results file")
    cal.set_defaults(func=_calibrate)
