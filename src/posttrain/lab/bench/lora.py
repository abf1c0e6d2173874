"""What LoRA saves: full fine-tuning against LoRA adapters on the same model, data and engine.

    posttrain bench lora                          # llama 4x256, rank 8 on q,k,v,o, 2 ranks
    posttrain bench lora --dim 512 --rank 16 --rounds 3 --json out/bench_lora.json

For each engine (flat ODC, FSDP2) and each variant (full, LoRA) the same SFT run (the built-in
``llama`` model, synthetic long-tail sequences, 2 ranks) is measured, variants interleaved over
``rounds`` rounds:

- trainable parameters and the optimizer's state, summed over the ranks (AdamW: two moments per
  trainable element; the counts, exact, from the optimizer itself);
- flat ODC's communication, from its counters: bytes pushed (gradients scattered into the owners'
  accumulators) and bytes gathered, per step;
- the step time's median (the ranks' slowest, after the first step) and its range over rounds,
  printed as LoRA / full.

Counts are exact; times on this 2-core machine move by 10-20 % run to run.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

__all__ = ["LoraBench", "bench_lora"]


@dataclass(frozen=True)
class LoraBench:
    """``posttrain bench lora``: the model, the adapters and the repetitions.

    Attributes:
        dim: the built-in llama's hidden size.
        layers: its transformer blocks.
        rank: the adapters' rank.
        targets: the layers that get adapters.
        steps: training steps per run (the first is not timed).
        rounds: runs of each variant, interleaved.
        json: results file ('' for none).
    """

    dim: int = 256
    layers: int = 4
    rank: int = 8
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    steps: int = 4
    rounds: int = 2
    json: str = "out/bench_lora.json"

    def __post_init__(self) -> None:
        for name in ("dim", "layers", "rank", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.steps < 2:
            raise ValueError(f"steps={self.steps} must be at least 2 (the first is not timed)")

    def run(self, log=print) -> dict:
        """:func:`bench_lora` of these options, written to ``json``."""
        from .split import write_result

        result = bench_lora(self, log=log)
        write_result(result, self.json, log)
        return result


def bench_lora(c: LoraBench, *, log=print) -> dict:
    """Run the comparison (see the module docstring); print it; return its rows."""
    from posttrain.dp import EngineConfig
    from posttrain.train.core import OptimConfig
    from posttrain.train.sft import TrainConfig, run_training

    base = TrainConfig(model="llama", dim=c.dim, num_layers=c.layers, steps=c.steps, sequences=8, max_len=256,
                       optim=OptimConfig(lr=1e-3))
    variants = {}
    for dp in ("odc", "fsdp"):
        full = replace(base, engine=EngineConfig(dp))
        variants[(dp, "full")] = full
        variants[(dp, "lora")] = replace(full, lora_rank=c.rank, lora_targets=tuple(c.targets))
    runs: dict[tuple[str, str], list[list[dict]]] = {k: [] for k in variants}
    for r in range(c.rounds):
        for key, cfg in variants.items():
            log(f"round {r + 1}/{c.rounds}: {key[0]} {key[1]}")
            runs[key].append(run_training(cfg, world_size=2, quiet=True))
    rows = []
    for (dp, kind), results in runs.items():
        first = results[0]
        times = [statistics.median(max(r["metrics"][s]["step_time_s"] for r in res) for s in range(1, c.steps))
                 for res in results]
        stats = [r["engine_stats"] for r in first]
        rows.append({
            "engine": dp, "variant": kind,
            "optimizer_state_numel": sum(r["optimizer_state_numel"] for r in first),
            "push_bytes_per_step": sum(s.get("push_bytes", 0) for s in stats) / c.steps if dp == "odc" else None,
            "gather_bytes_per_step": sum(s.get("gather_bytes", 0) for s in stats) / c.steps if dp == "odc" else None,
            "step_s_median": statistics.median(times), "step_s_min": min(times), "step_s_max": max(times),
        })
    by = {(r["engine"], r["variant"]): r for r in rows}
    log(f"LoRA rank {c.rank} on {','.join(c.targets)} vs full fine-tuning: llama {c.layers}x{c.dim}, 2 ranks, "
        f"{c.rounds} rounds x {c.steps - 1} timed steps")
    log(f"{'engine':>6} | {'optimizer state, elements: full -> LoRA':>40} {'ratio':>7} | "
        f"{'pushed per step, MiB: full -> LoRA':>34} {'ratio':>7} | {'gathered ratio':>14} | "
        f"step time LoRA/full: median (range)")
    for dp in ("odc", "fsdp"):
        f, lo = by[(dp, "full")], by[(dp, "lora")]
        state = f"{f['optimizer_state_numel']:,} -> {lo['optimizer_state_numel']:,}"
        push, push_ratio, gather = "not counted (FSDP2)", "", ""
        if dp == "odc":
            push = f"{f['push_bytes_per_step'] / 2**20:.2f} -> {lo['push_bytes_per_step'] / 2**20:.3f}"
            push_ratio = f"{lo['push_bytes_per_step'] / f['push_bytes_per_step']:.4f}"
            gather = f"{lo['gather_bytes_per_step'] / f['gather_bytes_per_step']:.3f}"
        t = (f"{lo['step_s_median'] / f['step_s_median']:.2f} "
             f"({lo['step_s_min'] / f['step_s_max']:.2f}-{lo['step_s_max'] / f['step_s_min']:.2f})")
        log(f"{dp:>6} | {state:>40} {lo['optimizer_state_numel'] / f['optimizer_state_numel']:>7.4f} | "
            f"{push:>34} {push_ratio:>7} | {gather:>14} | {t}")
    return {"rank": c.rank, "targets": list(c.targets), "dim": c.dim, "layers": c.layers, "rows": rows}
