"""Checkpoints of a training run: sharded state through ``torch.distributed.checkpoint``.

A checkpoint is a directory ``step-NNNNNN`` holding the engine's sharded state dict (model and
optimizer, any world size can load it) and ``posttrain.json`` (steps done, data position, the
run's configuration). A ``latest`` file names the newest; it is replaced atomically only after
every rank has written, so an interrupted save never hides the previous checkpoint. The two
newest checkpoints are kept.

The same functions serve RL runs (:mod:`posttrain.train.rl`): a run's config names the fields that
decide its data (``DATA_FIELDS``), the fields that decide the checkpoint's shapes
(``STATE_FIELDS``) and how many records a step consumes (``sequences_per_step``).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from posttrain.dp import DataParallelEngine, engine_class
from posttrain.train.core.config import config_value

from .config import DATA_FIELDS, STATE_FIELDS, TrainConfig

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


def _fields(cfg) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    return getattr(cfg, "DATA_FIELDS", DATA_FIELDS), getattr(cfg, "STATE_FIELDS", STATE_FIELDS)


def _per_step(cfg) -> int:
    return int(getattr(cfg, "sequences_per_step", None) or cfg.sequences)


def check_resumable(cfg: TrainConfig) -> dict | None:
    """Refuse, in one line naming the flag, to resume a checkpoint written with other data, another
    model shape or optimizer, or an engine whose checkpoints differ. Returns the checkpoint's
    metadata (``None``: nothing to resume). Runs before any rank starts."""
    data_fields, state_fields = _fields(cfg)
    if not cfg.checkpoint_dir:
        return None
    found = latest_checkpoint(cfg.checkpoint_dir)
    if found is None:
        return None
    path, meta = found
    saved = meta.get("full_config", {})
    fmt = meta.get("checkpoint_format")
    own_kind = getattr(cfg, "CHECKPOINT_FORMAT", None)  # a run of its own kind (pipeline), else an engine's
    mine = own_kind or engine_class(cfg.engine.name).checkpoint_format
    if own_kind is not None and fmt != own_kind:
        raise ValueError(f"checkpoint {path} holds {fmt} state, not a {own_kind} run's; give another --checkpoint-dir")
    if own_kind is None and fmt == "pipeline":
        raise ValueError(f"checkpoint {path} is a posttrain pipeline run's; resume it with posttrain pipeline")
    for k in data_fields:
        if meta["config"].get(k) != getattr(cfg, k):
            raise ValueError(
                f"checkpoint {path} was written with --{k.replace('_', '-')}={meta['config'].get(k)!r}, "
                f"this run has {getattr(cfg, k)!r}; resuming would replay different data"
            )
    # max_tokens sizes the built-in GPT's position table in posttrain train (not in other runs)
    checks = list(state_fields) + ([("max_tokens", "--max-tokens")]
                                   if own_kind is None and getattr(cfg, "model", None) == "gpt" else [])
    for field, flag in checks:
        was, now = config_value(saved, field), config_value(cfg, field)
        if was is not None and was != now:
            raise ValueError(
                f"checkpoint {path} holds a run with {flag}={was!r}, this run has {flag}={now!r}; "
                f"give {flag} {was} to resume it, or another --checkpoint-dir to start afresh"
            )
    steps_done = int(meta["steps_done"])
    if meta.get("data_position") != steps_done * _per_step(cfg):
        raise ValueError(f"checkpoint {path}: data position {meta.get('data_position')} does not match {steps_done} "
                         f"steps of {_per_step(cfg)} records (a different --sequences, --batch or --microbatches?)")
    if own_kind is None and fmt is not None and fmt != mine:
        raise ValueError(
            f"checkpoint {path} was written by --dp {config_value(saved, 'engine.name')} ({fmt} state), which --dp "
            f"{cfg.engine.name} cannot load ({mine} state); resume with --dp {config_value(saved, 'engine.name')}"
        )
    return meta


def save_checkpoint(cfg: TrainConfig, engine: DataParallelEngine, optimizer: torch.optim.Optimizer, step: int,
                    rank: int) -> str:
    """Write the state after ``step`` (0-based) under ``cfg.checkpoint_dir``; a collective."""
    root = cfg.checkpoint_dir
    name = f"step-{step + 1:06d}"
    path = os.path.join(root, name)
    dcp.save(engine.state_dict(optimizer), checkpoint_id=path)
    if rank == 0:
        meta = {"steps_done": step + 1, "data_position": (step + 1) * _per_step(cfg),
                "config": {k: getattr(cfg, k) for k in _fields(cfg)[0]}, "full_config": asdict(cfg),
                "checkpoint_format": engine.checkpoint_format, "world_size": dist.get_world_size()}
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


def resume(cfg: TrainConfig, engine: DataParallelEngine, optimizer: torch.optim.Optimizer) -> int:
    """Load the newest checkpoint under ``cfg.checkpoint_dir`` (resharding to this world size);
    the number of steps it holds (0 if there is none)."""
    meta = check_resumable(cfg)
    if meta is None:
        return 0
    path, _ = latest_checkpoint(cfg.checkpoint_dir)
    state = engine.state_dict(optimizer)
    dcp.load(state, checkpoint_id=path)
    engine.load_state_dict(state, optimizer)
    return int(meta["steps_done"])
