"""The launcher's reaper: a small process that outlives a launcher killed outright.

:func:`posttrain.launch.run_ranks` starts it (``python -I -S _reaper.py LAUNCHER_PID DIR``, in a
session of its own so that a signal to the terminal's process group does not reach it) and
writes it each rank's pid on stdin, then ``done`` once the job is over and its rendezvous
directory removed. Should the launcher die first (``SIGKILL``, an out-of-memory kill), the reaper
kills the ranks it was told of (those still the same processes: their start time is checked, so
a reused pid is left alone), waits for them to go, removes the rendezvous directory ``DIR`` and
the shared-memory names those ranks created and had not yet unlinked (a rank killed inside
:meth:`posttrain.odc.ShmTransport.create`; the names end with their creator's pid), and exits.
A rank stuck in native code (holding the GIL, so that its own watchdog thread cannot run) is
stopped all the same.

Standard library only: it starts in tens of milliseconds.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import time


def start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot), or ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


#: :data:`posttrain.odc._transport.SHM_DIR` and ``NAME_PREFIX`` (this file imports nothing of
#: posttrain's; a test checks they agree).
SHM_DIR, SHM_PREFIX = "/dev/shm", "posttrain-odc-"


def remove_shm_names(pick, shm_dir: str = SHM_DIR) -> list[str]:
    """Remove the transport's segment names in ``shm_dir`` (``SHM_PREFIX``TOKEN-RANK-PID) for which
    ``pick(creator pid, path)`` is true; the paths removed."""
    gone = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return gone
    for name in names:
        pid, path = name.rsplit("-", 1)[-1], os.path.join(shm_dir, name)
        if name.startswith(SHM_PREFIX) and pid.isdigit() and pick(int(pid), path):
            try:
                os.unlink(path)
                gone.append(path)
            except OSError:
                pass
    return gone


def stale_shm_name(pid: int, path: str, older_than_s: float = 60.0) -> bool:
    """Whether a segment name's creator ``pid`` is gone (killed inside
    :meth:`posttrain.odc.ShmTransport.create`, before every peer had mapped it) and the name is
    older than ``older_than_s``: a process in another pid namespace sharing this ``/dev/shm``
    would judge a live creator gone, and no creation lasts that long but one waiting on a slow peer."""
    try:
        return start_time(pid) is None and time.time() - os.stat(path).st_mtime > older_than_s
    except OSError:
        return False


def reap(ranks: dict[int, str | None], directory: str, wait_s: float = 10.0) -> None:
    """Kill ``ranks`` (pid: start time) that are still those processes, wait for them, remove
    ``directory`` and the shared-memory names they created."""
    for pid, started in ranks.items():
        if started is not None and start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(s is not None and start_time(p) == s for p, s in ranks.items()):
        time.sleep(0.05)
    shutil.rmtree(directory, ignore_errors=True)
    killed = {p for p, s in ranks.items() if s is not None and start_time(p) != s}
    remove_shm_names(lambda pid, path: pid in killed)


def main(launcher: int, directory: str) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ranks: dict[int, str | None] = {}
    buf = b""
    fd = sys.stdin.fileno()
    while True:
        if os.getppid() != launcher:
            reap(ranks, directory)
            return 1
        ready, _, _ = select.select([fd], [], [], 0.1)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:  # every writer closed without 'done': the launcher is gone
            reap(ranks, directory)
            return 1
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            word = line.strip().decode()
            if word == "done":
                return 0
            if word.isdigit():
                ranks[int(word)] = start_time(int(word))


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2]))
