"""The interface every data-parallel engine implements, and its configuration.

[Note: data-parallel engines]
A training loop needs these things of the engine that shards its model over the data-parallel
ranks, whatever the engine is:

- the tensors the optimizer steps (:meth:`DataParallelEngine.parameters`);
- a minibatch context that, given this rank's loss tokens, yields the minibatch's global token
  count and the divisor of a microbatch's summed token loss that makes the gradient the mean
  token loss of the whole minibatch, for any placement of sequences on ranks and microbatches
  (ODC sums gradients over ranks: the divisor is the global token count; FSDP2 averages them:
  the global token count over the number of ranks);
- whether every rank must run the same number of microbatches
  (:attr:`DataParallelEngine.equal_microbatches`: engines with a rendezvous per layer), and the
  padding that makes them (:meth:`DataParallelEngine.pad`, :meth:`DataParallelEngine.run_dummy`):
  a trainer pads every minibatch the same way whatever the engine;
- a hook timing every communication call, for wait-time accounting and timelines;
- state: sharded for ``torch.distributed.checkpoint`` and full (unsharded) for export;
- for pipeline stages: what it does around a split backward (``I`` and ``W`` apart; the
  :class:`~posttrain.pipeline.ShardedWeights` hooks, :attr:`DataParallelEngine.split_backward`),
  which saved tensors are its gathered weights rather than activations
  (:meth:`DataParallelEngine.holds`), and its shards of one unit (:meth:`DataParallelEngine.unit_parameters`).

An engine shards ``model`` over a mesh (default: every rank, or ``(replicas, world / replicas)``
for HSDP) in *units*, each gathered and reduced as one (default: every transformer block, then
the model for what is left). A pipeline passes the column of ranks holding the same stages as
the mesh and its stages' pieces as the units.

Engines register under a name (:func:`posttrain.dp.register_engine`); the loop looks them up with
:func:`posttrain.dp.build_engine` and never branches on the name.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from posttrain.models import checkpoint_blocks, find_blocks

from .registry import engine_class, engine_names

__all__ = ["CommHook", "DataParallelEngine", "EngineConfig", "MinibatchInfo", "Shards", "check_shard_hosts", "data_parallel_mesh",
           "decay_flags", "mixed_precision", "resolve_replicas"]


@dataclass
class Shards:
    """What one rank steps, as the step's recipe sees it (``posttrain.train.core.recipe``).

    Attributes:
        params: the tensors the optimizer steps on this rank (plain tensors or DTensors).
        masks: per tensor, whether weight decay applies: ``1.0`` / ``0.0``, or a boolean tensor
            of the tensor's local shape where it holds several parameters (flat ODC's shards).
        replicas: ranks holding the same shards with the same gradients (HSDP replicas).
    """

    params: Sequence[torch.Tensor]
    masks: Sequence[float | torch.Tensor]
    replicas: int = 1


def decay_flags(params: Sequence[torch.Tensor]) -> list[float]:
    """``1.0`` for each parameter of two or more dimensions (matrices, embeddings: weight decay
    applies), ``0.0`` for the others (biases, normalization weights); a DTensor's global shape
    decides."""
    return [1.0 if p.dim() >= 2 else 0.0 for p in params]

T = TypeVar("T")

#: One token: the input of a dummy microbatch.
_DUMMY_INPUT = torch.zeros(1, 1, dtype=torch.long)

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


def _engine_choices() -> tuple[str, ...]:
    return engine_names()


@dataclass(frozen=True)
class EngineConfig:
    """Which engine shards the model and how. Fields an engine does not use are ignored.

    Attributes:
        name: the data-parallel engine: ``odc`` (flat ODC), ``fsdp`` (FSDP2), ``odc-fsdp2``
            (ODC on FSDP2).
        mode: ODC engines: ``one-sided`` (one synchronization per minibatch) or
            ``collective`` (the same transport with a barrier at every gather and reduce: FSDP's
            rendezvous semantics, so benchmarks can separate mechanism from transport).
        precision: ``fp32``, or ``bf16``: parameters gathered and computed in bf16, gradients
            reduced in fp32, fp32 master weights stepped by the optimizer (FSDP2's
            ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``).
        deterministic: ODC engines: bitwise identical runs (per-writer accumulator slots summed
            in rank order; one unsharded gradient of memory per rank).
        activation_checkpointing: recompute each transformer block's forward in backward
            (non-reentrant ``torch.utils.checkpoint``), saving only its inputs.
        replicas: HSDP: the data-parallel ranks form a mesh of ``replicas`` rows (the ranks over
            ``replicas`` in each); parameters are sharded within a row (one host) and replicated across rows,
            with one gradient all-reduce across replicas per minibatch under ODC. ``auto``: one row
            per node of a ``torchrun`` job over several nodes (shard within each node, replicate
            across them), else 1.
        context_parallel: ODC engines in one-sided mode: split the costliest sequences of a
            minibatch into zigzag shards over groups of ranks, each group running its shards first
            (see docs/odc.md, "Context parallelism"). ``off``; ``auto``: 2 to the world size of
            shards per sequence, only where the plan predicts a faster step; ``K``: ``K`` shards.
    """

    name: str = field(default="odc", metadata={"choices": _engine_choices})
    mode: Literal["one-sided", "collective"] = "one-sided"
    precision: Literal["fp32", "bf16"] = "fp32"
    deterministic: bool = False
    activation_checkpointing: bool = False
    replicas: int | Literal["auto"] = "auto"
    context_parallel: int | Literal["off", "auto"] = "off"

    def __post_init__(self) -> None:
        cls = engine_class(self.name)
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision={self.precision!r} is not one of fp32, bf16")
        if self.mode not in ("one-sided", "collective"):
            raise ValueError(f"mode={self.mode!r} is not one of one-sided, collective")
        if self.replicas != "auto" and (not isinstance(self.replicas, int) or self.replicas < 1):
            raise ValueError(f"replicas={self.replicas!r} must be at least 1 (or auto)")
        if not cls.one_sided and self.mode == "collective":
            raise ValueError(f"`mode` collective is for the ODC engines (`name` odc or odc-fsdp2); {self.name} "
                             "always synchronizes per layer")
        if not cls.one_sided and self.deterministic:
            raise ValueError("`deterministic` is for the ODC engines (`name` odc or odc-fsdp2)")
        cp = self.context_parallel
        if cp not in ("off", "auto") and not (isinstance(cp, int) and not isinstance(cp, bool) and cp >= 2):
            raise ValueError(f"context_parallel={cp!r}: use off, auto or a shard count of 2 or more")
        if cp != "off" and (not cls.one_sided or self.mode != "one-sided"):
            raise ValueError(f"`context_parallel` is for the ODC engines in one-sided mode (`name` odc or odc-fsdp2, "
                             f"`mode` one-sided), not {self.label}")

    @property
    def label(self) -> str:
        """The engine and its mode in one word (``odc``, ``odc-collective``, ``fsdp``, ...), as
        benchmarks and progress lines name a run."""
        return f"{self.name}-collective" if self.mode == "collective" else self.name


class DataParallelEngine(ABC):
    """A model sharded over the data-parallel ranks. See [Note: data-parallel engines].

    Construction is a collective over the world: every rank builds the engine with the same
    model structure (initial values are taken from the first rank or must agree).
    """

    #: The registry name.
    name: ClassVar[str]
    #: What :meth:`state_dict` looks like: engines with the same format load each other's checkpoints.
    checkpoint_format: ClassVar[str]
    #: Whether a pipeline stage sharded by this engine may run a split backward (``I`` and ``W``
    #: apart): the weight pass assigns ``.grad`` outside autograd's accumulation, so an engine
    #: that reduces gradients from autograd hooks (FSDP2) would miss them.
    split_backward: ClassVar[bool] = False
    #: Whether the engine's communication is ODC's (one-sided): ``mode`` and ``deterministic`` apply.
    one_sided: ClassVar[bool] = False
    #: Whether :meth:`whole_state_dict` is implemented (checkpoints under the model's parameter
    #: names, loadable into another split of the model: the pipeline trainer's format).
    whole_state: ClassVar[bool] = False
    #: The device kinds the engine shards a model on (its parameters' device).
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    #: Whether ranks of this engine may share a GPU (then their process group is gloo alone): its
    #: data moves through ODC's device transport, and its collectives of device tensors are
    #: all-reduces and broadcasts, which gloo carries on CUDA. FSDP2's all-gathers and
    #: reduce-scatters need NCCL, one rank per GPU.
    device_sharing: ClassVar[bool] = False

    def __init__(self, model: nn.Module, config: EngineConfig, *, mesh: DeviceMesh | None = None,
                 units: Sequence[nn.Module] | None = None) -> None:
        """Args:
            model: what to shard (its forward is what the trainer calls).
            config: precision, mode and the rest.
            mesh: the data-parallel ranks (default: :func:`data_parallel_mesh` of ``config``).
            units: the modules each sharded as one (default: every transformer block of
                ``model``, then ``model`` itself for what is left).
        """
        self.model = model
        self.config = config
        #: where the model's parameters (and so its inputs) live
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if self.device.type not in self.devices:
            raise ValueError(f"the {self.name} engine shards models on {' and '.join(self.devices)} only so far; "
                             f"this one is on {self.device.type}")
        self.mesh = mesh if mesh is not None else data_parallel_mesh(config, self.device.type)
        if units is None:
            blocks = find_blocks(model)
            if config.activation_checkpointing:
                checkpoint_blocks(blocks)
            units = [*blocks, model]
        elif config.activation_checkpointing:
            raise ValueError("activation_checkpointing needs the default units (the model's transformer blocks)")
        self.units = list(units)
        # every rank of the mesh: the group a minibatch's token count is summed over
        self.group = self.mesh.get_group() if self.mesh.ndim == 1 else None

    @classmethod
    @abstractmethod
    def needs_equal_microbatches(cls, config: EngineConfig) -> bool:
        """Whether an engine of this class built with ``config`` needs every rank to run the same
        number of microbatches in a minibatch (a rendezvous per layer); known before any process
        starts, so a trainer can refuse a balancing method that cannot give equal counts."""

    @property
    def equal_microbatches(self) -> bool:
        """Whether every rank must run the same number of microbatches in a minibatch."""
        return self.needs_equal_microbatches(self.config)

    @abstractmethod
    def parameters(self) -> list[torch.Tensor]:
        """What the optimizer steps (this rank's shards)."""

    def shards(self) -> Shards:
        """:meth:`parameters` with their weight-decay masks and the replicas holding them."""
        params = self.parameters()
        return Shards(params, decay_flags(params), self.mesh.size(0) if self.mesh.ndim == 2 else 1)

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
    def iter_full_state(self, device: torch.device | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """The full parameters under the model's own names, a part at a time (a collective;
        every rank gets every part), as fresh tensors on ``device`` (default: the CPU, whatever the
        model's device: what exports and comparisons take; RL's rollout weight load asks for its
        own device). Holds at most one part's full parameters at a time."""

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

    # ------------------------------------------------------------ padding
    def pad(self, mine: Sequence[T], busiest: int) -> list[T | None]:
        """What this rank runs in a minibatch: its own microbatches ``mine`` and, on an engine
        whose ranks must run equal counts, ``None`` up to ``busiest`` (the most any rank runs;
        every rank computes the same plan, so each knows it). Run :meth:`run_dummy` for a
        ``None``: it takes part in every rendezvous a real microbatch does and changes nothing."""
        extra = max(0, busiest - len(mine)) if self.equal_microbatches else 0
        return [*mine, *([None] * extra)]

    def run_dummy(self, *, backward: bool = True) -> None:
        """A microbatch of one token whose loss weighs 0: the forward (and ``backward``) of
        :attr:`model` gathers and reduces like a real one and adds nothing to any gradient."""
        out = self.model(_DUMMY_INPUT.to(self.device))
        if backward:
            (out.sum() * 0.0).backward()

    # ------------------------------------------------------------ pipeline stages
    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in parameter memory this engine gathered (a weight a forward
        saved, which an activation offload must leave alone), not in an activation."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(p.untyped_storage().data_ptr() == ptr for p in self.model.parameters())

    def unit_parameters(self, unit: nn.Module) -> list[torch.Tensor]:
        """The tensors the optimizer steps that hold ``unit``'s parameters (``unit`` is one of
        :attr:`units`; not those of the units inside it): their gradients are final after a
        minibatch."""
        inner = {id(p) for u in self.units if u is not unit and any(m is u for m in unit.modules())
                 for p in u.parameters()}
        return [p for p in unit.parameters() if id(p) not in inner]

    def weights_of(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Around a split backward: the stage's weights, given its forward graph's leaves (see
        :class:`~posttrain.pipeline.ShardedWeights`; only engines with :attr:`split_backward`
        are asked)."""
        return leaves

    def after_input(self, weights: list[torch.Tensor]) -> None:  # noqa: B027 - optional
        """``I`` is done: gathered weights may be freed until :meth:`before_weight`."""

    def before_weight(self, weights: list[torch.Tensor]) -> None:  # noqa: B027 - optional
        """``W`` comes next: gather what :meth:`after_input` freed."""

    def after_weight(self, weights: list[torch.Tensor]) -> None:  # noqa: B027 - optional
        """``W`` is done: reduce the weight gradients it assigned."""

    def whole_state_dict(self, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Any]:
        """``{"model": {name: whole parameter}, "optim": {"state": {name: {...}}, "groups": [...]}}``
        under the model's names (``names``: ``id(parameter) -> name``, taken before sharding; a
        collective over the mesh): a checkpoint that loads into any split of the same model."""
        raise NotImplementedError(f"the {self.name} engine does not write whole-parameter checkpoints yet")

    def load_whole_state_dict(self, state: dict[str, Any], optimizer: torch.optim.Optimizer,
                              names: dict[int, str]) -> None:
        """Restore a :meth:`whole_state_dict` (as filled in place by ``dcp.load``)."""
        raise NotImplementedError(f"the {self.name} engine does not load whole-parameter checkpoints yet")

    def peer_failure(self) -> str | None:
        """Where a peer of this rank's shard group failed (its own message), if the engine can tell
        (ODC's transports can): a trainer whose collective outside the engine broke (a split
        sequence's exchange) reports the peer's failure instead of the broken connection."""
        return None

    def after_forward_only(self) -> None:  # noqa: B027 - optional
        """After forwards that no backward follows (a reference model's log-probs): free what the
        engine keeps gathered for a backward. Nothing for engines that keep nothing."""

    def close(self, *, restore: bool = False) -> None:  # noqa: B027 - optional
        """Free what the engine allocated. ``restore``: first put the full parameters back on the
        model as plain tensors (a collective over the mesh). Idempotent."""


def mixed_precision(config: EngineConfig) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``config.precision``."""
    if config.precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def resolve_replicas(replicas: int | str, world: int) -> int:
    """The HSDP replicas of ``world`` data-parallel ranks for ``EngineConfig.replicas``: a number
    as it is; ``auto``: the nodes of a ``torchrun`` job whose ranks are all data-parallel and
    spread evenly over several nodes (``WORLD_SIZE`` over ``LOCAL_WORLD_SIZE``; the shard groups
    then stay inside a node, as ODC's transports need), else 1.

    Raises:
        ValueError: a number that does not divide ``world``.
    """
    if replicas == "auto":
        local, total = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
        if local and total and local.isdigit() and total.isdigit() and int(total) == world:
            nodes, rest = divmod(world, int(local))
            return nodes if nodes > 1 and not rest else 1
        return 1
    if world % int(replicas):
        raise ValueError(f"replicas={replicas} does not divide the {world} data-parallel ranks")
    return int(replicas)


def check_shard_hosts(config: EngineConfig, world: int) -> None:
    """Refuse, before any work, an ODC engine whose shard groups would span the nodes of a
    ``torchrun`` job (ODC's transports share one host's memory), and ODC on FSDP2 with shard
    groups of one rank and several replicas (FSDP2 hands such gradients over only after its own
    all-reduce). The engines would refuse both anyway, later, once every rank had built its model.

    Raises:
        ValueError: in one line, with the ``replicas`` that shards within each node.
    """
    if config.name == "odc-fsdp2":
        replicas = resolve_replicas(config.replicas, world)
        if replicas > 1 and world // replicas == 1:
            raise ValueError(f"`engine.name` odc-fsdp2 with {replicas} replicas of one rank each: FSDP2 keeps a one-rank "
                             "shard group's gradients to itself until its own all-reduce, so ODC cannot take them; "
                             "shard over 2 or more ranks a replica, or use `engine.name` odc or fsdp")
    local, total = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if not engine_class(config.name).one_sided or not (local and total and local.isdigit() and total.isdigit()):
        return
    local_n = int(local)
    if int(total) != world or local_n >= world:
        return
    shard = world // resolve_replicas(config.replicas, world)
    if shard > local_n or local_n % shard:
        raise ValueError(f"`engine.name` {config.name} shards over groups of {shard} ranks, which would span nodes "
                         f"({world} ranks, {local_n} on each node); ODC shares one host's memory, so shard within "
                         f"each node: `engine.replicas` {world // local_n} (or auto)")


def data_parallel_mesh(config: EngineConfig, device_type: str = "cpu") -> DeviceMesh:
    """The world as a ``(shard,)`` mesh, or ``(replicate, shard)`` where it has several
    replicas (:func:`resolve_replicas`), on ``device_type`` (the parameters')."""
    world = dist.get_world_size()
    replicas = resolve_replicas(config.replicas, world)
    if replicas == 1:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))


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


def build_engine(model: nn.Module, config: EngineConfig | None = None, *, mesh: DeviceMesh | None = None,
                 units: Sequence[nn.Module] | None = None) -> DataParallelEngine:
    """Shard ``model`` with the engine ``config.name`` names (a collective over the mesh; see
    :class:`DataParallelEngine` for ``mesh`` and ``units``)."""
    config = config or EngineConfig()
    return engine_class(config.name)(model, config, mesh=mesh, units=units)


__all__.append("build_engine")
