"""Variants measured step by step in one job: what the demo and ``posttrain bench odc`` compare.

Timing each variant as its own run puts the machine's moods between them: on 2 shared cores one
run of 5 steps moves by up to 35% from the next (the demo's rounds of one variant: 5778, 7799,
7179 tokens/s; ``posttrain demo --diagnose`` shows where that comes from). So every variant is
built once, in the same processes, and they take turns a step at a time: round ``r`` runs the
same ``batches`` minibatches (data steps ``0 .. batches-1``) through every variant, the variants'
order rotated by one at every step, after one warm-up step of each (data step 0) that is not
counted; round ``r`` runs data steps ``1 .. batches``. A slow second slows every variant alike.

What this machine does to a measurement (``scripts/machine_noise.py``; docs/odc.md): a fixed matrix
product's speed changes by 10-90% from one second to the next, with the changes lasting seconds,
so one round of one variant still moves by 10% or more. The figures are therefore pooled: a
variant's tokens/s is its tokens over its time summed over every round (:func:`pooled`), and a
ratio's interval is the 5th-95th percentile of the same ratio over rounds drawn with replacement
(:func:`pooled_ratio`). Two runs of the demo measured its total 1.145x and 1.147x this way, where
the rounds of each ranged over 1.05-1.26x.

Every variant takes the same updates in the same order, so their losses stay equal (the demo
shows the final loss of each).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

from posttrain.launch import run_ranks
from posttrain.train.core import job_options
from posttrain.train.sft import SFTTrainer, TrainConfig
from posttrain.train.sft.bounds import PlainShares

__all__ = ["BOUNDS", "bootstrap_rate_ratio", "pooled", "pooled_ratio", "round_summary", "stepwise_rounds", "stepwise_worker"]


#: The bounds' turn among the variants' (:func:`stepwise_worker`'s ``shares``).
BOUNDS = "(bounds)"


def stepwise_worker(rank: int, world_size: int, cfgs: dict[str, TrainConfig], batches: int, rounds: int,
                    progress: bool = False, shares: dict | None = None) -> dict:
    """One rank of :func:`stepwise_rounds`: returns ``{"spans": {name: this rank's spans of the
    variant's last step}}`` and, on rank 0, every counted step of every variant (``"steps": {name:
    [{"round", "batch", "tokens", "step_time_s", "loss", "ranks": [each rank's row]}]}``) and
    ``"host_s"``: ``{name: seconds this process spent in the variant's steps}``. With ``progress``,
    rank 0 prints each round's tokens/s as it ends. ``shares`` (name -> per step, sequence ids per
    rank; :class:`posttrain.train.sft.bounds.PlainShares`): whole sequences on the plain model take a
    turn of their own among the variants, and every rank returns ``"bounds": {name: [[round, batch,
    its seconds]]}``."""
    trainers: dict[str, SFTTrainer] = {}
    try:
        for name, cfg in cfgs.items():
            trainers[name] = SFTTrainer(cfg, rank, world_size)
        names = list(trainers)
        for name in names:  # one warm-up step each: first-call costs (allocations, caches) not counted
            trainers[name].train_step(0)
        plain = None
        bounds: dict[str, list] = {name: [] for name in shares or {}}
        if shares:
            plain = PlainShares(next(iter(cfgs.values())), rank, world_size, shares)
            plain.warm_up()
            names.append(BOUNDS)
        steps: dict[str, list] = {name: [] for name in trainers}
        host: dict[str, float] = dict.fromkeys(trainers, 0.0)
        turn = 0
        for r in range(rounds):
            for k in range(1, batches + 1):
                for name in names[turn % len(names):] + names[:turn % len(names)]:
                    if name == BOUNDS:
                        for share, seconds in plain.run(k).items():
                            bounds[share].append([r, k, seconds])
                        continue
                    t = trainers[name]
                    began = time.perf_counter()
                    row = t.train_step(k)
                    host[name] += time.perf_counter() - began
                    if rank == 0:
                        steps[name].append({"round": r, "batch": k, "tokens": row["tokens"],
                                            "step_time_s": row["step_time_s"], "loss": row["loss"],
                                            "ranks": t.every_rank_rows(row)})
                turn += 1
            if progress and rank == 0:
                got = {name: round_summary([s for s in steps[name] if s["round"] == r])["tokens_per_s"] for name in trainers}
                print(f"  round {r + 1}/{rounds}: " + ", ".join(f"{name} {v:.0f}" for name, v in got.items())
                      + " tokens/s", flush=True)
        spans = {name: list(t.rec.spans) for name, t in trainers.items()}
        mine = {"bounds": bounds} if shares else {}
        if rank != 0:
            return {"spans": spans, **mine}
        return {"steps": steps, "spans": spans, "host_s": host, **mine}
    finally:
        for t in trainers.values():
            t.close()


def round_summary(steps: list[dict]) -> dict:
    """One variant's figures over one round's steps (the fields ``summarize`` gives a run):
    tokens/s over the steps' own time, utilization and wait share averaged over ranks and steps,
    compute seconds a step (summed over ranks, and the busiest rank's), mean step time, the last
    step's loss; the shared-memory barriers a rank passed a step and the seconds a rank spent in
    them, waiting in all (``barrier_wait_s``) and after the last peer had arrived
    (``barrier_late_s``: :func:`posttrain.odc.barrier_totals`), averaged over ranks and steps; the
    rest of a rank's step the same way (``comm_s`` and its ``gather_s`` and ``reduce_s``, ``sync_s``,
    ``optimizer_s``, ``microbatches``, and the system CPU seconds and minor page faults of the
    rank's process in the step, ``sys_s`` and ``page_faults``)
    and the most microbatches a rank ran (``max_microbatches``), so a step's time splits into
    what each part took."""
    times = [s["step_time_s"] for s in steps]
    ranks = [s["ranks"] for s in steps]
    return {
        "tokens_per_s": sum(s["tokens"] for s in steps) / sum(times),
        "utilization": sum(sum(r["utilization"] for r in rows) / len(rows) for rows in ranks) / len(ranks),
        "wait_share": sum(sum(r["wait_s"] for r in rows) / (len(rows) * s["step_time_s"])
                          for rows, s in zip(ranks, steps)) / len(steps),
        "compute_s": sum(sum(r["compute_s"] for r in rows) for rows in ranks) / len(ranks),
        "busiest_compute_s": sum(max(r["compute_s"] for r in rows) for rows in ranks) / len(ranks),
        "step_time_s": sum(times) / len(times),
        "final_loss": steps[-1]["loss"],
        **{k: sum(sum(r[k] for r in rows) / len(rows) for rows in ranks) / len(ranks)
           for k in ("barriers", "barrier_wait_s", "barrier_late_s", "comm_s", "gather_s", "reduce_s", "sync_s",
                     "optimizer_s", "microbatches", "sys_s", "page_faults")},
        "max_microbatches": sum(max(r["microbatches"] for r in rows) for rows in ranks) / len(ranks),
    }


def stepwise_rounds(cfgs: Mapping[str, TrainConfig], *, world_size: int, batches: int, rounds: int,
                    progress: bool = False, shares: dict | None = None) -> tuple[list[dict[str, dict]], dict]:
    """Run the variants ``cfgs`` (name -> run; they share the data and model) step by step in one
    job on ``world_size`` ranks of their device (see the module docstring); per round, each
    variant's :func:`round_summary`, and the raw result of rank 0 (:func:`stepwise_worker`; its
    ``spans``: every rank's).
    ``progress``: each round's tokens/s printed as it ends. ``shares``: whole sequences on the
    plain model take their turn too (:func:`stepwise_worker`); the raw result's ``"bounds"`` is
    ``{name: [per rank, [[round, batch, seconds]]]}``."""
    if batches < 1 or rounds < 1:
        raise ValueError(f"batches={batches} and rounds={rounds} must be at least 1")
    first = next(iter(cfgs.values()))
    kind = first.device_kind
    cfgs = {name: replace(cfg, device=kind, progress=False, checkpoint_dir=None, steps=batches + 1)
            for name, cfg in cfgs.items()}
    os.sync()  # files just written (a fresh install's, the data's) flushed now, not during the timed steps
    results = run_ranks(stepwise_worker, world_size, cfgs, batches, rounds, progress, shares, timeout_s=7200,
                        **job_options(kind, world_size))
    raw = {**results[0], "spans": {name: [s for r in results for s in r["spans"][name]] for name in cfgs}}
    if shares:
        raw["bounds"] = {name: [r["bounds"][name] for r in results] for name in shares}
    per_round = [{name: round_summary([s for s in steps if s["round"] == r]) for name, steps in raw["steps"].items()}
                 for r in range(rounds)]
    return per_round, raw


def pooled(raw: dict, rounds: Sequence[int] | None = None) -> dict[str, float]:
    """Each variant's tokens/s over its steps of ``rounds`` (default: every round) together."""
    out = {}
    for name, steps in raw["steps"].items():
        chosen = [s for s in steps if rounds is None or s["round"] in rounds]
        out[name] = sum(s["tokens"] for s in chosen) / sum(s["step_time_s"] for s in chosen)
    return out


def pooled_ratio(raw: dict, num: str, den: str, *, draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """``num``'s pooled tokens/s over ``den``'s, with the 5th and 95th percentile of the same ratio
    over the rounds drawn with replacement (``draws`` times)."""
    rounds = sorted({s["round"] for s in raw["steps"][num]})
    sums = {name: {r: (sum(s["tokens"] for s in steps if s["round"] == r),
                       sum(s["step_time_s"] for s in steps if s["round"] == r)) for r in rounds}
            for name, steps in raw["steps"].items() if name in (num, den)}
    return bootstrap_rate_ratio(sums[num], sums[den], draws=draws, seed=seed)


def bootstrap_rate_ratio(num: Mapping[int, tuple[float, float]], den: Mapping[int, tuple[float, float]], *,
                         draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Two variants' rates, each ``{round: (amount, seconds)}`` pooled over rounds (the amounts over
    the seconds): ``num``'s over ``den``'s over every round, and the 5th and 95th percentile of the
    same ratio over the rounds drawn with replacement (``draws`` times)."""
    rounds = sorted(num)

    def ratio(pick: list[int]) -> float:
        rate = [sum(x[r][0] for r in pick) / sum(x[r][1] for r in pick) for x in (num, den)]
        return rate[0] / rate[1]

    rng = random.Random(seed)
    got = sorted(ratio([rng.choice(rounds) for _ in rounds]) for _ in range(draws))
    return ratio(rounds), got[int(0.05 * (draws - 1))], got[int(0.95 * (draws - 1))]
