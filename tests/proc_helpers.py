"""Processes seen through /proc (Linux): the fault and safe-stop tests' view of what a run left."""

from __future__ import annotations


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (none once it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def running_with(text: str) -> list[int]:
    """The live processes whose command line contains ``text`` (whatever their parent: an orphan
    reparented to init counts)."""
    import os

    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and alive(int(entry)):
            out.append(int(entry))
    return out


def interruptible() -> None:
    """``preexec_fn`` for a command a test interrupts: SIGINT at its default, as on a terminal. A
    process started in the background by a non-interactive shell (``cmd &`` in a script, nohup)
    inherits SIGINT ignored, and a command rightly leaves an ignored SIGINT ignored."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
