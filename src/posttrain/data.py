"""Training data: embedded synthetic datasets with named length profiles, and a JSONL loader.

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

import json
import math
import random
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["PROFILES", "PUBLISHED_SHAPES", "load_jsonl", "profile_lengths", "synthetic_sequences"]

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


def load_jsonl(path: str | Path, *, tokenizer=None, field: str | None = None,
               max_tokens: int | None = None) -> list[torch.Tensor]:
    """Sequences from a JSONL file: one object per line with ``input_ids`` (a list of ints) or,
    with a ``transformers`` tokenizer, ``text``.

    Args:
        path: the file.
        tokenizer: a tokenizer callable (``tokenizer(text)["input_ids"]``) for ``text`` lines.
        field: the key to read (default ``input_ids``, or ``text`` when a tokenizer is given).
        max_tokens: if given, a sequence that trains on more tokens than this (its length minus
            one: inputs predict the next token) is an error naming its line.

    Raises:
        ValueError: a line that is not JSON, lacks the field, or holds something other than token
            ids / text, named by file and line number.
    """
    path = Path(path)
    key = field or ("text" if tokenizer is not None else "input_ids")
    seqs = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or key not in obj:
                raise ValueError(f"{where}: expected an object with a {key!r} field")
            value = obj[key]
            if tokenizer is not None and isinstance(value, str):
                value = tokenizer(value)["input_ids"]
            if not isinstance(value, list) or not all(isinstance(t, int) and t >= 0 for t in value):
                raise ValueError(f"{where}: {key!r} must be a list of non-negative token ids")
            if len(value) < 2:
                raise ValueError(f"{where}: a sequence needs at least 2 tokens, got {len(value)}")
            if max_tokens is not None and len(value) - 1 > max_tokens:
                raise ValueError(f"{where}: a sequence of {len(value)} tokens trains on {len(value) - 1}, more "
                                 f"than --max-tokens={max_tokens} fit in a microbatch; raise --max-tokens")
            seqs.append(torch.tensor(value, dtype=torch.long))
    if not seqs:
        raise ValueError(f"{path}: no sequences")
    return seqs
