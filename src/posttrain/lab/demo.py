"""The demo: FSDP2 and ODC train the same tiny GPT on the same long-tail data, 2 CPU processes,
and the speedup is split into where it comes from.

Four runs, each computing the same gradients (their loss curves match):

- ``FSDP2 + same_micro``: gloo collectives, the best balancing FSDP allows (every rank the same
  number of microbatches);
- ``ODC-on-FSDP2 collective``: FSDP2 with ODC's shared-memory transport but FSDP's rendezvous at
  every gather and reduce, same plans: the gain over the first is the **transport**;
- ``flat ODC collective``: ODC's own flat engine, still with the rendezvous and the same plans:
  the gain over the second is the **engine**;
- ``flat ODC + diff_micro``: one synchronization per minibatch and minibatch-level balancing:
  the gain over the third is ODC's **mechanism**, the paper's idea.

The variants take turns a step at a time in the same two processes, over ``rounds`` rounds of the
same minibatches (:mod:`posttrain.lab.bench.stepwise` says why: this machine's speed swings by tens
of percent from one second to the next, and measuring each variant as its own run put those swings
between them, so that one round of 5 steps moved by up to 35%). Figures are pooled over the rounds,
each ratio with its 5th-95th percentile over rounds drawn with replacement; the demo says when the
figures mean little: other processes were using the CPUs when it started, or an interval is wide.
The setting is the one where the benchmarks found the mechanism's headroom on 2 ranks largest
(``long_tail`` sequences up to 4,096 tokens, 8 a rank). Then the simulator, calibrated on this
machine, predicts the mechanism for the same data at 8 to 64 GPUs (labelled a prediction: nothing
there is measured). The timeline PNG shows the last step of every variant, a panel each: per rank,
compute, communication and waiting.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import replace

from posttrain.device import check_world
from posttrain.dp import EngineConfig
from posttrain.lab.bench.split import write_result
from posttrain.lab.bench.stepwise import pooled, pooled_ratio, stepwise_rounds
from posttrain.lab.plots import plot_timelines
from posttrain.train.core import OptimConfig
from posttrain.train.sft import TrainConfig

__all__ = ["DEMO", "PREDICT_AT", "ROUNDS", "VARIANTS", "busy_before", "run_demo"]

#: The embedded default: long-tail lengths up to 4,096 tokens, 8 sequences a rank and step, on CPU
#: processes also where a GPU is visible (left to ``auto``, the 4 and 8 ranks of the one-GPU machine all
#: ran on its GPU, and their collective run's gathers and adds then cost 10 times what they do on
#: CPU cores: docs/simulator.md, "Where prediction and measurement part").
DEMO = TrainConfig(balance="diff_micro", profile="long_tail", steps=6, sequences=16, max_len=4096, max_tokens=4096,
                   optim=OptimConfig(lr=3e-3), device="cpu")

#: (label, engine, odc mode, balancing method)
VARIANTS = (
    ("FSDP2 + same_micro", "fsdp", "one-sided", "same_micro"),
    ("ODC-on-FSDP2 collective", "odc-fsdp2", "collective", "same_micro"),
    ("flat ODC collective", "odc", "collective", "same_micro"),
    ("flat ODC + diff_micro", "odc", "one-sided", "diff_micro"),
)
#: factor -> (numerator run, denominator run, what differs)
FACTORS = {
    "transport": (1, 0, "shared-memory copies instead of gloo collectives (same FSDP2 engine, plans, rendezvous)"),
    "engine": (2, 1, "flat buffers instead of FSDP2's per-parameter work (same transport, plans, rendezvous)"),
    "mechanism": (3, 2, "ODC: one sync per minibatch, minibatch balancing (same engine and transport)"),
}
#: Rounds by default. Measured on 2 cores (two 10-round runs, 2026-11-28): a variant's step on the
#: same minibatch moves by up to 15% between rounds, and over 5 rounds the total's and mechanism's
#: 90% intervals were about 7% wide, so five runs would spread over more than 5%; 8 rounds narrow
#: them by a fifth (the square root of 5/8), for about 1.5 minutes more.
ROUNDS = 8
#: GPU counts the calibrated simulator predicts the mechanism at.
PREDICT_AT = (8, 16, 32, 64)
#: A factor's 90% interval (highest over lowest) wider than this makes it a guess (about 9% either side).
NOISY = 1.18


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) CPU time of the whole machine so far, in clock ticks (``None`` without
    /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_before(cores: int | None = None, *, sample_s: float = 1.0) -> str | None:
    """Why the machine is too busy to time anything now (``None``: it is not): the share of its
    CPU time other processes used over ``sample_s`` seconds, measured before the demo's own
    processes start (where /proc/stat is missing: the 1-minute load average, which trails)."""
    import time

    cores = cores or os.cpu_count() or 1
    first = _cpu_times()
    if first is not None:
        time.sleep(sample_s)
        second = _cpu_times()
        busy, total = second[0] - first[0], second[1] - first[1]
        if total > 0 and busy / total > 0.25:
            return (f"other processes used {busy / total:.0%} of the {cores} cores in the second before the demo "
                    "started")
        return None
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    if load > max(0.5, 0.25 * cores):
        return f"the load average was {load:.1f} on {cores} cores before the demo started: other work shares the CPUs"
    return None


def _med(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def run_demo(cfg: TrainConfig = DEMO, *, world_size: int = 2, rounds: int = ROUNDS, predict: bool = True,
             timeline_path: str | None = "out/demo_timeline.png", json_path: str | None = None, log=print) -> dict:
    """Train ``cfg`` with every variant, step by step in one job over ``rounds`` rounds of the
    same ``cfg.steps - 1`` minibatches (:mod:`posttrain.lab.bench.stepwise`); print the table, the
    factors (pooled over the rounds, with a 90% interval), a busy-machine warning where due, the
    calibrated simulator's predictions at :data:`PREDICT_AT` GPUs (with ``predict``), and write the
    timeline; with ``json_path``, the result and every timed step there.

    Returns:
        ``{"rounds": [{label: round summary}] per round, "factors": {name: (pooled, low, high)},
        "total": (pooled, low, high), "busy": str | None, "predicted": {gpus: {...}} or None,
        "calibration": what the prediction was calibrated with (see :func:`_predict`) or None}``.
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be at least 1")
    if cfg.steps < 2:
        raise ValueError(f"steps={cfg.steps} must be at least 2 (the first is a warm-up)")
    check_world(cfg.device_kind, world_size)  # (FSDP2's variants: one rank per GPU)
    os.sync()  # files just written (a fresh install's) flushed now, not under the first rounds' timing
    busy = busy_before()  # (stepwise_rounds syncs again before its job)
    labels = [v[0] for v in VARIANTS]
    batches = cfg.steps - 1
    log(f"{len(VARIANTS)} variants taking turns a step at a time in {world_size} processes: {rounds} rounds of the same "
        f"{batches} minibatches after a warm-up step; {cfg.profile} lengths up to {cfg.max_len} tokens, {cfg.sequences} "
        "sequences a step", flush=True)
    cfgs = {label: replace(cfg, engine=EngineConfig(dp, mode=mode), balance=balance, progress=False)
            for label, dp, mode, balance in VARIANTS}
    per_round, raw = stepwise_rounds(cfgs, world_size=world_size, batches=batches, rounds=rounds,
                                     progress=log is print)
    tp = pooled(raw)
    vs = {label: pooled_ratio(raw, label, labels[0]) for label in labels}
    log(f"\n{'':24} {'tokens/s':>9} {'utilization':>12} {'waiting':>8} {'final loss':>11} {'vs FSDP2':>9} {'(90%)':>11}")
    for label in labels:
        util = statistics.median(r[label]["utilization"] for r in per_round)
        wait = statistics.median(r[label]["wait_share"] for r in per_round)
        log(f"{label:24} {tp[label]:9.0f} {util:12.2f} {wait:8.2f} {per_round[-1][label]['final_loss']:11.3f} "
            f"{vs[label][0]:8.2f}x {vs[label][1]:5.2f}-{vs[label][2]:<5.2f}")
    log(f"(tokens/s: every round's tokens over their time; (90%): the ratio's 5th-95th percentile over the {rounds} "
        "rounds drawn with replacement; utilization: compute share of step time; waiting: communication and idle)")
    factors = {name: pooled_ratio(raw, labels[num], labels[den]) for name, (num, den, _) in FACTORS.items()}
    total = vs[labels[3]]
    log(f"\nwhere flat ODC + diff_micro's {total[0]:.2f}x ({total[1]:.2f}-{total[2]:.2f}) over FSDP2 comes from:")
    for name, (_, _, what) in FACTORS.items():
        med, lo, hi = factors[name]
        log(f"  {name:10} {med:5.2f}x ({lo:.2f}-{hi:.2f})  {what}")
    noisy = [name for name, (_, lo, hi) in factors.items() if hi / lo > NOISY]
    if busy or noisy:
        why = "; ".join(filter(None, [busy, noisy and (f"the 90% interval of {', '.join(noisy)} is wider than "
                                                      f"{(NOISY - 1) / 2:.0%} either side")]))
        which = "these figures say" if busy else f"the {', '.join(noisy)} figure{'s' if len(noisy) > 1 else ''} says"
        log(f"NOTE: {why}: {which} little; rerun on an idle machine (or with more --rounds).")
    elif rounds == 1:
        log("NOTE: one round: no interval to judge the figures by (--rounds 3 or more).")
    predicted, calibration = (_predict(cfg, world_size, log, measured=factors["mechanism"][0]) if predict
                              else (None, None))
    if timeline_path:
        os.makedirs(os.path.dirname(timeline_path) or ".", exist_ok=True)
        plot_timelines({label: raw["spans"][label] for label in labels}, timeline_path,
                       title="the last step of each variant: per rank, compute, communication and waiting",
                       side_by_side=False)
        log(f"wrote {timeline_path}")
    result = {"rounds": per_round, "factors": factors, "total": total, "busy": busy, "predicted": predicted,
              "calibration": calibration}
    if json_path:
        steps = {name: [{k: v for k, v in s.items() if k != "ranks"} for s in rows] for name, rows in raw["steps"].items()}
        write_result({**result, "steps": steps}, json_path, log)
    return result


