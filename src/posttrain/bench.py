"""``posttrain bench odc``: FSDP2 vs ODC training throughput, side by side in one run, 2 ranks.

Same model, data and steps for every variant: FSDP2 (gloo) with round_robin and with
same_micro; ODC on FSDP2 in collective mode (same_micro), with round_robin and with diff_micro; flat ODC
(``--dp odc``, no FSDP2) in collective mode and with diff_micro; and
the ideal bound: the compute time of all microbatches of a step divided evenly over the ranks,
no communication. The ideal's compute time is measured on ``world_size`` processes at once (each
runs every microbatch of the step on an unsharded model), so it sees the same core and memory
contention as the training runs. Variants run interleaved for ``repeats`` rounds; ratios are
medians over rounds (this machine is noisy: only ratios taken side by side mean anything).
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, replace

from posttrain._launch import run_ranks
from posttrain.train import TrainConfig, TrainData, ideal_compute_worker, summarize, train_worker

__all__ = ["ODC_VARIANTS", "bench_odc"]

#: (engine, odc mode, balancing method); named ``<dp label>+<method>`` (e.g. ``odc-collective+same_micro``).
ODC_VARIANTS = (
    ("fsdp", "odc", "round_robin"),
    ("fsdp", "odc", "same_micro"),
    ("odc-fsdp2", "collective", "same_micro"),
    ("odc-fsdp2", "odc", "round_robin"),
    ("odc-fsdp2", "odc", "diff_micro"),
    ("odc", "collective", "same_micro"),
    ("odc", "odc", "diff_micro"),
)
_REF = "fsdp+same_micro"


def _ideal(cfg: TrainConfig, world_size: int) -> dict:
    per_rank = run_ranks(ideal_compute_worker, world_size, cfg, timeout_s=3600)
    times = [sum(step) / len(step) for step in zip(*per_rank)][1:]  # mean over ranks, first step out
    data = TrainData(cfg, world_size)
    tokens = sum(sum(len(s) - 1 for s in data.minibatch(k)) for k in range(1, cfg.steps))
    return {"tokens_per_s": tokens / (sum(times) / world_size), "utilization": 1.0,
            "compute_s": sum(times) / len(times)}


def bench_odc(base: TrainConfig, *, world_size: int = 2, repeats: int = 5, json_path: str | None = None,
              log=print) -> dict:
    """Run every variant and the ideal ``repeats`` times, interleaved; print and return ratios.

    Returns:
        ``{"config", "world_size", "repeats", "rounds": [{variant: summary}], "median": {variant:
        {"tokens_per_s", "utilization", "vs_fsdp_same_micro", "vs_ideal", "compute_vs_ideal"}},
        "spread": {variant: {ratio: [lowest, highest] over the rounds}}}``.
    """
    if repeats < 1:
        raise ValueError(f"--repeats={repeats} must be at least 1")
    if base.steps < 2:
        raise ValueError(f"--steps={base.steps} must be at least 2 (the first step is warm-up)")
    base = replace(base, progress=False, checkpoint_dir=None)
    TrainData(base, world_size)
    rounds = []
    for k in range(repeats):
        got = {}
        for dp, mode, balance in ODC_VARIANTS:
            cfg = replace(base, dp=dp, odc_mode=mode, balance=balance)
            name = f"{cfg.dp_label}+{balance}"
            got[name] = summarize(run_ranks(train_worker, world_size, cfg, timeout_s=3600))
            log(f"  round {k + 1}/{repeats}  {name:28} {got[name]['tokens_per_s']:9.0f} tokens/s", flush=True)
        got["ideal"] = _ideal(base, world_size)
        log(f"  round {k + 1}/{repeats}  {'ideal':28} {got['ideal']['tokens_per_s']:9.0f} tokens/s", flush=True)
        rounds.append(got)
    median, spread = {}, {}
    for name in rounds[0]:
        ratios = {
            "vs_fsdp_same_micro": [r[name]["tokens_per_s"] / r[_REF]["tokens_per_s"] for r in rounds],
            "vs_ideal": [r[name]["tokens_per_s"] / r["ideal"]["tokens_per_s"] for r in rounds],
            # the same microbatches' compute (communication excluded) relative to the ideal's
            "compute_vs_ideal": [r[name]["compute_s"] / r["ideal"]["compute_s"] for r in rounds],
        }
        median[name] = {
            "tokens_per_s": statistics.median(r[name]["tokens_per_s"] for r in rounds),
            "utilization": statistics.median(r[name]["utilization"] for r in rounds),
            **{k: statistics.median(v) for k, v in ratios.items()},
        }
        spread[name] = {k: [min(v), max(v)] for k, v in ratios.items()}
    source = base.data or f"profile {base.profile}"
    log(f"\nFSDP2 vs ODC, {world_size} ranks, {source}, {base.model} {base.num_layers}x{base.dim} {base.precision}, "
        f"{base.sequences} sequences/step up to {base.max_len} tokens, {base.steps} steps (first excluded), "
        f"median of {repeats} rounds")
    log(f"{'variant':28} {'tokens/s':>9} {'util':>6} {'vs fsdp+same_micro':>19} {'(rounds)':>11} "
        f"{'vs ideal':>9} {'(rounds)':>11} {'compute/ideal':>14}")
    for name, m in median.items():
        lo, hi = spread[name]["vs_fsdp_same_micro"]
        ilo, ihi = spread[name]["vs_ideal"]
        log(f"{name:28} {m['tokens_per_s']:9.0f} {m['utilization']:6.2f} {m['vs_fsdp_same_micro']:18.2f}x "
            f"{lo:5.2f}-{hi:<5.2f} {m['vs_ideal']:9.2f} {ilo:5.2f}-{ihi:<5.2f} {m['compute_vs_ideal']:14.2f}")
    log("(util: compute share of step time; compute/ideal: the same microbatches' compute time, communication "
        "excluded, over the ideal's: FSDP2's per-module unshard/reshard work shows here; (rounds): lowest and "
        "highest ratio of a single round)")
    log("")
    for engine in ("odc-fsdp2", "odc"):
        odc, coll = median[f"{engine}+diff_micro"], median[f"{engine}-collective+same_micro"]
        log(f"{engine}+diff_micro / fsdp+same_micro = {odc['vs_fsdp_same_micro']:.2f}x; "
            f"{engine}+diff_micro / ideal = {odc['vs_ideal']:.2f}; "
            f"{engine}-collective / fsdp+same_micro = {coll['vs_fsdp_same_micro']:.2f}x; "
            f"{engine}+diff_micro / {engine}-collective = {odc['tokens_per_s'] / coll['tokens_per_s']:.2f}x")
    out = {"config": asdict(base), "world_size": world_size, "repeats": repeats, "rounds": rounds, "median": median,
           "spread": spread}
    if json_path:
        os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(out, f, indent=2)
        log(f"wrote {json_path}")
    return out
