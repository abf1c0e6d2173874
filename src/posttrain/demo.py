"""The ODC demo: a tiny GPT trained on 2 CPU processes with ODC on long-tail sequence lengths.

Each minibatch draws sequences from the embedded ``long_tail`` profile (:mod:`posttrain.data`).
``diff_micro`` balancing (:mod:`posttrain.balance`, FLOPs cost model) gives every rank about the
same cost, packed
into microbatches of at most ``max_len`` tokens, so ranks run *different numbers of
microbatches* - something FSDP's per-layer collectives cannot do and ODC can. The task is
learnable (counting with a per-sequence stride), so the loss falls visibly within a few dozen steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import posttrain.odc as odc_mod
from posttrain._launch import run_ranks
from posttrain.balance import FlopsCost, pack_sequences, plan_minibatch
from posttrain.data import profile_lengths, synthetic_sequences
from posttrain.models import GPT, GPTConfig, token_loss_sum

__all__ = ["DemoConfig", "run_demo"]


@dataclass(frozen=True)
class DemoConfig:
    """Knobs of the demo; the defaults run in well under a minute on 2 CPU cores.

    Attributes:
        steps: optimizer steps (minibatches).
        world_size: CPU processes.
        sequences: sequences per minibatch, over all ranks.
        max_len: longest sequence, and the token budget of one microbatch.
        lr: AdamW learning rate.
        seed: seeds data and initialization.
    """

    steps: int = 30
    world_size: int = 2
    sequences: int = 12
    max_len: int = 192
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "world_size", "sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be at least 1")
        if not 8 <= self.max_len <= MODEL.max_seq_len:
            raise ValueError(f"--max-len={self.max_len} must be between 8 and {MODEL.max_seq_len}")
        if self.sequences < self.world_size:
            raise ValueError(f"--sequences={self.sequences} is fewer than --world-size={self.world_size}")


MODEL = GPTConfig(vocab_size=64, dim=64, num_layers=4, num_heads=4, max_seq_len=256)


def make_minibatch(step: int, cfg: DemoConfig) -> list[torch.Tensor]:
    """The sequences of one step (same on every rank)."""
    seed = cfg.seed * 100_003 + step
    lengths = profile_lengths("long_tail", cfg.sequences, max_len=cfg.max_len, seed=seed)
    return synthetic_sequences([n + 1 for n in lengths], vocab_size=MODEL.vocab_size, seed=seed)


def _worker(rank: int, world_size: int, cfg: DemoConfig) -> list[dict]:
    torch.manual_seed(cfg.seed)
    model = GPT(MODEL)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    cost = FlopsCost.from_config(MODEL)
    log = []
    with odc_mod.enable(model) as odc:
        for step in range(cfg.steps):
            seqs = make_minibatch(step, cfg)
            plan = plan_minibatch([len(s) - 1 for s in seqs], world_size=world_size,
                                  max_tokens=cfg.max_len, method="diff_micro", cost=cost)
            mine = plan.microbatches_for(rank)
            t0 = time.perf_counter()
            loss_sum = torch.zeros(())
            with odc.minibatch(num_tokens=sum(m.num_tokens for m in mine)) as mb:
                for micro in mine:
                    packed = pack_sequences([seqs[i] for i in micro.sequence_ids])
                    logits = model(packed.inputs, document_lengths=packed.document_lengths)
                    loss = token_loss_sum(logits, packed.targets) / mb.global_tokens
                    loss.backward()
                    loss_sum += loss.detach()
            opt.step()
            opt.zero_grad()
            elapsed = time.perf_counter() - t0
            stats = torch.tensor([loss_sum.item(), elapsed, len(mine)], dtype=torch.float64)
            gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(world_size)]
            dist.all_gather(gathered, stats)  # reporting only, outside the minibatch
            if rank == 0:
                step_time = max(float(s[1]) for s in gathered)
                log.append({
                    "step": step,
                    "loss": sum(float(s[0]) for s in gathered),
                    "tokens": mb.global_tokens,
                    "step_time_s": step_time,
                    "tokens_per_s": mb.global_tokens / step_time,
                    "microbatches_per_rank": [int(s[2]) for s in gathered],
                })
    return log


def run_demo(cfg: DemoConfig) -> list[dict]:
    """Run the demo and print one line per step; returns rank 0's per-step log."""
    print(
        f"posttrain demo: ODC on {cfg.world_size} CPU processes, GPT {MODEL.num_layers}x{MODEL.dim}, "
        f"{cfg.sequences} long-tail sequences per minibatch (diff_micro, packed), {cfg.steps} steps"
    )
    log = run_ranks(_worker, cfg.world_size, cfg, timeout_s=1800)[0]
    for row in log:
        print(
            f"step {row['step']:3d}  loss {row['loss']:.3f}  {row['tokens']:5d} tokens  "
            f"{row['tokens_per_s']:8.0f} tokens/s  microbatches per rank {row['microbatches_per_rank']}"
        )
    steady = log[len(log) // 3 :] or log
    tps = sum(r["tokens"] for r in steady) / sum(r["step_time_s"] for r in steady)
    print(f"loss {log[0]['loss']:.3f} -> {log[-1]['loss']:.3f}; {tps:.0f} tokens/s after warm-up")
    return log
