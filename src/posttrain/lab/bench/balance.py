"""Benchmark of the load balancer: plan time and balance of every method, per length profile
and world size, and whether the balancer's targets are met.

    posttrain bench balance --world-sizes 2,8,32 --seeds 5 --json out/balance.json

Each (profile, world size, seed) draws ``sequences_per_rank * world_size`` lengths with
:func:`posttrain.sim.draw_lengths` (the scalable profiles ``long_tail``, ``uniform`` and
``bimodal`` with ``max_len=32768``; ``longalign`` and ``swe_smith`` at their own scale), plans
them with every method under :class:`~posttrain.balance.QuadraticCost` (the ODC reference's 7B
fit) and ``max_tokens`` = the profile's longest possible sequence, and times each
:func:`~posttrain.balance.plan_minibatch` call. Reported per (profile, world size, method):
the median plan time over the seeds, the imbalance (max / mean of the ranks' total costs;
what ODC's step waits for) and, for ``same_micro``, FSDP's step cost (``sum_j max_r``, see
[Note: balancing methods]) over the lower bound ``sum(costs) / world_size``.

Targets: diff_micro's imbalance <= 1.001 at 32 ranks on long_tail, longalign, swe_smith and
uniform; a plan of 256 sequences over 32 ranks in <= 20 ms and of 8,192 over 1,024 ranks in
<= 1 s, every method (medians; the timing targets assume 8 sequences per rank).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from posttrain.balance import METHODS, QuadraticCost, plan_minibatch
from posttrain.sim.lengths import LENGTH_PROFILES, draw_lengths, profile_max_len

__all__ = ["DEFAULT_PROFILES", "SCALABLE_MAX_LEN", "BalanceBench", "bench_balance"]

DEFAULT_PROFILES = ("longalign", "swe_smith", "long_tail", "uniform", "bimodal")
# long_tail / uniform / bimodal scale to max_len; 32K is a realistic post-training context and
# long enough that the quadratic (attention) term of the cost matters (scale=32000).
SCALABLE_MAX_LEN = 32768
IMBALANCE_TARGET = 1.001
IMBALANCE_PROFILES = ("long_tail", "longalign", "swe_smith", "uniform")
TIME_TARGETS_MS = {32: 20.0, 1024: 1000.0}  # world size -> most median ms per plan


@dataclass(frozen=True)
class BalanceBench:
    """``posttrain bench balance``: what to plan, and where the result goes.

    Attributes:
        world_sizes: ranks to plan for.
        sequences_per_rank: sequences per rank in each minibatch.
        profiles: length profiles to draw from.
        seeds: minibatches (seeds ``0..seeds-1``) per profile and world size; times and
            imbalances are medians over them.
        json: results file ('' for none).
    """

    world_sizes: tuple[int, ...] = (2, 8, 32, 128, 1024)
    sequences_per_rank: int = 8
    profiles: tuple[str, ...] = DEFAULT_PROFILES
    seeds: int = 5
    json: str = "out/bench_balance.json"

    def __post_init__(self) -> None:
        for p in self.profiles:
            if p not in LENGTH_PROFILES:
                raise ValueError(f"profiles: unknown length profile {p!r}; choose from {', '.join(LENGTH_PROFILES)}")
        if not self.profiles:
            raise ValueError("`profiles` is empty")
        if min(self.world_sizes, default=0) < 1 or self.sequences_per_rank < 1 or self.seeds < 1:
            raise ValueError(f"world_sizes={','.join(map(str, self.world_sizes))}, "
                             f"sequences_per_rank={self.sequences_per_rank} and seeds={self.seeds} must all be at "
                             "least 1 (and world_sizes non-empty)")

    def run(self, log: Callable[[str], None] | None = print) -> dict:
        """:func:`bench_balance` of these options, written to ``json``."""
        from .split import write_result

        result = bench_balance(self.world_sizes, self.sequences_per_rank, self.profiles, self.seeds, log=log)
        write_result(result, self.json, log or (lambda _line: None))
        return result


def _max_len(profile: str) -> int | None:
    return None if profile in ("longalign", "swe_smith") else SCALABLE_MAX_LEN


def bench_balance(world_sizes: Sequence[int] = (2, 8, 32, 128, 1024), sequences_per_rank: int = 8,
                  profiles: Sequence[str] = DEFAULT_PROFILES, seeds: int = 5,
                  log: Callable[[str], None] | None = print) -> dict:
    """Time and score every balancing method; print a table and the targets.

    Args:
        world_sizes: ranks to plan for.
        sequences_per_rank: sequences per rank in each minibatch.
        profiles: length profiles of :func:`posttrain.sim.draw_lengths`.
        seeds: minibatches (seeds ``0..seeds-1``) per (profile, world size); times and
            imbalances are medians over them.
        log: where table lines go (None: silent).

    Returns:
        ``{"config": ..., "rows": [...], "targets": [...]}``: one row per (profile, world size,
        method) with ``median_ms``, ``max_ms``, ``imbalance_median``, ``imbalance_max`` and, for
        ``same_micro``, ``fsdp_step_over_bound_median`` / ``_max``; one target per goal with
        ``met`` (None where this run has no data for it).

    Raises:
        ValueError: an unknown profile or a non-positive size.
    """
    BalanceBench(tuple(world_sizes), sequences_per_rank, tuple(profiles), seeds, json="")  # checks them
    say = log or (lambda _line: None)
    cost = QuadraticCost()
    plan_minibatch([100, 200, 300], world_size=2, max_tokens=1000, method="diff_micro", cost=cost)  # warm-up
    say(f"balance benchmark: {sequences_per_rank} sequences per rank, {seeds} seeds, {cost}, "
        f"max_len {SCALABLE_MAX_LEN} for the scalable profiles, max_tokens = longest possible sequence")
    head = f"{'profile':10} {'ranks':>5} {'method':11} {'median ms':>10} {'max ms':>8} {'imbalance':>17} {'fsdp step/bound':>16}"
    say(head)
    say("-" * len(head))
    rows = []
    for profile in profiles:
        max_len = _max_len(profile)
        max_tokens = max_len or profile_max_len(profile)
        for ws in world_sizes:
            batches = [draw_lengths(profile, sequences_per_rank * ws, seed=s, max_len=max_len) for s in range(seeds)]
            for method in METHODS:
                times, imb, fsdp = [], [], []
                for lengths in batches:
                    t0 = time.perf_counter()
                    plan = plan_minibatch(lengths, world_size=ws, max_tokens=max_tokens, method=method, cost=cost)
                    times.append(time.perf_counter() - t0)
                    imb.append(plan.imbalance)
                    if method == "same_micro":
                        fsdp.append(plan.step_time("microbatch") / (sum(map(cost, lengths)) / ws))
                row = {"profile": profile, "world_size": ws, "sequences": sequences_per_rank * ws,
                       "method": method, "max_tokens": max_tokens,
                       "median_ms": 1e3 * statistics.median(times), "max_ms": 1e3 * max(times),
                       "imbalance_median": statistics.median(imb), "imbalance_max": max(imb)}
                if fsdp:
                    row["fsdp_step_over_bound_median"] = statistics.median(fsdp)
                    row["fsdp_step_over_bound_max"] = max(fsdp)
                rows.append(row)
                step = (f"{row['fsdp_step_over_bound_median']:7.4f}/{row['fsdp_step_over_bound_max']:.4f}"
                        if fsdp else "")
                say(f"{profile:10} {ws:5d} {method:11} {row['median_ms']:10.2f} {row['max_ms']:8.1f} "
                    f"{row['imbalance_median']:8.5f}/{row['imbalance_max']:.5f} {step:>16}")
    targets = _targets(rows, sequences_per_rank)
    say("targets (imbalance: median/max over seeds; times: medians):")
    for t in targets:
        verdict = "n/a (not in this run)" if t["met"] is None else ("met" if t["met"] else "MISSED")
        detail = "" if t["value"] is None else f" ({t['value']})"
        say(f"  {t['target']}: {verdict}{detail}")
    config = {"world_sizes": list(world_sizes), "sequences_per_rank": sequences_per_rank,
              "profiles": list(profiles), "seeds": seeds, "cost": repr(cost),
              "scalable_max_len": SCALABLE_MAX_LEN}
    return {"config": config, "rows": rows, "targets": targets}


def _targets(rows: list[dict], sequences_per_rank: int) -> list[dict]:
    """Each goal with whether the rows meet it (None: no rows for it)."""
    out = []
    diff32 = [r for r in rows if r["method"] == "diff_micro" and r["world_size"] == 32
              and r["profile"] in IMBALANCE_PROFILES]
    worst = max((r["imbalance_max"] for r in diff32), default=None)
    covered = [p for p in IMBALANCE_PROFILES if any(r["profile"] == p for r in diff32)]
    out.append({"target": f"diff_micro imbalance <= {IMBALANCE_TARGET} at 32 ranks ({', '.join(IMBALANCE_PROFILES)})",
                "met": None if worst is None else worst <= IMBALANCE_TARGET,
                "value": None if worst is None else f"worst {worst:.5f} over {', '.join(covered)}"})
    for ws, limit in TIME_TARGETS_MS.items():
        timed = [r for r in rows if r["world_size"] == ws] if sequences_per_rank == 8 else []
        slowest = max(timed, key=lambda r: r["median_ms"], default=None)
        out.append({"target": f"plan of {8 * ws} sequences over {ws} ranks <= {limit:g} ms, every method",
                    "met": None if slowest is None else slowest["median_ms"] <= limit,
                    "value": None if slowest is None else
                    f"slowest {slowest['method']} on {slowest['profile']}: {slowest['median_ms']:.1f} ms"})
    return out
