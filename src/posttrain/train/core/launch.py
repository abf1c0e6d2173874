"""Starting a run: its output paths and checkpoint checked before any work, then its ranks as
forked CPU processes on this machine, or this process's rank under ``torchrun``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from posttrain.device import backend, check_world, device_count, rank_device, shares_devices, use
from posttrain.launch import end_process_groups, keep_freed_memory, run_job

from .checkpoint import check_resumable
from .config import RunConfig

__all__ = ["OutputLock", "check_output_path", "check_run", "claim_outputs", "launch", "launch_world", "under_torchrun"]


def check_output_path(flag: str, path: str | None, *, directory: bool) -> None:
    """Refuse, before any work, an output path that cannot be written: under a regular file, in
    an unwritable folder, or a directory where a file goes (and the reverse)."""
    if not path:
        return
    p = os.path.abspath(path)
    if os.path.exists(p):
        if directory and not os.path.isdir(p):
            raise ValueError(f"{flag} {path} is a file, not a directory")
        if not directory and os.path.isdir(p):
            raise ValueError(f"{flag} {path} is a directory; give a file name")
    parent = p if directory and os.path.isdir(p) else os.path.dirname(p)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: {parent} is a file, so nothing can be created under it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {parent} is not writable")


def check_run(cfg: RunConfig, outputs: Mapping[str, str | None] | None = None,
              world_size: int | None = None) -> dict | None:
    """Refuse, before any rank starts, what would fail late: a device the run cannot use (or,
    given ``world_size``, more ranks on this host than it has devices), an output path that
    cannot be written (the run's own and ``outputs``, ``{"`parameter`": file path}``), or a checkpoint
    under ``checkpoint_dir`` that is unreadable or was written by another kind of run. Returns
    that checkpoint's metadata (``None``: nothing to resume)."""
    kind = cfg.device_kind
    if cfg.tf32 and kind != "cuda":
        raise ValueError(f"`tf32` is a CUDA setting (TF32 tensor cores for fp32 matrix products); this run is on the "
                         f"{kind.upper()}: leave it out")
    if cfg.cudnn_attention and kind != "cuda":
        raise ValueError(f"`cudnn_attention` is a CUDA setting (cuDNN's attention kernel); this run is on the "
                         f"{kind.upper()}: leave it out")
    if world_size is not None:
        check_world(kind, world_size, local_world_size=local_world(world_size), shared_ok=cfg.device_sharing)
    for flag, path in (("`checkpoint_dir`", cfg.checkpoint_dir), ("`output_dir`", cfg.output_dir),
                       ("`tensorboard`", cfg.tensorboard)):
        check_output_path(flag, path, directory=True)
    for flag, path in {"`metrics`": cfg.metrics, **(outputs or {})}.items():
        check_output_path(flag, path, directory=False)
    if cfg.wandb is not None:
        check_wandb(cfg.wandb)
    return check_resumable(cfg)


def check_wandb(project: str) -> None:
    """Refuse ``wandb`` without the package, or with a project name W&B cannot take."""
    import importlib.util

    if not project.strip() or any(c in project for c in "/\\#?%:"):
        raise ValueError(f"`wandb` {project!r} is not a W&B project name (no /, \\, #, ?, %, : and not empty)")
    if importlib.util.find_spec("wandb") is None:
        raise ValueError("`wandb` needs the wandb package: pip install wandb (or pip install 'posttrain[wandb]')")


class OutputLock:
    """An exclusive claim on an output path for a run's life, so that a second run given the same
    path is refused at once rather than interleaving its writes with the first's.

    The claim is ``flock`` on ``.NAME.posttrain-lock`` beside the path (beside rather than inside:
    an ``output_dir`` is replaced whole when written). The kernel drops it when every process
    holding it has exited, however they ended (ranks forked from the launcher share it), so a
    lock file left by a killed run is taken over; a released lock's file is removed.
    """

    def __init__(self, flag: str, path: str) -> None:
        self.flag, self.path = flag, path
        full = os.path.abspath(path)
        self.lock = os.path.join(os.path.dirname(full), f".{os.path.basename(full)}.posttrain-lock")
        self.fd: int | None = None

    def __enter__(self) -> OutputLock:
        import fcntl

        os.makedirs(os.path.dirname(self.lock), exist_ok=True)
        while True:
            fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise ValueError(f"{self.flag} {self.path} is in use by another run (process {holder}); wait for it "
                                 f"to end or give another {self.flag}") from None
            try:  # the file may have been removed by a run releasing it between open and flock
                same = os.path.samestat(os.fstat(fd), os.stat(self.lock))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.lock)
        os.close(self.fd)
        self.fd = None


