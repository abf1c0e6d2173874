"""Failures reported to the user in one line: :class:`RunError`, and what turns a full disk into one.

A rank or the launcher raises :class:`RunError` for a failure whose cause its message states (a
non-finite loss, a full disk, a damaged checkpoint): the command prints that line and exits 1,
without tracebacks (:func:`posttrain.launch.run_job` carries it across processes).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator

__all__ = ["RunError", "disk_full", "no_space", "writing"]


class RunError(RuntimeError):
    """A run stopped for a reason its message states in one line (no traceback needed)."""


def no_space(exc: BaseException | None) -> bool:
    """Whether ``exc`` or an exception it was raised from or during is a full disk (or quota)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc):
            return True
        # torch.distributed.checkpoint's CheckpointException: each rank's (exception, traceback)
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict) and any(no_space(f[0] if isinstance(f, tuple) else f) for f in failures.values()):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def disk_full(what: str, path: str | os.PathLike) -> str:
    """One line: the device holding ``path`` is full (its free and total space, as far as they
    can be read), met while writing ``what``."""
    where = os.path.abspath(path)
    while where and not os.path.exists(where):
        where = os.path.dirname(where)
    try:
        usage = shutil.disk_usage(where)
        space = f" ({_size(usage.total)} in all, {_size(usage.free)} free now)"
    except OSError:
        space = ""
    return f"no space left on the device holding {path}{space} while writing {what}"


@contextlib.contextmanager
def writing(what: str, path: str | os.PathLike | None) -> Iterator[None]:
    """Turn a full disk met inside the block into :class:`RunError` naming ``path`` and ``what``."""
    try:
        yield
    except RunError:
        raise
    except Exception as e:
        if path is not None and no_space(e):
            raise RunError(disk_full(what, path)) from None
        raise
