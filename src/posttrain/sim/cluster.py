"""What the simulator runs on: a cluster of GPUs in nodes, and the links between them."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Cluster"]


@dataclass(frozen=True)
class Cluster:
    """GPUs in nodes of ``gpus_per_node``; bandwidths are per GPU and per direction.

    Defaults are an H100 node (NVLink, achieved ~360 GB/s per GPU) with one 400 Gb/s NIC per GPU
    (~40 GB/s achieved) between nodes.

    Attributes:
        num_gpus: data-parallel ranks.
        gpus_per_node: ranks per node (the HSDP shard group).
        intra_bandwidth: bytes/s per GPU inside a node.
        inter_bandwidth: bytes/s per GPU between nodes.
        intra_latency: seconds per transfer inside a node.
        inter_latency: seconds per transfer between nodes.
        accumulate_bandwidth: bytes/s at which an owner adds incoming gradient slices into its
            accumulator (ODC's scatter-accumulate; every pusher's slice to one owner queues here).
    """

    num_gpus: int = 8
    gpus_per_node: int = 8
    intra_bandwidth: float = 360e9
    inter_bandwidth: float = 40e9
    intra_latency: float = 5e-6
    inter_latency: float = 10e-6
    accumulate_bandwidth: float = 1.5e12

    def __post_init__(self) -> None:
        if self.num_gpus < 1:
            raise ValueError(f"num_gpus={self.num_gpus}: a cluster needs at least 1 GPU")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node={self.gpus_per_node} must be at least 1")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(f"num_gpus={self.num_gpus} is not a multiple of gpus_per_node={self.gpus_per_node}")
        for name in ("intra_bandwidth", "inter_bandwidth", "accumulate_bandwidth"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name}={v} must be a positive number of bytes/s")
        for name in ("intra_latency", "inter_latency"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name}={v} must be a non-negative number of seconds")

    @property
    def node_size(self) -> int:
        """Ranks in one node (fewer than ``gpus_per_node`` when the cluster is a partial node)."""
        return min(self.num_gpus, self.gpus_per_node)

    @property
    def num_nodes(self) -> int:
        return self.num_gpus // self.node_size

    def collective_time(self, nbytes: float, group: int, *, across_nodes: bool) -> float:
        """Ring all-gather or reduce-scatter of ``nbytes`` (the full tensor) over ``group`` ranks:
        each rank moves ``(group-1)/group`` of it over its slowest link; latency grows with
        ``log2(group)`` (NCCL's tree/ring latency for the message sizes of a layer)."""
        if group <= 1:
            return 0.0
        bw = self.inter_bandwidth if across_nodes else self.intra_bandwidth
        lat = self.inter_latency if across_nodes else self.intra_latency
        return lat * math.ceil(math.log2(group)) + (group - 1) / group * nbytes / bw

    def allreduce_time(self, nbytes: float, group: int) -> float:
        """Ring all-reduce of ``nbytes`` across ``group`` nodes (HSDP's replica all-reduce)."""
        if group <= 1:
            return 0.0
        return self.inter_latency * 2 * math.ceil(math.log2(group)) + 2 * (group - 1) / group * nbytes / self.inter_bandwidth

    def one_sided_time(self, nbytes: float, group: int, *, across_nodes: bool) -> float:
        """One rank reading (or writing) ``1/group`` of ``nbytes`` from (to) each of the other
        ``group - 1`` ranks, all requests in flight at once. Peers inside the node go over
        NVLink, the rest over the NIC; the two proceed in parallel."""
        if group <= 1:
            return 0.0
        shard = nbytes / group
        if not across_nodes:
            return self.intra_latency + (group - 1) * shard / self.intra_bandwidth
        local = self.node_size - 1
        remote = group - 1 - local
        return max(self.intra_latency + local * shard / self.intra_bandwidth,
                   self.inter_latency + remote * shard / self.inter_bandwidth)
