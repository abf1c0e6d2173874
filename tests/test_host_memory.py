"""Ranks keep the memory they free (posttrain.launch.keep_freed_memory): a second large allocation
reuses the pages of the first instead of faulting on fresh ones from the kernel, as glibc's
default allocator often does when allocations change size from step to step. A failure names the
rank's faults on reuse, or an environment that chose its own allocator and was overridden."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from posttrain.launch import keep_freed_memory, run_ranks

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")

#: A training step's sequence lengths, changing from step to step: with glibc's default allocator the
#: activations come from fresh pages again and again (its mmap and trim thresholds move with them).
_LENGTHS = (1024, 256, 512)


def _faults_on_reuse(rank, world):
    """Page faults over the last 6 of 12 forward and backward passes of posttrain's GPT (the
    allocator settles in the first ones)."""
    from posttrain.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, dim=128, num_layers=4, num_heads=4, max_seq_len=max(_LENGTHS)))
    faults = 0
    for step in range(12):
        ids = torch.randint(0, 64, (1, _LENGTHS[step % len(_LENGTHS)]))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        model(ids).float().square().mean().backward()
        if step >= 6:
            faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return keep_freed_memory(), faults


def test_a_rank_reuses_the_memory_it_freed():
    for kept, faults in run_ranks(_faults_on_reuse, 2, timeout_s=120):
        assert kept and faults < 2500, f"{faults} page faults in 6 steps that reuse what the steps before freed"


@pytest.mark.parametrize("env", [{"POSTTRAIN_KEEP_FREED_MEMORY": "0"}, {"MALLOC_TRIM_THRESHOLD_": "131072"}])
def test_an_environment_that_says_otherwise_keeps_the_allocator_as_it_is(monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # (the faults then are glibc's to decide: from one to some 17,000 in these 6 steps, by the heap the
    # rank inherits; without the setting most runs of the test above fail)
    assert run_ranks(_faults_on_reuse, 1, timeout_s=120)[0][0] is False
