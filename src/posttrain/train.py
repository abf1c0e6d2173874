"""The training loop: a GPT on synthetic long-tail data, data parallel with FSDP2 or ODC.

Composes the mechanisms: :mod:`posttrain.data` makes each minibatch, :mod:`posttrain.balance`
plans it (every rank computes the same plan, so the global token count needs no collective),
and the data-parallel engine runs it:

- ``dp="fsdp"``: FSDP2 with gloo collectives. Every rank must run the same number of
  microbatches, so a rank with fewer runs zero-weight dummy microbatches (one token) to keep
  the collectives matched - the cost FSDP pays for imbalance.
- ``dp="odc"``: ODC; each rank runs exactly its own microbatches.
- ``dp="odc-collective"``: ODC's transport with a barrier at every gather and reduce; padded
  with dummies like FSDP.

Losses are summed token losses divided by the minibatch's global token count, so every variant
computes the same gradient (FSDP2 averages over ranks, so its loss is scaled by the world size).
Step timing starts after a reporting barrier outside the minibatch, identical for all variants.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import posttrain.odc as odc_mod
from posttrain._launch import run_ranks
from posttrain.balance import METHODS, FlopsCost, pack_sequences, plan_minibatch
from posttrain.data import PROFILES, profile_lengths, synthetic_sequences
from posttrain.models import GPT, GPTConfig, token_loss_sum

__all__ = ["DP_MODES", "TrainConfig", "microbatch_compute_times", "run_training", "summarize", "train_worker"]

DP_MODES = ("fsdp", "odc", "odc-collective")


@dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Attributes:
        dp: data-parallel engine: ``fsdp``, ``odc`` or ``odc-collective``.
        balance: balancing method (``round_robin``, ``local_sort``, ``same_micro``, ``diff_micro``).
        profile: embedded length profile (``long_tail``, ``bimodal``, ``uniform``).
        steps: optimizer steps.
        sequences: sequences per minibatch, over all ranks.
        max_len: longest sequence.
        max_tokens: most tokens in one microbatch (at least ``max_len``).
        dim: model hidden size.
        num_layers: transformer blocks.
        optimizer: ``adamw`` or ``sgd`` (plain SGD shows gradient-scale errors that Adam hides).
        lr: learning rate.
        seed: data and initialization seed.
    """

    dp: Literal["fsdp", "odc", "odc-collective"] = "odc"
    balance: Literal["round_robin", "local_sort", "same_micro", "diff_micro"] = "diff_micro"
    profile: Literal["long_tail", "bimodal", "uniform"] = "long_tail"
    steps: int = 10
    sequences: int = 16
    max_len: int = 512
    max_tokens: int = 512
    dim: int = 128
    num_layers: int = 4
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dp not in DP_MODES:
            raise ValueError(f"--dp={self.dp!r} is not one of {', '.join(DP_MODES)}")
        if self.balance not in METHODS:
            raise ValueError(f"--balance={self.balance!r} is not one of {', '.join(METHODS)}")
        if self.profile not in PROFILES:
            raise ValueError(f"--profile={self.profile!r} is not one of {', '.join(PROFILES)}")
        for name in ("steps", "sequences", "dim", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be at least 1")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"--optimizer={self.optimizer!r} is not one of adamw, sgd")
        if not self.lr > 0:
            raise ValueError(f"--lr={self.lr} must be positive")
        if self.max_len < 8:
            raise ValueError(f"--max-len={self.max_len} must be at least 8")
        if self.max_tokens < self.max_len:
            raise ValueError(
                f"--max-tokens={self.max_tokens} is smaller than the longest sequence "
                f"(--max-len={self.max_len}); raise --max-tokens"
            )

    @property
    def model_config(self) -> GPTConfig:
        return GPTConfig(vocab_size=64, dim=self.dim, num_layers=self.num_layers,
                         num_heads=max(1, self.dim // 32), max_seq_len=self.max_tokens)


def minibatch_sequences(cfg: TrainConfig, step: int) -> list[torch.Tensor]:
    """The sequences of ``step`` (identical on every rank)."""
    seed = cfg.seed * 100_003 + step
    lengths = profile_lengths(cfg.profile, cfg.sequences, max_len=cfg.max_len, seed=seed)
    return synthetic_sequences([n + 1 for n in lengths], vocab_size=64, seed=seed)


def _plan(cfg: TrainConfig, seqs: list[torch.Tensor], world_size: int, cost: FlopsCost):
    return plan_minibatch([len(s) - 1 for s in seqs], world_size=world_size, max_tokens=cfg.max_tokens,
                          method=cfg.balance, cost=cost)


def _microbatch_loss(model, seqs, ids, scale: float) -> torch.Tensor:
    packed = pack_sequences([seqs[i] for i in ids])
    logits = model(packed.inputs, document_lengths=packed.document_lengths)
    return token_loss_sum(logits, packed.targets) * scale


_DUMMY = torch.zeros(1, 1, dtype=torch.long)


def train_worker(rank: int, world_size: int, cfg: TrainConfig) -> list[dict]:
    """Run ``cfg`` on this rank (inside an initialized process group); per-step metrics."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model_config)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    opt_cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.SGD
    opt = opt_cls(model.parameters(), lr=cfg.lr)
    odc = None if cfg.dp == "fsdp" else odc_mod.enable(
        model, mode="collective" if cfg.dp == "odc-collective" else "odc")
    pad = cfg.dp != "odc"  # engines with per-layer rendezvous need equal microbatch counts
    cost = FlopsCost.from_config(cfg.model_config)
    metrics = []
    try:
        for step in range(cfg.steps):
            seqs = minibatch_sequences(cfg, step)
            plan = _plan(cfg, seqs, world_size, cost)
            mine = [m for m in plan.microbatches_for(rank) if m.sequence_ids]
            rounds = max(len([m for m in mbs if m.sequence_ids]) for mbs in plan.ranks)
            total = sum(plan.rank_tokens)
            scale = (world_size if odc is None else 1.0) / total
            dist.barrier()  # reporting alignment, outside any minibatch
            t0 = time.perf_counter()
            compute = 0.0
            loss_sum = torch.zeros(())
            ctx = odc.minibatch(num_tokens=sum(m.num_tokens for m in mine)) if odc else contextlib.nullcontext()
            with ctx:
                for j in range(rounds if pad else len(mine)):
                    t1 = time.perf_counter()
                    if j < len(mine):
                        loss = _microbatch_loss(model, seqs, mine[j].sequence_ids, scale)
                        loss_sum += loss.detach()
                    else:
                        loss = model(_DUMMY).sum() * 0.0  # keeps FSDP's collectives matched
                    loss.backward()
                    compute += time.perf_counter() - t1
                t_sync = time.perf_counter()
            sync = time.perf_counter() - t_sync
            opt.step()
            opt.zero_grad()
            metrics.append({
                "step": step, "rank": rank, "step_time_s": time.perf_counter() - t0,
                "microbatch_time_s": compute, "sync_time_s": sync,
                "loss": loss_sum.item() / (world_size if odc is None else 1.0),
                "tokens": total, "microbatches": len(mine),
            })
    finally:
        if odc is not None:
            odc.close()
    return metrics


def microbatch_compute_times(cfg: TrainConfig, world_size: int) -> list[float]:
    """Per step: single-process forward+backward time of every microbatch of the plan, no
    communication at all (the ideal bound divides this evenly over ``world_size`` ranks)."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model_config)
    cost = FlopsCost.from_config(cfg.model_config)
    out = []
    for step in range(cfg.steps):
        seqs = minibatch_sequences(cfg, step)
        plan = _plan(cfg, seqs, world_size, cost)
        t0 = time.perf_counter()
        for mbs in plan.ranks:
            for m in mbs:
                if m.sequence_ids:
                    _microbatch_loss(model, seqs, m.sequence_ids, 1.0).backward()
        model.zero_grad()
        out.append(time.perf_counter() - t0)
    return out


def summarize(per_rank: list[list[dict]]) -> dict:
    """Aggregate rank metrics over the steps after the first (warm-up).

    ``utilization`` is the share of step time spent inside microbatches, averaged over ranks.
    Under FSDP that share includes waiting inside the per-layer collectives, so it overstates
    useful work there; compare tokens/s against the ideal bound instead.
    """
    steps = list(zip(*per_rank))[1:] or list(zip(*per_rank))
    step_times = [max(r["step_time_s"] for r in s) for s in steps]
    tokens = sum(s[0]["tokens"] for s in steps)
    util = [sum(r["microbatch_time_s"] for r in s) / (len(s) * st) for s, st in zip(steps, step_times)]
    return {
        "tokens_per_s": tokens / sum(step_times),
        "utilization": sum(util) / len(util),
        "final_loss": sum(r["loss"] for r in list(zip(*per_rank))[-1]),
        "step_time_s": sum(step_times) / len(step_times),
    }


def run_training(cfg: TrainConfig, *, world_size: int = 2, metrics_path: str | None = None) -> list[list[dict]]:
    """Train ``cfg`` on ``world_size`` forked CPU processes, printing one line per step.

    Args:
        cfg: the run.
        world_size: CPU processes.
        metrics_path: if given, every rank's per-step metrics are written there as JSON lines.

    Returns:
        Every rank's per-step metrics.
    """
    if world_size < 1:
        raise ValueError(f"--world-size={world_size} must be at least 1")
    if cfg.sequences < world_size:
        raise ValueError(f"--sequences={cfg.sequences} is fewer than --world-size={world_size}")
    print(
        f"posttrain: {cfg.dp} on {world_size} CPU processes, GPT {cfg.num_layers}x{cfg.dim}, "
        f"{cfg.sequences} {cfg.profile} sequences per minibatch ({cfg.balance}, packed), {cfg.steps} steps",
        flush=True,
    )
    per_rank = run_ranks(train_worker, world_size, cfg, timeout_s=24 * 3600)
    steps = list(zip(*per_rank))
    for s in steps:
        step_time = max(r["step_time_s"] for r in s)
        print(
            f"step {s[0]['step']:3d}  loss {sum(r['loss'] for r in s):.3f}  {s[0]['tokens']:5d} tokens  "
            f"{s[0]['tokens'] / step_time:8.0f} tokens/s  microbatches per rank {[r['microbatches'] for r in s]}"
        )
    steady = steps[len(steps) // 3 :] or steps
    tps = sum(s[0]["tokens"] for s in steady) / sum(max(r["step_time_s"] for r in s) for s in steady)
    first, last = (sum(r["loss"] for r in s) for s in (steps[0], steps[-1]))
    print(f"loss {first:.3f} -> {last:.3f}; {tps:.0f} tokens/s after warm-up")
    if metrics_path:
        os.makedirs(os.path.dirname(metrics_path) or ".", exist_ok=True)
        with open(metrics_path, "w") as f:
            for s in steps:
                for r in s:
                    f.write(json.dumps(r) + "\n")
        print(f"wrote {metrics_path}")
    return per_rank
