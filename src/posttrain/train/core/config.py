"""What every trainer's configuration has: the engine, the optimizer, the run's length, its
checkpoints and its outputs (:class:`RunConfig`, which each trainer's configuration extends)."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from posttrain.dp import EngineConfig

__all__ = ["LR_SCHEDULES", "LoraFields", "OptimConfig", "RunConfig", "config_from_dict", "config_value"]


#: Learning-rate schedules (:meth:`OptimConfig.lr_at`).
LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer and the step's recipe: learning-rate schedule, gradient clipping, weight decay.

    Attributes:
        name: ``adamw`` or ``sgd`` (plain SGD shows gradient-scale errors that Adam hides).
        lr: learning rate (the peak, under a schedule).
        lr_schedule: ``constant``, ``linear`` or ``cosine`` decay after the warm-up, down to
            ``min_lr_ratio`` x ``lr`` at the last step.
        warmup_steps: steps whose learning rate rises linearly to ``lr`` (step ``s`` of ``w``
            takes ``(s + 1) / w`` of it).
        warmup_ratio: the warm-up as a fraction of the run's steps (instead of ``warmup_steps``).
        min_lr_ratio: where the decay ends, as a fraction of ``lr``.
        max_grad_norm: clip the gradient to this global L2 norm, over every rank's shards, stage
            and replica (0: no clipping; the norm is measured and logged either way).
        weight_decay: AdamW's decoupled weight decay, applied to parameters of two or more
            dimensions (matrices and embeddings), not to one-dimensional ones (biases and
            normalization weights).
        adam_betas: AdamW's ``(beta1, beta2)``.
        adam_eps: AdamW's epsilon.
        on_nonfinite: what a step whose loss or gradient norm is not finite (NaN, infinite)
            does: ``stop`` the run before the update (the weights, checkpoints and the exported
            model stay as the previous step left them; the command exits 1) or ``skip`` the update
            (the step counts, its row says ``skipped_update``).
    """

    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-3
    lr_schedule: Literal["constant", "linear", "cosine"] = field(default="constant", metadata={"choices": lambda: LR_SCHEDULES})
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 0.0
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    on_nonfinite: Literal["stop", "skip"] = field(default="stop", metadata={"choices": lambda: ("stop", "skip")})

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "sgd"):
            raise ValueError(f"name={self.name!r} is not one of adamw, sgd")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be positive")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} is not one of {', '.join(LR_SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be non-negative")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("give warmup_steps or warmup_ratio, not both")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if not self.max_grad_norm >= 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm} must be non-negative (0: no clipping)")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be non-negative")
        if self.weight_decay and self.name != "adamw":
            raise ValueError(f"weight_decay={self.weight_decay} is AdamW's decoupled decay; the {self.name} optimizer "
                             "takes none")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            raise ValueError(f"adam_betas={','.join(map(str, self.adam_betas))} must be two numbers in [0, 1)")
        if not self.adam_eps > 0:
            raise ValueError(f"adam_eps={self.adam_eps} must be positive")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite={self.on_nonfinite!r} is not one of stop, skip")

    def warmup(self, steps: int) -> int:
        """Warm-up steps of a run of ``steps`` steps."""
        return self.warmup_steps or round(self.warmup_ratio * steps)

    def check_run(self, steps: int) -> None:
        """Refuse a warm-up as long as the run (one line)."""
        if self.warmup(steps) >= steps and (self.warmup_steps or self.warmup_ratio):
            raise ValueError(f"the warm-up ({self.warmup(steps)} steps) is as long as the run ({steps} steps); "
                             "lower warmup_steps or warmup_ratio")

    def lr_at(self, step: int, steps: int) -> float:
        """The learning rate of step ``step`` (0-based) of a run of ``steps`` steps: a function
        of the step alone, so a resumed run follows the uninterrupted run's curve."""
        w = self.warmup(steps)
        if step < w:
            return self.lr * (step + 1) / w
        if self.lr_schedule == "constant":
            return self.lr
        span = max(1, steps - 1 - w)  # the decay reaches its end at the last step
        progress = min(1.0, (step - w) / span)
        if self.lr_schedule == "linear":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * factor)

    def build(self, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        """The optimizer over ``params`` (weight decay is applied by the step, see
        :func:`posttrain.train.core.recipe.optimizer_step`, which knows which elements decay)."""
        # The default on CPU is a per-parameter loop whose every op pays DTensor dispatch: AdamW's
        # step is many times slower that way than fused (docs/results.md: posttrain bench overhead).
        # DTensor has no sharding rule for fused SGD: SGD takes foreach.
        if self.name == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, betas=tuple(self.adam_betas), eps=self.adam_eps,
                                     weight_decay=0.0, fused=True)
        return torch.optim.SGD(params, lr=self.lr, foreach=True)


