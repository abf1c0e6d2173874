"""Cost models: predicted compute time (arbitrary units) of one sequence of a given length.

A cost model is any callable ``length -> float``; the balancer only compares costs. The
quadratic fit and the FLOPs model follow ``design/odc.md`` (from the ODC reference's
``packing.py``); :class:`CalibratedCost` fits the same shape to timings measured here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["CalibratedCost", "CostModel", "FlopsCost", "QuadraticCost", "TokenCost", "measure_step_times"]


class CostModel(Protocol):
    def __call__(self, length: int) -> float: ...


@dataclass(frozen=True)
class TokenCost:
    """Cost = number of tokens (attention's quadratic term ignored)."""

    def __call__(self, length: int) -> float:
        return float(length)


@dataclass(frozen=True)
class QuadraticCost:
    """Cost = ``a * s**2 + b * s`` with ``s = length / scale``.

    The default is the reference's fit for a 7B model (``a=4.348, b=8.768, scale=32000``).
    """

    a: float = 4.348
    b: float = 8.768
    scale: float = 32000.0

    def __post_init__(self) -> None:
        if self.a < 0 or self.b < 0 or self.scale <= 0:
            raise ValueError(f"QuadraticCost needs a, b >= 0 and scale > 0, got {self}")

    def __call__(self, length: int) -> float:
        s = length / self.scale
        return self.a * s * s + self.b * s


@dataclass(frozen=True)
class FlopsCost:
    """Training FLOPs of one sequence: ``6 * linear_params * n + 6 * num_layers * dim * n**2``.

    The first term is forward+backward through every linear layer for each token; the second is
    causal attention's scores and weighted sum (``2 n^2 d`` forward per layer, halved by the
    causal mask, three times that for forward+backward).

    Attributes:
        linear_params: parameters that every token passes through (not the embeddings).
        num_layers: transformer blocks.
        dim: hidden size.
    """

    linear_params: int
    num_layers: int
    dim: int

    def __post_init__(self) -> None:
        if min(self.linear_params, self.num_layers, self.dim) < 1:
            raise ValueError(f"FlopsCost fields must be positive, got {self}")

    @classmethod
    def from_config(cls, config) -> FlopsCost:
        """From a :class:`posttrain.models.GPTConfig` or a ``transformers`` Llama-style config."""
        if hasattr(config, "hidden_size"):  # transformers
            d, n_layers = config.hidden_size, config.num_hidden_layers
            heads = config.num_attention_heads
            kv = getattr(config, "num_key_value_heads", None) or heads
            head_dim = getattr(config, "head_dim", None) or d // heads
            attn = d * head_dim * (heads + 2 * kv) + heads * head_dim * d
            mlp = 3 * d * config.intermediate_size
            head = d * config.vocab_size
        elif hasattr(config, "dim"):  # posttrain GPT
            d, n_layers = config.dim, config.num_layers
            attn, mlp, head = 4 * d * d, 8 * d * d, d * config.vocab_size
        else:
            raise TypeError(f"cannot read a model shape from {type(config).__name__}")
        return cls(linear_params=n_layers * (attn + mlp) + head, num_layers=n_layers, dim=d)

    def __call__(self, length: int) -> float:
        return 6.0 * self.linear_params * length + 6.0 * self.num_layers * self.dim * length * length


@dataclass(frozen=True)
class CalibratedCost:
    """Cost = ``a * n**2 + b * n + c`` seconds, least-squares fit to measured step times."""

    a: float
    b: float
    c: float

    @classmethod
    def fit(cls, lengths: Sequence[int], seconds: Sequence[float]) -> CalibratedCost:
        """Fit to ``(length, seconds)`` pairs; needs at least 3 distinct lengths.

        Coefficients are clamped to be non-negative (a cost must not fall with length).
        """
        if len(lengths) != len(seconds):
            raise ValueError(f"{len(lengths)} lengths but {len(seconds)} timings")
        if len(set(lengths)) < 3:
            raise ValueError("calibration needs timings at 3 or more distinct lengths")
        n = torch.tensor(lengths, dtype=torch.float64)
        scale = float(n.max())
        x = n / scale
        design = torch.stack([x * x, x, torch.ones_like(x)], dim=1)
        coef = torch.linalg.lstsq(design, torch.tensor(seconds, dtype=torch.float64).unsqueeze(1)).solution
        a, b, c = (max(0.0, float(v)) for v in coef.squeeze(1))
        return cls(a=a / scale**2, b=b / scale, c=c)

    def __call__(self, length: int) -> float:
        return self.a * length * length + self.b * length + self.c


def measure_step_times(
    step: Callable[[int], None], lengths: Sequence[int], *, repeats: int = 3
) -> list[float]:
    """Median wall time of ``step(length)`` (e.g. a forward+backward) for each length.

    One untimed warm-up call per length comes first.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1")
    out = []
    for n in lengths:
        step(n)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step(n)
            times.append(time.perf_counter() - t0)
        out.append(sorted(times)[len(times) // 2])
    return out
