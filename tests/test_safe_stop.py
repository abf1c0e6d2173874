"""Stopping a run: SIGINT, SIGTERM or SIGKILL of the launcher stops every rank within seconds and
leaves no rendezvous directory; a dead rank ends the job with one line naming it. A failure
names the signal whose handling leaves ranks running, files behind, or a traceback on the
terminal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from proc_helpers import alive, children, interruptible


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _start(tmp_path):
    """A long run; returns (process, its ranks and reaper, its TMPDIR) once both ranks are training."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    metrics = tmp_path / "m.jsonl"
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "posttrain", "train", "--steps", "100000", "--dim", "32", "--layers",
                             "1", "--sequences", "4", "--max-len", "64", "--metrics", str(metrics)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                            preexec_fn=interruptible)
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # a step done: both ranks train
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(0.2)
    kids = children(proc.pid)
    reaper = [k for k in kids if "_reaper.py" in _cmdline(k)]
    ranks = [k for k in kids if k not in reaper]
    assert len(ranks) == 2 and all(alive(r) for r in ranks) and len(reaper) == 1
    assert [p.name for p in tmp.iterdir() if p.name.startswith("posttrain-rdzv-")]
    return proc, ranks + reaper, tmp


def _gone(ranks, tmp, within: float) -> None:
    deadline = time.monotonic() + within
    while any(alive(r) for r in ranks) or any(p.name.startswith("posttrain-rdzv-") for p in tmp.iterdir()):
        assert time.monotonic() < deadline, (f"still running: {[r for r in ranks if alive(r)]}, left: "
                                             f"{[p.name for p in tmp.iterdir()]}")
        time.sleep(0.1)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupting_the_launcher_stops_every_rank_with_one_line(tmp_path, sig, code):
    proc, ranks, tmp = _start(tmp_path)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # Ctrl-C reaches the whole process group
    else:
        os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == code
    assert err.strip().splitlines() == [f"posttrain: interrupted by {signal.Signals(sig).name}; every rank stopped "
                                        "(a --checkpoint-dir run resumes from its last checkpoint)"]
    _gone(ranks, tmp, within=5)


def test_killing_the_launcher_stops_every_rank_and_removes_the_rendezvous(tmp_path):
    proc, ranks, tmp = _start(tmp_path)
    proc.kill()
    proc.wait()
    _gone(ranks, tmp, within=10)


def test_a_dead_rank_ends_the_job_with_one_line_and_a_log(tmp_path):
    proc, ranks, tmp = _start(tmp_path)
    os.kill(ranks[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "rank 1 died with exit code -9" in lines[0], err
    log = lines[0].rsplit("tracebacks: ", 1)[1].rstrip(")")
    assert log.startswith(str(tmp)) and "rank 1 died" in open(log).read()
    _gone(ranks, tmp, within=5)


_STUCK_JOB = """
import ctypes, os, sys, time
from posttrain.launch import run_ranks

def stuck(rank, world_size, marker):
    open(f"{marker}.{rank}", "w").close()
    ctypes.PyDLL(None).sleep(120)  # native code holding the GIL: the rank's own watchdog cannot run

run_ranks(stuck, 2, sys.argv[1], timeout_s=600)
"""


def test_ranks_stuck_in_native_code_die_with_a_killed_launcher(tmp_path):
    """The reaper stops ranks whose watchdog thread cannot run, and removes the rendezvous."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    marker = tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", _STUCK_JOB, str(marker)], env={**os.environ, "TMPDIR": str(tmp)})
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"started.{r}").exists() for r in (0, 1)):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    kids = children(proc.pid)
    assert len(kids) == 3  # two ranks and the reaper
    proc.kill()
    proc.wait()
    _gone(kids, tmp, within=10)


def test_the_next_job_removes_rendezvous_dirs_of_dead_launchers(tmp_path):
    from posttrain.launch import sweep_rendezvous

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"posttrain-rdzv-{dead.pid}-abc").mkdir()
    (tmp_path / f"posttrain-rdzv-{os.getpid()}-def").mkdir()  # a live launcher's: kept
    (tmp_path / "posttrain-rdzv-xyz").mkdir()  # not named by a pid: kept
    assert sweep_rendezvous(str(tmp_path)) == [f"posttrain-rdzv-{dead.pid}-abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"posttrain-rdzv-{os.getpid()}-def", "posttrain-rdzv-xyz"]


_CREATING_JOB = """
import os, sys, time
import torch.distributed as dist
from posttrain.launch import run_ranks
from posttrain.odc import ShmTransport

def creating(rank, world_size, marker):
    if rank == 1:  # held inside create, its segment file made: rank 0 waits for it at the barrier
        def held(fd, offset, length):
            open(marker, "w").close()
            time.sleep(120)
        os.posix_fallocate = held
    ShmTransport.create(dist.group.WORLD, {"x": 64})

run_ranks(creating, 2, sys.argv[1], timeout_s=600)
"""


def _shm_names_of(pids) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith("posttrain-odc-") and n.rsplit("-", 1)[1] in
            {str(p) for p in pids}]


def test_a_launcher_killed_while_its_ranks_create_the_transport_leaves_no_shared_memory(tmp_path):
    """Ranks killed between making their segment files and unlinking them (every peer mapped)
    cannot unlink them: the reaper removes the names of the ranks it killed."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    marker = tmp_path / "held"
    proc = subprocess.Popen([sys.executable, "-c", _CREATING_JOB, str(marker)], env={**os.environ, "TMPDIR": str(tmp)})
    deadline = time.monotonic() + 60
    kids = []
    while not marker.exists() or len(_shm_names_of(kids)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, "the ranks did not reach the transport"
        time.sleep(0.05)
        kids = children(proc.pid)
    proc.kill()
    proc.wait()
    _gone(kids, tmp, within=10)
    assert _shm_names_of(kids) == []


def test_the_next_job_removes_shared_memory_names_of_dead_creators(tmp_path):
    from posttrain._reaper import SHM_DIR, SHM_PREFIX, remove_shm_names, stale_shm_name
    from posttrain.odc._transport import NAME_PREFIX
    from posttrain.odc._transport import SHM_DIR as TRANSPORT_DIR

    assert (SHM_DIR, SHM_PREFIX) == (TRANSPORT_DIR, NAME_PREFIX + "-")  # the reaper's copy of the name's form
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = time.time() - 120
    for name, mtime in [(f"{NAME_PREFIX}-t1-0-{dead.pid}", old), (f"{NAME_PREFIX}-t2-0-{dead.pid}", None),
                        (f"{NAME_PREFIX}-t3-1-{os.getpid()}", old), (f"other-0-{dead.pid}", old)]:
        (tmp_path / name).touch()
        if mtime:
            os.utime(tmp_path / name, (mtime, mtime))
    assert remove_shm_names(stale_shm_name, str(tmp_path)) == [str(tmp_path / f"{NAME_PREFIX}-t1-0-{dead.pid}")]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(  # young, alive or not ours: kept
        [f"{NAME_PREFIX}-t2-0-{dead.pid}", f"{NAME_PREFIX}-t3-1-{os.getpid()}", f"other-0-{dead.pid}"])
