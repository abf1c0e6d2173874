"""Bounds on a training step: what the same sequences cost with no communication at all.

- **Even bound**: the partition run's measured compute divided evenly over the ranks. Whole
  sequences cannot always be divided that evenly, so no scheduler reaches it when a step holds few
  sequences of very different lengths.
- **Partition bound** (:func:`partition_candidates`, :func:`partition_bound_worker`): the best
  assignment of whole sequences to ranks under their measured compute times, each rank running
  its share packed into microbatches back to back, no communication; the step lasts as long as
  its slowest rank. What any scheduling of whole sequences could still win over a run is its
  distance to this bound. A sequence's time measured alone is noisy (docs/results.md) and
  includes per-microbatch overhead that packing amortizes, so an assignment optimal for those
  times need not be the fastest when run: three candidate assignments are run per step (the
  optimum for the measured times, the optimum for a least-squares fit ``a + b*n + c*n^2`` of
  them, and ``diff_micro``'s; exact search for small steps, Karmarkar-Karp and refinement
  otherwise), the fastest is chosen per step, and the chosen ones are run again to be timed (a
  minimum over noisy runs would favour noise).

Every worker runs on ``world_size`` processes at once, so each measures under the same core and
memory contention as training.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from posttrain.balance import FlopsCost, fit_least_squares, pack_share
from posttrain.balance.exact import min_max_partition
from posttrain.device import rank_device, rank_kind, synchronize, use
from posttrain.models import build_model

from .config import TrainConfig
from .loop import microbatch_loss, plan_step
from .minibatches import TrainData

__all__ = ["PARTITION_CANDIDATES", "PlainShares", "partition_bound_worker",
           "partition_candidates", "sequence_times_worker"]


def _model(cfg: TrainConfig, vocab_size: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.model_config(vocab_size)).to(device)
    return model.to(torch.bfloat16) if cfg.engine.precision == "bf16" else model


def _device(cfg: TrainConfig, rank: int) -> torch.device:
    """This rank's device (``cfg.device`` as the launcher resolved it), made current."""
    device = rank_device(rank_kind(cfg.device), rank)
    use(device)
    return device


def sequence_times_worker(rank: int, world_size: int, cfg: TrainConfig) -> dict[tuple[int, int], float]:
    """Seconds of forward+backward of each sequence alone, ``(step, index) -> seconds``, for the
    steps after the first. The ranks split the sequences and measure at the same time; the caller
    merges their dicts."""
    device = _device(cfg, rank)
    data = TrainData(cfg, world_size)
    model = _model(cfg, data.vocab_size, device)
    jobs = [(step, i) for step in range(1, cfg.steps) for i in range(cfg.sequences)]
    seqs = {step: data.minibatch(step) for step in range(1, cfg.steps)}
    seqs0 = data.minibatch(0)
    for i in range(rank, cfg.sequences, world_size):
        microbatch_loss(model, seqs0, [i], 1.0, device=device).backward()  # warm-up: step 0, as training's
    out = {}
    synchronize(device)
    dist.barrier()
    for step, i in jobs[rank::world_size]:
        t0 = time.perf_counter()
        microbatch_loss(model, seqs[step], [i], 1.0, device=device).backward()
        synchronize(device)  # (on a GPU: the kernels, not their launch)
        out[(step, i)] = time.perf_counter() - t0
    model.zero_grad()
    dist.barrier()
    return out


def _fit_times(points: list[tuple[int, float]]) -> list[float]:
    """Coefficients ``(a, b, c)`` of ``seconds = a + b*n + c*n^2`` (non-negative least squares; with
    fewer than 3 distinct lengths the minimum-norm fit: this candidate is only ever one of several)."""
    return fit_least_squares([[1.0, n, n * n] for n, _ in points], [t for _, t in points], underdetermined=True)


#: The candidate assignments :func:`partition_candidates` makes, in order.
PARTITION_CANDIDATES = ("measured", "fitted", "diff_micro")


