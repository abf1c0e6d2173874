"""The interface every data-parallel engine implements, and its configuration.

[Note: data-parallel engines]
A training loop needs five things of the engine that shards its model over the data-parallel
ranks, whatever the engine is:

- the tensors the optimizer steps (:meth:`DataParallelEngine.parameters`);
- a minibatch context that, given this rank's loss tokens, yields the minibatch's global token
  count and the divisor of a microbatch's summed token loss that makes the gradient the mean
  token loss of the whole minibatch, for any placement of sequences on ranks and microbatches
  (ODC sums gradients over ranks: the divisor is the global token count; FSDP2 averages them:
  the global token count over the number of ranks);
- whether every rank must run the same number of microbatches
  (:attr:`DataParallelEngine.equal_microbatches`: engines with a rendezvous per layer);
- a hook timing every communication call, for wait-time accounting and timelines;
- state: sharded for ``torch.distributed.checkpoint`` and full (unsharded) for export.

Engines register under a name (:func:`posttrain.dp.register_engine`); the loop looks them up with
:func:`posttrain.dp.build_engine` and never branches on the name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn as nn

__all__ = ["CommHook", "DataParallelEngine", "EngineConfig", "MinibatchInfo"]

#: ``hook(kind, start, end)``: ``kind`` is "gather" or "reduce", times from ``time.perf_counter``.
CommHook = Callable[[str, float, float], None]


@dataclass(frozen=True)
class MinibatchInfo:
    """What ``with engine.minibatch(num_tokens) as mb`` yields.

    Attributes:
        global_tokens: the sum of ``num_tokens`` over every data-parallel rank.
        loss_divisor: divide each microbatch's summed token loss by this before ``backward``.
    """

    global_tokens: int
    loss_divisor: float


@dataclass(frozen=True)
class EngineConfig:
    """How an engine shards and runs the model. Fields an engine does not use are ignored.

    Attributes:
        precision: ``fp32``, or ``bf16``: parameters gathered and computed in bf16, gradients
            reduced in fp32, fp32 master weights stepped by the optimizer (FSDP2's
            ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``).
        mode: ODC engines: ``odc`` (one-sided, one synchronization per minibatch) or
            ``collective`` (the same transport with a barrier at every gather and reduce: FSDP's
            rendezvous semantics, so benchmarks can separate mechanism from transport).
        deterministic: ODC engines: bitwise identical runs (per-writer accumulator slots summed
            in rank order; one unsharded gradient of memory per rank).
        activation_checkpointing: recompute each transformer block's forward in backward
            (non-reentrant ``torch.utils.checkpoint``), saving only its inputs.
        replicas: HSDP: the data-parallel ranks form a ``(replicas, world_size / replicas)``
            mesh; parameters are sharded within a row (one host) and replicated across rows,
            with one gradient all-reduce across replicas per minibatch under ODC.
    """

    precision: Literal["fp32", "bf16"] = "fp32"
    mode: Literal["odc", "collective"] = "odc"
    deterministic: bool = False
    activation_checkpointing: bool = False
    replicas: int = 1

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"--precision={self.precision!r} is not one of fp32, bf16")
        if self.mode not in ("odc", "collective"):
            raise ValueError(f"odc mode {self.mode!r} is not one of odc, collective")
        if self.replicas < 1:
            raise ValueError(f"--replicas={self.replicas} must be at least 1")


class DataParallelEngine(ABC):
    """A model sharded over the data-parallel ranks. See [Note: data-parallel engines].

    Construction is a collective over the world: every rank builds the engine with the same
    model structure (initial values are taken from the first rank or must agree).
    """

    #: The registry name (``--dp``).
    name: ClassVar[str]
    #: What :meth:`state_dict` looks like: engines with the same format load each other's checkpoints.
    checkpoint_format: ClassVar[str]

    def __init__(self, model: nn.Module, config: EngineConfig) -> None:
        self.model = model
        self.config = config

    @property
    @abstractmethod
    def equal_microbatches(self) -> bool:
        """Whether every rank must run the same number of microbatches in a minibatch."""

    @abstractmethod
    def parameters(self) -> list[torch.Tensor]:
        """What the optimizer steps (this rank's shards)."""

    @abstractmethod
    def minibatch(self, num_tokens: int) -> AbstractContextManager[MinibatchInfo]:
        """Context around one minibatch's microbatches (a collective at entry or exit or both);
        yields its :class:`MinibatchInfo`."""

    @abstractmethod
    def set_comm_hook(self, hook: CommHook | None) -> None:
        """Call ``hook(kind, start, end)`` after every gather and reduce."""

    @abstractmethod
    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``{"model": ..., "optim": ...}`` of sharded tensors for ``torch.distributed.checkpoint``;
        loading it back (:meth:`load_state_dict`) works on any world size."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        """Restore a :meth:`state_dict` (as filled in place by ``dcp.load``)."""

    @abstractmethod
    def iter_full_state(self) -> Iterator[dict[str, torch.Tensor]]:
        """The full parameters under the model's own names, a part at a time (a collective;
        every rank gets every part). Holds at most one part's full parameters at a time."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every full parameter under the model's own names (a collective)."""
        out: dict[str, torch.Tensor] = {}
        for part in self.iter_full_state():
            out.update(part)
        return out

    @property
    def stats(self) -> dict[str, int]:
        """Communication counters, where the engine keeps them."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional
        """Free what the engine allocated. Idempotent."""


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its optimizer state without changing any value: a step with zero
    gradients and a learning rate of 0 (as ``torch.distributed.checkpoint.state_dict`` does), so
    that a state dict to load into has every key."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(p in optimizer.state and optimizer.state[p] for p in params):
        return
    fresh = [p for p in params if not optimizer.state.get(p)]
    lrs = [g["lr"] for g in optimizer.param_groups]
    grads = [p.grad for p in params]
    for g in optimizer.param_groups:
        g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    for p, grad in zip(params, grads):
        p.grad = grad
    for p in fresh:  # the filling step is not a step: the first real one is still the first (Adam's bias correction)
        step = optimizer.state[p].get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            optimizer.state[p]["step"] = 0


__all__.append("ensure_optimizer_state")
