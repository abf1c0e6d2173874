"""Shared fixtures: the shared-memory leak check on every test, and running the command line."""

import os
import subprocess
import sys
import time

import pytest
import torch

torch.set_num_threads(1)

_ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def run_cli():
    """``run_cli(*args)``: ``posttrain ARGS`` in a fresh process, as a user runs it; returns the
    completed process (stdout, stderr, returncode)."""

    def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "posttrain", *args], capture_output=True, text=True,
                              timeout=timeout, env=_ENV)

    return run


def _ours() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("posttrain")}


@pytest.fixture(autouse=True)
def _no_shm_leak():
    """Every test must leave nothing of ours in /dev/shm.

    A name exists only between creation and the moment every rank mapped it, so a file that is
    still there after a short grace period is a leak; one that vanishes belonged to another job
    running concurrently on this machine.
    """
    before = _ours()
    yield
    leaked = _ours() - before
    deadline = time.monotonic() + 2.0
    while leaked and time.monotonic() < deadline:
        time.sleep(0.1)
        leaked &= _ours()
    assert not leaked, f"leaked in /dev/shm: {sorted(leaked)}"
