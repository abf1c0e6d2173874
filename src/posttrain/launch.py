"""Start ``world_size`` ranks as forked CPU processes on one machine.

Used by the demo, the benchmarks and the multi-process tests. Ranks are started with the
``fork`` start method after ``torch.set_num_threads(1)`` and rendezvous through a file, so
ranks start quickly: no child re-imports torch (``spawn`` would, in every child).

Results travel back serialized with ``torch.save``; a rank that raises sends its traceback,
and :func:`run_ranks` raises one error naming every failed rank. Ranks that are still alive
when the deadline passes are killed, so a hung job cannot hang the caller.

Stopping is safe: the ranks ignore SIGINT (the launcher handles Ctrl-C for the job); SIGINT or
SIGTERM to the launcher kills every rank and removes the rendezvous directory before
:class:`Interrupted` propagates. A launcher killed outright (SIGKILL) cannot clean up: its
reaper (:mod:`posttrain._reaper`, a small process in a session of its own) kills the ranks and
removes the rendezvous directory, and a watchdog thread in every rank ends it within a second
as well (rank 0 removing the directory first); should the reaper die too, the next job removes
the directories of launchers no longer running. When a rank fails, the others get
:data:`FAILURE_GRACE_S` seconds to report their own errors, then are killed.

A rank that raises :class:`RunError` (a failure the user acts on: a non-finite loss, a full
disk, a damaged checkpoint) makes :func:`run_job` raise that one line, without tracebacks.
"""

from __future__ import annotations

import gc
import io
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from posttrain._files import pid_alive
from posttrain._reaper import remove_shm_names, stale_shm_name
from posttrain.device import start_method
from posttrain.errors import RunError

__all__ = ["FAILURE_GRACE_S", "Interrupted", "RanksFailedError", "RunError", "end_process_groups", "keep_freed_memory",
           "run_job", "run_ranks", "sweep_rendezvous"]

#: Seconds the surviving ranks of a failed job get to report their own errors before being killed.
FAILURE_GRACE_S = 10.0

#: glibc's ``mallopt`` parameters (malloc.h): give freed memory back to the system above this much at the
#: heap's top; serve allocations of at least this many bytes with a fresh ``mmap`` each.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: The environment that sets glibc's allocator itself (then it is left as set).
_MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_", "GLIBC_TUNABLES",
               "LD_PRELOAD")


def keep_freed_memory() -> bool:
    """Keep the memory a rank frees for its next allocations instead of giving it back to the
    system (glibc: no trimming of the heap, no ``mmap`` per large allocation, up to 2 GiB). A CPU
    training step allocates and frees its activations every microbatch; by default glibc serves
    each large one with fresh pages from the kernel, and every first touch of a page is a fault
    (about 2 microseconds a 4 KiB page on this project's CPU machines, a tenth of the time to
    fill it: ``scripts/page_faults.py``), some 20,000 of them a 4,096-token sequence's forward
    and backward. Left as it is where the environment sets the allocator (``MALLOC_*_``,
    ``GLIBC_TUNABLES``, ``LD_PRELOAD``: jemalloc or tcmalloc, say) or says
    ``POSTTRAIN_KEEP_FREED_MEMORY=0``, and off glibc. A rank's memory then stays at its peak
    until it exits. Returns whether it was set."""
    if os.environ.get("POSTTRAIN_KEEP_FREED_MEMORY", "1") == "0" or any(os.environ.get(k) for k in _MALLOC_ENV):
        return False
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    most = ctypes.c_int(2**31 - 1)
    return bool(mallopt(_M_TRIM_THRESHOLD, most)) and bool(mallopt(_M_MMAP_THRESHOLD, most))


