"""What a trainer needs to split sequences across ranks (context parallelism): the price of the
exchange the plan weighs (:func:`exchange_cost`) and the groups of ranks that hold a split
sequence's shards, with their exchanges (:class:`SplitGroups`). The SFT trainer and the RL
update both plan with :func:`posttrain.balance.plan_context` and run shards through these."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from posttrain.balance import ExchangeCost, FlopsCost, Shard
from posttrain.dp import DataParallelEngine
from posttrain.odc import PeerFailedError, row_exchange

from .config import RunConfig

__all__ = ["FLOPS_PER_EXCHANGED_BYTE", "FLOPS_PER_EXCHANGE_CALL", "MIN_SPLIT_GAIN", "SplitGroups", "check_shard_count",
           "exchange_cost", "group_failure"]

#: FLOPs a rank computes in the time it moves one byte of a split sequence's keys and values, and
#: in the time one of a layer's two exchanges costs whatever its size, by the exchange: ``cpu``
#: (every rank on one host: :class:`posttrain.odc.ShmRowExchange`), ``cpu-gloo`` (CPU ranks on
#: several hosts: gloo's collectives), ``cuda``. The CPU's are measured on 2 processes of this
#: project's 2-core machine by ``python -m posttrain.lab.bench.cp_exchange``, the whole sequence
#: timed on both ranks at once as in training (three runs through shared memory: 36-145 FLOPs a
#: byte and 12-28M a call; over gloo 100-241 a byte and 85-121M a call). Before 2026-11-28 it
#: timed the whole sequence on one rank alone, which runs 5-10% faster with the machine's memory
#: to itself, and fitted 375-483 a byte through shared memory: three times the price, which kept
#: the plan from splitting sequences of 1,000-1,500 tokens that pay. CUDA: estimates, not yet
#: measured on a GPU (about 1 PFLOP/s bf16 over NVLink's ~1 TB/s, and ~20 microseconds a
#: collective).
FLOPS_PER_EXCHANGED_BYTE = {"cpu": 130.0, "cpu-gloo": 200.0, "cuda": 1000.0}
FLOPS_PER_EXCHANGE_CALL = {"cpu": 2e7, "cpu-gloo": 1e8, "cuda": 2e10}
#: The least fraction of a step's predicted time a split must save (``plan_context``'s ``min_gain``):
#: about the error of the predictions it compares (the exchange's price above, at the top of what
#: three runs fitted). On this machine's long_tail benchmark (2 sequences a step) 5% and 10% gave
#: about the same odc+cp / odc+diff_micro (5%: 1.15x and 1.16x; 10%: 1.14x and 1.15x; two runs
#: each); 10% had been chosen when the price was three times too high (above).
MIN_SPLIT_GAIN = 0.05


def check_shard_count(cfg: RunConfig, world_size: int, what: str) -> None:
    """Refuse a fixed shard count (``--context-parallel K``) above the run's ranks, in one line
    naming ``what`` is split (a sequence, a rollout)."""
    cp = cfg.engine.context_parallel
    if cp not in ("off", "auto") and int(cp) > world_size:
        raise ValueError(f"context_parallel={cp} shards a {what} over {cp} ranks, but the run has {world_size}")


def exchange_cost(cfg: RunConfig, cost: FlopsCost, one_host: bool = True) -> ExchangeCost:
    """What moving a split sequence's keys and values costs in ``cost``'s units (FLOPs) on the
    run's device (:data:`FLOPS_PER_EXCHANGED_BYTE`, :data:`FLOPS_PER_EXCHANGE_CALL`) at its
    precision; on the CPU through shared memory where every rank is on ``one_host``, else gloo."""
    kind = "cuda" if cfg.device_kind != "cpu" else "cpu" if one_host else "cpu-gloo"
    return ExchangeCost.for_shape(cost.shape, flops_per_byte=FLOPS_PER_EXCHANGED_BYTE[kind],
                                  dtype_bytes=2 if cfg.engine.precision == "bf16" else 4,
                                  flops_per_call=FLOPS_PER_EXCHANGE_CALL[kind])


class SplitGroups:
    """The exchanges of split sequences' rank groups, made the first time a plan uses a group and
    kept: ``groups[ranks]`` is the group's process group, or on the CPU, where its members share
    a host, its shared-memory exchange ([Note: the split sequence's exchange in shared memory]).

    Args:
        rank: this rank.
        device: this rank's device (shared memory on the CPU only).
        watch: a failure elsewhere that ends an exchange's wait (the engine's ``peer_failure``).
    """

    def __init__(self, rank: int, device: torch.device, watch: Callable[[], str | None] | None = None) -> None:
        self.rank, self.device, self.watch = rank, device, watch
        self._groups: dict[tuple[int, ...], object] = {}

    def make(self, groups: Iterable[tuple[int, ...]]) -> None:
        """Make the groups not made yet: their process groups (a collective: every rank computes
        the same plan, so every rank makes the same new groups in the same order), then, among
        each group's members, the exchange (:func:`posttrain.odc.row_exchange`)."""
        new = [g for g in groups if g not in self._groups]
        for g in new:
            self._groups[g] = dist.new_group(list(g))
        for g in new:
            if self.rank in g and self.device.type == "cpu":
                self._groups[g] = row_exchange(self._groups[g], watch=self.watch)

    def __getitem__(self, ranks: tuple[int, ...]):
        return self._groups[ranks]

    def close(self) -> None:
        for ex in self._groups.values():
            if hasattr(ex, "close"):
                ex.close()


def group_failure(engine: DataParallelEngine, shard: Shard, exc: RuntimeError, wait_s: float = 2.0) -> RuntimeError:
    """What a broken exchange of a split sequence means: where a peer failed (the engine can tell
    within ``wait_s``: its message, as ODC's own waits report it), a :class:`~posttrain.odc.PeerFailedError`
    naming the sequence and its group; else ``exc`` itself."""
    deadline = time.monotonic() + wait_s
    while (msg := engine.peer_failure()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if msg is None:
        return exc
    return PeerFailedError(f"{msg} (while rank {dist.get_rank()} exchanged split sequence {shard.sequence_id} "
                           f"with ranks {list(shard.group)})")
