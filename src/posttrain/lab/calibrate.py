"""``posttrain simulate calibrate``: the simulator against this machine.

1. **Measure** on ``world_size`` CPU processes at once (each under the same core contention as
   training): forward+backward seconds of every microbatch shape the benchmark's plans contain
   (unsharded model, no communication), fitted per layer to :class:`posttrain.sim.LayerCost`;
   and each engine's cost per layer and microbatch (communication, copies, hooks): FSDP2 and
   ODC train on *equal-length* sequences, where no rank waits for another, and their step time
   minus the compute alone is spread over layers and microbatches. (A gloo all-gather timed on
   its own misses FSDP2's copies and hooks, so it underestimates what FSDP2 costs.)
   Flat ODC's two modes (``bench odc --sweep``, ``bench rl``) are calibrated more tightly by
   :func:`flat_odc_costs`: each run is its own reference, and the collective mode's excess over
   ODC's copies is fitted as compute jitter (:func:`fit_jitter`).
2. **Predict** the benchmark's imbalanced steps (the same minibatches and plans as
   ``posttrain bench odc``) with :func:`posttrain.sim.simulate_dp`, the measured per-layer times
   in place of the link model and no overlap (on CPU both engines communicate synchronously).
   What is tested is the simulator's synchronization model: FSDP's per-layer rendezvous against
   ODC's one barrier per minibatch, with costs it never saw on imbalanced data.
3. **Run** the real FSDP2+same_micro and ODC+diff_micro trainings (or read a ``bench odc`` JSON)
   and print predicted and measured speedups side by side.

Pipeline: the real :class:`posttrain.pipeline.PipelineRunner` measures its per-rank peak of
saved activations from the hooks; the simulator predicts it in chunk-microbatches. Both printed.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

from posttrain.balance import FlopsCost
from posttrain.data import synthetic_sequences
from posttrain.dp import EngineConfig
from posttrain.launch import run_ranks
from posttrain.models import build_model
from posttrain.sim import Cluster, LayerCost, SimModel, plan_lengths, simulate_dp, simulate_minibatch
from posttrain.train.core import config_value
from posttrain.train.sft import (
    TrainConfig,
    TrainData,
    microbatch_loss,
    partition_bound_worker,
    plan_step,
    step_cost,
    summarize,
    train_worker,
)

__all__ = ["MeasuredSplitCost", "calibrate_odc", "calibrate_pipeline", "cp_config", "fit_jitter", "flat_odc_costs",
           "machine_from_shapes", "measure_machine", "measure_sweep_machine", "pipeline_workload_from_metrics",
           "predict_context_parallel", "predict_mechanism", "predict_plans", "simulated_excess",
           "step_context_plans", "step_plans", "write_pipeline_metrics"]


def step_plans(cfg: TrainConfig, world_size: int, method: str):
    """The trainer's balancing plans (``method``) of ``cfg``'s steps after the first."""
    data = TrainData(cfg, world_size)
    cost = step_cost(cfg, data.vocab_size)
    c = replace(cfg, balance=method)
    return [plan_step(c, data.minibatch(k), world_size, cost) for k in range(1, cfg.steps)]  # step 0 is warm-up


def _slowest_median(fn, iters: int) -> float:
    times = []
    for _ in range(iters + 1):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times[1:])], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _compute_worker(rank: int, world_size: int, cfg: TrainConfig, shapes: list[list[int]], iters: int) -> list[float]:
    data = TrainData(cfg, world_size)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.model_config(data.vocab_size))
    seconds = []
    for shape in shapes:
        seqs = synthetic_sequences([n + 1 for n in shape], vocab_size=data.vocab_size, seed=len(shape))
        ids = list(range(len(seqs)))
        seconds.append(_slowest_median(lambda: microbatch_loss(model, seqs, ids, 1.0).backward(), iters))
    return seconds


def _write_equal(path: str, sequences: int, length: int) -> None:
    """A JSONL of ``sequences`` token-id sequences of ``length`` inputs each (one more id: the
    last target), for the equal-length calibration runs."""
    with open(path, "w") as f:
        for i in range(sequences):
            f.write(json.dumps({"input_ids": [(i + k) % 97 for k in range(length + 1)]}) + "\n")


def _steady(results: list[dict]) -> list[tuple[dict, ...]]:
    """A run's steps after the first (warm-up), each as every rank's metrics row."""
    return list(zip(*(r["metrics"] for r in results)))[1:]


def _per_step(step: tuple[dict, ...]) -> float:
    """A step's own per-step work: the optimizer and the sync of the rank that arrived last (the
    exit's own cost, not waiting for a slower peer: the simulator models that waiting itself)."""
    return statistics.mean(r["optimizer_s"] for r in step) + min(r["sync_s"] for r in step)


