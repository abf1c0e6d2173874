"""Pipeline simulation: a schedule from :mod:`posttrain.pipeline` with real durations, activation
bytes, a host link and an offload policy.

It runs the same dependency model as the runtime's tests (:func:`posttrain.pipeline.deps`):
compute actions on a compute stream, the copies (``OFFLOAD``/``RELOAD``, and ``OFFLOAD_W``/
``RELOAD_W`` for what a split backward keeps for ``W``) on one copy stream per rank (both
directions share it, as in the PipeOffload reference), a copy taking
``activation_bytes / host_bandwidth``. Whether offload hides is read two ways: the measured
overhead (makespan with offload over makespan without), and the design's criterion
``k = (D2H + H2D) / (F + B + W)`` of one chunk-microbatch (hides fully when ``k <= 1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from posttrain.pipeline import COPY_KINDS, Durations, OffloadPolicy, SimResult, add_offload, build_schedule, simulate

__all__ = ["PipelineSimResult", "PipelineWorkload", "simulate_pipeline"]


@dataclass(frozen=True)
class PipelineWorkload:
    """Per chunk-microbatch costs.

    Attributes:
        forward_s: seconds of one chunk's forward on one microbatch (``F``).
        input_grad_s: its input-gradient backward (``I``; a full ``B`` is ``I + W``).
        weight_grad_s: its weight-gradient backward (``W``).
        activation_bytes: saved activations of one chunk-microbatch.
        host_bandwidth: bytes/s of the device-host link, per copy direction (shared stream).
        weight_keep: under a split backward, the fraction of ``activation_bytes`` that ``W``
            still needs after ``I`` (the rest is freed when ``I`` ends; this part is offloaded
            on its own, ``OFFLOAD_W``/``RELOAD_W``); 1 assumes ``W`` needs everything.
            ``posttrain pipeline`` prints the fraction it measured per stage.
    """

    forward_s: float = 1.0
    input_grad_s: float = 1.0
    weight_grad_s: float = 1.0
    activation_bytes: float = 1.0
    host_bandwidth: float = math.inf
    weight_keep: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.weight_keep <= 1:
            raise ValueError(f"weight_keep={self.weight_keep} must be between 0 and 1")
        for name in ("forward_s", "input_grad_s", "weight_grad_s", "activation_bytes"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name}={v} must be a non-negative number")
        if not self.host_bandwidth > 0:
            raise ValueError(f"host_bandwidth={self.host_bandwidth} must be a positive number of bytes/s")

    @property
    def copy_s(self) -> float:
        return self.activation_bytes / self.host_bandwidth

    @property
    def k(self) -> float:
        """Round-trip copy time over compute time of one chunk-microbatch."""
        compute = self.forward_s + self.input_grad_s + self.weight_grad_s
        return 2 * self.copy_s / compute if compute > 0 else math.inf

    def durations(self, fraction: float = 1.0) -> Durations:
        """The actions' durations; copies move ``fraction`` of a chunk-microbatch (selective
        offload within a chunk)."""
        copy = self.copy_s * fraction
        w_copy = copy * self.weight_keep
        return Durations(F=self.forward_s, B=self.input_grad_s + self.weight_grad_s, I=self.input_grad_s,
                         W=self.weight_grad_s, OFFLOAD=copy, RELOAD=copy, OFFLOAD_W=w_copy, RELOAD_W=w_copy)


@dataclass
class PipelineSimResult:
    """What one configuration costs.

    Attributes:
        makespan: seconds of the step with offload.
        base_makespan: the same schedule without offload.
        peaks: per rank, peak resident chunk-microbatches.
        sim: the full simulation (start/end of every action, memory intervals).
    """

    schedule: str
    num_ranks: int
    num_chunks: int
    group_size: int | None
    offload_chunks: int
    workload: PipelineWorkload
    makespan: float
    base_makespan: float
    peaks: list[float]
    sim: SimResult
    offload_fraction: float = 1.0

    @property
    def peak_bytes(self) -> float:
        return max(self.peaks) * self.workload.activation_bytes

    @property
    def offloaded_bytes(self) -> float:
        """Bytes a step copies to host memory, over all ranks (each comes back once)."""
        w = self.workload
        return self.offload_fraction * sum(w.activation_bytes if a.kind == "OFFLOAD" else w.activation_bytes * w.weight_keep
                                           for _, a in self.sim.start if a.kind in ("OFFLOAD", "OFFLOAD_W"))

    @property
    def overhead(self) -> float:
        """Makespan with offload over without, minus one (0: the offload hides completely)."""
        return self.makespan / self.base_makespan - 1.0 if self.base_makespan > 0 else 0.0

    @property
    def bubble_fraction(self) -> float:
        r = self.num_ranks
        return sum(self.sim.bubble_fraction(k) for k in range(r)) / r

    def copy_utilization(self, rank: int) -> float:
        busy = sum(self.sim.end[key] - t0 for key, t0 in self.sim.start.items()
                   if key[0] == rank and key[1].kind in COPY_KINDS)
        return busy / self.makespan if self.makespan else 0.0

    def memory_curve_bytes(self, rank: int) -> list[tuple[float, float]]:
        return [(t, n * self.workload.activation_bytes) for t, n in self.sim.memory_curve(rank)]

    @property
    def hidden(self) -> bool:
        """The offload costs less than 1% of the step."""
        return self.overhead <= 0.01


def simulate_pipeline(schedule: str, *, num_ranks: int, num_microbatches: int, num_chunks: int | None = None,
                      group_size: int | None = None, offload_chunks: int = 0,
                      workload: PipelineWorkload = PipelineWorkload(),
                      min_lifespan: float | None = None, offload_fraction: float = 1.0) -> PipelineSimResult:
    """Simulate one step.

    Args:
        schedule: a name from :data:`posttrain.pipeline.SCHEDULES`.
        num_chunks: chunks per rank (default: the schedule's own, see
            :func:`posttrain.pipeline.default_chunks`).
        offload_chunks: offload each rank's first this many chunks (longest-lived first).
        min_lifespan: skip chunk-microbatches whose forward-to-backward gap is not longer
            (default: one round trip of the copies, ``2 * offload_fraction * copy time``:
            shorter cannot be hidden).
        offload_fraction: the share of an offloaded chunk-microbatch that its copies move
            (selective offload within a chunk; the rest stays resident).
    """
    sched = build_schedule(schedule, num_ranks=num_ranks, num_microbatches=num_microbatches,
                           num_chunks=num_chunks, group_size=group_size)
    if not 0 <= offload_chunks <= sched.layout.num_chunks:
        raise ValueError(f"offload_chunks={offload_chunks} must be between 0 and the {sched.layout.num_chunks} chunks "
                         "per rank")
    d = workload.durations(offload_fraction)
    base = simulate(sched.actions, sched.layout, num_microbatches, durations=d, weight_keep=workload.weight_keep)
    policy = OffloadPolicy(offload_chunks, 2 * d.OFFLOAD if min_lifespan is None else min_lifespan,
                           fraction=offload_fraction)
    lowered = add_offload(sched.actions, sched.layout, num_microbatches, policy, durations=d)
    res = simulate(lowered, sched.layout, num_microbatches, durations=d, weight_keep=workload.weight_keep,
                   offload_fraction=offload_fraction)
    return PipelineSimResult(schedule=schedule, num_ranks=num_ranks, num_chunks=sched.layout.num_chunks,
                             group_size=sched.group_size, offload_chunks=offload_chunks, workload=workload,
                             makespan=res.makespan, base_makespan=base.makespan, peaks=res.peaks(), sim=res,
                             offload_fraction=offload_fraction)
