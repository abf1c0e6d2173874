"""User-facing policy of ODC. Imports nothing else of the package."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ODCConfig"]


@dataclass(frozen=True)
class ODCConfig:
    """How ODC runs. All fields have defaults suited to training.

    Attributes:
        mode: ``"one-sided"``: one-sided gather and scatter-accumulate, ranks synchronize only when
            entering and leaving a minibatch, and may run different numbers of microbatches.
            ``"collective"``: the same shared-memory transport with a barrier at every gather
            and every reduce (FSDP's rendezvous semantics); ranks must run equal microbatch
            counts. It exists so benchmarks can separate the effect of removing barriers from
            the speed of the transport.
        deterministic: ``False``: every writer adds straight into the owner's accumulator
            under stripe locks; the summation order is arrival order, so results can differ in
            the last bits from run to run. ``True``: every writer adds into its own slot on the
            owner and the owner sums the slots in rank order at the sync: bitwise identical runs,
            at a cost of ``shard_size`` accumulators per rank, i.e. one full unsharded gradient
            (in the reduce dtype) per rank instead of one shard of it.
        grad_divide_factor: gradients are the plain sum over every microbatch of every rank,
            divided by this. Keep 1.0 and scale each microbatch's loss by a minibatch-global
            normalizer (``Minibatch.global_tokens``); use the data-parallel size to reproduce
            FSDP's averaging of per-rank gradients.
        device_accumulate: on a GPU (non-deterministic mode), how concurrent pushes into one
            accumulator stay race-free: ``"atomic"`` (device atomic adds, no wait) or ``"locked"``
            (the host's stripe locks, held until each add has finished). No effect on the CPU.
        timeout_s: how long a rank waits at the minibatch barriers for a slow peer before
            failing. A peer that aborts or dies is noticed within about 0.2 s regardless.
        prefetch: flat ODC: gather the next unit while this one computes (the unit the last
            forward ran next), and in backward the unit before, on a side stream.
            ``None``: on for models on an accelerator in one-sided mode. ``True``: also on the
            CPU, where the early gather runs at once (no overlap: what the CPU tests check the
            bookkeeping with). No effect in collective mode (its barrier per gather) or on ODC
            on FSDP2 (FSDP2 prefetches on its own all-gather stream).
    """

    mode: Literal["one-sided", "collective"] = "one-sided"
    deterministic: bool = False
    grad_divide_factor: float = 1.0
    device_accumulate: Literal["atomic", "locked"] = "atomic"
    timeout_s: float = 1800.0
    prefetch: bool | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("one-sided", "collective"):
            raise ValueError(f"mode={self.mode!r} is not one of 'one-sided', 'collective'")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic={self.deterministic!r} must be True or False")
        if not self.grad_divide_factor > 0:
            raise ValueError(f"grad_divide_factor={self.grad_divide_factor} must be positive")
        if self.device_accumulate not in ("atomic", "locked"):
            raise ValueError(f"device_accumulate={self.device_accumulate!r} is not one of 'atomic', 'locked'")
        if self.prefetch not in (None, True, False):
            raise ValueError(f"prefetch={self.prefetch!r} must be True, False or None (auto)")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be positive")
