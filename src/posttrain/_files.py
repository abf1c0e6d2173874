"""Temporary directories that a killed process cannot remove, and how the next one does.

A directory that is built and then renamed into place (a tokenized cache, an exported model) is
made with :func:`work_dir`, whose name carries the pid of the process writing it. Should that
process be killed outright, the next :func:`work_dir` beside it removes the leftovers of every
process that no longer runs.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

__all__ = ["pid_alive", "remove_orphans", "replace_dir", "work_dir"]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def remove_orphans(root: str | os.PathLike, prefix: str) -> list[str]:
    """Remove the directories ``PREFIX...<pid>.<8 characters>`` under ``root`` (what :func:`work_dir`
    makes) whose process no longer runs; the names removed."""
    gone = []
    pattern = re.compile(re.escape(prefix) + r"(?:.*\.)?(\d+)\.[a-z0-9_]{8}")
    try:
        names = os.listdir(root)
    except OSError:
        return gone
    for name in names:
        m = pattern.fullmatch(name)
        if m and not pid_alive(int(m.group(1))):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            gone.append(name)
    return gone


def work_dir(parent: str | os.PathLike, prefix: str, orphans: str | None = None) -> Path:
    """A new directory ``PREFIX<this pid>.<random>`` under ``parent``, after removing those of
    processes that died before renaming theirs into place (the names that start with
    ``orphans``, default ``prefix``: a folder of our own may sweep wider than a user's)."""
    remove_orphans(parent, prefix if orphans is None else orphans)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}.", dir=parent))


def replace_dir(new: str | os.PathLike, out: str | os.PathLike) -> None:
    """Put the finished directory ``new`` at ``out`` (a sibling), replacing what is there: the
    old one is renamed aside first, so ``out`` is always either the old or the new whole."""
    new, out = Path(new), Path(out)
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(new, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, out)
