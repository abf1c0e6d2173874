"""Embedded synthetic data: named length profiles and a counting task.

Synthetic sequences need no download. Each one counts up from a random start with a random
stride (mod the vocabulary), a task a small model learns in a few dozen steps, so the loss falls
visibly. Length profiles (``PROFILES``), every one scaled to ``max_len``:

- ``long_tail``: log-normal, median ``max_len / 8``: most sequences short, a few very long;
- ``bimodal``: 80% chat turns (``max_len / 32`` +- noise) and 20% documents (``max_len / 2``
  to ``max_len``);
- ``uniform``: uniform in ``[max_len / 2, max_len]`` (nearly balanced: the control case);
- ``longalign``: the shape of LongAlign as the ODC paper reports it (mean ~16.5K tokens, at most
  64K): log-normal, median 13,076, sigma 0.7, clipped to [1,024, 65,536], then every length
  multiplied by ``max_len / 65536`` (``max_len=4096``: 1/16, lengths 64-4,096, mean ~1.0K);
- ``swe_smith``: SWE-smith agent trajectories (mean ~34.7K, at most 128K): median 29,125,
  sigma 0.6, clipped to [2,048, 131,072], scaled by ``max_len / 131072``.
The last two are stand-ins with the published mean and a long tail, not the datasets.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

__all__ = ["PROFILES", "PUBLISHED_SHAPES", "profile_lengths", "synthetic_sequences"]

PROFILES = ("long_tail", "bimodal", "uniform", "longalign", "swe_smith")
_MIN_LEN = 8
#: name -> (median, sigma of log, min, max) in tokens at the published scale; the median is
#: chosen so that the clipped mean is the published one.
PUBLISHED_SHAPES = {
    "longalign": (13076.0, 0.7, 1024, 65536),   # mean ~16.5K
    "swe_smith": (29125.0, 0.6, 2048, 131072),  # mean ~34.7K
}


def profile_lengths(profile: str, num_sequences: int, *, max_len: int, seed: int = 0) -> list[int]:
    """``num_sequences`` lengths in ``[8, max_len]`` drawn from a named profile (see the module
    docstring; ``longalign`` and ``swe_smith`` at ``max_len`` equal to their published maximum are
    the published scale)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown length profile {profile!r}; choose one of {', '.join(PROFILES)}")
    if max_len < _MIN_LEN:
        raise ValueError(f"max_len={max_len} must be at least {_MIN_LEN}")
    if num_sequences < 0:
        raise ValueError(f"num_sequences={num_sequences} must be non-negative")
    rng = random.Random(f"{profile}/{seed}")
    out = []
    if profile in PUBLISHED_SHAPES:
        median, sigma, lo, hi = PUBLISHED_SHAPES[profile]
        scale = max_len / hi
        for _ in range(num_sequences):
            n = min(hi, max(lo, math.exp(math.log(median) + sigma * rng.gauss(0, 1))))
            out.append(int(min(max_len, max(_MIN_LEN, round(n * scale)))))
        return out
    for _ in range(num_sequences):
        if profile == "long_tail":
            n = math.exp(math.log(max_len / 8) + 0.9 * rng.gauss(0, 1))
        elif profile == "bimodal":
            n = rng.gauss(max_len / 32, max_len / 128) if rng.random() < 0.8 else rng.uniform(max_len / 2, max_len)
        else:
            n = rng.uniform(max_len / 2, max_len)
        out.append(int(min(max_len, max(_MIN_LEN, n))))
    return out


def synthetic_sequences(lengths: Sequence[int], *, vocab_size: int, seed: int = 0) -> list[torch.Tensor]:
    """One learnable counting sequence (1-D token ids) per length."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size={vocab_size} must be at least 2")
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lengths:
        start = torch.randint(0, vocab_size, (1,), generator=g)
        stride = torch.randint(1, 4, (1,), generator=g)
        seqs.append((start + stride * torch.arange(n)) % vocab_size)
    return seqs