def _engine_costs(cfg: TrainConfig, dp: str, world_size: int, log, *, mode: str = "one-sided") -> dict[str, float]:
    """What engine ``dp`` (in ``mode``) adds to pure compute, from a run on equal-length sequences
    where no rank waits for another: seconds per layer and microbatch (communication, copies,
    hooks) and per step (optimizer step and minibatch sync)."""
    length = max(8, cfg.max_tokens // 2)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "equal.jsonl")
        _write_equal(path, max(cfg.sequences, 4 * world_size), length)
        c = replace(cfg, data=path, engine=EngineConfig(dp, mode=mode), balance="same_micro",
                    sequences=max(cfg.sequences, 4 * world_size), max_len=length + 1,
                    max_tokens=max(cfg.max_tokens, length))
        results = run_ranks(train_worker, world_size, c, timeout_s=3600)
        run = summarize(results)
        data = TrainData(c, world_size)
        cost = FlopsCost.from_config(c.model_config(data.vocab_size))
        plans = [plan_step(c, data.minibatch(k), world_size, cost) for k in range(1, c.steps)]
        # The same microbatches on a plain model, each rank its own share at the same time.
        shares = {"plan": [[[i for mb in mbs for i in mb.sequence_ids] for mbs in p.ranks] for p in plans]}
        per_rank = run_ranks(partition_bound_worker, world_size, c, shares, timeout_s=3600)
        ideal = statistics.mean(max(r["plan"][k] for r in per_rank) for k in range(len(plans)))
        mbs = max(plans[0].num_microbatches)
    per_step = statistics.median(_per_step(s) for s in _steady(results))
    left = run["step_time_s"] - ideal - per_step
    extra = max(0.0, left) / (mbs * cfg.num_layers)
    if left > 0:
        result = f"{extra * 1e3:.3f} ms per layer and microbatch"
    else:  # the run came out no slower than its compute and optimizer: nothing this machine can resolve
        result = (f"below what this run resolves (step minus compute and optimizer: {left * 1e3:+.1f} ms, "
                  "within the noise), taken as 0 ms per layer and microbatch")
    log(f"  {c.engine.label} on equal lengths: step {run['step_time_s'] * 1e3:.1f} ms, compute alone {ideal * 1e3:.1f} ms, "
        f"optimizer and sync {per_step * 1e3:.1f} ms, {mbs} microbatches x {cfg.num_layers} layers -> {result}",
        flush=True)
    return {"per_layer_microbatch": extra, "per_step": per_step, "microbatches": mbs}


def _engine_cost(cfg: TrainConfig, dp: str, world_size: int, log) -> float:
    """Seconds per layer and microbatch that ``dp`` adds to pure compute, its per-step costs spread
    over the layers and microbatches of the equal-length run."""
    c = _engine_costs(cfg, dp, world_size, log)
    return c["per_layer_microbatch"] + c["per_step"] / (c["microbatches"] * cfg.num_layers)


def measure_machine(cfg: TrainConfig, *, world_size: int = 2, iters: int = 3, log=print) -> dict:
    """Per-layer cost fit and per-layer engine cost of FSDP2 and ODC on this machine."""
    shapes = sorted({tuple(sorted(m_lens)) for method in ("same_micro", "diff_micro")
                     for plan in step_plans(cfg, world_size, method)
                     for m_lens in ([plan.lengths[i] for i in mb.sequence_ids] for mbs in plan.ranks for mb in mbs)
                     if m_lens})
    seconds = run_ranks(_compute_worker, world_size, cfg, [list(s) for s in shapes], iters, timeout_s=1800)[0]
    per_layer = [t / cfg.num_layers for t in seconds]
    cost = LayerCost.fit([list(s) for s in shapes], per_layer)
    pred = [(1 + cost.backward_ratio) * cost.forward(list(s)) for s in shapes]
    err = statistics.median(abs(p - m) / m for p, m in zip(pred, per_layer))
    comm = {}
    for dp in ("fsdp", "odc"):
        extra = _engine_cost(cfg, dp, world_size, log)
        # FSDP: three rendezvous per layer and microbatch (gather, gather, reduce) share it evenly
        comm[dp] = {"gather": extra / 3, "reduce": extra / 3, **({"add": 0.0} if dp == "odc" else {})}
    return {"layer_cost": cost, "fit_median_error": err, "shapes": len(shapes), "comm": comm}


def predict_odc(cfg: TrainConfig, machine: dict, *, world_size: int = 2) -> dict:
    """Simulated tokens/s of FSDP+same_micro and ODC+diff_micro (and the round-robin variants)."""
    model = SimModel(num_layers=cfg.num_layers, layer_cost=machine["layer_cost"], layer_param_bytes=0.0,
                     layer_grad_bytes=0.0)
    cluster = Cluster(num_gpus=world_size, gpus_per_node=world_size)
    out = {}
    for strat, method in (("fsdp", "same_micro"), ("fsdp", "round_robin"), ("odc", "round_robin"), ("odc", "diff_micro")):
        res = simulate_dp(step_plans(cfg, world_size, method), strategy=strat, model=model, cluster=cluster,
                          op_times=machine["comm"][strat], overlap=False)
        out[f"{strat}+{method}"] = {"time_s": res.time, "utilization": 1 - res.bubble_fraction}
    return out


def measure_sweep_machine(base: TrainConfig, points: list[TrainConfig], *, world_size: int = 2, iters: int = 3,
                          max_shapes: int = 48, log=print) -> dict:
    """What :func:`predict_mechanism` needs, measured on ``world_size`` processes: a per-layer
    cost fit over microbatch shapes drawn from every point's same_micro and diff_micro plans (at
    most ``max_shapes``, the largest always among them), and flat ODC's costs in both modes
    (per layer and microbatch; per step)."""
    import random

    shapes = sorted({tuple(sorted(plan.lengths[i] for i in mb.sequence_ids))
                     for cfg in points for method in ("same_micro", "diff_micro")
                     for plan in step_plans(cfg, world_size, method) for mbs in plan.ranks for mb in mbs if mb.sequence_ids})
    if len(shapes) > max_shapes:
        largest = max(shapes, key=sum)
        shapes = sorted({largest, *random.Random(0).sample(shapes, max_shapes - 1)})
    seconds = run_ranks(_compute_worker, world_size, base, [list(s) for s in shapes], iters, timeout_s=3600)[0]
    ref = max(points, key=lambda c: c.max_tokens)
    return machine_from_shapes(ref, [list(s) for s in shapes], seconds, world_size=world_size, log=log)


def machine_from_shapes(ref: TrainConfig, shapes: list[list[int]], seconds: list[float], *, world_size: int = 2,
                        rounds: int = 3, log=print) -> dict:
    """What :func:`predict_plans` needs: the per-layer cost fitted to ``seconds`` (forward and
    backward of the whole ``ref.num_layers``-layer model on each microbatch shape, measured with
    every rank computing at once), and flat ODC's costs in both modes with the compute jitter that
    explains the collective mode's, measured on ``ref``'s model on sequences of the shapes'
    median length (:func:`flat_odc_costs`)."""
    per_layer = [t / ref.num_layers for t in seconds]
    cost = LayerCost.fit(shapes, per_layer)
    pred = [(1 + cost.backward_ratio) * cost.forward(s) for s in shapes]
    err = statistics.median(abs(p - m) / m for p, m in zip(pred, per_layer))
    log(f"  layer cost fit over {len(shapes)} microbatch shapes: forward {cost.linear * 1e6:.3f} us/token + "
        f"{cost.quadratic * 1e9:.4f} ns/token^2 + {cost.overhead * 1e3:.3f} ms; median error {err:.1%}", flush=True)
    length = round(statistics.median(n for shape in shapes for n in shape))
    costs = flat_odc_costs(ref, cost, length=length, world_size=world_size, rounds=rounds, log=log)
    return {"layer_cost": cost, "fit_median_error": err, "shapes": len(shapes), "engine": costs["engine"],
            "jitter": costs["jitter"]}


def _excess(step: tuple[dict, ...]) -> float:
    """Seconds a step took beyond its slowest rank's own compute and its :func:`_per_step` work."""
    return max(0.0, step[0]["step_time_s"] - max(r["compute_s"] for r in step) - _per_step(step))


def _compute(results: list[dict]) -> float:
    """A run's compute a step: per step the ranks' mean compute, the median over the steps."""
    return statistics.median(statistics.mean(r["compute_s"] for r in s) for s in _steady(results))


def flat_odc_costs(cfg: TrainConfig, layer_cost: LayerCost, *, length: int, world_size: int = 2, rounds: int = 3,
                   draws: int = 8, log=print) -> dict:
    """Flat ODC's costs on this machine, from ``rounds`` interleaved pairs of runs of both modes on
    sequences of ``length`` tokens (``cfg``'s model, two sequences a microbatch, two microbatches
    a rank).

    Each run is its own reference: per step, its time beyond the slowest rank's compute (timed
    around each microbatch, communication excluded) and the optimizer and exit sync. (Compute taken
    from a separate run of the same work on a plain model would leave the per-layer cost inside
    the noise between the two runs.)

    - ``engine[mode]``: ``per_layer_microbatch`` (ODC: the copies and adds; the simulator's
      operation cost for both modes, since both move the same bytes through the same transport),
      ``per_step`` (optimizer and exit) and ``measured_compute_factor``: the collective mode's
      compute (communication excluded) over ODC's on the same equal work, the median of the
      rounds' paired ratios (printed with each round's). It is recorded, not applied: its
      readings vary between calibrations by more than its own size, and applying it mispredicts
      the sweep (docs/simulator.md). Both modes' compute is taken as the plain
      model's (``bench odc``'s compute factor compares ODC's with it).
    - ``jitter``: the coefficient of variation of a layer's compute time with which the
      simulated collective run (per-layer rendezvous, ODC's operation cost) loses what the
      measured one lost beyond that cost. On equal work only the variance of each rank's layer
      times makes a rendezvous wait; it is what the collective mode pays beyond ODC there. The
      relative variance may depend on the microbatch size (fixed per-operation overheads), so the
      caller picks a length typical of its microbatches.
    """
    length = max(8, length)
    sequences = 4 * world_size
    runs: dict[str, list] = {"one-sided": [], "collective": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "equal.jsonl")
        _write_equal(path, sequences, length)
        c = replace(cfg, data=path, engine=EngineConfig("odc"), balance="same_micro", sequences=sequences, max_len=length + 1,
                    max_tokens=2 * length, progress=False, checkpoint_dir=None)
        for _ in range(rounds):
            for mode in runs:
                runs[mode].append(run_ranks(train_worker, world_size, replace(c, engine=EngineConfig("odc", mode=mode)),
                                            timeout_s=3600))
        data = TrainData(c, world_size)
        cost = FlopsCost.from_config(c.model_config(data.vocab_size))
        plans = [plan_step(c, data.minibatch(k), world_size, cost) for k in range(1, c.steps)]
    mbs = max(plans[0].num_microbatches)
    ratios = [_compute(a) / _compute(b) for a, b in zip(runs["collective"], runs["one-sided"])]
    factor = statistics.median(ratios)
    measured, per_step, split = {}, {}, {}
    for mode, results in runs.items():
        steps = [s for res in results for s in _steady(res)]
        excess = [_excess(s) for s in steps]
        measured[mode] = statistics.median(excess)
        per_step[mode] = statistics.median(_per_step(s) for s in steps)
        # recorded beside the fit (not used by it): a rank's communication a step and the part of
        # it spent waiting in the transport's barriers, medians over steps of the ranks' means
        split[mode] = {k: statistics.median(statistics.mean(r[k] for r in s) for s in steps)
                       for k in ("comm_s", "barrier_wait_s")}
        log(f"  flat ODC {mode} on {length}-token sequences ({rounds} runs, {len(excess)} steps): beyond the slowest rank's "
            f"compute {measured[mode] * 1e3:.1f} ms a step (quartiles {_quartiles(excess)}), optimizer and exit "
            f"{per_step[mode] * 1e3:.1f} ms; {mbs} microbatches x {cfg.num_layers} layers", flush=True)
    # Both modes copy the same bytes: the collective run's operations are taken to cost what ODC's
    # do. Measured true on CPU ranks: at 2 ranks on 2 cores and at 4 and 8 on 16 (5-7 ms a step
    # outside the barriers in the collective run, 7-9 ms one-sided). Ranks sharing one GPU are
    # another matter (21-77 ms against 0.1-2: docs/simulator.md); the demo runs on CPU processes.
    copies = measured["one-sided"] / (mbs * cfg.num_layers)
    engine = {mode: {"per_layer_microbatch": copies, "per_step": per_step[mode], "microbatches": mbs,
                     "excess_per_step": measured[mode], "measured_compute_factor": factor if mode == "collective" else 1.0,
                     "comm_per_step": split[mode]["comm_s"], "barrier_wait_per_step": split[mode]["barrier_wait_s"]}
              for mode in runs}
    cluster = Cluster(num_gpus=world_size, gpus_per_node=world_size)
    model = SimModel(num_layers=cfg.num_layers, layer_cost=layer_cost, layer_param_bytes=0.0,
                     layer_grad_bytes=0.0, optimizer_s=engine["collective"]["per_step"])
    ops = {"gather": copies / 3, "reduce": copies / 3}
    jitter = fit_jitter(plans, model=model, cluster=cluster, op_times=ops, excess=measured["collective"], draws=draws)
    log(f"  -> per layer and microbatch: {copies * 1e3:.2f} ms of copies (both modes); "
        f"the collective mode's compute over ODC's on the same work {factor:.3f}x (rounds: "
        f"{', '.join(f'{x:.3f}' for x in ratios)}; recorded, not applied); "
        f"compute jitter {jitter:.1%} (coefficient of variation) explains the collective run's "
        f"{(measured['collective'] - measured['one-sided']) * 1e3:.1f} ms a step more than ODC's", flush=True)
    return {"engine": engine, "jitter": jitter}


def simulated_excess(plans: list, *, model: SimModel, cluster: Cluster, op_times: dict, jitter: float,
                     draws: int = 8) -> float:
    """Seconds a simulated FSDP-style step of ``plans`` (per-layer rendezvous, no overlap) lasts
    beyond its slowest rank's compute and ``model.optimizer_s``, as :func:`_excess` measures a real
    one's; the mean over ``draws`` seeded draws and the steps."""
    total = 0.0
    for d in range(draws if jitter else 1):
        for k, plan in enumerate(plans):
            res = simulate_minibatch(plan_lengths(plan), strategy="fsdp", model=model, cluster=cluster,
                                     op_times=op_times, overlap=False, jitter=jitter, seed=1000 * d + k)
            total += res.time - max(res.compute) - model.optimizer_s
    return total / ((draws if jitter else 1) * len(plans))


def fit_jitter(plans: list, *, model: SimModel, cluster: Cluster, op_times: dict, excess: float, draws: int = 8,
               limit: float = 1.0) -> float:
    """The compute jitter (coefficient of variation, in ``[0, limit]``) with which
    :func:`simulated_excess` of ``plans`` equals ``excess`` seconds a step (bisection; the draws'
    seeds are fixed, so the simulated excess grows with the jitter)."""
    def f(j: float) -> float:
        return simulated_excess(plans, model=model, cluster=cluster, op_times=op_times, jitter=j, draws=draws)

    lo, hi = 0.0, limit
    if f(lo) >= excess:
        return 0.0
    if f(hi) <= excess:
        return hi
    for _ in range(20):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < excess else (lo, mid)
    return (lo + hi) / 2


def _quartiles(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"{q[0] * 1e3:.1f}-{q[2] * 1e3:.1f}"


def predict_mechanism(cfg: TrainConfig, machine: dict, *, world_size: int = 2) -> dict:
    """The simulator's headroom and mechanism gain of flat ODC for ``cfg`` (see
    [Note: where ODC's gain comes from] in :mod:`posttrain.lab.bench.odc`).

    - collective+same_micro: :func:`~posttrain.sim.simulate_dp` with FSDP's per-layer rendezvous;
    - odc+diff_micro: with ODC's one barrier per minibatch;
    - partition bound: each step's best whole-sequence assignment under the fitted costs, every
      rank's share packed as the measured bound packs it, no communication.
    All three with the machine's compute jitter (averaged over seeded draws); both runs with flat
    ODC's measured per-layer and per-step costs and compute factor of their mode, and no overlap
    (on CPU the engine copies synchronously).
    """
    return predict_plans(step_plans(cfg, world_size, "same_micro"), step_plans(cfg, world_size, "diff_micro"), machine,
                         num_layers=cfg.num_layers, max_tokens=cfg.max_tokens, world_size=world_size)


def predict_plans(same_micro: list, diff_micro: list, machine: dict, *, num_layers: int, max_tokens: int,
                  world_size: int = 2, draws: int = 8) -> dict:
    """:func:`predict_mechanism` for given plans: ``same_micro`` and ``diff_micro`` hold each
    step's :class:`~posttrain.balance.Plan` of the same minibatches under those methods; with
    jitter, every figure is the mean of ``draws`` seeded simulations."""
    from posttrain.balance import pack_share
    from posttrain.balance.exact import min_max_partition

    cost = machine["layer_cost"]
    jitter = machine.get("jitter", 0.0)
    draws = draws if jitter else 1
    cluster = Cluster(num_gpus=world_size, gpus_per_node=world_size)
    times = {}
    for mode, strategy, plans in (("collective", "fsdp", same_micro), ("one-sided", "odc", diff_micro)):
        eng = machine["engine"][mode]
        per_op = eng["per_layer_microbatch"] / 3
        model = SimModel(num_layers=num_layers, layer_cost=cost,
                         layer_param_bytes=0.0, layer_grad_bytes=0.0, optimizer_s=eng["per_step"])
        ops = {"gather": per_op, "reduce": per_op, **({"add": 0.0} if strategy == "odc" else {})}
        times[mode] = statistics.mean(simulate_dp(plans, strategy=strategy, model=model, cluster=cluster, op_times=ops,
                                                  overlap=False, jitter=jitter, seed=1000 * d).time
                                      for d in range(draws))
    layers = num_layers * (1 + cost.backward_ratio)
    bare = SimModel(num_layers=num_layers, layer_cost=cost, layer_param_bytes=0.0, layer_grad_bytes=0.0)
    partition = 0.0
    for k, plan in enumerate(diff_micro):
        lengths = plan.lengths
        parts, _ = min_max_partition([layers * cost.forward([n]) for n in lengths], world_size)
        shares = [[[lengths[i] for i in mb] for mb in pack_share(lengths, part, max_tokens)] for part in parts]
        partition += statistics.mean(
            simulate_minibatch(shares, strategy="odc", model=bare, cluster=cluster,
                               op_times={"gather": 0.0, "reduce": 0.0, "add": 0.0}, overlap=False, jitter=jitter,
                               seed=1000 * d + k).time for d in range(draws))
    return {"headroom": times["collective"] / partition, "mechanism": times["collective"] / times["one-sided"],
            "collective_s": times["collective"], "odc_s": times["one-sided"], "partition_s": partition}


def cp_config(cfg: TrainConfig, context_parallel: int | str) -> TrainConfig:
    """``cfg`` as ``bench odc``'s ``odc+cp`` runs it: flat ODC, one-sided, diff_micro's plan with
    the costliest sequences split (``context_parallel``)."""
    return replace(cfg, engine=replace(cfg.engine, name="odc", mode="one-sided", context_parallel=context_parallel),
                   balance="diff_micro")


def step_context_plans(cfg: TrainConfig, world_size: int, context_parallel: int | str) -> list:
    """The trainer's plans of ``cfg``'s steps after the first, run as :func:`cp_config`."""
    from posttrain.train.sft.loop import plan_context_step

    c = cp_config(cfg, context_parallel)
    data = TrainData(c, world_size)
    cost = step_cost(c, data.vocab_size)
    return [plan_context_step(c, data.minibatch(k), world_size, cost) for k in range(1, c.steps)]


class MeasuredSplitCost:
    """What splitting an ``n``-token sequence over 2 ranks costs beyond half its work, in seconds:
    measured at some lengths (``overheads[i]`` at ``lengths[i]``, e.g.
    :func:`posttrain.lab.bench.cp_exchange.measure`'s split minus half the whole), linear in ``n``
    between them, the nearest measurement's beyond them, never below 0. (Two fitted constants, a
    cost a split and a cost a token, went negative on noisy measurements: the overhead is about
    flat from 256 to 1,024 tokens and grows beyond.) For ``k`` shards the cost is taken as at 2
    (measured on 2 ranks only)."""

    def __init__(self, lengths: list[int], overheads: list[float]) -> None:
        if not lengths or len(lengths) != len(overheads) or sorted(lengths) != list(lengths):
            raise ValueError("MeasuredSplitCost needs increasing lengths, one overhead each")
        self.lengths, self.overheads = list(lengths), [max(0.0, x) for x in overheads]

    def __call__(self, n: int, k: int) -> float:
        return float(np.interp(n, self.lengths, self.overheads)) if k >= 2 else 0.0


def predict_context_parallel(cfg: TrainConfig, machine: dict, split: Callable[[int, int], float], *,
                             context_parallel: int | str = "auto", world_size: int = 2, draws: int = 8) -> dict:
    """The simulator's ``odc+cp / odc+diff_micro`` for ``cfg``'s steps: both runs simulated with
    ODC's one barrier per minibatch, flat ODC's measured one-sided costs and the machine's compute
    jitter (``machine`` from :func:`measure_sweep_machine`), on the plans the trainer makes
    (diff_micro's, and with ``context_parallel`` its split plans). A shard of ``n``-token sequence
    over ``k`` ranks runs as a microbatch costing ``sequence_cost(n) / k + split(n, k)`` seconds:
    ``split`` is what splitting costs beyond the share, measured (:class:`MeasuredSplitCost`); the
    group's per-layer meetings are inside that measurement, not simulated as rendezvous."""
    from posttrain.balance import ContextPlan

    jitter = machine.get("jitter", 0.0)
    draws = draws if jitter else 1
    eng = machine["engine"]["one-sided"]
    per_op = eng["per_layer_microbatch"] / 3
    model = SimModel(num_layers=cfg.num_layers, layer_cost=machine["layer_cost"], layer_param_bytes=0.0,
                     layer_grad_bytes=0.0, optimizer_s=eng["per_step"])
    cluster = Cluster(num_gpus=world_size, gpus_per_node=world_size)

    def priced(plan):  # a split plan's shards at their cost in seconds on this machine
        if not isinstance(plan, ContextPlan):
            return plan
        return replace(plan, shards=tuple(tuple(
            replace(sh, cost=model.sequence_cost(plan.lengths[sh.sequence_id]) / sh.num_shards
                    + split(plan.lengths[sh.sequence_id], sh.num_shards)) for sh in shards) for shards in plan.shards))

    runs = {"odc+diff_micro": step_plans(cfg, world_size, "diff_micro"),
            "odc+cp": [priced(p) for p in step_context_plans(cfg, world_size, context_parallel)]}
    times = {name: statistics.mean(
        simulate_dp(plans, strategy="odc", model=model, cluster=cluster, op_times={"gather": per_op, "reduce": per_op,
                                                                                    "add": 0.0},
                    overlap=False, jitter=jitter, seed=1000 * d).time for d in range(draws))
        for name, plans in runs.items()}
    return {"cp": times["odc+diff_micro"] / times["odc+cp"], "odc_s": times["odc+diff_micro"],
            "cp_s": times["odc+cp"], "split": sum(len(getattr(p, "split", {})) for p in runs["odc+cp"])}


def _measure_real(cfg: TrainConfig, world_size: int, repeats: int, log) -> dict:
    rounds = []
    for k in range(repeats):
        got = {}
        for dp, method in (("fsdp", "same_micro"), ("odc", "diff_micro")):
            run = replace(cfg, engine=EngineConfig(dp), balance=method)
            got[f"{dp}+{method}"] = summarize(run_ranks(train_worker, world_size, run, timeout_s=3600))
            log(f"  round {k + 1}/{repeats}  {dp}+{method}: {got[f'{dp}+{method}']['tokens_per_s']:.0f} tokens/s",
                flush=True)
        rounds.append(got["odc+diff_micro"]["tokens_per_s"] / got["fsdp+same_micro"]["tokens_per_s"])
    return {"speedup": statistics.median(rounds), "rounds": rounds}


def calibrate_odc(cfg: TrainConfig, *, world_size: int = 2, repeats: int = 3, measured_json: str | None = None,
                  iters: int = 3, log=print) -> dict:
    """Measure, predict, run; print the predicted and the measured ODC+diff_micro / FSDP+same_micro.

    Args:
        measured_json: a ``posttrain bench odc`` results file to take the measured speedup from
            instead of running the two trainings (its config must match ``cfg``).
    """
    cfg = replace(cfg, progress=False, checkpoint_dir=None)
    if cfg.steps < 2:
        raise ValueError(f"steps={cfg.steps} must be at least 2 (the first step is warm-up)")
    log(f"measuring per-layer compute and communication on {world_size} processes ...", flush=True)
    machine = measure_machine(cfg, world_size=world_size, iters=iters, log=log)
    c = machine["layer_cost"]
    log(f"  layer cost fit over {machine['shapes']} microbatch shapes: forward {c.linear * 1e6:.3f} us/token + "
        f"{c.quadratic * 1e9:.4f} ns/token^2 + {c.overhead * 1e3:.3f} ms; median error {machine['fit_median_error']:.1%}")
    pred = predict_odc(cfg, machine, world_size=world_size)
    predicted = pred["fsdp+same_micro"]["time_s"] / pred["odc+diff_micro"]["time_s"]
    if measured_json:
        with open(measured_json) as f:
            bench = json.load(f)
        keys = ("profile", "sequences", "max_len", "max_tokens", "dim", "num_layers", "steps", "seed", "model",
                "engine.precision")
        diff = {k: (config_value(bench["config"], k), config_value(cfg, k)) for k in keys
                if config_value(bench["config"], k) != config_value(cfg, k)}
        if diff:
            raise ValueError(f"{measured_json} was run with a different config: {diff}")
        measured = {"speedup": bench["median"]["odc+diff_micro"]["vs_fsdp_same_micro"], "rounds": None,
                    "source": measured_json}
    else:
        log(f"running the real trainings ({repeats} rounds) ...", flush=True)
        measured = _measure_real(cfg, world_size, repeats, log)
    error = predicted / measured["speedup"] - 1
    log("")
    log(f"{'variant':20} {'predicted step s':>16} {'predicted util':>15}")
    for name, r in pred.items():
        log(f"{name:20} {r['time_s'] / (cfg.steps - 1):16.4f} {r['utilization']:15.2f}")
    log(f"ODC+diff_micro / FSDP+same_micro: predicted {predicted:.3f}, measured {measured['speedup']:.3f} "
        f"({error:+.1%}; target within 10%: {'met' if abs(error) <= 0.10 else 'NOT met'})")
    return {"predicted": predicted, "measured": measured, "error": error, "variants": pred,
            "layer_cost": c.__dict__, "comm": machine["comm"], "fit_median_error": machine["fit_median_error"]}


def calibrate_pipeline(cfg, *, log=print) -> dict:
    """Run the real pipeline runner and print its measured per-rank peaks next to the simulator's."""
    from posttrain.train.sft.pipeline import measured_weight_keep, predicted_peaks, run_pipeline

    results = run_pipeline(cfg)
    measured = [round(r["result"]["peak_units"], 9) for r in results]
    predicted = predicted_peaks(cfg, weight_keep=measured_weight_keep(results))
    log(f"pipeline {cfg.schedule} ({cfg.num_ranks} ranks, {cfg.chunks} chunks, {cfg.num_microbatches} microbatches, "
        f"offload {cfg.offload}): peak chunk-microbatches per rank predicted {predicted}, measured {measured} "
        f"({'equal' if list(predicted) == list(measured) else 'DIFFERENT'})")
    return {"predicted": list(predicted), "measured": list(measured)}


def write_pipeline_metrics(cfg, results: list[dict], path: str) -> None:
    """Write a ``posttrain pipeline`` run (its config and every rank's last step: actions with
    start and end, saved bytes per chunk-microbatch, peaks) as JSON, for
    :func:`pipeline_workload_from_metrics`."""
    from dataclasses import asdict

    ranks = [{k: res[k] for k in ("rank", "stages", "losses", "step_times", "result")} for res in results]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"config": asdict(cfg), "ranks": ranks}, f)


