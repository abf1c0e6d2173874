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