@dataclass(frozen=True)
class LoraFields:
    """LoRA adapters in place of full fine-tuning (a trainer's configuration that offers them
    derives from this before :class:`RunConfig`).

    Attributes:
        lora_rank: train LoRA adapters of this rank through peft instead of every weight (0:
            full fine-tuning); the base stays frozen and sharded, and ``output_dir`` gets a peft
            adapter directory.
        lora_alpha: the adapters' updates are scaled by this over the rank (0: twice the rank).
        lora_dropout: dropout on the adapters' input while training.
        lora_targets: the linear layers that get adapters, by the last part of their names
            (``q_proj,v_proj``; default: peft's choice for the model's architecture).
        merge_lora: write ``output_dir`` as a whole model with the adapters merged into its
            weights instead of an adapter directory.
    """

    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ()
    merge_lora: bool = False

    @property
    def lora(self):
        """The run's :class:`~posttrain.models.lora.LoraSpec` (``None``: full fine-tuning)."""
        from posttrain.models.lora import LoraSpec

        if not self.lora_rank:
            return None
        return LoraSpec(self.lora_rank, self.lora_alpha, self.lora_dropout, tuple(self.lora_targets))

    def state_fields(self) -> tuple[str, ...]:
        return ("lora_rank", "lora_targets", *super().state_fields())

    def __post_init__(self) -> None:
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank={self.lora_rank} must be positive (0: full fine-tuning)")
        if not self.lora_rank:
            given = [f for f in ("lora_alpha", "lora_dropout", "lora_targets", "merge_lora") if getattr(self, f)]
            if given:
                raise ValueError(f"`{given[0]}` needs `lora_rank` (LoRA adapters of that rank)")
        else:
            if not 0 <= self.lora_dropout < 1:
                raise ValueError(f"lora_dropout={self.lora_dropout} must be in [0, 1)")
            if self.lora_alpha < 0:
                raise ValueError(f"lora_alpha={self.lora_alpha} must be positive (0: twice the rank)")
        super().__post_init__()


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
        wandb: also log the step's main figures to a Weights & Biases run in this project (needs
            ``pip install wandb``; ``WANDB_MODE=offline`` keeps the run on this machine, and a run
            resumed from ``checkpoint_dir`` continues its W&B run).
        output_dir: write a ``transformers`` model directory (weights, config, tokenizer) here
            after the last step (and every ``save_every`` steps).
        save_every: also write ``output_dir`` every this many steps (0: only at the end).
        progress: on rank 0, a progress bar (on a terminal) and a line every tenth of the run.
        device: ``auto`` (CUDA where torch can use it and the trainer and engine run on it, else
            the CPU), ``cpu`` or ``cuda`` (one rank per GPU).
        tf32: on CUDA, let fp32 matrix products and convolutions use TF32 tensor cores (faster,
            about 10 mantissa bits in the products; bf16 runs are unaffected). A CUDA setting:
            refused on the CPU.
        cudnn_attention: on CUDA, let attention use cuDNN's kernel. Off by default: cuDNN
            prepares a graph for every new shape (milliseconds of host time a call), and packed
            microbatches change shape at nearly every call; flash attention has no such cost. A
            CUDA setting: refused on the CPU.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    steps: int = 10
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    metrics: str | None = None
    tensorboard: str | None = None
    wandb: str | None = field(default=None, metadata={"metavar": "PROJECT"})
    output_dir: str | None = None
    save_every: int = 0
    progress: bool = field(default=False, metadata={"cli": False})
    device: Literal["auto", "cpu", "cuda"] = "auto"
    tf32: bool = False
    cudnn_attention: bool = False

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
        if not getattr(self, "epochs", 0):  # (a run of epochs checks once its steps are known)
            self.optim.check_run(self.steps)

    @property
    def device_kind(self) -> str:
        """``"cpu"`` or ``"cuda"``: :func:`posttrain.device.resolve` of ``device`` over the kinds
        both the trainer and its engine run on (a clear error for one they do not)."""
        from posttrain.device import resolve
        from posttrain.dp import engine_class

        engine_kinds = engine_class(self.engine.name).devices
        kinds = tuple(k for k in self.DEVICE_KINDS if k in engine_kinds)
        return resolve(self.device, kinds, what=f"{self.TRAINER} with the {self.engine.name} engine")

    @property
    def device_sharing(self) -> bool:
        """Whether several ranks of this run may share a GPU: its engine moves data one-sidedly and
        its collectives of device tensors are all-reduces and broadcasts, which gloo carries
        (:func:`posttrain.device.backend`)."""
        from posttrain.dp import engine_class

        return engine_class(self.engine.name).device_sharing

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