def pipeline_workload_from_metrics(path: str, *, num_ranks: int, host_bandwidth: float):
    """The planner's workload (per chunk-microbatch at one chunk per rank of ``num_ranks``) measured
    by a ``posttrain pipeline --calibration-out`` run, and one line per assumption it rests on.

    Per stage, the median time of each action kind over the run's last step; summed over the
    stages, that is the whole model's forward, input-gradient and weight-gradient time of one
    microbatch (of the run's shape), of which each of ``num_ranks`` ranks runs an equal share.
    Likewise the saved bytes of one microbatch through the whole model. A run without split
    backward (``B``) is split evenly into ``I`` and ``W``. The host link is the median bytes/s of
    the run's copies, or ``host_bandwidth`` if it offloaded nothing.

    Raises:
        ValueError: the file is missing or not such a run.
    """
    from posttrain.pipeline import Action
    from posttrain.sim.pipeline import PipelineWorkload
    from posttrain.train.sft.pipeline.report import measured_weight_keep

    try:
        with open(path) as f:
            data = json.load(f)
        cfg, ranks = data["config"], data["ranks"]
        actions = [(Action.parse(a), t0, t1, {int(s): b for s, b in r["result"]["chunk_bytes"].items()})
                   for r in ranks for a, t0, t1 in r["result"]["actions"]]
        kept = measured_weight_keep(ranks)
    except OSError as e:
        raise ValueError(f"calibrate={path}: {e.strerror}") from None
    except (KeyError, TypeError, ValueError, json.JSONDecodeError):
        raise ValueError(f"calibrate={path}: not the `calibration_out` file of a pipeline run") from None
    times: dict[tuple[str, int], list[float]] = {}
    copies, stage_bytes = [], {}
    for a, t0, t1, chunk_bytes in actions:
        stage_bytes.update(chunk_bytes)
        if a.kind in ("F", "B", "I", "W"):
            times.setdefault((a.kind, a.stage), []).append(t1 - t0)
        elif a.kind in ("OFFLOAD", "RELOAD") and t1 > t0 and chunk_bytes.get(a.stage):  # (whole entries only)
            copies.append(chunk_bytes[a.stage] / (t1 - t0))
    if not any(kind == "F" for kind, _ in times):
        raise ValueError(f"calibrate={path}: the run recorded no forward")

    def total(kind: str) -> float:
        return sum(statistics.median(v) for (k, _), v in times.items() if k == kind)

    split = any(kind == "I" for kind, _ in times)
    fwd, bytes_ = total("F"), sum(stage_bytes.values())
    inp, wgt = (total("I"), total("W")) if split else (total("B") / 2, total("B") / 2)
    notes = [f"calibrated from {path}: {cfg['schedule']}, {cfg['num_ranks']} ranks, {len(stage_bytes)} stages, "
             f"microbatches of {cfg['batch']} x {cfg['seq_len']} tokens, its last step (medians per stage)",
             f"whole model per microbatch: F {fwd * 1e3:.2f} ms, I {inp * 1e3:.2f} ms, W {wgt * 1e3:.2f} ms"
             + ("" if split else " (the run's full backward B split evenly into I and W)")
             + f", saved activations {bytes_ / 2**20:.2f} MiB; each of {num_ranks} ranks runs 1/{num_ranks}"]
    weight_keep = 1.0
    if split and kept:
        weight_keep = sum(kept.get(s, 1.0) * b for s, b in stage_bytes.items()) / bytes_
        notes.append(f"W keeps {weight_keep:.2f} of the saved activations after I (the run's stages, weighted by "
                     "their bytes)")
    if copies:
        host_bandwidth = statistics.median(copies)
        notes.append(f"host link: the median of the run's {len(copies)} copies")
    else:
        notes.append("host link: from `host_gbps` (the run offloaded nothing)")
    return PipelineWorkload(forward_s=fwd / num_ranks, input_grad_s=inp / num_ranks, weight_grad_s=wgt / num_ranks,
                            activation_bytes=bytes_ / num_ranks, host_bandwidth=host_bandwidth,
                            weight_keep=weight_keep), notes
