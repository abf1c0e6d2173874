"""The configuration of one training run (``posttrain train``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from posttrain.balance import METHODS
from posttrain.data import PROFILES
from posttrain.dp import DP_ALIASES, EngineConfig, engine_names, resolve_dp
from posttrain.models import MODELS, GPTConfig

__all__ = ["DP_CHOICES", "OPTIMIZERS", "PRECISIONS", "SYNTHETIC_VOCAB", "TrainConfig"]

PRECISIONS = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "sgd")
SYNTHETIC_VOCAB = 64


def _dp_choices() -> tuple[str, ...]:
    return (*engine_names(), *DP_ALIASES)


DP_CHOICES = _dp_choices()


@dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Attributes:
        dp: data-parallel engine: ``odc`` (flat ODC), ``fsdp`` (FSDP2), ``odc-fsdp2`` (ODC on
            FSDP2); the spellings ``odc-collective``, ``odc-flat``, ``odc-flat-collective``,
            ``odc-fsdp2-collective`` name an engine and an ``odc_mode``.
        odc_mode: ODC engines: ``odc`` or ``collective`` (a barrier at every gather and reduce;
            every rank runs the same number of microbatches, like FSDP).
        balance: balancing method (``round_robin``, ``local_sort``, ``same_micro``, ``diff_micro``).
        profile: embedded length profile; unused with ``data``.
        data: a JSONL file of ``input_ids`` lines to train on instead of synthetic sequences.
        model: ``gpt`` (built in) or ``llama`` (``transformers.LlamaForCausalLM``, random init).
        precision: ``fp32``, or ``bf16`` (bf16 parameters and compute, fp32 gradient reduction and
            master weights).
        deterministic: ODC engines: bitwise identical runs.
        activation_checkpointing: recompute each block's forward in backward.
        replicas: HSDP replicas (the ranks form a ``(replicas, world_size / replicas)`` mesh).
        steps: optimizer steps (total, including those before a resumed checkpoint).
        sequences: sequences per minibatch, over all ranks.
        max_len: longest synthetic sequence.
        max_tokens: most tokens in one microbatch (at least ``max_len``).
        dim: model hidden size.
        num_layers: transformer blocks.
        optimizer: ``adamw`` or ``sgd`` (plain SGD shows gradient-scale errors that Adam hides).
        lr: learning rate.
        seed: data and initialization seed.
        checkpoint_dir: save checkpoints here and resume from the newest one found there.
        checkpoint_every: save every this many steps (0: only after the last step).
        progress: on rank 0, a progress bar (on a terminal) and a line every tenth of the run.
    """

    dp: str = field(default="odc", metadata={"choices": _dp_choices})
    odc_mode: Literal["odc", "collective"] = "odc"
    balance: Literal["round_robin", "local_sort", "same_micro", "diff_micro"] = "diff_micro"
    profile: str = field(default="long_tail", metadata={"choices": lambda: PROFILES})
    data: str | None = None
    model: Literal["gpt", "llama"] = "gpt"
    precision: Literal["fp32", "bf16"] = "fp32"
    deterministic: bool = False
    activation_checkpointing: bool = False
    replicas: int = 1
    steps: int = 10
    sequences: int = 16
    max_len: int = 512
    max_tokens: int = 512
    dim: int = 128
    num_layers: int = field(default=4, metadata={"flag": "--layers"})
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-3
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    progress: bool = field(default=False, metadata={"cli": False})

    def __post_init__(self) -> None:
        engine, mode = resolve_dp(self.dp, self.odc_mode)
        object.__setattr__(self, "dp", engine)
        object.__setattr__(self, "odc_mode", mode)
        for name, choices in (("balance", METHODS), ("profile", PROFILES), ("model", MODELS),
                              ("precision", PRECISIONS), ("optimizer", OPTIMIZERS), ("odc_mode", ("odc", "collective"))):
            if getattr(self, name) not in choices:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)!r} is not one of {', '.join(choices)}")
        for name in ("steps", "sequences", "dim", "num_layers", "replicas"):
            if getattr(self, name) < 1:
                flag = "layers" if name == "num_layers" else name
                raise ValueError(f"--{flag}={getattr(self, name)} must be at least 1")
        if self.dp == "fsdp" and self.odc_mode == "collective":
            raise ValueError("--odc-mode collective is for the ODC engines (--dp odc or odc-fsdp2); FSDP2 always is")
        if self.dp == "fsdp" and self.deterministic:
            raise ValueError("--deterministic is for the ODC engines (--dp odc or odc-fsdp2)")
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every={self.checkpoint_every} must be non-negative")
        if not self.lr > 0:
            raise ValueError(f"--lr={self.lr} must be positive")
        if self.data is None:
            if self.max_len < 8:
                raise ValueError(f"--max-len={self.max_len} must be at least 8")
            if self.max_tokens < self.max_len:
                raise ValueError(
                    f"--max-tokens={self.max_tokens} is smaller than the longest sequence "
                    f"(--max-len={self.max_len}); raise --max-tokens"
                )
        elif self.max_tokens < 1:
            raise ValueError(f"--max-tokens={self.max_tokens} must be at least 1")

    @property
    def dp_label(self) -> str:
        """The engine and its mode, as the CLI spells them (``odc``, ``odc-collective``, ...)."""
        return f"{self.dp}-collective" if self.odc_mode == "collective" else self.dp

    def engine_config(self) -> EngineConfig:
        """What the data-parallel engine needs of this run."""
        return EngineConfig(precision=self.precision, mode=self.odc_mode, deterministic=self.deterministic,
                            activation_checkpointing=self.activation_checkpointing, replicas=self.replicas)

    def model_config(self, vocab_size: int = SYNTHETIC_VOCAB) -> GPTConfig:
        """The model shape: heads of about 32 channels (the most heads up to ``dim // 32`` that
        divide ``dim``)."""
        heads = max(1, self.dim // 32)
        while self.dim % heads:
            heads -= 1
        return GPTConfig(vocab_size=vocab_size, dim=self.dim, num_layers=self.num_layers,
                         num_heads=heads, max_seq_len=self.max_tokens)


#: Fields that decide which data each step sees; a resumed run must agree on them.
DATA_FIELDS = ("profile", "data", "sequences", "max_len", "seed")
#: Fields that decide the shapes a checkpoint holds, with their flags (``max_tokens`` sizes the
#: built-in GPT's position table).
STATE_FIELDS = (("model", "--model"), ("dim", "--dim"), ("num_layers", "--layers"), ("optimizer", "--optimizer"))
__all__ += ["DATA_FIELDS", "STATE_FIELDS"]
