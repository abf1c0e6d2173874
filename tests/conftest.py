import os
import time

import pytest
import torch

torch.set_num_threads(1)


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
