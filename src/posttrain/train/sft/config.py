"""The configuration of one training run (``posttrain train``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from posttrain.balance import METHODS
from posttrain.data import PROFILES
from posttrain.models import MODELS, GPTConfig
from posttrain.train.core.config import LoraFields, RunConfig

__all__ = ["SYNTHETIC_VOCAB", "TrainConfig"]

SYNTHETIC_VOCAB = 64


@dataclass(frozen=True)
class TrainConfig(LoraFields, RunConfig):
    """One supervised fine-tuning run on a data-parallel engine (the engine, optimizer,
    checkpoint and output fields: :class:`~posttrain.train.core.RunConfig`).

    Attributes:
        balance: balancing method (``round_robin``, ``local_sort``, ``same_micro``, ``diff_micro``).
        profile: embedded length profile of the synthetic sequences (without ``data``).
        data: train on this instead of synthetic sequences: a JSONL or JSON file, or a ``datasets``
            ``save_to_disk`` folder, of chat ``messages``, ``prompt``/``completion``, ``text`` or
            ``input_ids`` (+ ``labels``) records (docs/post-training.md).
        model: ``gpt`` (built in) or ``llama`` (``transformers.LlamaForCausalLM``, random init);
            ignored with ``model_path``.
        model_path: a local ``transformers`` causal LM directory (config and safetensors) to start
            from, with its weights; its tokenizer is used when it has one.
        tokenizer: a tokenizer directory (default: ``model_path``'s).
        train_on_prompt: train every token, not only the assistant's (completion's).
        loss_agg: ``token-mean``: the mean loss over the minibatch's trained tokens;
            ``seq-mean-token-mean``: each sequence's mean, then the mean over sequences.
        truncate: cut sequences longer than :attr:`longest` + 1 tokens instead of refusing them.
        skip_long: leave out sequences longer than :attr:`longest` + 1 tokens instead of refusing them.
        vocab_size: the vocabulary of the built-in models on pre-tokenized data (default: the
            tokenizer's, else the largest id + 1); an id outside it is an error.
        eval_data: held-out records (same formats and masks as ``data``): their loss, averaged as
            ``loss_agg`` says, goes into the metrics as ``eval_loss``.
        eval_every: evaluate every this many steps (0: after the last step only).
        sequences: sequences per minibatch, over all ranks.
        max_len: longest synthetic sequence; with context parallelism (``engine.context_parallel``
            not ``off``) also the longest sequence a run takes from ``data``, which may exceed
            ``max_tokens``: such a sequence is split across ranks into shards of at most
            ``max_tokens`` (:attr:`longest`).
        max_tokens: most tokens in one microbatch or shard (at least ``max_len`` unless context
            parallelism splits the longer sequences; default ``max_len``).
        dim: model hidden size.
        num_layers: transformer blocks.
        epochs: passes over ``data`` instead of ``steps`` (which it then sets:
            ``ceil(epochs x usable sequences / sequences)``, known once the data is tokenized; each
            epoch is a new seeded shuffle, and a resumed run goes on at the same record).
        peak_tflops: a device's peak rate in the training dtype, TFLOP/s, that ``mfu`` (model
            FLOPs utilization) divides by; 0: measured at the start by a short matrix product on
            every rank (:func:`posttrain.device.matmul_tflops`).
    """

    balance: Literal["round_robin", "local_sort", "same_micro", "diff_micro"] = "diff_micro"
    profile: str = field(default="long_tail", metadata={"choices": lambda: PROFILES})
    data: str | None = None
    model: Literal["gpt", "llama"] = "gpt"
    model_path: str | None = None
    tokenizer: str | None = None
    train_on_prompt: bool = False
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    truncate: bool = False
    skip_long: bool = False
    vocab_size: int | None = None
    sequences: int = 16
    max_len: int = 512
    max_tokens: int | None = field(default=None, metadata={"derived": True})
    dim: int = 128
    num_layers: int = 4
    eval_data: str | None = None
    eval_every: int = 0
    epochs: float = field(default=0.0, metadata={"excludes": "steps"})
    peak_tflops: float = 0.0

    TRAINER: ClassVar[str] = "the SFT trainer"
    DATA_FIELDS: ClassVar[tuple[str, ...]] = ("profile", "data", "sequences", "max_len", "seed", "train_on_prompt",
                                              "truncate", "skip_long")

    def state_fields(self) -> tuple[str, ...]:
        # the position table's size: max_tokens, max_len where split sequences are longer
        gpt = (("max_tokens", "max_len") if self.longest > self.max_tokens else ("max_tokens",)) if self.model == "gpt" else ()
        return ("model_path", "model", "dim", "num_layers", *super().state_fields(), *gpt)

    @property
    def sequences_per_step(self) -> int:
        return self.sequences

    @property
    def longest(self) -> int:
        """The longest sequence (input tokens) the run takes: ``max_tokens``, or with context
        parallelism ``max(max_len, max_tokens)`` (a longer sequence than a microbatch holds is
        split across ranks)."""
        return self.max_tokens if self.engine.context_parallel == "off" else max(self.max_len, self.max_tokens)

    def __post_init__(self) -> None:
        if self.max_tokens is None:
            object.__setattr__(self, "max_tokens", self.max_len)
        super().__post_init__()
        for name, choices in (("balance", METHODS), ("profile", PROFILES), ("model", MODELS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {', '.join(choices)}")
        if self.engine.context_parallel != "off" and self.balance != "diff_micro":
            raise ValueError(f"`context_parallel` splits sequences within diff_micro's plan; balance={self.balance!r} "
                             "does not take it (use `balance` diff_micro)")
        if not self.epochs >= 0:
            raise ValueError(f"epochs={self.epochs} must be positive (0: run `steps` steps)")
        if self.epochs and self.data is None:
            raise ValueError("`epochs` needs `data` (synthetic sequences have no epochs)")
        if self.lora_rank and self.model_path is None and self.model == "gpt":
            raise ValueError("`lora_rank` adds peft adapters to a transformers model: give `model_path` "
                             "(or `model` llama)")
        if not self.peak_tflops >= 0:
            raise ValueError(f"peak_tflops={self.peak_tflops} must be non-negative (0: measured at the start)")
        for name in ("sequences", "dim", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.loss_agg not in ("token-mean", "seq-mean-token-mean"):
            raise ValueError(f"loss_agg={self.loss_agg!r} is not one of token-mean, seq-mean-token-mean")
        if self.truncate and self.skip_long:
            raise ValueError("`truncate` and `skip_long` exclude each other: choose one")
        if self.vocab_size is not None and self.vocab_size < 2:
            raise ValueError(f"vocab_size={self.vocab_size} must be at least 2")
        if self.eval_every < 0:
            raise ValueError(f"eval_every={self.eval_every} must be non-negative")
        if self.eval_every and not self.eval_data:
            raise ValueError("`eval_every` needs `eval_data`")
        if self.output_dir and self.model_path is None and self.model == "gpt":
            raise ValueError("`output_dir` writes a transformers model: give `model_path` (or `model` llama)")
        if self.model_path is None and self.model == "llama":
            head = self.dim // self.model_config().num_heads
            if head % 2:
                raise ValueError(f"dim={self.dim} gives attention heads of {head} channels, and llama's rotary "
                                 "position embeddings need an even number; give a multiple of 32 as `dim` (heads of "
                                 "32 channels)")
        if self.data is None:
            if self.max_len < 8:
                raise ValueError(f"max_len={self.max_len} must be at least 8")
            if self.max_tokens < self.max_len and self.engine.context_parallel == "off":
                raise ValueError(
                    f"max_tokens={self.max_tokens} is smaller than the longest sequence "
                    f"(max_len={self.max_len}); raise `max_tokens`, or split the longer sequences across "
                    "ranks with `context_parallel`"
                )
        elif self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be at least 1")

    def model_config(self, vocab_size: int = SYNTHETIC_VOCAB) -> GPTConfig:
        """The model shape: heads of about 32 channels (the most heads up to ``dim // 32`` that
        divide ``dim``)."""
        heads = max(1, self.dim // 32)
        while self.dim % heads:
            heads -= 1
        return GPTConfig(vocab_size=vocab_size, dim=self.dim, num_layers=self.num_layers,
                         num_heads=heads, max_seq_len=self.longest)
