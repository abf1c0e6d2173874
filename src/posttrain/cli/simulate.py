"""``posttrain simulate ...``: the discrete-event simulator at cluster scale, and its calibration."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Literal

from posttrain.text import count
from posttrain.train.sft import TrainConfig

from .options import add_command

__all__ = ["Calibrate", "ClusterOptions", "CostOptions", "DPSetting", "LengthOptions", "ScheduleOptions", "SimulateODC",
           "SimulatePipeline", "SimulateTable", "WorkloadOptions", "add_parser", "dp_inputs"]


def _profiles():
    from posttrain.sim import LENGTH_PROFILES

    return LENGTH_PROFILES


def _schedules():
    from posttrain.pipeline import SCHEDULES

    return SCHEDULES


def _methods():
    from posttrain.balance import METHODS

    return METHODS


def _cost_models():
    from posttrain.sim import MODEL_SHAPES

    return tuple(MODEL_SHAPES)


@dataclass(frozen=True)
class LengthOptions:
    """The sequence lengths of the simulated minibatches.

    Attributes:
        profile: length profile (longalign and swe_smith at their published scale).
        lengths_file: sequence lengths to use instead: a JSON list, integers, or JSON lines.
        sequences_per_rank: sequences per rank in each minibatch.
        minibatches: minibatches simulated.
        seed: length sampling seed.
    """

    profile: str = field(default="longalign", metadata={"choices": _profiles})
    lengths_file: str | None = None
    sequences_per_rank: int = 8
    minibatches: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("sequences_per_rank", "minibatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")


@dataclass(frozen=True)
class ClusterOptions:
    """The simulated cluster.

    Attributes:
        world_size: data-parallel ranks, one GPU each.
        gpus_per_node: GPUs per node.
        intra_gbps: GB/s per GPU inside a node.
        inter_gbps: GB/s per GPU between nodes.
        replicas: HSDP: 1 (shard over every rank), or the number of nodes (shard within each
            node, all-reduce across nodes once per minibatch).
    """

    world_size: int = 32
    gpus_per_node: int = 8
    intra_gbps: float = 360.0
    inter_gbps: float = 40.0
    replicas: int = 1

    @property
    def hsdp(self) -> bool:
        return self.replicas > 1

    def __post_init__(self) -> None:
        nodes = -(-self.world_size // max(1, self.gpus_per_node))
        if self.replicas not in (1, nodes):
            raise ValueError(f"replicas={self.replicas}: the simulated HSDP shards within a node, so `replicas` is 1 "
                             f"or the {nodes} nodes (world_size={self.world_size} / gpus_per_node={self.gpus_per_node})")
        # in the units these options take: the library checks its own in bytes/s
        for name in ("intra_gbps", "inter_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")


@dataclass(frozen=True)
class CostOptions:
    """The simulated model's compute.

    Attributes:
        cost_model: cost preset (Qwen2.5 shapes).
        achieved_tflops: per-GPU achieved TFLOP/s.
    """

    cost_model: str = field(default="7b", metadata={"choices": _cost_models})
    achieved_tflops: float = 400.0

    def __post_init__(self) -> None:
        if not self.achieved_tflops > 0:
            raise ValueError(f"achieved_tflops={self.achieved_tflops} must be positive")


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
            raise ValueError(f"weight_keep={self.weight_keep} must be between 0 and 1")
        for name in ("forward_ms", "backward_ms", "weight_ms", "activation_mib"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name}={v} must be a non-negative number")
        if not self.host_gbps > 0:  # inf (free copies) is allowed; nan is not
            raise ValueError(f"host_gbps={self.host_gbps} must be a positive number of GB/s")

    def build(self):
        """The :class:`~posttrain.sim.pipeline.PipelineWorkload` of these costs."""
        from posttrain.sim.pipeline import PipelineWorkload

        return PipelineWorkload(forward_s=self.forward_ms / 1e3, input_grad_s=self.backward_ms / 1e3,
                                weight_grad_s=self.weight_ms / 1e3, activation_bytes=self.activation_mib * 2**20,
                                host_bandwidth=self.host_gbps * 1e9, weight_keep=self.weight_keep)


@dataclass(frozen=True)
class ScheduleOptions:
    """The simulated pipeline schedule.

    Attributes:
        schedule: the schedule (one of posttrain.pipeline.SCHEDULES).
        num_ranks: pipeline ranks.
        chunks: model chunks per rank (default: what the schedule takes, 2 for the interleaved
            families and zbv, else 1).
        num_microbatches: microbatches per step.
        group_size: group size of the grouped schedules (default: the number of ranks).
    """

    schedule: str = field(default="group_interleaved", metadata={"choices": _schedules})
    num_ranks: int = 8
    chunks: int | None = None
    num_microbatches: int = 32
    group_size: int | None = None

    def __post_init__(self) -> None:
        from posttrain.pipeline import check_schedule_options

        check_schedule_options(self.schedule, num_ranks=self.num_ranks, num_microbatches=self.num_microbatches,
                               num_chunks=self.chunks, group_size=self.group_size)


def dp_inputs(lengths: LengthOptions, c: ClusterOptions, cost: CostOptions):
    """``(cluster, model, batches of lengths, longest possible length)`` of the length, cluster
    and cost options."""
    from posttrain.sim import Cluster, SimModel, draw_lengths, load_lengths
    from posttrain.sim.lengths import profile_max_len

    cluster = Cluster(num_gpus=c.world_size, gpus_per_node=c.gpus_per_node, intra_bandwidth=c.intra_gbps * 1e9,
                      inter_bandwidth=c.inter_gbps * 1e9)
    model = SimModel.preset(cost.cost_model, achieved_flops=cost.achieved_tflops * 1e12)
    per_batch = lengths.sequences_per_rank * c.world_size
    if lengths.lengths_file:
        found = load_lengths(lengths.lengths_file)
        need = per_batch * lengths.minibatches
        if len(found) < need:
            raise ValueError(f"{lengths.lengths_file} holds {len(found)} lengths; {lengths.minibatches} minibatches of "
                             f"{per_batch} need {need}: lower `sequences_per_rank` or `minibatches`")
        batches = [found[k * per_batch:(k + 1) * per_batch] for k in range(lengths.minibatches)]
        longest = max(found)
    else:
        batches = [draw_lengths(lengths.profile, per_batch, seed=lengths.seed * 1000 + k)
                   for k in range(lengths.minibatches)]
        longest = profile_max_len(lengths.profile)
    return cluster, model, batches, longest


@dataclass(frozen=True)
class DPSetting:
    """What a simulated data-parallel run trains on and where (``simulate odc``, ``plan odc``).

    Attributes:
        lengths: the minibatches' lengths.
        cluster: the cluster.
        cost: the model's compute.
    """

    lengths: LengthOptions = field(default_factory=LengthOptions)
    cluster: ClusterOptions = field(default_factory=ClusterOptions)
    cost: CostOptions = field(default_factory=CostOptions)

    def inputs(self):
        """``(cluster, model, batches of lengths, longest possible length)``: :func:`dp_inputs`."""
        return dp_inputs(self.lengths, self.cluster, self.cost)


@dataclass(frozen=True)
class SimulateODC(DPSetting):
    """``posttrain simulate odc``: FSDP and ODC on one simulated cluster.

    Attributes:
        balance: ODC's balancing method.
        fsdp_balance: FSDP's balancing method (FSDP needs equal microbatch counts).
        max_tokens: tokens per microbatch (default: the longest possible sequence).
        context_parallel: also ODC whose plan splits the costliest sequences across ranks
            (``auto``: 2 up to every rank, or a shard count; ``off``: not simulated); a shard runs
            as its share of the sequence plus its keys' and values' exchange over the intra-node
            link (every layer, forward and backward, 20 microseconds a collective).
        trace: Chrome trace JSON of both runs ('' for none).
        plot: timeline PNG of the first 16 ranks ('' for none).
    """

    balance: str = field(default="diff_micro", metadata={"choices": _methods})
    fsdp_balance: Literal["round_robin", "local_sort", "same_micro"] = "same_micro"
    max_tokens: int | None = None
    context_parallel: int | Literal["off", "auto"] = "off"
    trace: str = "out/sim_odc_trace.json"
    plot: str = "out/sim_odc.png"


@dataclass(frozen=True)
class SimulatePipeline:
    """``posttrain simulate pipeline``: one schedule with activation offload.

    Attributes:
        schedule: the schedule and its shape.
        workload: the costs of one chunk-microbatch.
        offload: none, full, or the number of chunks per rank to offload (the first ones).
        offload_fraction: the share of each offloaded chunk-microbatch its copies move (selective
            offload within a chunk; the rest stays resident), or auto: the largest multiple of 0.05
            predicted to cost at most 2% of the step.
        plot: chart PNG ('' for none).
        paper_table: only print ours beside the PipeOffload paper's unit-cost table.
    """

    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)
    workload: WorkloadOptions = field(default_factory=WorkloadOptions)
    offload: str = "none"
    offload_fraction: str = "1"
    plot: str = "out/sim_pipeline.png"
    paper_table: bool = False


@dataclass(frozen=True)
class SimulateTable:
    """``posttrain simulate table``: the predicted speedup over world sizes, length profiles and
    models.

    Attributes:
        world_sizes: simulated world sizes (one GPU per rank).
        cost_models: cost presets.
        profiles: length profiles.
        lengths: sequences per rank, minibatches and seed (the profile is ``profiles``').
        json: results file ('' for none).
    """

    world_sizes: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
    cost_models: tuple[str, ...] = ("1.5b", "7b")
    profiles: tuple[str, ...] = ("longalign", "swe_smith")
    lengths: LengthOptions = field(default_factory=LengthOptions,
                                   metadata={"fields": ("sequences_per_rank", "minibatches", "seed")})
    json: str = "out/sim_table.json"

    def __post_init__(self) -> None:
        if not self.world_sizes or min(self.world_sizes) < 1:
            raise ValueError(f"world_sizes={','.join(map(str, self.world_sizes))} needs positive sizes")
        for name, known in (("cost_models", _cost_models()), ("profiles", _profiles())):
            for value in getattr(self, name):
                if value not in known:
                    raise ValueError(f"{name}: unknown {value!r}; choose from {', '.join(known)}")


@dataclass(frozen=True)
class Calibrate:
    """``posttrain simulate calibrate``: the simulator against real runs on this machine.

    Attributes:
        train: the run the 2-rank ODC benchmark trains (its engine and balancing method are the
            benchmark's).
        repeats: rounds of the real trainings.
        measured_json: take the measured speedup from a ``posttrain bench odc`` results file instead.
        json: results file ('' for none).
    """

    train: TrainConfig = field(
        default_factory=lambda: TrainConfig(steps=8, sequences=16, max_len=1024),
        metadata={"fields": ("profile", "steps", "sequences", "max_len", "dim", "num_layers", "seed")})
    repeats: int = 3
    measured_json: str | None = None
    json: str = "out/sim_calibrate.json"

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats} must be at least 1")


def _write_json(data, path: str) -> None:
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=2, default=str)
        print(f"wrote {path}")


def context_plan(lengths, o: SimulateODC, cluster, max_tokens: int, cost):
    """The plan of one simulated minibatch with context parallelism: :func:`posttrain.balance.plan_context`
    in the simulator's units (seconds, ``cost``), the exchange priced by :func:`posttrain.sim.exchange_seconds`
    at the preset model's key/value bytes (bf16), no margin (the simulator has no prediction error
    to hedge)."""
    from posttrain.balance import plan_context
    from posttrain.sim import MODEL_SHAPES, exchange_seconds

    return plan_context(lengths, world_size=cluster.num_gpus, max_tokens=max_tokens, cost=cost,
                        exchange=exchange_seconds(MODEL_SHAPES[o.cost.cost_model], cluster),
                        context_parallel=o.context_parallel)


def _odc(o: SimulateODC) -> int:
    from posttrain.balance import plan_minibatch
    from posttrain.lab.plots import plot_dp_timelines
    from posttrain.sim import simulate_dp
    from posttrain.spans import write_chrome_trace

    cluster, model, batches, longest = o.inputs()
    max_tokens = o.max_tokens or longest
    runs = []
    trace = bool(o.trace or o.plot)
    for strategy, method in (("fsdp", o.fsdp_balance), ("odc", o.balance)):
        plans = [plan_minibatch(b, world_size=cluster.num_gpus, max_tokens=max_tokens, method=method,
                                cost=model.sequence_cost) for b in batches]
        res = simulate_dp(plans, strategy=strategy, model=model, cluster=cluster, hsdp=o.cluster.hsdp, trace=trace)
        res.strategy = f"{res.strategy}+{method}"
        runs.append(res)
    if o.context_parallel != "off":
        plans = [context_plan(b, o, cluster, max_tokens, model.sequence_cost) for b in batches]
        res = simulate_dp(plans, strategy="odc", model=model, cluster=cluster, hsdp=o.cluster.hsdp, trace=trace)
        res.strategy = f"{res.strategy}+cp ({sum(len(p.split) for p in plans)} split)"
        runs.append(res)
    print(f"{o.cost.cost_model} on {cluster.num_gpus} GPUs ({cluster.num_nodes} nodes), {o.lengths.minibatches} "
          f"minibatches of {o.lengths.sequences_per_rank * cluster.num_gpus} sequences "
          f"({o.lengths.lengths_file or o.lengths.profile}), max_tokens {max_tokens}")
    print(f"{'run':28} {'tokens/s':>12} {'step s':>8} {'util min/mean':>14} {'bubble':>7}")
    for r in runs:
        u = r.utilization
        print(f"{r.strategy:28} {r.throughput:12,.0f} {r.time / len(r.minibatch_times):8.3f} "
              f"{min(u):6.2f}/{sum(u) / len(u):<6.2f} {r.bubble_fraction:7.2f}")
    print(f"speedup {runs[1].strategy} / {runs[0].strategy}: {runs[1].throughput / runs[0].throughput:.2f}")
    if len(runs) > 2:
        print(f"speedup {runs[2].strategy} / {runs[1].strategy}: {runs[2].throughput / runs[1].throughput:.2f} "
              "(a prediction: context parallelism has not run on more than 2 ranks or on a GPU cluster)")
    if o.trace:
        write_chrome_trace({r.strategy: r.spans for r in runs}, o.trace)
        print(f"wrote {o.trace} (chrome://tracing or ui.perfetto.dev)")
    if o.plot:
        plot_dp_timelines(runs, o.plot)
        print(f"wrote {o.plot}")
    return 0


def _pipeline(o: SimulatePipeline) -> int:
    from posttrain.lab.paper import format_pipeoffload_table, pipeoffload_table
    from posttrain.lab.plots import plot_pipeline_sim
    from posttrain.sim.pipeline import simulate_pipeline

    if o.paper_table:
        print(format_pipeoffload_table(pipeoffload_table()))
        return 0
    from posttrain.pipeline import OffloadPolicy, default_chunks

    w, s = o.workload.build(), o.schedule
    chunks = OffloadPolicy.parse(o.offload, s.chunks or default_chunks(s.schedule)).chunks
    run = {"num_ranks": s.num_ranks, "num_microbatches": s.num_microbatches, "num_chunks": s.chunks,
           "group_size": s.group_size, "offload_chunks": chunks, "workload": w}
    if o.offload_fraction == "auto":
        from posttrain.sim.planner import plan_offload_fraction

        if chunks == 0:
            raise ValueError("--offload-fraction auto picks a share of the offloaded chunks: give --offload too")
        res = plan_offload_fraction(s.schedule, **run)
        if res is None:
            print("--offload-fraction auto: even 5% of each chunk-microbatch costs more than 2% of the step; "
                  "no offload")
            res = simulate_pipeline(s.schedule, **{**run, "offload_chunks": 0})
    else:
        try:
            fraction = float(o.offload_fraction)
        except ValueError:
            raise ValueError(f"--offload-fraction={o.offload_fraction!r} is not a number in (0, 1] or auto") from None
        if fraction != 1 and chunks == 0:
            raise ValueError(f"--offload-fraction={o.offload_fraction} is a share of the offloaded chunks, and "
                             f"--offload={o.offload} offloads none: give --offload too")
        res = simulate_pipeline(s.schedule, offload_fraction=fraction, **run)
    ms = 1e3
    share = "" if res.offload_fraction == 1 or not res.offload_chunks else f", {res.offload_fraction:.2f} of each"
    print(f"{s.schedule}: {count(s.num_ranks, 'rank')} x {count(res.num_chunks, 'chunk')}, "
          f"{count(s.num_microbatches, 'microbatch', 'microbatches')}, offload "
          f"{count(res.offload_chunks, 'chunk')} per rank{share}")
    print(f"makespan {res.makespan * ms:.2f} ms (without offload {res.base_makespan * ms:.2f} ms, overhead "
          f"{res.overhead:+.1%}); bubble {res.bubble_fraction:.1%}")
    print(f"k = (D2H + H2D) / (F + I + W) = {w.k:.2f} "
          f"({'<= 1: offload can hide fully' if w.k <= 1 else '> 1: not fully hidden'}); "
          f"hidden here: {'yes' if res.hidden else 'no'}")
    print(f"{'rank':>4} {'peak units':>10} {'peak GiB':>9} {'copy util':>9}")
    for r in range(res.num_ranks):
        print(f"{r:>4} {res.peaks[r]:>10.2f} {res.peaks[r] * w.activation_bytes / 2**30:>9.2f} "
              f"{res.copy_utilization(r):>9.1%}")
    if o.plot:
        plot_pipeline_sim(res, o.plot)
        print(f"wrote {o.plot}")
    return 0


def _table(o: SimulateTable) -> int:
    from posttrain.lab.scale_table import format_table, scale_table

    rows = scale_table(world_sizes=o.world_sizes, profiles=o.profiles, models=o.cost_models,
                       sequences_per_rank=o.lengths.sequences_per_rank, minibatches=o.lengths.minibatches,
                       seed=o.lengths.seed, progress=lambda s: print("  " + s, flush=True))
    print(format_table(rows))
    _write_json(rows, o.json)
    return 0


def _calibrate(o: Calibrate) -> int:
    from posttrain.lab.calibrate import calibrate_odc, calibrate_pipeline
    from posttrain.train.sft.pipeline import PipelineConfig

    out = calibrate_odc(o.train, repeats=o.repeats, measured_json=o.measured_json)
    out["pipeline"] = [calibrate_pipeline(PipelineConfig(schedule=s, num_ranks=p, chunks=v, num_microbatches=m,
                                                         offload=off, num_layers=p * v, steps=2))
                       for s, p, v, m, off in (("1f1b", 2, 1, 4, "none"), ("interleaved_1f1b", 2, 2, 4, "1"),
                                               ("group_interleaved", 4, 2, 8, "1"), ("zbv", 2, 2, 4, "full"))]
    _write_json(out, o.json)
    # A calibration reports how well it fits; it fails only when it could not run (an exception).
    exact = sum(p["predicted"] == p["measured"] for p in out["pipeline"])
    print(f"fit: the calibrated speedup is {out['error']:+.1%} off the measured one "
          f"({'within' if abs(out['error']) <= 0.10 else 'outside'} the 10% this machine's noise allows); "
          f"pipeline peaks predicted exactly for {exact} of {len(out['pipeline'])} schedules")
    return 0


def add_parser(sub) -> None:
    sim = sub.add_parser("simulate", help="discrete-event simulation at cluster scale (FSDP vs ODC, pipeline)")
    ss = sim.add_subparsers(dest="simulate", required=True)
    add_command(ss, "odc", SimulateODC, _odc,
                help="FSDP vs ODC on a simulated cluster: throughput, utilization, timeline")
    add_command(ss, "pipeline", SimulatePipeline, _pipeline,
                help="a pipeline schedule with activation offload: makespan, memory, copies")
    add_command(ss, "table", SimulateTable, _table,
                help="predicted ODC/FSDP speedup per balancing method, 8-256 GPUs")
    add_command(ss, "calibrate", Calibrate, _calibrate,
                help="simulator vs the real 2-rank benchmark and pipeline runner, side by side")
