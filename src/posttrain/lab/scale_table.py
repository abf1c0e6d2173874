"""The scale table: predicted ODC/FSDP speedup per balancing method, 8 to 256 GPUs.

For every (model, length profile, GPU count) the same minibatches (``sequences_per_rank`` per
GPU, seeded) are balanced by each method with the model's own cost (:meth:`SimModel.sequence_cost`)
and simulated under FSDP and ODC. Columns:

- ``round_robin``, ``local_sort``, ``same_micro``: ODC over FSDP with the same plan;
- ``diff_micro``: ODC with ``diff_micro`` (which only ODC can run) over FSDP with ``same_micro``
  (the best FSDP can do): the paper's headline comparison;
- ``diff_micro hsdp``: the same with both sharded per node (HSDP).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from posttrain.balance import plan_minibatch
from posttrain.sim.cluster import Cluster
from posttrain.sim.costs import SimModel
from posttrain.sim.dp import simulate_dp
from posttrain.sim.lengths import draw_lengths, profile_max_len

__all__ = ["COLUMNS", "format_table", "scale_table"]

COLUMNS = ("round_robin", "local_sort", "same_micro", "diff_micro", "diff_micro hsdp")


def scale_table(*, world_sizes: Sequence[int] = (8, 16, 32, 64, 128, 256), profiles: Sequence[str] = ("longalign", "swe_smith"),
                models: Sequence[str] = ("1.5b", "7b"), sequences_per_rank: int = 8, minibatches: int = 2,
                max_tokens: int | None = None, cluster: Cluster | None = None, seed: int = 0,
                progress: Callable[[str], None] | None = None) -> list[dict]:
    """One row per (model, profile, GPU count): ``{"model", "profile", "world_size", column: speedup,
    "fsdp_bubble", "odc_bubble"}`` (bubbles of FSDP+same_micro and ODC+diff_micro, flat)."""
    cluster = cluster or Cluster()
    if sequences_per_rank < 1:
        raise ValueError(f"sequences_per_rank={sequences_per_rank} must be at least 1")
    if minibatches < 1:
        raise ValueError(f"minibatches={minibatches} must be at least 1")
    rows = []
    for model_name in models:
        model = SimModel.preset(model_name)
        for profile in profiles:
            mt = max_tokens or profile_max_len(profile)
            for n in world_sizes:
                cl = Cluster(**{**cluster.__dict__, "num_gpus": n})
                batches = [draw_lengths(profile, sequences_per_rank * n, seed=seed * 1000 + k, max_len=mt)
                           for k in range(minibatches)]
                plans = {m: [plan_minibatch(b, world_size=n, max_tokens=mt, method=m, cost=model.sequence_cost)
                             for b in batches] for m in ("round_robin", "local_sort", "same_micro", "diff_micro")}
                sim = {}
                for strat, meths in (("fsdp", ("round_robin", "local_sort", "same_micro")),
                                     ("odc", ("round_robin", "local_sort", "same_micro", "diff_micro"))):
                    for m in meths:
                        sim[(strat, m, False)] = simulate_dp(plans[m], strategy=strat, model=model, cluster=cl)
                sim[("fsdp", "same_micro", True)] = simulate_dp(plans["same_micro"], strategy="fsdp", model=model,
                                                                cluster=cl, hsdp=True)
                sim[("odc", "diff_micro", True)] = simulate_dp(plans["diff_micro"], strategy="odc", model=model,
                                                               cluster=cl, hsdp=True)
                tp = {k: v.throughput for k, v in sim.items()}
                row = {"model": model_name, "profile": profile, "world_size": n}
                for m in ("round_robin", "local_sort", "same_micro"):
                    row[m] = tp[("odc", m, False)] / tp[("fsdp", m, False)]
                row["diff_micro"] = tp[("odc", "diff_micro", False)] / tp[("fsdp", "same_micro", False)]
                row["diff_micro hsdp"] = tp[("odc", "diff_micro", True)] / tp[("fsdp", "same_micro", True)]
                row["fsdp_bubble"] = sim[("fsdp", "same_micro", False)].bubble_fraction
                row["odc_bubble"] = sim[("odc", "diff_micro", False)].bubble_fraction
                rows.append(row)
                if progress:
                    progress(f"{model_name} {profile} {n} GPUs: ODC+diff_micro / FSDP+same_micro = {row['diff_micro']:.2f}")
    return rows


def format_table(rows: Sequence[dict]) -> str:
    head = f"{'model':5} {'lengths':10} {'GPUs':>5} " + " ".join(f"{c:>15}" for c in COLUMNS) + f" {'bubble F/O':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:5} {r['profile']:10} {r['world_size']:5d} " + " ".join(f"{r[c]:15.2f}" for c in COLUMNS)
                     + f" {r['fsdp_bubble']:5.2f}/{r['odc_bubble']:.2f}")
    return "\n".join(lines)