class Interrupted(Exception):
    """The launcher got SIGINT or SIGTERM; every rank was stopped and the rendezvous removed."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def line(self) -> str:
        """What the command prints for it (one line)."""
        return f"posttrain: {self}; every rank stopped (a --checkpoint-dir run resumes from its last checkpoint)"


class RanksFailedError(RuntimeError):
    """One or more ranks of a :func:`run_ranks` job raised, died or timed out."""

    def __init__(self, message: str, errors: dict[int, str]):
        super().__init__(message)
        self.errors = errors

    def summary(self) -> str:
        """One line: the ranks that failed first (died, or raised something other than losing a
        peer) and how, then the ranks that only failed with them."""
        last = {}
        for r, text in self.errors.items():
            lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
            last[r] = lines[-1] if lines else "failed"
        follower = ("Connection reset", "Connection closed", "PeerFailedError", "was stopped after", "peer")
        first = [r for r in sorted(last) if not any(k in last[r] for k in follower)] or sorted(last)
        parts = [last[r] if last[r].startswith(f"rank {r} ") else f"rank {r}: {last[r]}" for r in first]
        rest = [r for r in sorted(last) if r not in first]
        if rest:
            parts.append(f"rank{'s' if len(rest) > 1 else ''} {', '.join(map(str, rest))} stopped with it")
        return "; ".join(parts)

    def value_error(self) -> str | None:
        """The message of a ``ValueError`` (bad input) some rank raised, if any: the
        user-facing cause, without the rank tracebacks."""
        return self._raised("ValueError")

    def run_error(self) -> str | None:
        """The message of a :class:`RunError` some rank raised, if any."""
        return self._raised("posttrain.errors.RunError") or self._raised("RunError")

    def _raised(self, name: str) -> str | None:
        for r in sorted(self.errors):
            _, sep, msg = self.errors[r].rpartition(f"\n{name}: ")
            if sep:
                return msg.strip()
        return None


def end_process_groups() -> None:
    """Destroy every process group, after freeing what still holds one. FSDP2 keeps its modules,
    states and communication contexts in reference cycles, which hold the process groups; left to
    the interpreter's teardown, the groups' C++ side (gloo's threads and their work) is destroyed
    then, and a process ended that way sometimes aborts ("terminate called without an active
    exception": seen in 1 of about 40 runs of examples/engines.py under torchrun, after every loss
    had printed). Collecting the cycles first frees them while the interpreter still runs."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    backend: str,
    pg_timeout_s: float,
    results: Any,
    args: tuple,
    kwargs: dict,
) -> None:
    torch.set_num_threads(1)
    keep_freed_memory()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    parent, rendezvous = os.getppid(), os.path.dirname(init_file) if rank == 0 else None
    _watch_parent(parent, rendezvous)
    status, payload = "ok", b""
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        if backend == "gloo":
            # Every rank done connecting before any goes on: a rank whose work needs no collective
            # can otherwise finish and close its sockets while a peer still accepts its connection
            # (gloo's connectFullMesh then fails on that peer: "Connection closed by peer"; seen
            # once in five `make test` runs, a bad-input test whose ranks return at once).
            dist.barrier()
        out = fn(rank, world_size, *args, **kwargs)
        buf = io.BytesIO()
        torch.save(out, buf)
        payload = buf.getvalue()
    except BaseException:
        status, payload = "error", traceback.format_exc().encode()
    finally:
        try:  # (no teardown follows here: the rank ends with os._exit, so the groups need no collection first)
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
    if os.getppid() != parent:  # the launcher died (a peer's failure may end this rank before the
        _orphaned(rendezvous)     # watcher's next look): nobody reads the result; clean up and go
    results.put((rank, status, payload))
    results.close()
    results.join_thread()
    # Skip interpreter teardown in the forked child: the parent owns atexit handlers.
    os._exit(0)


def _orphaned(rendezvous: str | None) -> None:
    """End a rank whose launcher is gone, removing the rendezvous directory it owns."""
    if rendezvous:
        shutil.rmtree(rendezvous, ignore_errors=True)
    os._exit(1)


