"""One optimizer step with the usual recipe, the same on every trainer and engine.

[Note: the step's recipe]
After a step's gradients are complete (an engine's minibatch has ended, a pipeline's backward
passes are done), :func:`optimizer_step`:

1. sets the step's learning rate (:meth:`OptimConfig.lr_at`: warm-up, then constant, linear or
   cosine decay; a function of the step, so a resumed run follows the uninterrupted curve);
2. measures the global gradient norm with one all-reduce over every rank: each rank adds the sum
   of squares of the gradients it holds (:class:`Shards`: an engine's shards, a pipeline rank's
   stages), divided by the replicas holding the same shards (HSDP replicas hold equal gradients),
   so the reduced sum counts every element once; with ``max_grad_norm`` it scales every gradient by
   ``max_grad_norm / (norm + 1e-6)`` where that is below 1, as ``torch.nn.utils.clip_grad_norm_``;
3. applies AdamW's decoupled weight decay, ``p *= 1 - lr * weight_decay``, to parameters of two or
   more dimensions only (a mask per element where one tensor holds several parameters: flat ODC's
   shards), exactly what AdamW with a decay and a no-decay parameter group does;
4. steps the optimizer and zeroes the gradients.

A step whose gradient norm, or any rank's loss, is not finite is not applied: with
``on_nonfinite="stop"`` every rank raises :class:`~posttrain.errors.RunError` naming the step
(before the update, so no checkpoint or export holds such weights); with ``"skip"`` the gradients
are dropped and the step's row says ``skipped_update``. The loss's finiteness travels in the norm's
all-reduce (a second element), so the check costs no collective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from posttrain.dp import Shards
from posttrain.errors import RunError

from .config import OptimConfig

__all__ = ["local_grad_sq", "optimizer_step", "with_copies"]


def with_copies(shards: Shards, shared: Sequence[torch.Tensor], copies: int) -> list[Shards]:
    """``shards`` with the tensors in ``shared`` counted as held by ``copies`` times as many ranks
    (tied embeddings: a copy on the first and on the last pipeline stage, gradients summed)."""
    ids = {id(t) for t in shared}
    pairs = list(zip(shards.params, shards.masks, strict=True))
    own = [(p, m) for p, m in pairs if id(p) not in ids]
    dup = [(p, m) for p, m in pairs if id(p) in ids]
    out = [Shards([p for p, _ in own], [m for _, m in own], shards.replicas)]
    if dup:
        out.append(Shards([p for p, _ in dup], [m for _, m in dup], shards.replicas * copies))
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_grad_sq(shards: Sequence[Shards], device: torch.device) -> torch.Tensor:
    """This rank's share of the squared global gradient norm (float64 on ``device``)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for s in shards:
        part = torch.zeros((), dtype=torch.float64, device=device)
        for p in s.params:
            if p.grad is not None:
                g = _local(p.grad)
                if g.numel():
                    part += torch.linalg.vector_norm(g, dtype=torch.float64).to(device) ** 2
        total += part / s.replicas
    return total


def optimizer_step(optimizer: torch.optim.Optimizer, cfg: OptimConfig, step: int, steps: int,
                   shards: Sequence[Shards], device: torch.device, group: dist.ProcessGroup | None = None,
                   loss: torch.Tensor | float | None = None) -> dict:
    """Steps 1-4 of [Note: the step's recipe] (a collective over ``group``, default the world);
    returns ``{"lr": ..., "grad_norm": ..., "skipped_update": ...}`` (the norm before clipping; whether
    the update was skipped as not finite). ``loss``: this rank's loss of the step, if known.

    Raises:
        RunError: the step is not finite and ``cfg.on_nonfinite`` is ``stop`` (on every rank).
    """
    lr = cfg.lr_at(step, steps)
    for g in optimizer.param_groups:
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(lr)
        else:
            g["lr"] = lr
        if cfg.name == "adamw":  # this run's settings, also over what a resumed checkpoint's groups hold
            g["betas"], g["eps"], g["weight_decay"] = tuple(cfg.adam_betas), cfg.adam_eps, 0.0
    both = torch.zeros(2, dtype=torch.float64, device=device)
    both[0] = local_grad_sq(shards, device)
    if isinstance(loss, torch.Tensor):  # (on the device: no host sync beyond the norm's own)
        both[1] = (~torch.isfinite(loss.detach().to(device, torch.float64))).any()
    elif loss is not None and not math.isfinite(loss):
        both[1] = 1.0
    if dist.is_initialized():
        dist.all_reduce(both, group=group)
    sq, bad_loss = both.tolist()
    norm = math.sqrt(sq) if sq >= 0 else math.nan  # NaN stays NaN (a diverged step is not hidden as 0)
    if bad_loss or not math.isfinite(norm):
        what = f"the loss is not finite on {int(bad_loss)} rank{'s' if bad_loss > 1 else ''}" if bad_loss else ""
        what = "; ".join(x for x in (what, f"the gradient norm is {norm}" if not math.isfinite(norm) else "") if x)
        if cfg.on_nonfinite == "stop":
            raise RunError(f"step {step}: {what}; stopped before updating the weights (give `on_nonfinite` skip "
                           "to step over such steps)")
        optimizer.zero_grad()
        return {"lr": lr, "grad_norm": norm, "skipped_update": True}
    with torch.no_grad():
        if cfg.max_grad_norm and norm > 0:
            coef = cfg.max_grad_norm / (norm + 1e-6)
            if coef < 1:
                for s in shards:
                    for p in s.params:
                        if p.grad is not None:
                            _local(p.grad).mul_(coef)
        if cfg.weight_decay:
            for s in shards:
                for p, m in zip(s.params, s.masks, strict=True):
                    if p.grad is None:
                        continue
                    local = _local(p)
                    if isinstance(m, torch.Tensor):  # a 0/1 mask per element
                        local.mul_(torch.where(m, 1.0 - lr * cfg.weight_decay, 1.0))
                    elif m:
                        local.mul_(1.0 - lr * cfg.weight_decay)
    optimizer.step()
    optimizer.zero_grad()
    return {"lr": lr, "grad_norm": norm, "skipped_update": False}