def partition_candidates(cfg: TrainConfig, world_size: int, times: dict[tuple[int, int], float]
                         ) -> tuple[dict[str, list[list[list[int]]]], bool]:
    """Per candidate (:data:`PARTITION_CANDIDATES`) and step after the first, sequence ids per rank;
    and whether every optimum searched was proven. ``times`` is a merged :func:`sequence_times_worker`
    result."""
    data = TrainData(cfg, world_size)
    cost = FlopsCost.from_config(cfg.model_config(data.vocab_size))
    steps = range(1, cfg.steps)
    lengths = {step: [len(s) - 1 for s in data.minibatch(step)] for step in steps}
    a, b, c = _fit_times([(lengths[k][i], t) for (k, i), t in times.items()])
    out: dict[str, list[list[list[int]]]] = {name: [] for name in PARTITION_CANDIDATES}
    exact = True
    for step in steps:
        for name, weights in (("measured", [times[(step, i)] for i in range(cfg.sequences)]),
                              ("fitted", [a + b * n + c * n * n for n in lengths[step]])):
            parts, proven = min_max_partition(weights, world_size)
            out[name].append(parts)
            exact &= proven
        plan = plan_step(cfg, data.minibatch(step), world_size, cost, method="diff_micro")
        out["diff_micro"].append([[i for mb in mbs for i in mb.sequence_ids] for mbs in plan.ranks])
    return out, exact


class PlainShares:
    """Shares of whole sequences run on the plain model (no engine, no communication), each rank
    timing its own share of a step: what the bounds time (:func:`partition_bound_worker`, and
    ``posttrain bench odc``'s bounds taking turns with the variants in their job,
    :mod:`posttrain.lab.bench.stepwise`). Every rank calls :meth:`run` at the same point: each
    share starts at a barrier.

    Args:
        cfg: the run (its model, data, device and ``max_tokens``).
        rank, world_size: this rank of the job.
        shares: name -> per step after the first (index ``step - 1``), sequence ids per rank.
    """

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, shares: dict[str, list[list[list[int]]]]) -> None:
        self.cfg, self.rank, self.world_size, self.shares = cfg, rank, world_size, shares
        self.device = _device(cfg, rank)
        self.data = TrainData(cfg, world_size)
        self.model = _model(cfg, self.data.vocab_size, self.device)

    def warm_up(self) -> None:
        """Step 0's share (``diff_micro``'s), untimed, as training's first step."""
        cost = FlopsCost.from_config(self.cfg.model_config(self.data.vocab_size))
        seqs0 = self.data.minibatch(0)
        for mb in plan_step(self.cfg, seqs0, self.world_size, cost, method="diff_micro").microbatches_for(self.rank):
            if mb.sequence_ids:
                microbatch_loss(self.model, seqs0, mb.sequence_ids, 1.0, device=self.device).backward()
        self.model.zero_grad()
        synchronize(self.device)

    def run(self, step: int) -> dict[str, float]:
        """This rank's seconds to run its share of data step ``step`` (at least 1) under every
        name, packed into microbatches, back to back."""
        seqs = self.data.minibatch(step)
        lengths = [len(s) - 1 for s in seqs]
        out = {}
        for name, shares in self.shares.items():
            mine = pack_share(lengths, shares[step - 1][self.rank], self.cfg.max_tokens)
            dist.barrier()
            t0 = time.perf_counter()
            for ids in mine:
                microbatch_loss(self.model, seqs, ids, 1.0, device=self.device).backward()
            synchronize(self.device)
            out[name] = time.perf_counter() - t0
        self.model.zero_grad()
        return out


def partition_bound_worker(rank: int, world_size: int, cfg: TrainConfig,
                           candidates: dict[str, list[list[list[int]]]]) -> dict[str, list[float]]:
    """Per candidate and step after the first, this rank's seconds to run its share packed into
    microbatches, back to back, with no communication (a candidate's step lasts as long as its
    slowest rank). Step 0's share (``diff_micro``'s) runs first, untimed, as training's does."""
    plain = PlainShares(cfg, rank, world_size, candidates)
    plain.warm_up()
    out: dict[str, list[float]] = {name: [] for name in candidates}
    for step in range(1, cfg.steps):
        for name, t in plain.run(step).items():
            out[name].append(t)
    return out
