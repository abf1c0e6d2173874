"""Sequence-length distributions for the simulator: the named profiles of :mod:`posttrain.data`
(one source for training, benchmarks and the simulator), or a file.

``longalign`` and ``swe_smith`` are drawn at their published scale here (up to 64K and 128K
tokens) unless ``max_len`` scales them down as training on this machine does; pass
``--lengths-file`` with the real lengths to simulate the datasets themselves.
"""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.data import PROFILES, PUBLISHED_SHAPES, profile_lengths

__all__ = ["LENGTH_PROFILES", "draw_lengths", "load_lengths", "profile_max_len"]

LENGTH_PROFILES = PROFILES


def profile_max_len(profile: str, default: int = 65536) -> int:
    """Longest sequence a profile draws at its own scale (``default`` for the scalable profiles)."""
    return PUBLISHED_SHAPES[profile][3] if profile in PUBLISHED_SHAPES else default


def draw_lengths(profile: str, num_sequences: int, *, seed: int = 0, max_len: int | None = None) -> list[int]:
    """``num_sequences`` lengths from a named profile (seeded), at most ``max_len`` (default: the
    profile's published maximum, or 65,536)."""
    if profile not in LENGTH_PROFILES:
        raise ValueError(f"unknown length profile {profile!r}; choose one of {', '.join(LENGTH_PROFILES)} "
                         "or give a lengths file")
    if num_sequences < 1:
        raise ValueError(f"num_sequences={num_sequences} must be at least 1")
    if profile not in PUBLISHED_SHAPES:
        return profile_lengths(profile, num_sequences, max_len=max_len or 65536, seed=seed)
    lengths = profile_lengths(profile, num_sequences, max_len=profile_max_len(profile), seed=seed)
    # A published shape is clipped, not rescaled, by a smaller limit: the simulator's max_tokens
    # caps what fits in a microbatch, it does not shrink the data.
    return [min(n, max_len) for n in lengths] if max_len is not None else lengths


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
