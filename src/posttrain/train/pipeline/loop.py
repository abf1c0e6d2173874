"""Short pipeline training runs on CPU processes: what ``posttrain pipeline`` and the tests run.

:func:`run_pipeline` forks one process per pipeline rank; each builds the same seeded model,
keeps its stages (:func:`~posttrain.pipeline.stages.split_model`), and trains ``steps`` steps of
``microbatches`` microbatches on the embedded synthetic counting task with a
:class:`~posttrain.pipeline.PipelineRunner`. :func:`reference_gradients` computes the same first
step's gradients in one process, for parity checks.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
import torch.nn.functional as F

from posttrain.data import synthetic_sequences
from posttrain.launch import run_job
from posttrain.models import build_model
from posttrain.pipeline import PipelineRunner, add_offload, add_send_recv, simulate
from posttrain.pipeline.stages import split_model

from .config import PipelineConfig

__all__ = [
    "build_pipeline_model", "microbatch_loss", "predicted_peaks", "reference_gradients", "run_pipeline",
    "step_batch",
]


def step_batch(cfg: PipelineConfig, step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Inputs and targets of step ``step``, one ``(batch, seq_len)`` pair per microbatch."""
    seqs = synthetic_sequences([cfg.seq_len + 1] * (cfg.batch * cfg.num_microbatches), vocab_size=cfg.vocab_size,
                               seed=cfg.seed * 100_003 + step)
    data = torch.stack(seqs).view(cfg.num_microbatches, cfg.batch, cfg.seq_len + 1)
    return [d[:, :-1] for d in data], [d[:, 1:] for d in data]


def microbatch_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one microbatch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def build_pipeline_model(cfg: PipelineConfig):
    """The unsplit model of ``cfg`` (seeded)."""
    torch.manual_seed(cfg.seed)
    return build_model(cfg.model, cfg.model_config())


def predicted_peaks(cfg: PipelineConfig) -> list[int]:
    """Peak resident chunk-microbatches per rank that the schedule predicts, lowered as the runner
    runs it (offload, then sends and receives)."""
    sched = cfg.build()
    lowered = add_offload(sched.actions, sched.layout, cfg.num_microbatches, cfg.policy())
    return simulate(add_send_recv(lowered, sched.layout), sched.layout, cfg.num_microbatches).peaks()


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
    """Run ``cfg`` on ``cfg.num_ranks`` forked CPU processes; one dict per rank (see :func:`pipeline_worker`).

    Raises:
        ValueError: bad configuration, or a rank rejected its input.
    """
    out = run_job(pipeline_worker, cfg.num_ranks, cfg, return_grads, timeout_s=timeout_s)
    return [out[r] for r in range(cfg.num_ranks)]


def reference_gradients(cfg: PipelineConfig) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean microbatch loss and gradients of the first step, in one process without a pipeline."""
    model = build_pipeline_model(cfg)
    inputs, targets = step_batch(cfg, 0)
    total = torch.zeros(())
    for x, y in zip(inputs, targets):
        loss = microbatch_loss(model(x), y) / cfg.num_microbatches
        loss.backward()
        total += loss.detach()
    return float(total), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