def _watch_parent(parent: int, rendezvous: str | None) -> None:
    """A daemon thread that ends this rank within a second of the launcher's death (even by
    SIGKILL, which the launcher cannot clean up after), removing ``rendezvous`` first."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        _orphaned(rendezvous)

    threading.Thread(target=watch, name="posttrain-watch-launcher", daemon=True).start()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    start: str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked processes (spawned
    where ``backend`` uses an accelerator: :func:`posttrain.device.start_method`; ``fn`` and the
    arguments must pickle then).

    Each process has an initialized default process group. Returns the ranks' return
    values in rank order.

    Args:
        fn: the per-rank function; its return value must be serializable by ``torch.save``.
        world_size: number of ranks to start.
        backend: torch.distributed backend (``gloo`` on CPU, :func:`posttrain.device.backend`).
        timeout_s: wall-clock limit for the whole job; ranks still running then are killed.
        start: the start method, ``fork`` or ``spawn`` (default: :func:`posttrain.device.start_method`
            of ``backend``); ``spawn`` for ranks that use a GPU over a gloo group (several ranks on
            one GPU, which NCCL refuses).

    Raises:
        RanksFailedError: a rank raised, died or did not finish within ``timeout_s``.
        Interrupted: SIGINT or SIGTERM reached this process (the ranks are stopped by then).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    torch.set_num_threads(1)
    ctx = mp.get_context(start or start_method(backend))
    results = ctx.Queue()
    sweep_rendezvous()
    with _Reaper(tempfile.mkdtemp(prefix=f"{_RDZV_PREFIX}{os.getpid()}-")) as reaper:
        tmp = reaper.directory
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, init_file, backend, timeout_s, results, args, kwargs),
                daemon=True,
            )
            for rank in range(world_size)
        ]

        def stop(signum, frame):
            raise Interrupted(signum)

        main_thread = threading.current_thread() is threading.main_thread()
        old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
        try:
            for p in procs:
                p.start()
                reaper.watch(p.pid)
            outputs, errors = _collect(procs, results, world_size, timeout_s)
        except BaseException:
            for p in procs:
                if p.pid is not None and p.is_alive():
                    p.kill()
            for p in procs:
                if p.pid is not None:
                    p.join()
            raise
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
    if errors:
        detail = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
        raise RanksFailedError(f"{len(errors)} of {world_size} ranks failed:\n{detail}", errors)
    return [outputs[r] for r in range(world_size)]


def _collect(procs: list, results: Any, world_size: int, timeout_s: float) -> tuple[dict[int, Any], dict[int, str]]:
    """Wait for every rank's result; kill the ranks that are late (the deadline, or the grace
    period after another rank failed)."""
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    late = f"did not finish within {timeout_s:.0f}s and was killed"
    while len(outputs) + len(errors) < world_size:
        if errors and deadline > time.monotonic() + FAILURE_GRACE_S:
            deadline = time.monotonic() + FAILURE_GRACE_S
            late = f"was stopped after rank {min(errors)} failed"
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue_mod.Empty:
            if time.monotonic() > deadline:
                break
            dead = [
                r
                for r, p in enumerate(procs)
                if not p.is_alive() and r not in outputs and r not in errors
            ]
            # A process that exited without reporting died hard (signal, os._exit).
            if dead and results.empty():
                time.sleep(0.5)
                if results.empty():
                    for r in dead:
                        errors[r] = f"rank {r} died with exit code {procs[r].exitcode}"
            continue
        if status == "ok":
            outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors[rank] = payload.decode()
    for r, p in enumerate(procs):
        if r not in outputs and r not in errors:
            errors[r] = f"rank {r} {late}"
        p.join(timeout=1.0)
        if p.is_alive():
            p.kill()
            p.join()
    return outputs, errors


_RDZV_PREFIX = "posttrain-rdzv-"


def sweep_rendezvous(root: str | None = None) -> list[str]:
    """Remove the rendezvous directories (``posttrain-rdzv-PID-*`` under ``root``, default the
    temporary folder) of launchers that are no longer running: what a launcher killed together
    with its reaper leaves; and (``root`` not given) the transport's shared-memory names whose
    creators are gone (:func:`posttrain._reaper.stale_shm_name`). The directories removed."""
    if root is None:
        remove_shm_names(stale_shm_name)
    root = root or tempfile.gettempdir()
    gone = []
    try:
        names = os.listdir(root)
    except OSError:
        return gone
    for name in names:
        pid = name[len(_RDZV_PREFIX):].split("-", 1)[0]
        if name.startswith(_RDZV_PREFIX) and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            gone.append(name)
    return gone


class _Reaper:
    """The job's rendezvous directory and reaper process (:mod:`posttrain._reaper`): told every
    rank's pid, the reaper kills them and removes the directory should this launcher die before
    the job ends; on leaving, the directory is removed, then the reaper told ``done``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> _Reaper:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_reaper.py")
        try:
            self.proc = subprocess.Popen([sys.executable, "-I", "-S", script, str(os.getpid()), self.directory],
                                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
        except OSError:  # no reaper: the ranks' own watchdogs still stop them
            self.proc = None
        return self

    def watch(self, pid: int) -> None:
        self._say(f"{pid}\n")

    def _say(self, text: str) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.write(text.encode())
                self.proc.stdin.flush()
            except OSError:
                pass

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        if self.proc is None:
            return
        self._say("done\n")
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_job(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0, **kwargs: Any) -> list[Any]:
    """:func:`run_ranks` for commands: a rank that rejected its input (raised ``ValueError``)
    raises that ``ValueError`` here, and one that raised :class:`RunError` that ``RunError``: one
    line for the user; other failures stay :class:`RanksFailedError`."""
    try:
        return run_ranks(fn, world_size, *args, timeout_s=timeout_s, **kwargs)
    except RanksFailedError as e:
        msg = e.value_error()
        if msg is not None:
            raise ValueError(msg) from None
        msg = e.run_error()
        if msg is not None:
            raise RunError(msg) from None
        raise