def _predict(cfg: TrainConfig, world_size: int, log, *, measured: float) -> tuple[dict, dict]:
    """The simulator, calibrated on this machine (per-layer compute fitted to the demo's model and
    a sample of its microbatch shapes, flat ODC's measured costs in both modes), at the demo's
    own ranks (beside the ``measured`` mechanism: how far to trust it) and at :data:`PREDICT_AT`
    GPUs with the same sequences per rank: its headroom and mechanism; and what it was calibrated
    with (the layer cost's fit error, the per-layer copies, each mode's measured seconds a step
    beyond the slowest rank's compute, its communication a step and the barrier waits inside it,
    the fitted jitter), to tell where a prediction parts from the measurement."""
    from posttrain.lab.calibrate import measure_sweep_machine, predict_mechanism

    log("\ncalibrating the simulator on this machine's runs of the demo's model ...", flush=True)
    base = replace(cfg, progress=False, checkpoint_dir=None)
    machine = measure_sweep_machine(base, [base], world_size=world_size, iters=2, max_shapes=16,
                                    log=lambda *a, **k: None)
    per_rank = cfg.sequences // world_size
    out = {n: predict_mechanism(replace(base, sequences=per_rank * n), machine, world_size=n)
           for n in dict.fromkeys((world_size, *PREDICT_AT))}  # (the demo's own ranks once, first)
    log(f"PREDICTED, not measured: the simulator calibrated here, for the same data at more GPUs "
        f"({per_rank} sequences a GPU and step, this machine's costs):")
    log(f"  {'GPUs':>5} {'headroom':>9} {'mechanism':>10}")
    for n, p in out.items():
        check = f"   (measured above: {measured:.2f}x)" if n == world_size else ""
        log(f"  {n:5d} {p['headroom']:8.2f}x {p['mechanism']:9.2f}x{check}")
    log("  (headroom: what any schedule of whole sequences could win over the collective run; mechanism: what "
        "ODC's one-sided minibatch and balancing win; docs/simulator.md says what the simulator models)")
    engine = machine["engine"]
    calibration = {"fit_median_error": machine["fit_median_error"], "jitter": machine["jitter"],
                   "copies_per_layer_microbatch_s": engine["one-sided"]["per_layer_microbatch"],
                   "excess_per_step_s": {mode: e["excess_per_step"] for mode, e in engine.items()},
                   "per_step_s": {mode: e["per_step"] for mode, e in engine.items()},
                   "comm_per_step_s": {mode: e["comm_per_step"] for mode, e in engine.items()},
                   "barrier_wait_per_step_s": {mode: e["barrier_wait_per_step"] for mode, e in engine.items()}}
    return out, calibration
