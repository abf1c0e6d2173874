"""What every trainer's configuration has: the engine, the optimizer, the run's length, its
checkpoints and its outputs (:class:`RunConfig`, which each trainer's configuration extends)."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from posttrain.dp import EngineConfig

__all__ = ["OptimConfig", "RunConfig", "config_from_dict", "config_value"]


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer.

    Attributes:
        name: ``adamw`` or ``sgd`` (plain SGD shows gradient-scale errors that Adam hides).
        lr: learning rate.
    """

    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-3

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "sgd"):
            raise ValueError(f"name={self.name!r} is not one of adamw, sgd")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be positive")

    def build(self, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        """The optimizer over ``params``."""
        # The default on CPU is a per-parameter loop whose every op pays DTensor dispatch: AdamW's
        # step is many times slower that way than fused (docs/results.md: posttrain bench overhead).
        # DTensor has no sharding rule for fused SGD: SGD takes foreach.
        if self.name == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, fused=True)
        return torch.optim.SGD(params, lr=self.lr, foreach=True)


@dataclass(frozen=True)
class RunConfig:
    """What every training run has.

    Attributes:
        engine: the data-parallel engine and how it shards the model.
        optim: the optimizer.
        steps: training steps (total, including those a resumed checkpoint holds).
        seed: data, initialization and sampling seed.
        checkpoint_dir: save checkpoints here and resume from the newest one found there.
        checkpoint_every: save every this many steps (0: only after the last step).
        metrics: append every step's metrics here as the run goes (``.csv``, else JSON lines; a
            resumed run continues the file).
        tensorboard: also write the step's main figures as TensorBoard events into this directory.
        output_dir: write a ``transformers`` model directory (weights, config, tokenizer) here
            after the last step (and every ``save_every`` steps).
        save_every: also write ``output_dir`` every this many steps (0: only at the end).
        progress: on rank 0, a progress bar (on a terminal) and a line every tenth of the run.
        device: ``auto`` (CUDA where torch can use it and the trainer and engine run on it, else
            the CPU), ``cpu`` or ``cuda`` (one rank per GPU).
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    steps: int = 10
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    metrics: str | None = None
    tensorboard: str | None = None
    output_dir: str | None = None
    save_every: int = 0
    progress: bool = field(default=False, metadata={"cli": False})
    device: Literal["auto", "cpu", "cuda"] = "auto"

    #: Fields that decide which data each step sees; a resumed run must agree on them.
    DATA_FIELDS: ClassVar[tuple[str, ...]] = ("seed",)
    #: The format of the trainer's own checkpoints, where they are not its engine's (``None``).
    CHECKPOINT_FORMAT: ClassVar[str | None] = None
    #: The device kinds the trainer places its model and data on, and how errors name it.
    DEVICE_KINDS: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    TRAINER: ClassVar[str] = "this trainer"

    def state_fields(self) -> tuple[str, ...]:
        """Fields that decide the shapes a checkpoint holds (a resumed run must agree on them), by
        their dotted paths."""
        return ("optim.name",)

    @property
    def sequences_per_step(self) -> int:
        """Records a step consumes (a checkpoint's data position counts them)."""
        raise NotImplementedError

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be at least 1")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every={self.checkpoint_every} must be non-negative")
        if self.save_every < 0:
            raise ValueError(f"save_every={self.save_every} must be non-negative")
        if self.save_every and not self.output_dir:
            raise ValueError("`save_every` needs `output_dir`")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device={self.device!r} is not one of auto, cpu, cuda")

    @property
    def device_kind(self) -> str:
        """``"cpu"`` or ``"cuda"``: :func:`posttrain.device.resolve` of ``device`` over the kinds
        both the trainer and its engine run on (a clear error for one they do not)."""
        from posttrain.device import resolve
        from posttrain.dp import engine_class

        engine_kinds = engine_class(self.engine.name).devices
        kinds = tuple(k for k in self.DEVICE_KINDS if k in engine_kinds)
        return resolve(self.device, kinds, what=f"{self.TRAINER} with the {self.engine.name} engine")

    def due(self, step: int, every: int) -> bool:
        """Whether step ``step`` (0-based) ends on a multiple of ``every`` or is the last."""
        return step + 1 == self.steps or bool(every and (step + 1) % every == 0)


def config_value(config: Any, path: str) -> Any:
    """``config``'s value at a dotted ``path`` (``"optim.name"``); ``config`` is a configuration
    or its :func:`dataclasses.asdict` (``None`` where a dict lacks the key)."""
    value = config
    for part in path.split("."):
        if value is None:
            return None
        value = value.get(part) if isinstance(value, Mapping) else getattr(value, part, None)
    return value


def config_from_dict(cls: type, values: Mapping[str, Any]) -> Any:
    """A configuration of dataclass ``cls`` from its :func:`dataclasses.asdict` (nested sections
    rebuilt); keys ``cls`` has no field for are left out."""
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        value = values[f.name]
        if dataclasses.is_dataclass(hints[f.name]) and isinstance(value, Mapping):
            value = config_from_dict(hints[f.name], value)
        kw[f.name] = value
    return cls(**kw)
