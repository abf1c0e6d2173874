"""``posttrain bench odc``: FSDP2 vs ODC, side by side in one run, and where the gain comes from.

Same model, data and steps for every variant (``<engine>[-collective]+<balancing method>``):

- ``fsdp+round_robin``, ``fsdp+same_micro``: FSDP2 with gloo collectives;
- ``odc-fsdp2-collective+same_micro``, ``odc-fsdp2+round_robin``, ``odc-fsdp2+diff_micro``: ODC on
  FSDP2 (collective mode: ODC's shared-memory transport with FSDP's rendezvous at every gather
  and reduce);
- ``odc-collective+same_micro``, ``odc+diff_micro``: flat ODC (``--dp odc``), in collective mode
  and with one synchronization per minibatch;

and two bounds with no communication at all (:mod:`posttrain.train.sft.bounds`): the **even bound**
(the partition run's measured compute divided evenly over the ranks) and the **partition bound** (the best assignment of
whole sequences to ranks under their measured compute times, each rank running its share back to
back: per step the fastest of three candidate assignments, chosen on one run and timed on
another). Every figure is a throughput (tokens/s over the steps after the first); variants run
interleaved for ``repeats`` rounds (each round's order rotated by one, the bounds included, so a
machine whose speed drifts over a run does not always favour the same variant) and ratios are
medians of the per-round ratios, with their range (docs/results.md says how noisy this machine is).

[Note: where ODC's gain comes from]
``odc+diff_micro / fsdp+same_micro`` multiplies three factors, each measured with the other two
held fixed:

- **transport** = ``odc-fsdp2-collective+same_micro / fsdp+same_micro``: shared-memory copies and
  adds instead of gloo collectives; same engine (FSDP2), same plans, same rendezvous;
- **engine** = ``odc-collective+same_micro / odc-fsdp2-collective+same_micro``: flat buffers and
  module hooks instead of FSDP2's per-parameter work; same transport, plans and rendezvous;
- **mechanism** = ``odc+diff_micro / odc-collective+same_micro``: ODC's own idea, one
  synchronization per minibatch and minibatch-level balancing; same engine and transport.

The mechanism can only win what the collective run loses to imbalance: **headroom** =
``partition bound / odc-collective+same_micro``. **Captured** = the time the mechanism saved over
the time it could have saved, ``(1 - 1/mechanism) / (1 - 1/headroom)`` (shown where headroom
exceeds 1.05).

But the headroom also holds the engine's own costs (copies, a slower forward and backward than the
plain model's), which ODC pays as much as the collective run: with one sequence per rank both modes
run the same plan, and the headroom there is those costs alone. So ``odc+diff_micro / partition
bound`` is split, each factor measured (:func:`split_odc_vs_partition`): **plan** (ODC's own
assignment run on the plain model, over the partition bound), **compute** (that plain run over the
ODC run's busiest-rank compute) and **critical** (the ODC run's busiest-rank compute over its step).
**Reachable headroom** = headroom x compute x critical: what scheduling could win once the engine's
costs are counted; the mechanism's capture of it is reported beside the plain capture.

[Note: against the even bound]
What ``odc+diff_micro`` and ``odc+cp`` leave to the even bound (:func:`split_vs_even`) is, per
round, the product of three measured factors: **work** (the even bound's compute over the
variant's, both summed over the ranks: the engine's costs inside the forward and backward and, for
split sequences, the exchange and the shards' own overhead), **balance** (the variant's mean rank
compute over its busiest rank's: what its plan leaves, plus the ranks' jitter) and **critical**
(the busiest rank's compute over the step: copies, waits, the optimizer). Beside them, the cost
model's work and balance for the plans the variant ran (:func:`planned_vs_even`, the exchange
priced as the planner prices it): where a measured factor falls short of its planned one, the
plan's model is what to look at; where the planned one is short, the plan itself.

``sweep_odc`` repeats the mechanism measurement over sequences per rank and ``max_tokens`` and
puts the calibrated simulator's predictions beside it (:mod:`posttrain.lab.calibrate`).
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from posttrain.device import check_world
from posttrain.lab.bench.stepwise import pooled_ratio, stepwise_rounds
from posttrain.lab.calibrate import cp_config, step_context_plans, step_plans
from posttrain.launch import run_ranks
from posttrain.train.core import job_options
from posttrain.train.sft import (
    TrainConfig,
    TrainData,
    partition_bound_worker,
    partition_candidates,
    sequence_times_worker,
    summarize,
    train_worker,
)

__all__ = ["MECHANISM_VARIANTS", "ODC_VARIANTS", "ODCBench", "bench_odc", "bounds_from_times", "choose_bounds",
           "factors", "measure_bounds", "predict_cp", "split_odc_vs_partition", "stepwise_bounds", "sweep_odc"]

#: (engine, odc mode, balancing method); named ``<dp label>+<method>`` (e.g. ``odc-collective+same_micro``).
ODC_VARIANTS = (
    ("fsdp", "one-sided", "round_robin"),
    ("fsdp", "one-sided", "same_micro"),
    ("odc-fsdp2", "collective", "same_micro"),
    ("odc-fsdp2", "one-sided", "round_robin"),
    ("odc-fsdp2", "one-sided", "diff_micro"),
    ("odc", "collective", "same_micro"),
    ("odc", "one-sided", "diff_micro"),
)
#: What the mechanism and its headroom need.
MECHANISM_VARIANTS = (("odc", "collective", "same_micro"), ("odc", "one-sided", "diff_micro"))
_REF = "fsdp+same_micro"
_COLL, _ODC = "odc-collective+same_micro", "odc+diff_micro"
#: The factors of the variants alone, pooled over the rounds: name -> (numerator, denominator).
_POOLED = {"total": (_ODC, _REF), "transport": ("odc-fsdp2-collective+same_micro", _REF),
           "engine": (_COLL, "odc-fsdp2-collective+same_micro"), "mechanism": (_ODC, _COLL)}


@dataclass(frozen=True)
class ODCBench:
    """``posttrain bench odc``: the run every variant trains, the ranks, the sweep, and where the
    result goes.

    Attributes:
        train: the model, data and steps every variant shares (its engine and balancing method
            are the variants'); its ``device`` defaults to the CPU here (``--device cuda``: one
            rank per GPU).
        world_size: processes (on CUDA one per GPU: FSDP2 is among the variants, and NCCL runs one
            rank per GPU).
        repeats: interleaved rounds; ratios are medians, with the range over rounds.
        sweep: measure ODC's mechanism and its headroom at every ``sequences_per_rank`` x
            ``sweep_max_tokens`` point, beside the calibrated simulator's predictions.
        sequences_per_rank: sweep points.
        sweep_max_tokens: sweep points, each at least ``max_len`` (default: ``max_tokens``).
        no_predict: without the simulator's predictions (the sweep's, and ``odc+cp``'s gain; each
            calibrates the simulator on this machine first: for ``odc+cp`` about a minute and a half
            here).
        context_parallel: also run ``odc+cp``: flat ODC whose plan splits the costliest sequences
            across ranks (``auto`` or a shard count; see docs/odc.md, "Context parallelism"), set
            against ``odc+diff_micro`` and the bounds (``off``: not run).
        json: results file ('' for none; default out/bench_odc.json, with ``sweep``
            out/bench_odc_sweep.json).
    """

    train: TrainConfig = field(
        default_factory=lambda: TrainConfig(steps=8, sequences=16, max_len=1024, device="cpu"),
        metadata={"fields": ("profile", "data", "model", "engine.precision", "steps", "sequences", "max_len",
                             "max_tokens", "dim", "num_layers", "optim.lr", "seed", "device")})
    world_size: int = 2
    repeats: int = 5
    sweep: bool = False
    sequences_per_rank: tuple[int, ...] = (2, 4, 8, 16)
    sweep_max_tokens: tuple[int, ...] | None = None
    no_predict: bool = False
    context_parallel: int | Literal["off", "auto"] = "off"
    json: str | None = None

    def __post_init__(self) -> None:
        if self.context_parallel != "off":
            if self.sweep:
                raise ValueError("`context_parallel` is not part of the sweep yet; leave it off with `sweep`")
            cp_config(self.train, self.context_parallel)  # (refuses a bad value in one line)
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be at least 1")
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats} must be at least 1")
        if self.train.steps < 2:
            raise ValueError(f"steps={self.train.steps} must be at least 2 (the first step is warm-up)")
        if self.sweep:
            if not self.sequences_per_rank or min(self.sequences_per_rank) < 1:
                raise ValueError("`sequences_per_rank` needs positive values")
            if self.sweep_max_tokens is not None and (not self.sweep_max_tokens
                                                      or min(self.sweep_max_tokens) < self.train.max_len):
                raise ValueError(f"sweep_max_tokens={','.join(map(str, self.sweep_max_tokens))} is below "
                                 f"max_len={self.train.max_len}: every point trains the same sequences, so every "
                                 "max_tokens must fit the longest")

    def run(self, log=print) -> dict:
        """:func:`sweep_odc` with ``sweep``, else :func:`bench_odc`; written to ``json``."""
        check_world(self.train.device_kind, self.world_size)  # (FSDP2's variants: one rank per GPU)
        json_path = self.json if self.json is not None else (
            "out/bench_odc_sweep.json" if self.sweep else "out/bench_odc.json")
        if self.sweep:
            return sweep_odc(self.train, sequences_per_rank=self.sequences_per_rank,
                             max_tokens=self.sweep_max_tokens or (self.train.max_tokens,), world_size=self.world_size,
                             repeats=self.repeats, predict=not self.no_predict, json_path=json_path or None, log=log)
        return bench_odc(self.train, world_size=self.world_size, repeats=self.repeats, json_path=json_path or None,
                         context_parallel=self.context_parallel, predict=not self.no_predict, log=log)


def _on_ranks(worker: Callable, world_size: int, cfg: TrainConfig, *args) -> list:
    """``worker(rank, world_size, cfg, *args)`` on ``world_size`` ranks of ``cfg``'s device
    (resolved once: every variant and bound on the same device, one rank per GPU on CUDA)."""
    kind = cfg.device_kind
    return run_ranks(worker, world_size, replace(cfg, device=kind), *args, timeout_s=3600,
                     **job_options(kind, world_size))


def _steady_tokens(cfg: TrainConfig, world_size: int) -> int:
    data = TrainData(cfg, world_size)
    return sum(sum(len(s) - 1 for s in data.minibatch(k)) for k in range(1, cfg.steps))


def choose_bounds(cfg: TrainConfig, world_size: int) -> dict:
    """The partition bound's assignment per step after the first, chosen in two jobs (each
    sequence timed alone, then the candidates run): ``{"shares": {"chosen": ..., "diff_micro":
    ...}}`` (sequence ids per rank per step: the chosen assignment, and diff_micro's own to time
    beside it), ``"exact"`` (every optimum searched proven), ``"best"`` (steps each candidate won)
    ``"candidates_tokens_per_s"`` and ``"tokens"`` (those steps' tokens)."""
    times: dict = {}
    for part in _on_ranks(sequence_times_worker, world_size, cfg):
        times.update(part)
    candidates, exact = partition_candidates(cfg, world_size, times)
    # Per step each candidate lasts as long as its slowest rank. The fastest is chosen on one run and
    # timed on another: taking the minimum of noisy runs as the bound would favour noise.
    steps = cfg.steps - 1
    per_rank = _on_ranks(partition_bound_worker, world_size, cfg, candidates)
    by_candidate = {name: [max(r[name][k] for r in per_rank) for k in range(steps)] for name in candidates}
    best = [min(by_candidate, key=lambda name: by_candidate[name][k]) for k in range(steps)]
    # ODC's own plan (diff_micro's assignment) is timed again beside the chosen one, step by step in
    # the same run, so the two compare without the noise between runs.
    tokens = _steady_tokens(cfg, world_size)
    return {"shares": {"chosen": [candidates[name][k] for k, name in enumerate(best)],
                       "diff_micro": candidates["diff_micro"]},
            "exact": exact, "best": {name: best.count(name) for name in candidates}, "tokens": tokens,
            "candidates_tokens_per_s": {name: tokens / sum(v) for name, v in by_candidate.items()}}


def bounds_from_times(cfg: TrainConfig, world_size: int, choice: dict, per_rank: list[dict[str, list[float]]]
                      ) -> dict[str, dict]:
    """Both bounds from one timed run of :func:`choose_bounds`'s shares (``per_rank[r][name]``:
    rank ``r``'s seconds per step): ``{"even": {...}, "partition": {...}}`` with ``tokens_per_s``,
    ``compute_s`` and, for the partition bound, ``plan_tokens_per_s`` (diff_micro's assignment in
    the same run) and the choice's ``exact``, ``best`` and ``candidates_tokens_per_s``."""
    tokens, steps = choice["tokens"], cfg.steps - 1
    partition_s = sum(max(r["chosen"][k] for r in per_rank) for k in range(steps))
    plan_s = sum(max(r["diff_micro"][k] for r in per_rank) for k in range(steps))
    # The even bound divides the same measured compute evenly over the ranks, so the two bounds
    # differ only in how whole sequences divide (not in contention: a separate run of every
    # microbatch on every rank would time them under other contention than the ranks' own shares).
    even_s = sum(sum(r["chosen"][k] for r in per_rank) / world_size for k in range(steps))
    # compute_s as summarize() reports it: seconds of compute per step, summed over the ranks
    compute_s = sum(sum(r["chosen"]) for r in per_rank) / steps
    return {"even": {"tokens_per_s": tokens / even_s, "utilization": 1.0, "compute_s": compute_s},
            "partition": {"tokens_per_s": tokens / partition_s, "utilization": 1.0, "compute_s": compute_s,
                          "exact": choice["exact"], "best": choice["best"], "plan_tokens_per_s": tokens / plan_s,
                          "candidates_tokens_per_s": choice["candidates_tokens_per_s"]}}


def measure_bounds(cfg: TrainConfig, world_size: int) -> dict[str, dict]:
    """Both bounds for the steps after the first (:func:`bounds_from_times`), chosen and then timed
    in a job of their own (:func:`choose_bounds`)."""
    choice = choose_bounds(cfg, world_size)
    return bounds_from_times(cfg, world_size, choice,
                             _on_ranks(partition_bound_worker, world_size, cfg, choice["shares"]))


def stepwise_bounds(cfg: TrainConfig, world_size: int, choice: dict, raw: dict, rounds: int) -> list[dict[str, dict]]:
    """Both bounds per round of a :func:`posttrain.lab.bench.stepwise.stepwise_rounds` job that
    timed ``choice``'s shares among the variants (``raw["bounds"]``)."""
    def seconds(rows: list, k: int) -> list[float]:  # round k's, by step
        return [s for _, _, s in sorted(row for row in rows if row[0] == k)]

    return [bounds_from_times(cfg, world_size, choice,
                              [{name: seconds(raw["bounds"][name][rank], k) for name in choice["shares"]}
                               for rank in range(world_size)])
            for k in range(rounds)]


def _variant_cfg(base: TrainConfig, dp: str, mode: str, balance: str) -> TrainConfig:
    return replace(base, engine=replace(base.engine, name=dp, mode=mode), balance=balance)


#: The variant with split sequences, beside ``odc+diff_micro``.
_CP = "odc+cp"


def _round(base: TrainConfig, world_size: int, variants, log: Callable, prefix: str, k: int = 0) -> dict[str, dict]:
    """One round: every variant and the bounds, in an order rotated by ``k`` (round ``k`` starts
    ``k`` places later), so that a machine slowing or speeding up over a round does not always
    favour the same variant."""
    got = {}
    jobs = [*variants, None]  # None: the bounds
    for job in jobs[k % len(jobs):] + jobs[:k % len(jobs)]:
        if job is None:
            for name, bound in measure_bounds(base, world_size).items():
                got[name] = bound
                log(f"  {prefix}{name + ' bound':32} {bound['tokens_per_s']:9.0f} tokens/s", flush=True)
            continue
        dp, mode, balance = job
        cfg = _variant_cfg(base, dp, mode, balance)
        name = f"{cfg.engine.label}+{balance}"
        got[name] = summarize(_on_ranks(train_worker, world_size, cfg))
        log(f"  {prefix}{name:32} {got[name]['tokens_per_s']:9.0f} tokens/s", flush=True)
    return got


def factors(r: dict[str, dict]) -> dict[str, float]:
    """The factors of [Note: where ODC's gain comes from] for one round (those its variants allow)."""
    tp = {k: v["tokens_per_s"] for k, v in r.items()}
    out = {}
    if _REF in tp and _ODC in tp:
        out["total"] = tp[_ODC] / tp[_REF]
    if "odc-fsdp2-collective+same_micro" in tp and _REF in tp:
        out["transport"] = tp["odc-fsdp2-collective+same_micro"] / tp[_REF]
    if "odc-fsdp2-collective+same_micro" in tp and _COLL in tp:
        out["engine"] = tp[_COLL] / tp["odc-fsdp2-collective+same_micro"]
    out["mechanism"] = tp[_ODC] / tp[_COLL]
    out["headroom"] = tp["partition"] / tp[_COLL]
    out["odc_vs_partition"] = tp[_ODC] / tp["partition"]
    out["partition_vs_even"] = tp["partition"] / tp["even"]
    out.update(split_odc_vs_partition(r))
    # what the mechanism could win with this engine, whose costs it pays as the collective run does
    out["reachable_headroom"] = out["headroom"] * out["odc_vs_plan"]
    return out


def split_odc_vs_partition(r: dict[str, dict]) -> dict[str, float]:
    """Where ``odc+diff_micro`` loses to the partition bound in one round, as three factors whose
    product is ``odc_vs_partition`` (see [Note: where ODC's gain comes from]):

    - ``plan_vs_partition``: ODC's own plan (diff_micro's assignment) run on the plain model, over
      the partition bound: what the balancer leaves;
    - ``plain_vs_engine_compute``: that plan's plain compute over the ODC run's compute (per step
      its busiest rank's, communication excluded): the engine's cost inside the forward and backward;
    - ``odc_critical_share``: the ODC run's busiest-rank compute over its step time: what copies,
      waits, the optimizer and the exit take from the step.

    Also ``odc_vs_plan``: the last two together, the engine at ODC's own plan.
    """
    plan = r["partition"]["plan_tokens_per_s"]
    odc = r[_ODC]
    out = {"plan_vs_partition": plan / r["partition"]["tokens_per_s"],
           "odc_vs_plan": odc["tokens_per_s"] / plan,
           "odc_critical_share": odc["busiest_compute_s"] / odc["step_time_s"]}
    out["plain_vs_engine_compute"] = out["odc_vs_plan"] / out["odc_critical_share"]
    return out


def split_vs_even(r: dict[str, dict], name: str, world_size: int) -> dict[str, float]:
    """What variant ``name`` leaves to the even bound in round ``r``: ``vs_even`` and its factors
    ``work`` x ``balance`` x ``critical`` (see [Note: against the even bound]; the product is exact,
    both throughputs being tokens over summed step time and the even bound's step its compute over
    the ranks)."""
    v, even = r[name], r["even"]
    return {"vs_even": v["tokens_per_s"] / even["tokens_per_s"],
            "work": even["compute_s"] / v["compute_s"],
            "balance": v["compute_s"] / (world_size * v["busiest_compute_s"]),
            "critical": v["busiest_compute_s"] / v["step_time_s"]}


def planned_vs_even(plans: Sequence, whole: Sequence) -> dict[str, float]:
    """The cost model's ``work`` and ``balance`` (see [Note: against the even bound]) of a
    variant's ``plans`` (one a step), against ``whole``, the same steps' plans of whole sequences
    (whose costs sum to the sequences' own): a context plan's shards carry the exchange as the
    planner prices it."""
    return {"work": sum(sum(p.rank_costs) for p in whole) / sum(sum(p.rank_costs) for p in plans),
            "balance": sum(sum(p.rank_costs) / len(p.rank_costs) for p in plans) / sum(max(p.rank_costs) for p in plans)}


def capture(mechanism: float, headroom: float) -> float | None:
    """Share of the time the mechanism could save that it saved; ``None`` without headroom."""
    if headroom <= 1.0:
        return None
    return (1 - 1 / mechanism) / (1 - 1 / headroom)


def _med(rounds: list[dict], key: str) -> tuple[float, float, float]:
    vals = [r[key] for r in rounds]
    return statistics.median(vals), min(vals), max(vals)


def _write(path: str | None, out: dict, log: Callable) -> None:
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
        log(f"wrote {path}")


def bench_odc(base: TrainConfig, *, world_size: int = 2, repeats: int = 5, json_path: str | None = None,
              context_parallel: int | str = "off", predict: bool = True, log=print) -> dict:
    """Run every variant and both bounds ``repeats`` times, interleaved; print and return ratios
    and the factors of [Note: where ODC's gain comes from]. ``context_parallel`` (not ``off``):
    ``odc+cp`` too, and its gain over ``odc+diff_micro`` among the factors (``cp``); with
    ``predict``, beside it the calibrated simulator's (:func:`predict_cp`; ``predicted_cp`` in the
    result).

    Returns:
        ``{"config", "world_size", "repeats", "rounds": [{variant: summary}], "median": {variant:
        {"tokens_per_s", "utilization", "vs_fsdp_same_micro", "vs_partition", "vs_even",
        "compute_vs_even"}}, "spread": {variant: {ratio: [lowest, highest]}}, "factors": {name:
        [median, lowest, highest]}, "vs_even": {variant: {"vs_even", "work", "balance", "critical":
        [median, lowest, highest], "planned": {"work", "balance"}}}}`` (``vs_even``: ``odc+diff_micro``
        and ``odc+cp``, [Note: against the even bound]).
    """
    ODCBench(base, world_size, repeats, json="")  # checks them
    base = replace(base, progress=False, checkpoint_dir=None)
    TrainData(base, world_size)
    if base.steps < 2:
        raise ValueError(f"steps={base.steps} must be at least 2 (the first is a warm-up)")
    # the variants take turns a step at a time in one job (posttrain.lab.bench.stepwise): rounds of
    # data steps 1 .. steps-1; the bounds' assignments are chosen first, in two jobs, and timed in
    # that job too, on the plain model, a turn of their own among the variants (in jobs of their
    # own after it, a machine that drifted between the jobs moved every ratio to the bounds)
    cfgs = {f"{cfg.engine.label}+{cfg.balance}": cfg
            for cfg in (_variant_cfg(base, dp, mode, balance) for dp, mode, balance in ODC_VARIANTS)}
    if context_parallel != "off":
        cfgs[_CP] = cp_config(base, context_parallel)
    log("choosing the partition bound's assignments (each sequence timed alone, then three candidates)", flush=True)
    choice = choose_bounds(base, world_size)
    log(f"{len(cfgs)} variants and the bounds taking turns a step at a time, {repeats} rounds of {base.steps - 1} "
        "steps:", flush=True)
    variant_rounds, raw = stepwise_rounds(cfgs, world_size=world_size, batches=base.steps - 1, rounds=repeats,
                                          progress=log is print, shares=choice["shares"])
    rounds = []
    for k, (got, bounds) in enumerate(zip(variant_rounds, stepwise_bounds(base, world_size, choice, raw, repeats))):
        for name, bound in bounds.items():
            got[name] = bound
            log(f"  round {k + 1}/{repeats}  {name + ' bound':32} {bound['tokens_per_s']:9.0f} tokens/s", flush=True)
        rounds.append(got)
    median, spread = {}, {}
    for name in rounds[0]:
        ratios = {
            "vs_fsdp_same_micro": [r[name]["tokens_per_s"] / r[_REF]["tokens_per_s"] for r in rounds],
            "vs_partition": [r[name]["tokens_per_s"] / r["partition"]["tokens_per_s"] for r in rounds],
            "vs_even": [r[name]["tokens_per_s"] / r["even"]["tokens_per_s"] for r in rounds],
            # the same microbatches' compute (communication excluded) relative to the even bound's
            "compute_vs_even": [r[name]["compute_s"] / r["even"]["compute_s"] for r in rounds],
        }
        median[name] = {
            "tokens_per_s": statistics.median(r[name]["tokens_per_s"] for r in rounds),
            "utilization": statistics.median(r[name]["utilization"] for r in rounds),
            **{k: statistics.median(v) for k, v in ratios.items()},
        }
        spread[name] = {k: [min(v), max(v)] for k, v in ratios.items()}
    per_round = [factors(r) for r in rounds]
    fac = {k: list(_med(per_round, k)) for k in per_round[0]}
    # the variants' own factors pooled over the rounds (a 90% interval), as the demo gives them
    for k, (num, den) in _POOLED.items():
        fac[k] = list(pooled_ratio(raw, num, den))
    if _CP in cfgs:
        fac["cp"] = list(pooled_ratio(raw, _CP, _ODC))
    source = base.data or f"profile {base.profile}"
    log(f"\nFSDP2 vs ODC, {world_size} ranks, {source}, {base.model} {base.num_layers}x{base.dim} {base.engine.precision}, "
        f"{base.sequences} sequences/step up to {base.max_len} tokens, max_tokens {base.max_tokens}, "
        f"{base.steps} steps (first excluded), median of {repeats} rounds")
    log(f"{'variant':34} {'tokens/s':>9} {'util':>5} {'vs fsdp+same_micro':>19} {'(rounds)':>11} "
        f"{'vs partition':>13} {'(rounds)':>11} {'compute/even':>13}")
    for name, m in median.items():
        lo, hi = spread[name]["vs_fsdp_same_micro"]
        plo, phi = spread[name]["vs_partition"]
        label = f"{name} bound" if name in ("even", "partition") else name
        log(f"{label:34} {m['tokens_per_s']:9.0f} {m['utilization']:5.2f} {m['vs_fsdp_same_micro']:18.2f}x "
            f"{lo:5.2f}-{hi:<5.2f} {m['vs_partition']:13.2f} {plo:5.2f}-{phi:<5.2f} {m['compute_vs_even']:13.2f}")
    log("(util: compute share of step time; compute/even: the same microbatches' compute time, communication "
        "excluded, over the even bound's; (rounds): lowest and highest ratio of a single round)")
    # the trainer's own plans of the steps timed (odc+diff_micro's are every sequence whole)
    plans = {_ODC: step_plans(base, world_size, "diff_micro")}
    if _CP in cfgs:
        plans[_CP] = step_context_plans(base, world_size, context_parallel)
    even_split = {}
    for name, ps in plans.items():
        per = [split_vs_even(r, name, world_size) for r in rounds]
        even_split[name] = {k: list(_med(per, k)) for k in per[0]}
        even_split[name]["planned"] = planned_vs_even(ps, plans[_ODC])
    log("\nagainst the even bound (median of per-round ratios, lowest-highest; vs even = work x balance x critical, "
        "exactly per round):")
    log(f"{'variant':18} {'vs even':>8} {'(rounds)':>11} {'work':>6} {'balance':>8} {'critical':>9}   "
        f"{'planned work':>12} {'balance':>8}")
    for name, e in even_split.items():
        log(f"{name:18} {e['vs_even'][0]:8.3f} {e['vs_even'][1]:5.3f}-{e['vs_even'][2]:<5.3f} {e['work'][0]:6.3f} "
            f"{e['balance'][0]:8.3f} {e['critical'][0]:9.3f}   {e['planned']['work']:12.3f} "
            f"{e['planned']['balance']:8.3f}")
    log("(work: the even bound's compute / the variant's, summed over ranks (the engine's costs in the forward and "
        "backward; for split sequences the exchange and the shards' overhead too); balance: mean rank compute / the "
        "busiest rank's (the plan, and jitter); critical: busiest-rank compute / step (copies, waits, optimizer); "
        "planned: the cost model's work and balance for the plans run)")
    log("\nwhere the gain comes from (total, transport, engine, mechanism: pooled over the rounds, with the 5th-95th "
        "percentile over rounds drawn with replacement; the others: median of per-round ratios, lowest-highest):")
    text = {
        "total": "odc+diff_micro / fsdp+same_micro",
        "transport": "shm vs gloo: odc-fsdp2-collective+same_micro / fsdp+same_micro",
        "engine": "flat vs FSDP2: odc-collective+same_micro / odc-fsdp2-collective+same_micro",
        "mechanism": "ODC's own: odc+diff_micro / odc-collective+same_micro",
        "headroom": "what scheduling could win: partition bound / odc-collective+same_micro",
        "odc_vs_partition": "odc+diff_micro / partition bound",
        "plan_vs_partition": "  = diff_micro's plan on the plain model / partition bound (the balancer)",
        "plain_vs_engine_compute": "  x that plan's plain compute / odc+diff_micro's (the engine inside compute)",
        "odc_critical_share": "  x odc+diff_micro's busiest-rank compute / its step (copies, waits, optimizer)",
        "reachable_headroom": "headroom x odc+diff_micro / its plan on the plain model (what this engine can win)",
        "partition_vs_even": "partition bound / even bound (whole sequences do not divide evenly)",
    }
    if "cp" in fac:
        text["cp"] = f"split sequences: odc+cp / odc+diff_micro (context_parallel {context_parallel})"
    for k, desc in text.items():
        m, lo, hi = fac[k]
        log(f"  {k:18} {m:6.2f}x  ({lo:.2f}-{hi:.2f})  {desc}")
    cap = capture(fac["mechanism"][0], fac["headroom"][0])
    log(f"  {'captured':18} " + (f"{cap:6.0%}   of the headroom's time saving" if cap is not None and
                                  fac["headroom"][0] > 1.05 else "  n/a    (headroom below 1.05: nothing to win)"))
    reach = capture(fac["mechanism"][0], fac["reachable_headroom"][0])
    log(f"  {'captured/reach':18} " + (f"{reach:6.0%}   of the reachable headroom's" if reach is not None and
                                  fac["reachable_headroom"][0] > 1.05 else "  n/a    (reachable headroom below 1.05)"))
    exact = all(r["partition"].get("exact") for r in rounds)
    wins = {name: sum(r["partition"]["best"][name] for r in rounds) for name in rounds[0]["partition"]["best"]}
    log(f"(partition bound: per step the fastest of the candidate assignments ({', '.join(f'{k} {v}' for k, v in wins.items())}"
        f" steps); optimum searches {'exact' if exact else 'partly Karmarkar-Karp + refinement'}; "
        "transport x engine x mechanism = total)")
    out = {"config": asdict(base), "world_size": world_size, "repeats": repeats, "rounds": rounds, "median": median,
           "spread": spread, "factors": fac, "captured": cap, "captured_of_reachable": reach,
           "vs_even": even_split}
    if _CP in cfgs and predict:
        _write(json_path, out, lambda *a, **k: None)  # (the measurements kept whatever the calibration does)
        try:
            out["predicted_cp"] = predict_cp(base, context_parallel, world_size=world_size, log=log)
        except ValueError as e:  # (a run too small to fit the per-layer cost to, another model or device)
            out["predicted_cp"] = {"error": str(e)}
            log(f"  cp: no prediction ({e})")
        else:
            p, m = out["predicted_cp"]["cp"], fac["cp"][0]
            log(f"  cp predicted {p:.2f}x by the simulator calibrated on this machine, measured {m:.2f}x "
                f"({p / m - 1:+.1%}; within 5%: {'yes' if abs(p / m - 1) <= 0.05 else 'no'})")
    _write(json_path, out, log)
    return out


def predict_cp(base: TrainConfig, context_parallel: int | str, *, world_size: int = 2, reps: int = 7,
               log=print) -> dict:
    """The calibrated simulator's ``odc+cp / odc+diff_micro`` for ``base``
    (:func:`posttrain.lab.calibrate.predict_context_parallel`): the per-layer cost, flat ODC's costs
    and the compute jitter measured on ``world_size`` processes (as the sweep's predictions are),
    and what splitting a sequence over 2 ranks costs beyond its half at ``max_len`` and a half, a
    quarter, an eighth and a sixteenth of it (:mod:`posttrain.lab.bench.cp_exchange`, ``reps``
    rounds; :class:`~posttrain.lab.calibrate.MeasuredSplitCost`)."""
    from posttrain.lab.bench.cp_exchange import measure, measured_config
    from posttrain.lab.calibrate import MeasuredSplitCost, measure_sweep_machine, predict_context_parallel

    lengths = sorted({max(16, base.max_len // d) for d in (16, 8, 4, 2, 1)})
    measured_config(lengths, base)  # (refuses a model the split's measurement does not run, before the calibration)
    if base.device_kind != "cpu":
        raise ValueError("the calibrated prediction is made for CPU ranks (the split's cost is measured through "
                         "shared memory)")
    log("\ncalibrating the simulator on this machine for odc+cp's prediction ...", flush=True)
    machine = measure_sweep_machine(base, [base], world_size=world_size, log=log)
    got = measure(lengths, reps=reps, cfg=base)["lengths"]
    over = [got[n]["overhead_s (split-shm)"] for n in lengths]
    split = MeasuredSplitCost(lengths, over)
    log("  splitting a sequence over 2 ranks costs beyond its half: " + ", ".join(
        f"{n} tokens {x * 1e3:.1f} ms ({x / (got[n]['whole'] / 2):+.0%})" for n, x in zip(lengths, over))
        + f" (median of {reps} rounds of a whole and a split back to back, both ranks at once)", flush=True)
    pred = predict_context_parallel(base, machine, split, context_parallel=context_parallel, world_size=world_size)
    return {**pred, "split_lengths": lengths, "split_overhead_s": over,
            "layer_fit_median_error": machine["fit_median_error"], "jitter": machine["jitter"]}


#: The per-round factors of :func:`split_odc_vs_partition`, in the order the sweep prints them.
_SPLIT = ("plan_vs_partition", "plain_vs_engine_compute", "odc_critical_share", "odc_vs_plan", "reachable_headroom")


def _log_split(points: list[dict], log: Callable) -> None:
    """The sweep's second table: where odc+diff_micro loses to the partition bound, and the headroom
    this engine leaves the mechanism (each the median of its per-round values)."""
    log("\nwhere odc+diff_micro loses to the partition bound, and what the mechanism could win with this engine")
    log(f"{'seq/rank':>8} {'max_tok':>7} {'odc/part':>9} {'= plan':>7} {'x compute':>10} {'x critical':>11} "
        f"{'reachable':>10} {'mechanism':>10} {'captured':>9}")
    for p in points:
        reach, mech = p["reachable_headroom"][0], p["mechanism"][0]
        cap_s = f"{p['captured_of_reachable']:8.0%}" if reach > 1.05 else "     n/a"
        log(f"{p['sequences_per_rank']:8d} {p['max_tokens']:7d} {p['odc_vs_partition'][0]:9.2f} "
            f"{p['plan_vs_partition'][0]:7.2f} {p['plain_vs_engine_compute'][0]:10.2f} "
            f"{p['odc_critical_share'][0]:11.2f} {reach:9.2f}x {mech:9.2f}x {cap_s}")
    log("(plan: diff_micro's assignment on the plain model / partition bound; compute: that plan's plain compute / "
        "the ODC run's busiest-rank compute; critical: the ODC run's busiest-rank compute / its step; reachable: "
        "headroom x compute x critical, what scheduling could win once this engine's own costs, which both modes "
        "pay, are counted; captured: of the reachable headroom, where it exceeds 1.05; medians of rounds, so the "
        "products hold only roughly)")


def sweep_estimate(timed: Sequence[tuple[int, float]], sequences: Sequence[int], repeats: int) -> str:
    """What the sweep's measurements will take, from the points timed so far (``(sequences a
    step, seconds)``): a fixed cost per point (processes, model, warm-up) plus a cost per sequence,
    fitted through two points of different sizes; from one point, its time scaled by each point's
    sequences (an overestimate where the fixed cost is large)."""
    sizes = {n for n, _ in timed}
    if len(sizes) >= 2:
        (n0, t0), (n1, t1) = timed[0], next((n, t) for n, t in timed if n != timed[0][0])
        per = max(0.0, (t1 - t0) / (n1 - n0))
        fixed = max(0.0, t0 - per * n0)
        total = sum(fixed + per * n for n in sequences) * repeats
        how = "a fixed cost per point plus a cost per sequence, fitted to the first two points"
    else:
        n0, t0 = timed[0]
        total = t0 / n0 * sum(sequences) * repeats
        how = "the first point's time scaled by each point's sequences a step"
    return (f"the measurements will take about {total / 60:.0f} min in all ({len(sequences)} points x {repeats} "
            f"rounds; {how})")


def sweep_odc(base: TrainConfig, *, sequences_per_rank: Sequence[int], max_tokens: Sequence[int],
              world_size: int = 2, repeats: int = 5, predict: bool = True,
              predict_world_sizes: Sequence[int] = (2, 4, 8, 16, 32), json_path: str | None = None,
              log=print) -> dict:
    """The mechanism and its headroom at every (sequences per rank, max_tokens) point, interleaved
    over ``repeats`` rounds, beside the calibrated simulator's predictions; then the simulator's
    headroom and mechanism at ``predict_world_sizes`` for every point (same sequences per rank).

    Returns:
        ``{"config", "world_size", "repeats", "points": [{"sequences_per_rank", "max_tokens",
        "headroom", "mechanism", "odc_vs_partition", "partition_vs_even" and the factors of
        :func:`split_odc_vs_partition` (each [median, lowest, highest]), "captured",
        "captured_of_reachable", "predicted": {...} or None, "predicted_at": {world size: {...}}}]}``.
    """
    ODCBench(base, world_size, repeats, sweep=True, sequences_per_rank=tuple(sequences_per_rank),
             sweep_max_tokens=tuple(max_tokens), json="")  # checks them
    base = replace(base, progress=False, checkpoint_dir=None)
    points = []
    for spr, mt in itertools.product(sequences_per_rank, max_tokens):
        cfg = replace(base, sequences=spr * world_size, max_tokens=mt)
        TrainData(cfg, world_size)
        points.append(cfg)
    rounds: list[list[dict]] = [[] for _ in points]
    log(f"sweep: {len(points)} points x {repeats} rounds x {len(MECHANISM_VARIANTS)} runs"
        + (", then the simulator's calibration" if predict else "") + "; an estimate of the time follows the first "
        "points", flush=True)
    began = time.perf_counter()
    sizes = [c.sequences for c in points]
    timed: list[tuple[int, float]] = []
    for k in range(repeats):
        for i, cfg in enumerate(points):
            tag = f"round {k + 1}/{repeats} {cfg.sequences // world_size:3d} seq/rank max_tokens {cfg.max_tokens:5d}  "
            t0 = time.perf_counter()
            rounds[i].append(factors(_round(cfg, world_size, MECHANISM_VARIANTS, log, tag, k)))
            if k == 0 and len({n for n, _ in timed}) < 2:
                timed.append((cfg.sequences, time.perf_counter() - t0))
                if len({n for n, _ in timed}) == 2 or (len(set(sizes)) == 1 and len(timed) == 1):
                    log(sweep_estimate(timed, sizes, repeats), flush=True)
    log(f"measured in {(time.perf_counter() - began) / 60:.1f} min", flush=True)
    machine = None
    if predict:
        from posttrain.lab.calibrate import measure_sweep_machine, predict_mechanism

        log("calibrating the simulator on this machine ...", flush=True)
        machine = measure_sweep_machine(base, points, world_size=world_size, log=log)
    out_points = []
    log(f"\nODC's mechanism over a sweep, {world_size} ranks, {base.data or 'profile ' + base.profile}, "
        f"{base.model} {base.num_layers}x{base.dim}, {base.steps} steps (first excluded), median of {repeats} rounds")
    log(f"{'seq/rank':>8} {'max_tok':>7} {'headroom':>9} {'(range)':>11} {'mechanism':>10} {'(range)':>11} "
        f"{'captured':>9} {'odc/part':>9} {'part/even':>10} {'pred head':>10} {'pred mech':>10}")
    for cfg, rs in zip(points, rounds):
        fac = {k: list(_med(rs, k)) for k in ("headroom", "mechanism", "odc_vs_partition", "partition_vs_even",
                                             *_SPLIT)}
        cap = capture(fac["mechanism"][0], fac["headroom"][0])
        pred = predict_mechanism(cfg, machine, world_size=world_size) if machine else None
        row = {"sequences_per_rank": cfg.sequences // world_size, "max_tokens": cfg.max_tokens, **fac,
               "captured": cap, "captured_of_reachable": capture(fac["mechanism"][0], fac["reachable_headroom"][0]),
               "predicted": pred}
        out_points.append(row)
        h, m = fac["headroom"], fac["mechanism"]
        cap_s = f"{cap:8.0%}" if cap is not None and h[0] > 1.05 else "     n/a"
        pred_s = (f"{pred['headroom']:9.2f}x {pred['mechanism']:9.2f}x" if pred else f"{'-':>10} {'-':>10}")
        log(f"{row['sequences_per_rank']:8d} {cfg.max_tokens:7d} {h[0]:8.2f}x {h[1]:5.2f}-{h[2]:<5.2f} {m[0]:9.2f}x "
            f"{m[1]:5.2f}-{m[2]:<5.2f} {cap_s} {fac['odc_vs_partition'][0]:9.2f} {fac['partition_vs_even'][0]:10.2f} "
            f"{pred_s}")
    log("(headroom: partition bound / odc-collective+same_micro; mechanism: odc+diff_micro / "
        "odc-collective+same_micro; captured: (1 - 1/mechanism) / (1 - 1/headroom), where headroom > 1.05; "
        "pred: the simulator calibrated on this machine)")
    _log_split(out_points, log)
    if machine and predict_world_sizes:
        log("\nthe calibrated simulator at more ranks (same sequences per rank; headroom / mechanism):")
        log(f"{'seq/rank':>8} {'max_tok':>7} " + " ".join(f"{f'{n} ranks':>15}" for n in predict_world_sizes))
        for cfg, row in zip(points, out_points):
            spr = cfg.sequences // world_size
            row["predicted_at"] = {}
            cells = []
            for n in predict_world_sizes:
                at = predict_mechanism(replace(cfg, sequences=spr * n), machine, world_size=n)
                row["predicted_at"][n] = at
                cells.append(f"{at['headroom']:6.2f}/{at['mechanism']:5.2f}x")
            log(f"{spr:8d} {cfg.max_tokens:7d} " + " ".join(f"{c:>15}" for c in cells))
    out = {"config": asdict(base), "world_size": world_size, "repeats": repeats, "points": out_points}
    if machine:  # what the predictions rest on: the per-layer cost fit and each mode's engine costs
        out["calibration"] = {"layer_cost": asdict(machine["layer_cost"]),
                              "fit_median_error": machine["fit_median_error"], "engine": machine["engine"],
                              "jitter": machine["jitter"]}
    _write(json_path, out, log)
    return out
