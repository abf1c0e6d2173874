"""Per-layer compute cost and parameter bytes of the simulated model.

One transformer layer's forward on a microbatch of sequences ``s_1..s_k`` takes
``linear * sum(s_i) + quadratic * sum(s_i**2) + overhead`` seconds (packed sequences do not
attend to each other, so the attention term is per sequence); its backward (input and weight
gradients) takes ``backward_ratio`` times that. The coefficients come from a model shape and an
achieved FLOP rate (:meth:`SimModel.preset`) or from timings on this machine
(:meth:`LayerCost.fit`, used by ``posttrain simulate calibrate``).

Presets ``1.5b`` and ``7b`` have the shapes of Qwen2.5-1.5B and Qwen2.5-7B. For the 7B shape
the ratio of the quadratic to the linear term at 32K tokens is 0.45; the ODC reference's fitted
cost ``4.348 s^2 + 8.768 s`` (s = length / 32000) has 0.50: the FLOP model's shape is within
about 10% of that published fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from posttrain.balance.cost import ModelShape, fit_least_squares

__all__ = ["MODEL_SHAPES", "LayerCost", "ModelShape", "SimModel"]


MODEL_SHAPES = {
    "1.5b": ModelShape(num_layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2, vocab=151936),
    "7b": ModelShape(num_layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, vocab=152064),
}


@dataclass(frozen=True)
class LayerCost:
    """Seconds of one layer's forward: ``linear * tokens + quadratic * sum(s^2) + overhead``.

    Attributes:
        linear: seconds per token.
        quadratic: seconds per squared sequence length (causal attention).
        overhead: seconds per layer and microbatch, whatever its size.
        backward_ratio: backward (input + weight gradient) time over forward time.
    """

    linear: float
    quadratic: float = 0.0
    overhead: float = 0.0
    backward_ratio: float = 2.0

    def __post_init__(self) -> None:
        for name in ("linear", "quadratic", "overhead"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"LayerCost.{name}={v} must be a non-negative number of seconds")
        if not self.backward_ratio > 0:
            raise ValueError(f"LayerCost.backward_ratio={self.backward_ratio} must be positive")

    def forward(self, lengths: Sequence[int]) -> float:
        if not lengths:
            return 0.0
        return self.linear * sum(lengths) + self.quadratic * sum(n * n for n in lengths) + self.overhead

    def backward(self, lengths: Sequence[int]) -> float:
        return self.backward_ratio * self.forward(lengths)

    def sequence(self, length: int) -> float:
        """Forward + backward seconds of one sequence alone, without the per-microbatch overhead
        (the cost the balancer compares)."""
        return (1 + self.backward_ratio) * (self.linear * length + self.quadratic * length * length)

    @classmethod
    def fit(cls, microbatches: Sequence[Sequence[int]], seconds: Sequence[float], *,
            backward_ratio: float = 2.0) -> LayerCost:
        """Least-squares fit of forward+backward ``seconds`` per layer for each microbatch (a list
        of sequence lengths); needs 3 or more microbatches of different shape. Coefficients are
        clamped at zero (a cost never falls with length)."""
        if len(microbatches) != len(seconds):
            raise ValueError(f"{len(microbatches)} microbatches but {len(seconds)} timings")
        rows = [[sum(mb), sum(n * n for n in mb), 1.0] for mb in microbatches]
        try:
            lin, quad, over = (c / (1 + backward_ratio) for c in fit_least_squares(rows, seconds))
        except ValueError:
            raise ValueError("calibration needs 3 or more microbatches of different token counts and shapes") from None
        return cls(linear=lin, quadratic=quad, overhead=over, backward_ratio=backward_ratio)


@dataclass(frozen=True)
class SimModel:
    """The simulated model: identical layers, each with a cost and parameter bytes.

    Attributes:
        num_layers: layers (each one FSDP unit: one all-gather forward, one backward, one
            reduce-scatter).
        layer_cost: compute time of one layer.
        layer_param_bytes: bytes of one layer's parameters as gathered (bf16: 2 per parameter).
        layer_grad_bytes: bytes of one layer's gradient as reduced.
        optimizer_s: seconds of the optimizer step on a rank's shard.
    """

    num_layers: int
    layer_cost: LayerCost
    layer_param_bytes: float
    layer_grad_bytes: float
    optimizer_s: float = 0.0

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers={self.num_layers} must be at least 1")
        for name in ("layer_param_bytes", "layer_grad_bytes", "optimizer_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be non-negative")

    @property
    def param_bytes(self) -> float:
        return self.num_layers * self.layer_param_bytes

    def sequence_cost(self, length: int) -> float:
        """Forward + backward seconds of one sequence through every layer (the balancer's cost)."""
        return self.num_layers * self.layer_cost.sequence(length)

    @classmethod
    def preset(cls, name: str, *, achieved_flops: float = 400e12, param_bytes: int = 2,
               grad_bytes: int = 2) -> SimModel:
        """A model from :data:`MODEL_SHAPES` on a GPU achieving ``achieved_flops`` (default
        400 TFLOP/s: an H100 at ~40% of its dense bf16 peak).

        Forward FLOPs of a layer: ``2 * layer_params`` per token and ``2 * s^2 * hidden`` per
        sequence for causal attention (scores and weighted sum, half of them masked). The embedding
        and head are folded into the layers (their FLOPs spread evenly)."""
        if name not in MODEL_SHAPES:
            raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_SHAPES)}")
        if not achieved_flops > 0:
            raise ValueError(f"achieved_flops={achieved_flops} must be positive")
        shape = MODEL_SHAPES[name]
        lin = 2.0 * shape.linear_params / shape.num_layers / achieved_flops  # the head spread over the layers
        quad = 2.0 * shape.hidden / achieved_flops
        per_layer = shape.params / shape.num_layers
        # Adam on the rank's shard is memory-bound and tiny next to a minibatch; left at 0.
        return cls(num_layers=shape.num_layers, layer_cost=LayerCost(linear=lin, quadratic=quad),
                   layer_param_bytes=per_layer * param_bytes, layer_grad_bytes=per_layer * grad_bytes)
