"""Sequence-length distributions for the simulator: named profiles or a file.

``longalign`` and ``swe_smith`` are log-normal shapes with the means the ODC paper reports for
LongAlign (~16.5K tokens, at most 64K) and SWE-smith agent trajectories (~34.7K, at most 128K).
They are stand-ins with the right mean and a long tail, not the datasets: pass ``--lengths-file``
with the real lengths to simulate those. The embedded training profiles of :mod:`posttrain.data`
(``long_tail``, ``bimodal``, ``uniform``) are available too, scaled to ``max_len``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from posttrain.data import PROFILES as TRAIN_PROFILES
from posttrain.data import profile_lengths

__all__ = ["LENGTH_PROFILES", "draw_lengths", "load_lengths", "profile_max_len"]

# name -> (median, sigma of log, min, max); medians chosen so the clipped mean is the target
_LOGNORMAL = {
    "longalign": (13076.0, 0.7, 1024, 65536),   # mean ~16.5K
    "swe_smith": (29125.0, 0.6, 2048, 131072),  # mean ~34.7K
}
LENGTH_PROFILES = (*_LOGNORMAL, *TRAIN_PROFILES)


def profile_max_len(profile: str, default: int = 65536) -> int:
    """Longest sequence a profile draws (``default`` for the scalable training profiles)."""
    return _LOGNORMAL[profile][3] if profile in _LOGNORMAL else default


def draw_lengths(profile: str, num_sequences: int, *, seed: int = 0, max_len: int | None = None) -> list[int]:
    """``num_sequences`` lengths from a named profile (seeded)."""
    if profile not in LENGTH_PROFILES:
        raise ValueError(f"unknown length profile {profile!r}; choose one of {', '.join(LENGTH_PROFILES)} "
                         "or give a lengths file")
    if num_sequences < 1:
        raise ValueError(f"num_sequences={num_sequences} must be at least 1")
    if profile in TRAIN_PROFILES:
        return profile_lengths(profile, num_sequences, max_len=max_len or 65536, seed=seed)
    median, sigma, lo, hi = _LOGNORMAL[profile]
    if max_len is not None:
        hi = min(hi, max_len)
    rng = np.random.default_rng([seed, sum(map(ord, profile))])
    x = np.exp(np.log(median) + sigma * rng.standard_normal(num_sequences))
    return [int(v) for v in np.clip(x, min(lo, hi), hi)]


def load_lengths(path: str | Path) -> list[int]:
    """Lengths from a file: a JSON list, or integers separated by whitespace or commas, or JSON
    lines with an ``input_ids`` list or a ``length`` field."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"lengths file {path} does not exist")
    text = path.read_text()
    out: list[int] = []
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            out = [int(v) for v in json.loads(stripped)]
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a JSON list of integers ({e})") from None
    elif stripped.startswith("{"):
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out.append(len(row["input_ids"]) if "input_ids" in row else int(row["length"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path} line {i}: needs an 'input_ids' list or a 'length' integer ({e})") from None
    else:
        for tok in stripped.replace(",", " ").split():
            try:
                out.append(int(tok))
            except ValueError:
                raise ValueError(f"{path}: {tok!r} is not an integer length") from None
    if not out:
        raise ValueError(f"{path} holds no lengths")
    bad = [n for n in out if n < 1]
    if bad:
        raise ValueError(f"{path}: length {bad[0]} is not positive")
    return out
