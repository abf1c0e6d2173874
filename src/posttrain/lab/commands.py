"""Running ``posttrain`` commands in fresh processes, as a reader would type them: what
``posttrain results`` (docs/results.md) and the README's rerun (``lab/readme.py``) both do."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

__all__ = ["run_posttrain"]


def run_posttrain(argv: Sequence[str], log: Callable[[str], None], *, cwd: str | None = None,
                  ok: tuple[int, ...] = (0,)) -> list[str]:
    """``posttrain ARGV`` in a fresh process (in ``cwd``), said and timed in ``log``; its standard
    output's lines. Raises ``RuntimeError`` (with the end of its standard error) on an exit
    status not in ``ok``."""
    log("$ posttrain " + " ".join(argv))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "posttrain", *argv], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log(f"  ({time.monotonic() - start:.0f} s, exit {proc.returncode})")
    if proc.returncode not in ok:
        raise RuntimeError(f"posttrain {' '.join(argv)} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return proc.stdout.splitlines()