@contextlib.contextmanager
def claim_outputs(cfg: RunConfig, outputs: Mapping[str, str | None] | None = None, *,
                  lead: bool = True) -> Iterator[None]:
    """Hold :class:`OutputLock` on every output path of the run (``checkpoint_dir``,
    ``output_dir``, ``metrics``, ``tensorboard`` and ``outputs``) for the block; only where
    ``lead`` (under ``torchrun``, rank 0 claims for every rank).

    Raises:
        ValueError: another run holds one of them (named, with its process).
    """
    paths = {"`checkpoint_dir`": cfg.checkpoint_dir, "`output_dir`": cfg.output_dir, "`metrics`": cfg.metrics,
             "`tensorboard`": cfg.tensorboard, **(outputs or {})}
    with contextlib.ExitStack() as stack:
        if lead:
            seen = set()
            for flag, path in paths.items():
                if path and os.path.abspath(path) not in seen:
                    seen.add(os.path.abspath(path))
                    stack.enter_context(OutputLock(flag, path))
        yield


def under_torchrun() -> bool:
    """Whether this process is a rank started by ``torchrun``."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                    and "MASTER_ADDR" in os.environ)


def launch_world(world_size: int | None, device: str = "cpu") -> tuple[int, bool]:
    """``(world size, whether this process leads)`` of a run asked for ``world_size`` processes
    (``None``: one per GPU on ``device`` cuda, else 2): under ``torchrun``, torchrun's world and
    whether this is its rank 0."""
    if world_size is None:
        world_size = 2 if device == "cpu" else device_count(device)
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]) == 0
    return world_size, True


def local_world(world_size: int) -> int:
    """Ranks on this host: torchrun's ``LOCAL_WORLD_SIZE``, else ``world_size`` (the fork launcher
    starts every rank here)."""
    local = os.environ.get("LOCAL_WORLD_SIZE") if under_torchrun() else None
    return int(local) if local else world_size


def placement(kind: str, world_size: int) -> str:
    """Where a run's ranks are, as its banner says it: ``2 CPU processes``, ``8 processes, one
    cuda device each`` or ``2 processes sharing 1 cuda device (gloo for every collective)``."""
    from posttrain.text import count

    if kind == "cpu":
        return count(world_size, "CPU process", "CPU processes")
    if not shares_devices(kind, local_world(world_size)):
        return f"{count(world_size, 'process', 'processes')}, one {kind} device each"
    return (f"{count(world_size, 'process', 'processes')} sharing {count(device_count(kind), f'{kind} device')} "
            "(gloo for every collective)")


def job_options(device: str, world_size: int) -> dict[str, str | None]:
    """How ``world_size`` ranks of device kind ``device`` start (:func:`~posttrain.launch.run_job`'s
    ``backend`` and ``start``): :func:`posttrain.device.backend`, gloo alone where ranks share a GPU
    (which :func:`check_run` allowed); GPU ranks spawned, over gloo too (a child forked from a parent
    that touched CUDA cannot use it)."""
    return {"backend": backend(device, shared=shares_devices(device, local_world(world_size))),
            "start": "spawn" if device != "cpu" else None}


def launch(worker: Callable[..., Any], world_size: int, *args: Any, device: str = "cpu",
           timeout_s: float = 24 * 3600) -> list[Any] | None:
    """``worker(rank, world_size, *args)`` on every rank: ``world_size`` forked processes, or,
    under ``torchrun``, this process's rank of torchrun's world; their process groups are
    :func:`job_options` of the device kind ``device``. Every rank's result, in rank order (``None`` on
    torchrun ranks other than 0)."""
    how = job_options(device, world_size)
    if not under_torchrun():
        return run_job(worker, world_size, *args, timeout_s=timeout_s, **how)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if device == "cpu":
        keep_freed_memory()
    use(rank_device(device, int(os.environ["RANK"])))
    dist.init_process_group(how["backend"])
    try:
        mine = worker(dist.get_rank(), dist.get_world_size(), *args)
        every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, every, dst=0)
        return every
    finally:
        end_process_groups()
