"""The configuration of one pipeline run (``posttrain pipeline``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

from posttrain.dp import engine_class
from posttrain.models import MODELS
from posttrain.models.gpt import GPTConfig
from posttrain.pipeline import SCHEDULES, OffloadPolicy, build_schedule, check_schedule_options, default_chunks
from posttrain.train.core.config import LoraFields, OptimConfig, RunConfig

__all__ = ["PipelineConfig"]


def _engines(capability: str) -> list[str]:
    """The registered engines that have ``capability`` (a class attribute of the engine)."""
    from posttrain.dp import engine_class, engine_names

    return [n for n in engine_names() if getattr(engine_class(n), capability)]


@dataclass(frozen=True)
class PipelineConfig(LoraFields, RunConfig):
    """One pipeline run (the engine, optimizer, checkpoint and output fields:
    :class:`~posttrain.train.core.RunConfig`; with ``dp_size`` > 1 the engine shards each stage
    over the ranks that run it, and is not used otherwise).

    Attributes:
        schedule: the schedule: gpipe, 1f1b, interleaved_1f1b, group_interleaved,
            group_interleaved_zb, interleaved_zb, zb_h1, zb_h1_tight or zbv (docs/pipeline.md).
        num_ranks: pipeline ranks, one CPU process each (a rank runs one stage per chunk).
        chunks: model chunks per rank (default: 1 for gpipe, 1f1b, zb_h1 and zb_h1_tight, which
            take only 1; 2 for zbv, which takes only 2, and for the interleaved families).
        num_microbatches: microbatches per step.
        group_size: group size of group_interleaved, group_interleaved_zb and interleaved_zb
            (default: the number of ranks); the other schedules take none.
        offload: none, full, or the number of chunks per rank to offload (the longest-lived first).
        offload_fraction: the share of each offloaded chunk-microbatch's saved bytes that goes to
            host memory (the tensors saved first; 1: all). Below 1, selective offload within a
            chunk: the copies shrink with it, for where full offload cannot hide (docs/pipeline.md).
        no_weight_split: under a split backward (zb_h1, zbv, the _zb schedules), keep a
            chunk-microbatch's saved activations whole until W instead of freeing what only I
            needs when I ends (and offloading W's part on its own).
        model: gpt (built in) or llama (transformers, random init).
        dim: model hidden size.
        num_layers: transformer blocks (at least ranks x chunks).
        num_heads: attention heads.
        vocab_size: token ids.
        seq_len: tokens per sequence.
        batch: sequences per microbatch.
        model_path: train this local ``transformers`` causal LM (with its weights) instead of a
            built-in model; its blocks are spread over the stages by cost.
        data: train on this data (the formats, masks and loss aggregation of ``posttrain
            train``; needs ``model_path``) instead of the synthetic task: each step takes
            ``sequences`` records and packs them into microbatches (``num_microbatches`` of them,
            each holding at most ``max_tokens``), balanced by cost; the loss is normalized over the
            step's trained tokens (or sequences).
        tokenizer: tokenizer directory for ``data`` (default: ``model_path``'s).
        sequences: records per step with ``data``.
        max_tokens: most tokens in one packed microbatch with ``data``.
        train_on_prompt: also train on prompt tokens.
        loss_agg: ``token-mean``: every trained token weighs the same; ``seq-mean-token-mean``: every
            sequence does (the aggregations of ``posttrain rl``'s ``loss_agg``).
        truncate: cut records longer than ``max_tokens`` + 1 tokens instead of refusing them.
        skip_long: leave out records longer than ``max_tokens`` + 1 tokens instead of refusing them.
        checkpoint_dir: save checkpoints here and resume from the newest one found there (on any
            number of ranks, chunks or schedule: parameters are saved under the model's names).
        steps: optimizer steps.
        epochs: passes over ``data`` instead of ``steps`` (which it then sets:
            ``ceil(epochs x usable records / sequences)``, known once the data is tokenized; each
            epoch is a new seeded shuffle, and a resumed run goes on at the same record).
        dp_size: data-parallel pipelines, each on its share of a step's records (``num_ranks`` x
            ``dp_size`` processes); each stage's parameters are sharded over the ``dp_size`` ranks
            that run it, by the run's engine (needs ``data``; docs/pipeline.md).
        balance: with ``dp_size`` > 1, how a step's records are balanced over the pipelines
            (``diff_micro``: each pipeline its own microbatch count; ``same_micro``: equal counts).
    """

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-3))
    steps: int = 3
    schedule: str = field(default="1f1b", metadata={"choices": lambda: SCHEDULES})
    num_ranks: int = 2
    chunks: int | None = None
    num_microbatches: int = 4
    group_size: int | None = None
    offload: str = "none"
    offload_fraction: float = 1.0
    no_weight_split: bool = False
    model: str = field(default="gpt", metadata={"choices": lambda: MODELS})
    dim: int = 64
    num_layers: int = 4
    num_heads: int = 4
    vocab_size: int = 64
    seq_len: int = 64
    batch: int = 2
    model_path: str | None = None
    data: str | None = None
    tokenizer: str | None = None
    sequences: int = 16
    max_tokens: int = 512
    train_on_prompt: bool = False
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    truncate: bool = False
    skip_long: bool = False
    epochs: float = field(default=0.0, metadata={"excludes": "steps"})
    dp_size: int = 1
    balance: Literal["same_micro", "diff_micro", "local_sort", "round_robin"] = "diff_micro"

    TRAINER: ClassVar[str] = "the pipeline trainer"
    DATA_FIELDS: ClassVar[tuple[str, ...]] = ("data", "sequences", "seed", "seq_len", "batch", "train_on_prompt",
                                              "truncate", "skip_long")
    CHECKPOINT_FORMAT: ClassVar[str | None] = "pipeline"

    def state_fields(self) -> tuple[str, ...]:
        return ("model_path", "model", "dim", "num_layers", "vocab_size", "seq_len", *super().state_fields())

    @property
    def device_sharing(self) -> bool:
        """Whether ranks may share a GPU: a pipeline alone sends through host memory where they do;
        with ``dp_size`` > 1 its engine decides."""
        return self.dp_size == 1 or super().device_sharing

    def __post_init__(self) -> None:
        super().__post_init__()
        check_schedule_options(self.schedule, num_ranks=self.num_ranks, num_microbatches=self.num_microbatches,
                               num_chunks=self.chunks, group_size=self.group_size)
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r} is not one of {', '.join(MODELS)}")
        if not self.epochs >= 0:
            raise ValueError(f"epochs={self.epochs} must be positive (0: run `steps` steps)")
        if self.epochs and self.data is None:
            raise ValueError("`epochs` needs `data` (the synthetic task has no epochs)")
        if self.lora_rank and self.model_path is None and self.model == "gpt":
            raise ValueError("`lora_rank` adds peft adapters to a transformers model: give `model_path` "
                             "(or `model` llama)")
        for name in ("num_ranks", "num_microbatches", "dim", "num_layers", "num_heads", "vocab_size", "seq_len",
                     "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.model_path is None and self.num_layers < self.num_stages:
            raise ValueError(f"num_layers={self.num_layers} cannot be cut into {self.num_stages} stages "
                             f"({self.num_ranks} ranks x {self.num_chunks} chunks): need at least one block each")
        offloaded = OffloadPolicy.parse(self.offload, self.num_chunks).chunks
        if not 0 < self.offload_fraction <= 1:
            raise ValueError(f"offload_fraction={self.offload_fraction} must be in (0, 1]")
        if self.offload_fraction != 1 and not offloaded:
            raise ValueError(f"offload_fraction={self.offload_fraction:g} is a share of the offloaded chunks, and "
                             f"offload={self.offload} offloads none: give `offload` too")
        self._check_data()
        self.build()  # schedule errors (too few microbatches for it, a bad group size) surface here

    def _check_data(self) -> None:
        if self.data and not self.model_path:
            raise ValueError("`data` needs `model_path` (a transformers model directory to train)")
        if self.output_dir and not self.model_path:
            raise ValueError("`output_dir` writes a transformers model: give `model_path`")
        if self.loss_agg not in ("token-mean", "seq-mean-token-mean"):
            raise ValueError(f"loss_agg={self.loss_agg!r} is not one of token-mean, seq-mean-token-mean")
        if self.truncate and self.skip_long:
            raise ValueError("`truncate` and `skip_long` exclude each other")
        for value, flag in ((self.engine.precision != "fp32", "engine.precision='bf16'"),
                            (self.engine.activation_checkpointing, "`engine.activation_checkpointing`"),
                            (self.engine.replicas not in (1, "auto"), "`engine.replicas`")):
            if value:
                raise ValueError(f"posttrain pipeline does not take {flag} yet")
        for name in ("sequences", "max_tokens", "dp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.dp_size > 1:
            from posttrain.balance import METHODS

            from .dp import SPLIT_BACKWARD

            if not self.data:
                raise ValueError("`dp_size` needs `data` (and `model_path`): pipelines balance a step's records")
            if self.balance not in METHODS:
                raise ValueError(f"balance={self.balance!r} is not one of {', '.join(METHODS)}")
            engine = engine_class(self.engine.name)
            if self.schedule in SPLIT_BACKWARD and not engine.split_backward:
                raise ValueError(f"engine.name={self.engine.name!r} with schedule={self.schedule!r}: the engine reduces "
                                 "gradients from backward hooks, which a split backward's weight pass bypasses; use "
                                 f"`engine.name` {' or '.join(_engines('split_backward'))}, or gpipe, 1f1b, "
                                 "interleaved_1f1b or group_interleaved")
            if self.checkpoint_dir and not engine.whole_state:
                raise ValueError(f"`checkpoint_dir` with `dp_size`: engine.name={self.engine.name!r} does not write "
                                 f"the pipeline's checkpoints yet; use `engine.name` {' or '.join(_engines('whole_state'))}")
            if engine.needs_equal_microbatches(self.engine) and self.balance != "same_micro":
                raise ValueError(f"the engine {self.engine.label} has a rendezvous per layer, so every pipeline must "
                                 "run the same number of microbatches: give `balance` same_micro")
        elif self.data and self.sequences < self.num_microbatches:
            raise ValueError(f"sequences={self.sequences} is fewer than num_microbatches={self.num_microbatches}: "
                             "every microbatch needs a sequence")

    @property
    def num_chunks(self) -> int:
        """Chunks per rank as the schedule runs them (``chunks``, or the schedule's default)."""
        return default_chunks(self.schedule) if self.chunks is None else self.chunks

    @property
    def sequences_per_step(self) -> int:
        """Records (or synthetic sequences) a step consumes."""
        return self.sequences if self.data else self.batch * self.num_microbatches

    @property
    def num_stages(self) -> int:
        """Stages of the model (a stage is one chunk on one rank)."""
        return self.num_ranks * self.num_chunks

    def build(self, num_microbatches: int | None = None):
        """The :class:`~posttrain.pipeline.Schedule` of this run (for ``num_microbatches`` instead
        of ``--microbatches``: a data-parallel pipeline's own count)."""
        return build_schedule(self.schedule, num_ranks=self.num_ranks,
                              num_microbatches=num_microbatches or self.num_microbatches,
                              num_chunks=self.num_chunks, group_size=self.group_size)

    def policy(self) -> OffloadPolicy:
        return replace(OffloadPolicy.parse(self.offload, self.num_chunks), weight=not self.no_weight_split,
                       fraction=self.offload_fraction)

    def model_config(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab_size, dim=self.dim, num_layers=self.num_layers,
                         num_heads=self.num_heads, max_seq_len=self.seq_len)
