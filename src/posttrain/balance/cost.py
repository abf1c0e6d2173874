"""Cost models: predicted compute time (arbitrary units) of one sequence of a given length.

A cost model is any callable ``length -> float``; the balancer only compares costs. The
quadratic fit and the FLOPs model follow the ODC reference's ``packing.py``;
:class:`CalibratedCost` fits the same shape to timings measured here. :class:`ModelShape` is the
one FLOPs model and :func:`fit_least_squares` the one fit of the package.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = [
    "CalibratedCost", "CostModel", "FlopsCost", "ModelShape", "QuadraticCost", "TokenCost", "fit_least_squares",
    "measure_step_times",
]


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
class ModelShape:
    """A decoder-only transformer's shape: what its FLOPs per token and per sequence depend on.
    The one FLOPs model of the package: the balancer's :class:`FlopsCost` and the simulator's
    presets (:meth:`posttrain.sim.SimModel.preset`) both use it.

    Attributes:
        num_layers: transformer blocks.
        hidden: hidden size.
        intermediate: MLP width.
        heads: attention heads.
        kv_heads: key/value heads (grouped-query attention).
        vocab: vocabulary size (the LM head's width).
        gated: a gated MLP (SwiGLU: three matrices) rather than two (GELU).
    """

    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    gated: bool = True

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelShape.{name}={getattr(self, name)} must be at least 1")

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a :class:`posttrain.models.GPTConfig` or a ``transformers`` Llama-style config."""
        if hasattr(config, "hidden_size"):  # transformers
            heads = config.num_attention_heads
            return cls(num_layers=config.num_hidden_layers, hidden=config.hidden_size,
                       intermediate=config.intermediate_size, heads=heads,
                       kv_heads=getattr(config, "num_key_value_heads", None) or heads, vocab=config.vocab_size,
                       gated=True)
        if hasattr(config, "dim"):  # posttrain GPT: 4x GELU MLP, full multi-head attention
            return cls(num_layers=config.num_layers, hidden=config.dim, intermediate=4 * config.dim,
                       heads=config.num_heads, kv_heads=config.num_heads, vocab=config.vocab_size, gated=False)
        raise TypeError(f"cannot read a model shape from {type(config).__name__}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        """Weights of one block that every token passes through (attention and MLP matrices)."""
        attn = self.hidden * self.head_dim * (self.heads + 2 * self.kv_heads) + self.heads * self.head_dim * self.hidden
        return attn + (3 if self.gated else 2) * self.hidden * self.intermediate

    @property
    def linear_params(self) -> int:
        """Weights every token passes through: every block and the LM head (not the embeddings)."""
        return self.num_layers * self.layer_params + self.hidden * self.vocab

    @property
    def params(self) -> int:
        """Blocks, embeddings and head (untied)."""
        return self.num_layers * self.layer_params + 2 * self.vocab * self.hidden

    def training_flops(self, length: int) -> float:
        """Forward and backward FLOPs of one sequence: ``6 * linear_params * n`` for the matrices and
        ``6 * num_layers * hidden * n**2`` for causal attention (``2 n^2 d`` forward per layer, scores
        and weighted sum halved by the mask; backward twice the forward)."""
        return 6.0 * self.linear_params * length + 6.0 * self.num_layers * self.hidden * length * length


@dataclass(frozen=True)
class FlopsCost:
    """Cost = training FLOPs of one sequence of a model shape (:meth:`ModelShape.training_flops`).

    Attributes:
        shape: the model's shape.
    """

    shape: ModelShape

    @classmethod
    def from_config(cls, config) -> FlopsCost:
        """From a :class:`posttrain.models.GPTConfig` or a ``transformers`` Llama-style config."""
        return cls(ModelShape.from_config(config))

    @property
    def linear_params(self) -> int:
        return self.shape.linear_params

    def __call__(self, length: int) -> float:
        return self.shape.training_flops(length)


def fit_least_squares(rows: Sequence[Sequence[float]], values: Sequence[float], *,
                      underdetermined: bool = False) -> list[float]:
    """Non-negative coefficients ``c`` minimizing ``|rows @ c - values|`` (columns scaled first so
    that lengths and squared lengths condition alike; a coefficient fitted negative is clamped to
    zero: a cost never falls as its inputs grow). The one least-squares fit of the package.

    Args:
        underdetermined: with fewer independent rows than columns, return the minimum-norm fit
            (exact at the rows given, a guess elsewhere) instead of raising.

    Raises:
        ValueError: fewer independent rows than columns (unless ``underdetermined``).
    """
    a = torch.tensor([list(r) for r in rows], dtype=torch.float64)
    y = torch.tensor(list(values), dtype=torch.float64)
    if a.ndim != 2 or a.shape[0] != y.shape[0]:
        raise ValueError(f"{a.shape[0]} rows but {y.shape[0]} values")
    if int(torch.linalg.matrix_rank(a)) < a.shape[1] and not underdetermined:
        raise ValueError(f"the fit needs {a.shape[1]} or more independent measurements (different shapes)")
    scale = a.abs().amax(dim=0).clamp_min(1e-300)
    coef = torch.linalg.lstsq(a / scale, y.unsqueeze(1), driver="gelsd").solution.squeeze(1) / scale
    return [max(0.0, float(c)) for c in coef]


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
        a, b, c = fit_least_squares([[n * n, n, 1.0] for n in lengths], seconds)
        return cls(a=a, b=b, c=c)

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
