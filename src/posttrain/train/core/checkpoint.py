"""Checkpoints of every trainer's runs, through ``torch.distributed.checkpoint``.

A checkpoint is a directory ``step-NNNNNN`` holding a state dict (the engine's sharded model and
optimizer, which any world size can load, or a pipeline's whole parameters under the model's
names) and ``posttrain.json`` (steps done, data position, the run's configuration). A ``latest``
file names the newest; it is replaced atomically only after every rank has written, so an
interrupted save never hides the previous checkpoint. The two newest checkpoints are kept.

Every file of a checkpoint has its SHA-256 in ``posttrain.json`` (each rank hashes the files it
wrote, rank 0 records them before ``latest`` names the checkpoint). A resume checks them, the
ranks sharing the files, before any rank loads anything (:func:`verify_checkpoint`): a damaged,
truncated or missing file stops the run with one line naming it. A full disk while saving
removes the partial checkpoint and stops the run with one line naming the device; ``latest``
still names the previous one.

A run's configuration (:class:`~posttrain.train.core.RunConfig`) names the fields that decide its
data (``DATA_FIELDS``), those that decide the checkpoint's shapes (:meth:`state_fields`), how
many records a step consumes (``sequences_per_step``) and, for a trainer whose checkpoints are
its own rather than its engine's, their format (``CHECKPOINT_FORMAT``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from dataclasses import asdict

import torch
import torch.distributed as dist

from posttrain.dp import engine_class
from posttrain.errors import RunError, disk_full, no_space

from .config import RunConfig, config_value

__all__ = ["check_resumable", "file_digest", "latest_checkpoint", "load", "resume", "save_checkpoint",
           "verify_checkpoint"]

#: The checksums' algorithm (``hashlib`` name).
CHECKSUM = "sha256"


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
        if isinstance(now, tuple):  # (the checkpoint's JSON holds lists)
            now = list(now)
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


def file_digest(path: str) -> str:
    """The checksum (:data:`CHECKSUM`) of the file at ``path``, as hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, CHECKSUM).hexdigest()


def _nearly_full(path: str) -> bool:
    try:
        return shutil.disk_usage(path).free < 1 << 20
    except OSError:
        return False


def save_checkpoint(cfg: RunConfig, state, optimizer: torch.optim.Optimizer, step: int, rank: int) -> str:
    """Write ``state`` (an engine, or what stands in for one: see :class:`~posttrain.train.core.Trainer`)
    after ``step`` (0-based) under ``cfg.checkpoint_dir``, with its checksums; a collective.

    Raises:
        RunError: the device holding ``checkpoint_dir`` is full (on every rank; the partial
            checkpoint removed, ``latest`` unchanged).
    """
    root = cfg.checkpoint_dir
    name = f"step-{step + 1:06d}"
    path = os.path.join(root, name)
    failed = torch.zeros(1)
    try:
        import torch.distributed.checkpoint as dcp  # (here: its import costs every command a fifth of a second)

        dcp.save(state.state_dict(optimizer), checkpoint_id=path)
        # this rank's files (DCP names them __RANK_N.distcp; rank 0 also writes .metadata)
        mine = {f: file_digest(os.path.join(path, f)) for f in sorted(os.listdir(path))
                if f.startswith(f"__{rank}_") or (rank == 0 and f == ".metadata")}
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)) or not (no_space(e) or _nearly_full(root)):
            raise
        failed[0], mine = 1, {}
    dist.all_reduce(failed)  # every rank stops if one met a full disk (DCP usually says so on all)
    every = [None] * dist.get_world_size() if rank == 0 else None
    if not failed.item():
        dist.gather_object(mine, every, dst=0)
    if rank == 0 and not failed.item():
        checksums = {f: d for part in every for f, d in part.items()}
        meta = {"steps_done": step + 1, "data_position": (step + 1) * cfg.sequences_per_step,
                "config": {k: getattr(cfg, k) for k in cfg.DATA_FIELDS}, "full_config": asdict(cfg),
                "checkpoint_format": state.checkpoint_format, "world_size": dist.get_world_size(),
                "checksum": CHECKSUM, "checksums": checksums}
        try:
            with open(os.path.join(path, "posttrain.json"), "w") as f:
                json.dump(meta, f, indent=1)
            tmp = os.path.join(root, ".latest.tmp")
            with open(tmp, "w") as f:
                f.write(name)
            os.replace(tmp, os.path.join(root, "latest"))
        except OSError as e:
            if not no_space(e):
                raise
            failed[0] = 1
        if not failed.item():
            old = sorted(d for d in os.listdir(root) if d.startswith("step-") and d != name)
            for d in old[:-1]:  # keep this one and the previous
                shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    dist.broadcast(failed, src=0)
    if failed.item():
        try:
            previous = latest_checkpoint(root)
        except ValueError:
            previous = None
        kept = f"`latest` still names {os.path.basename(previous[0])}" if previous else "no earlier checkpoint"
        msg = disk_full(f"checkpoint {name} under `checkpoint_dir` {root} (removed; {kept})", root)
        dist.barrier()  # every rank has read the free space before the partial checkpoint goes
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.remove(os.path.join(root, ".latest.tmp"))
        raise RunError(msg)
    dist.barrier()
    return path


