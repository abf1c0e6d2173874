import os

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_shm_leak():
    """Every test must leave nothing of ours in /dev/shm."""
    before = {f for f in os.listdir("/dev/shm") if f.startswith("posttrain")}
    yield
    after = {f for f in os.listdir("/dev/shm") if f.startswith("posttrain")}
    assert after <= before, f"leaked in /dev/shm: {sorted(after - before)}"
