"""The configuration of one pipeline run (``posttrain pipeline``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.models import MODELS
from posttrain.models.gpt import GPTConfig
from posttrain.pipeline import SCHEDULES, OffloadPolicy, build_schedule, check_schedule_options, default_chunks

__all__ = ["PipelineConfig"]


@dataclass(frozen=True)
class PipelineConfig:
    """One pipeline run.

    Attributes:
        schedule: the schedule (one of posttrain.pipeline.SCHEDULES).
        num_ranks: pipeline ranks, one CPU process each (a rank runs one stage per chunk).
        chunks: model chunks per rank (default: 1 for gpipe, 1f1b, zb_h1 and zb_h1_tight, which
            take only 1; 2 for zbv, which takes only 2, and for the interleaved families).
        num_microbatches: microbatches per step.
        group_size: group size of group_interleaved, group_interleaved_zb and interleaved_zb
            (default: the number of ranks); the other schedules take none.
        offload: none, full, or the number of chunks per rank to offload (the longest-lived first).
        model: gpt (built in) or llama (transformers, random init).
        dim: model hidden size.
        num_layers: transformer blocks (at least ranks x chunks).
        num_heads: attention heads.
        vocab_size: token ids.
        seq_len: tokens per sequence.
        batch: sequences per microbatch.
        steps: optimizer steps.
        lr: AdamW learning rate.
        seed: data and initialization seed.
    """

    schedule: str = field(default="1f1b", metadata={"choices": lambda: SCHEDULES})
    num_ranks: int = field(default=2, metadata={"flag": "--ranks", "aliases": ("--stages",)})
    chunks: int | None = None
    num_microbatches: int = field(default=4, metadata={"flag": "--microbatches"})
    group_size: int | None = None
    offload: str = "none"
    model: str = field(default="gpt", metadata={"choices": lambda: MODELS})
    dim: int = 64
    num_layers: int = field(default=4, metadata={"flag": "--layers"})
    num_heads: int = field(default=4, metadata={"flag": "--heads"})
    vocab_size: int = field(default=64, metadata={"flag": "--vocab"})
    seq_len: int = 64
    batch: int = 2
    steps: int = 3
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        check_schedule_options(self.schedule, num_ranks=self.num_ranks, num_microbatches=self.num_microbatches,
                               num_chunks=self.chunks, group_size=self.group_size)
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; valid: {', '.join(MODELS)}")
        flags = {"num_ranks": "ranks", "num_microbatches": "microbatches", "dim": "dim",
                 "num_layers": "layers", "num_heads": "heads", "vocab_size": "vocab", "seq_len": "seq-len",
                 "batch": "batch", "steps": "steps"}
        for name, flag in flags.items():
            if getattr(self, name) < 1:
                raise ValueError(f"--{flag}={getattr(self, name)} must be at least 1")
        if self.num_layers < self.num_stages:
            raise ValueError(f"--layers={self.num_layers} cannot be cut into {self.num_stages} stages "
                             f"({self.num_ranks} ranks x {self.num_chunks} chunks): need at least one block each")
        OffloadPolicy.parse(self.offload, self.num_chunks)
        self.build()  # schedule errors (too few microbatches for it, a bad group size) surface here

    @property
    def num_chunks(self) -> int:
        """Chunks per rank as the schedule runs them (``chunks``, or the schedule's default)."""
        return default_chunks(self.schedule) if self.chunks is None else self.chunks

    @property
    def num_stages(self) -> int:
        """Stages of the model (a stage is one chunk on one rank)."""
        return self.num_ranks * self.num_chunks

    def build(self):
        """The :class:`~posttrain.pipeline.Schedule` of this run."""
        return build_schedule(self.schedule, num_ranks=self.num_ranks, num_microbatches=self.num_microbatches,
                              num_chunks=self.num_chunks, group_size=self.group_size)

    def policy(self) -> OffloadPolicy:
        return OffloadPolicy.parse(self.offload, self.num_chunks)

    def model_config(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab_size, dim=self.dim, num_layers=self.num_layers,
                         num_heads=self.num_heads, max_seq_len=self.seq_len)
