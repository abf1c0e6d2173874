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
        data: train on this instead of synthetic sequences: a JSONL or JSON file, or a ``datasets``
            ``save_to_disk`` folder, of chat ``messages``, ``prompt``/``completion``, ``text`` or
            ``input_ids`` (+ ``labels``) records (docs/data.md).
        model: ``gpt`` (built in) or ``llama`` (``transformers.LlamaForCausalLM``, random init);
            ignored with ``model_path``.
        model_path: a local ``transformers`` causal LM directory (config and safetensors) to start
            from, with its weights; its tokenizer is used when it has one.
        tokenizer: a tokenizer directory (default: ``model_path``'s).
        train_on_prompt: train every token, not only the assistant's (completion's).
        loss_norm: ``token``: the mean loss over the minibatch's trained tokens; ``sequence``: each
            sequence's mean, then the mean over sequences.
        truncate: cut sequences longer than ``max_tokens`` + 1 tokens instead of refusing them.
        skip_long: leave out sequences longer than ``max_tokens`` + 1 tokens instead of refusing them.
        vocab_size: the vocabulary of the built-in models on pre-tokenized data (default: the
            tokenizer's, else the largest id + 1); an id outside it is an error.
        eval_data: held-out records (same formats and masks as ``data``): their loss, averaged as
            ``loss_norm`` says, goes into the metrics as ``eval_loss``.
        eval_every: evaluate every this many steps (0: after the last step only).
        metrics: append every rank's per-step metrics here as the run goes (``.csv``, else JSON
            lines; a resumed run continues the file).
        tensorboard: also write the step's loss, eval loss, tokens/s and step time as TensorBoard
            events into this directory.
        output_dir: write a ``transformers`` model directory (weights, config, tokenizer) here
            after the last step (and every ``save_every`` steps).
        save_every: also write ``output_dir`` every this many steps (0: only at the end).
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
    model_path: str | None = None
    tokenizer: str | None = None
    train_on_prompt: bool = False
    loss_norm: Literal["token", "sequence"] = "token"
    truncate: bool = False
    skip_long: bool = False
    vocab_size: int | None = None
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
    eval_data: str | None = None
    eval_every: int = 0
    metrics: str | None = None
    tensorboard: str | None = None
    output_dir: str | None = None
    save_every: int = 0
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
        if self.loss_norm not in ("token", "sequence"):
            raise ValueError(f"--loss-norm={self.loss_norm!r} is not one of token, sequence")
        if self.truncate and self.skip_long:
            raise ValueError("--truncate and --skip-long exclude each other: choose one")
        if self.vocab_size is not None and self.vocab_size < 2:
            raise ValueError(f"--vocab-size={self.vocab_size} must be at least 2")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every={self.eval_every} must be non-negative")
        if self.eval_every and not self.eval_data:
            raise ValueError("--eval-every needs --eval-data")
        if self.save_every < 0:
            raise ValueError(f"--save-every={self.save_every} must be non-negative")
        if self.save_every and not self.output_dir:
            raise ValueError("--save-every needs --output-dir")
        if self.output_dir and self.model_path is None and self.model == "gpt":
            raise ValueError("--output-dir writes a transformers model: give --model-path (or --model llama)")
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
DATA_FIELDS = ("profile", "data", "sequences", "max_len", "seed", "train_on_prompt", "truncate", "skip_long")
#: Fields that decide the shapes a checkpoint holds, with their flags (``max_tokens`` sizes the
#: built-in GPT's position table).
STATE_FIELDS = (("model_path", "--model-path"), ("model", "--model"), ("dim", "--dim"), ("num_layers", "--layers"),
                ("optimizer", "--optimizer"))
__all__ += ["DATA_FIELDS", "STATE_FIELDS"]
