"""Short pipeline training runs on CPU processes: what ``posttrain pipeline`` and the tests run.

:func:`run_pipeline` forks one process per pipeline rank; each builds the same seeded model,
keeps its stages (:func:`~posttrain.pipeline.stages.split_model`), and trains ``steps`` steps of
``microbatches`` microbatches on the embedded synthetic counting task with a
:class:`~posttrain.pipeline.PipelineRunner`. :func:`reference_gradients` computes the same first
step's gradients in one process, for parity checks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .._launch import RanksFailedError, run_ranks
from ..data import synthetic_sequences
from ..models import MODELS, build_model
from ..models.gpt import GPTConfig
from .passes import OffloadPolicy, add_offload
from .runtime import PipelineRunner
from .schedules import SCHEDULES, build_schedule
from .simulate import simulate
from .stages import split_model

__all__ = [
    "PipelineConfig", "build_pipeline_model", "microbatch_loss", "predicted_peaks", "reference_gradients", "run_pipeline",
    "step_batch",
]


@dataclass(frozen=True)
class PipelineConfig:
    """One pipeline run.

    Attributes:
        schedule: one of :data:`~posttrain.pipeline.SCHEDULES`.
        stages: pipeline ranks (processes).
        chunks: model chunks per rank (interleaved families; ``zbv`` always uses 2).
        microbatches: microbatches per step.
        group_size: group size of ``group_interleaved``, ``group_interleaved_zb`` and ``interleaved_zb``
            (default: ``stages``).
        offload: ``none``, ``full`` or the number of chunks per rank to offload.
        model: ``gpt`` or ``llama``.
        dim, layers, heads, vocab: model shape (``layers`` at least ``stages * chunks``).
        seq_len: tokens per sequence; batch: sequences per microbatch.
        steps, lr, seed: training.
    """

    schedule: str = "1f1b"
    stages: int = 2
    chunks: int = 1
    microbatches: int = 4
    group_size: int | None = None
    offload: str = "none"
    model: str = "gpt"
    dim: int = 64
    layers: int = 4
    heads: int = 4
    vocab: int = 64
    seq_len: int = 64
    batch: int = 2
    steps: int = 3
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; valid: {', '.join(SCHEDULES)}")
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; valid: {', '.join(MODELS)}")
        for name in ("stages", "chunks", "microbatches", "dim", "layers", "heads", "vocab", "seq_len", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be at least 1")
        if self.steps < 1:
            raise ValueError(f"--steps={self.steps} must be at least 1")
        if self.layers < self.num_stages:
            raise ValueError(f"--layers={self.layers} cannot be cut into {self.num_stages} stages "
                             f"({self.stages} ranks x {self.num_chunks} chunks): need at least one block each")
        OffloadPolicy.parse(self.offload, self.num_chunks)

    @property
    def num_chunks(self) -> int:
        return 2 if self.schedule == "zbv" else self.chunks

    @property
    def num_stages(self) -> int:
        return self.stages * self.num_chunks

    def build(self):
        """The :class:`~posttrain.pipeline.Schedule` of this run."""
        return build_schedule(self.schedule, num_ranks=self.stages, num_microbatches=self.microbatches,
                              num_chunks=self.num_chunks,
                              group_size=self.group_size)

    def policy(self) -> OffloadPolicy:
        return OffloadPolicy.parse(self.offload, self.num_chunks)

    def model_config(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab, dim=self.dim, num_layers=self.layers, num_heads=self.heads,
                         max_seq_len=self.seq_len)


def step_batch(cfg: PipelineConfig, step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Inputs and targets of step ``step``, one ``(batch, seq_len)`` pair per microbatch."""
    seqs = synthetic_sequences([cfg.seq_len + 1] * (cfg.batch * cfg.microbatches), vocab_size=cfg.vocab,
                               seed=cfg.seed * 100_003 + step)
    data = torch.stack(seqs).view(cfg.microbatches, cfg.batch, cfg.seq_len + 1)
    return [d[:, :-1] for d in data], [d[:, 1:] for d in data]


def microbatch_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one microbatch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def build_pipeline_model(cfg: PipelineConfig):
    """The unsplit model of ``cfg`` (seeded)."""
    torch.manual_seed(cfg.seed)
    return build_model(cfg.model, cfg.model_config())


def predicted_peaks(cfg: PipelineConfig) -> list[int]:
    """Peak resident chunk-microbatches per rank that the schedule (with its offload) predicts."""
    sched = cfg.build()
    lowered = add_offload(sched.actions, sched.layout, cfg.microbatches, cfg.policy())
    return simulate(lowered, sched.layout, cfg.microbatches).peaks()


def pipeline_worker(rank: int, world_size: int, cfg: PipelineConfig, return_grads: bool = False) -> dict:
    """One rank of :func:`run_pipeline`."""
    sched = cfg.build()
    model = build_pipeline_model(cfg)
    stages = split_model(model, cfg.num_stages)
    mine = {s: stages[s] for s in range(cfg.num_stages) if sched.layout.rank_of(s) == rank}
    runner = PipelineRunner(mine, sched, loss_fn=microbatch_loss, offload=cfg.policy())
    params = [p for mod in mine.values() for p in mod.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    losses, times, grads, result = [], [], {}, None
    for step in range(cfg.steps):
        inputs, targets = step_batch(cfg, step)
        opt.zero_grad(set_to_none=True)
        result = runner.step(inputs, targets)
        if step == 0 and return_grads:
            ids = {id(p) for p in params}
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if id(p) in ids and p.grad is not None}
        opt.step()
        losses.append(result.loss)
        times.append(result.step_time_s)
    return {"rank": rank, "losses": losses, "step_times": times, "result": asdict(result), "grads": grads,
            "stages": sorted(mine)}


def run_pipeline(cfg: PipelineConfig, *, return_grads: bool = False, timeout_s: float = 300.0) -> list[dict]:
    """Run ``cfg`` on ``cfg.stages`` forked CPU processes; one dict per rank (see :func:`pipeline_worker`).

    Raises:
        ValueError: bad configuration, or a rank rejected its input.
    """
    cfg.build()  # schedule errors surface here, before any process starts
    try:
        out = run_ranks(pipeline_worker, cfg.stages, cfg, return_grads, timeout_s=timeout_s)
    except RanksFailedError as e:
        msg = e.value_error()
        if msg:
            raise ValueError(msg) from None
        raise
    return [out[r] for r in range(cfg.stages)]


def reference_gradients(cfg: PipelineConfig) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean microbatch loss and gradients of the first step, in one process without a pipeline."""
    model = build_pipeline_model(cfg)
    inputs, targets = step_batch(cfg, 0)
    total = torch.zeros(())
    for x, y in zip(inputs, targets):
        loss = microbatch_loss(model(x), y) / cfg.microbatches
        loss.backward()
        total += loss.detach()
    return float(total), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
