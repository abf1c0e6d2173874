"""The ODC demo: a tiny GPT trained on 2 CPU processes with ODC on long-tail sequence lengths.

Each minibatch holds sequences whose lengths follow a long-tail (log-normal) profile. They are
split so that each rank gets about the same number of tokens, which means the ranks run
*different numbers of microbatches* (one sequence each) - something FSDP's per-layer
collectives cannot do and ODC can. The task is learnable (each token is the previous one plus a
per-sequence stride, mod the vocabulary), so the loss falls visibly within a few dozen steps.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import posttrain.odc as odc_mod
from posttrain._launch import run_ranks
from posttrain.models import GPT, GPTConfig, token_loss_sum

__all__ = ["DemoConfig", "run_demo"]


@dataclass(frozen=True)
class DemoConfig:
    """Knobs of the demo; the defaults run in well under a minute on 2 CPU cores.

    Attributes:
        steps: optimizer steps (minibatches).
        world_size: CPU processes.
        sequences: sequences per minibatch, over all ranks.
        max_len: longest sequence; lengths are log-normal with median ``max_len / 8``.
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
        if self.max_len < 8:
            raise ValueError(f"--max-len={self.max_len} must be at least 8")
        if self.sequences < self.world_size:
            raise ValueError(f"--sequences={self.sequences} is fewer than --world-size={self.world_size}")


MODEL = GPTConfig(vocab_size=64, dim=64, num_layers=4, num_heads=4, max_seq_len=256)


def make_minibatch(step: int, cfg: DemoConfig) -> list[torch.Tensor]:
    """Long-tail lengths; each sequence counts up from a random start with a random stride."""
    g = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    median = cfg.max_len / 8
    seqs = []
    for _ in range(cfg.sequences):
        n = int(min(cfg.max_len, max(8, math.exp(math.log(median) + 0.9 * torch.randn((), generator=g).item()))))
        start = torch.randint(0, MODEL.vocab_size, (1,), generator=g)
        stride = torch.randint(1, 4, (1,), generator=g)
        seqs.append(((start + stride * torch.arange(n + 1)) % MODEL.vocab_size).unsqueeze(0))
    return seqs


def split_by_tokens(seqs: list[torch.Tensor], world_size: int) -> list[list[int]]:
    """Longest first onto the least-loaded rank: equal tokens, unequal sequence counts."""
    loads = [0] * world_size
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(seqs)), key=lambda i: -seqs[i].shape[1]):
        r = loads.index(min(loads))
        ranks[r].append(i)
        loads[r] += seqs[i].shape[1] - 1
    return ranks


def _worker(rank: int, world_size: int, cfg: DemoConfig) -> list[dict]:
    torch.manual_seed(cfg.seed)
    model = GPT(MODEL)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    log = []
    with odc_mod.enable(model) as odc:
        for step in range(cfg.steps):
            seqs = make_minibatch(step, cfg)
            mine = split_by_tokens(seqs, world_size)[rank]
            t0 = time.perf_counter()
            loss_sum = torch.zeros(())
            with odc.minibatch(num_tokens=sum(seqs[i].shape[1] - 1 for i in mine)) as mb:
                for i in mine:
                    x = seqs[i]
                    loss = token_loss_sum(model(x[:, :-1]), x[:, 1:]) / mb.global_tokens
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
        f"{cfg.sequences} long-tail sequences per minibatch, {cfg.steps} steps"
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