def verify_checkpoint(path: str, meta: dict, rank: int = 0, world_size: int = 1) -> None:
    """Check the files of the checkpoint at ``path`` against the checksums ``meta`` records: this
    rank's share of them (every ``world_size``-th file, hashed on threads); a collective when the
    process group is initialized, every rank then raising the same error.

    Raises:
        RunError: a file is missing or does not match its checksum, named.
    """
    checksums = meta.get("checksums")
    problems: list[str] = []
    if checksums is None:  # written before checksums: at least the index must be there
        md = os.path.join(path, ".metadata")
        if not os.path.isfile(md) or os.path.getsize(md) == 0:
            problems.append(f"checkpoint {path}: its index .metadata is {'empty' if os.path.isfile(md) else 'missing'}")
    else:
        from concurrent.futures import ThreadPoolExecutor

        names = sorted(checksums)[rank::world_size]

        def check(f: str) -> str | None:
            full = os.path.join(path, f)
            if not os.path.isfile(full):
                return f"checkpoint {path}: {f} is missing"
            if file_digest(full) != checksums[f]:
                return (f"checkpoint {path}: {f} does not match its checksum (damaged or truncated; "
                        f"{os.path.getsize(full)} bytes)")
            return None

        with ThreadPoolExecutor(max_workers=min(8, max(1, len(names)))) as pool:
            problems = [p for p in pool.map(check, names) if p]
    if dist.is_initialized() and world_size > 1:
        every: list = [None] * world_size
        dist.all_gather_object(every, problems)
        problems = [p for part in every for p in part]
    if problems:
        hint = "; restore it, or write the name of the previous step-N folder into `latest` to resume from that"
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise RunError(f"{sorted(problems)[0]}{more}{hint}")


def resume(cfg: RunConfig, state, optimizer: torch.optim.Optimizer) -> int:
    """Load the newest checkpoint under ``cfg.checkpoint_dir`` into ``state`` and ``optimizer``
    (resharding to this world size); the number of steps it holds (0 if there is none)."""
    meta = check_resumable(cfg)
    if meta is None:
        return 0
    path, _ = latest_checkpoint(cfg.checkpoint_dir)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    verify_checkpoint(path, meta, rank, world)
    saved = state.state_dict(optimizer)
    load(saved, path)
    state.load_state_dict(saved, optimizer)
    return int(meta["steps_done"])


def load(state: dict, path: str, **kwargs) -> None:
    """``dcp.load(state, checkpoint_id=path)``: a failure to read the checkpoint in one line."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state, checkpoint_id=path, **kwargs)
    except (Exception, dcp.api.CheckpointException) as e:
        first = next((ln for ln in str(e).strip().splitlines() if ln.strip()), type(e).__name__)
        raise RunError(f"checkpoint {path} could not be loaded: {first[:300]}") from e
