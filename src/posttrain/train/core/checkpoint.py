"""Checkpoints of every trainer's runs, through ``torch.distributed.checkpoint``.

A checkpoint is a directory ``step-NNNNNN`` holding a state dict (the engine's sharded model and
optimizer, which any world size can load, or a pipeline's whole parameters under the model's
names) and ``posttrain.json`` (steps done, data position, the run's configuration). A ``latest``
file names the newest; it is replaced atomically only after every rank has written, so an
interrupted save never hides the previous checkpoint. The two newest checkpoints are kept.

A run's configuration (:class:`~posttrain.train.core.RunConfig`) names the fields that decide its
data (``DATA_FIELDS``), those that decide the checkpoint's shapes (:meth:`state_fields`), how
many records a step consumes (``sequences_per_step``) and, for a trainer whose checkpoints are
its own rather than its engine's, their format (``CHECKPOINT_FORMAT``).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from posttrain.dp import engine_class

from .config import RunConfig, config_value

__all__ = ["check_resumable", "latest_checkpoint", "resume", "save_checkpoint"]


def latest_checkpoint(root: str) -> tuple[str, dict] | None:
    """``(path, metadata)`` of the newest checkpoint under ``root``, or ``None``."""
    pointer = os.path.join(root, "latest")
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        path = os.path.join(root, f.read().strip())
    try:
        with open(os.path.join(path, "posttrain.json")) as f:
            return path, json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint {path} named by {pointer} is unreadable: {e}") from None


def check_resumable(cfg: RunConfig) -> dict | None:
    """Refuse, in one line naming the flag, to resume a checkpoint written with other data, another
    model shape or optimizer, or an engine whose checkpoints differ. Returns the checkpoint's
    metadata (``None``: nothing to resume). Runs before any rank starts."""
    if not cfg.checkpoint_dir:
        return None
    found = latest_checkpoint(cfg.checkpoint_dir)
    if found is None:
        return None
    path, meta = found
    saved = meta.get("full_config", {})
    fmt = meta.get("checkpoint_format")
    own_kind = cfg.CHECKPOINT_FORMAT  # a run of its own kind (pipeline), else an engine's
    mine = own_kind or engine_class(cfg.engine.name).checkpoint_format
    if own_kind is not None and fmt != own_kind:
        raise ValueError(f"checkpoint {path} holds {fmt} state, not a {own_kind} run's; give another `checkpoint_dir`")
    if own_kind is None and fmt == "pipeline":
        raise ValueError(f"checkpoint {path} is a posttrain pipeline run's; resume it with posttrain pipeline")
    for k in cfg.DATA_FIELDS:
        if meta["config"].get(k) != getattr(cfg, k):
            raise ValueError(
                f"checkpoint {path} was written with {k}={meta['config'].get(k)!r}, "
                f"this run has {getattr(cfg, k)!r}; resuming would replay different data"
            )
    for field in cfg.state_fields():
        was, now = config_value(saved, field), config_value(cfg, field)
        if was is not None and was != now:
            raise ValueError(
                f"checkpoint {path} holds a run with {field}={was!r}, this run has {field}={now!r}; "
                f"give `{field}` {was} to resume it, or another `checkpoint_dir` to start afresh"
            )
    steps_done = int(meta["steps_done"])
    if meta.get("data_position") != steps_done * cfg.sequences_per_step:
        raise ValueError(f"checkpoint {path}: data position {meta.get('data_position')} does not match {steps_done} "
                         f"steps of {cfg.sequences_per_step} records (a different `sequences`, `batch` or `num_microbatches`?)")
    if own_kind is None and fmt is not None and fmt != mine:
        raise ValueError(
            f"checkpoint {path} was written by engine.name={config_value(saved, 'engine.name')!r} ({fmt} state), "
            f"which engine.name={cfg.engine.name!r} cannot load ({mine} state); resume with `engine.name` "
            f"{config_value(saved, 'engine.name')}"
        )
    return meta


def save_checkpoint(cfg: RunConfig, state, optimizer: torch.optim.Optimizer, step: int, rank: int) -> str:
    """Write ``state`` (an engine, or what stands in for one: see :class:`~posttrain.train.core.Trainer`)
    after ``step`` (0-based) under ``cfg.checkpoint_dir``; a collective."""
    root = cfg.checkpoint_dir
    name = f"step-{step + 1:06d}"
    path = os.path.join(root, name)
    dcp.save(state.state_dict(optimizer), checkpoint_id=path)
    if rank == 0:
        meta = {"steps_done": step + 1, "data_position": (step + 1) * cfg.sequences_per_step,
                "config": {k: getattr(cfg, k) for k in cfg.DATA_FIELDS}, "full_config": asdict(cfg),
                "checkpoint_format": state.checkpoint_format, "world_size": dist.get_world_size()}
        with open(os.path.join(path, "posttrain.json"), "w") as f:
            json.dump(meta, f, indent=1)
        tmp = os.path.join(root, ".latest.tmp")
        with open(tmp, "w") as f:
            f.write(name)
        os.replace(tmp, os.path.join(root, "latest"))
        old = sorted(d for d in os.listdir(root) if d.startswith("step-") and d != name)
        for d in old[:-1]:  # keep this one and the previous
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    dist.barrier()
    return path


def resume(cfg: RunConfig, state, optimizer: torch.optim.Optimizer) -> int:
    """Load the newest checkpoint under ``cfg.checkpoint_dir`` into ``state`` and ``optimizer``
    (resharding to this world size); the number of steps it holds (0 if there is none)."""
    meta = check_resumable(cfg)
    if meta is None:
        return 0
    path, _ = latest_checkpoint(cfg.checkpoint_dir)
    saved = state.state_dict(optimizer)
    dcp.load(saved, checkpoint_id=path)
    state.load_state_dict(saved, optimizer)
    return int(meta["steps_done"])
