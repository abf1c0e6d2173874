"""ODC's replacements for FSDP2's all-gather and reduce-scatter, and the layout they share.

[Note: ODC layouts]
For every FSDP module (one param group), FSDP2's all-gather input on a rank is the concatenation
of its parameters' padded local shards (``ceil(dim0 / shard_size)`` rows each) in the param dtype,
and the reduce-scatter input is ``shard_size`` rows, row ``p`` being the concatenation of the
padded shard ``p`` of every trainable parameter's gradient in the reduce dtype. ODC keeps, in each
rank's shm segment:

- ``params``: the all-gather input of every module, written once per minibatch (already cast to
  the mixed-precision param dtype, so gathers move half the bytes of an fp32 gather);
- ``grads``: the gradient accumulator, one reduce-scatter row per module (``deterministic=True``:
  one such accumulator per writer rank, summed in rank order at the sync).

A gather copies each peer's ``params`` slice into FSDP2's output buffer; a scatter-accumulate adds
row ``p`` of the local gradient into owner ``p``'s ``grads`` slice. Neither involves the peer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from posttrain._compat import AllGather, ReduceScatter, ShardedParamInfo
from posttrain.spans import comm_span

from ._protocol import traced

logger = logging.getLogger(__name__)


@dataclass
class ModuleLayout:
    """Where one FSDP module's data lives in the shm segments. See [Note: ODC layouts]."""

    name: str
    module: FSDPModule
    params: list[ShardedParamInfo]
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    gather_numel: int  # all-gather input elements per rank
    reduce_numel: int  # reduce-scatter row elements (one owner's shard of all trainable grads)
    params_offset: int = 0  # bytes into the "params" region
    grads_offset: int = 0  # bytes into one accumulator of the "grads" region
    checked: bool = False  # first gather compared our exposure against FSDP2's own input
    all_params_pushed: bool = True  # FSDP2 reduce-scatters unused parameters too (torch 2.13+)

    @staticmethod
    def build(name: str, module: FSDPModule, params: list[ShardedParamInfo]) -> ModuleLayout:
        dtypes = {p.param_dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(
                f"FSDP module {name!r} mixes parameter dtypes {sorted(map(str, dtypes))}; ODC "
                "needs one dtype per fully_shard group (shard such parameters separately)"
            )
        trainable = [p for p in params if p.requires_grad]
        reduce_dtypes = {p.reduce_dtype for p in trainable} or {params[0].param_dtype}
        return ModuleLayout(
            name=name,
            module=module,
            params=params,
            param_dtype=params[0].param_dtype,
            reduce_dtype=next(iter(reduce_dtypes)),
            gather_numel=sum(p.padded_data.numel() for p in params),
            reduce_numel=sum(p.padded_data.numel() for p in trainable),
        )

    @property
    def gather_bytes(self) -> int:
        return self.gather_numel * self.param_dtype.itemsize

    @property
    def reduce_bytes(self) -> int:
        return self.reduce_numel * self.reduce_dtype.itemsize


class CommEngine(Protocol):
    """What the comm hooks call: the ODC-on-FSDP2 engine."""

    on_comm: object

    def gather(self, lay: ModuleLayout, output: torch.Tensor, input: torch.Tensor, group) -> None: ...

    def scatter_accumulate(self, lay: ModuleLayout, output: torch.Tensor, input: torch.Tensor, group) -> None: ...


class _ODCComm:
    """Binds a comm hook to the engine and one module's layout; plain allocations."""

    def __init__(self, engine: CommEngine, layout: ModuleLayout) -> None:
        self._odc = engine
        self._layout = layout

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class ODCAllGather(_ODCComm, AllGather):
    """FSDP2 all-gather replaced by one-sided reads of peers' exposed shards."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        with comm_span(self._odc.on_comm, "gather"), traced("ODC::gather"):
            self._odc.gather(self._layout, output_tensor, input_tensor, group)
        return None


class ODCReduceScatter(_ODCComm, ReduceScatter):
    """FSDP2 reduce-scatter replaced by one-sided adds into the owners' accumulators."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op=None,
        async_op: bool = False,
    ) -> dist.Work | None:
        with comm_span(self._odc.on_comm, "reduce"), traced("ODC::scatter_accumulate"):
            self._odc.scatter_accumulate(self._layout, output_tensor, input_tensor, group)
        return None


def regroup_gather(
    out: torch.Tensor,
    layout: ModuleLayout,
    exposures: list[torch.Tensor],
    *,
    skip_slot: int | None,
) -> None:
    """Fill an all-gather output laid out for a group of ``out.shape[0]`` ranks.

    ``exposures[q]`` is shard-group rank ``q``'s all-gather input (``ceil(dim0/len(exposures))``
    rows per parameter). FSDP2 asks for this layout when it re-gathers from a smaller
    post-forward group (``reshard_after_forward=int``): same values, different row split.
    """
    num_slots = out.shape[0]
    shard_size = len(exposures)
    out_off = exp_off = 0
    for info in layout.params:
        shape = info.unsharded_shape
        dim0 = shape[0] if len(shape) else 1
        # padded rows per shard-group rank and per output slot
        rows_in = -(-dim0 // shard_size)
        rows_out = -(-dim0 // num_slots)
        row = (shape.numel() // dim0) if dim0 else 0
        full = torch.empty(dim0 * row, dtype=out.dtype)
        for q, src in enumerate(exposures):
            n = max(0, min(rows_in, dim0 - q * rows_in)) * row
            if n:
                full[q * rows_in * row : q * rows_in * row + n] = src[exp_off : exp_off + n]
        for s in range(num_slots):
            if s == skip_slot:
                continue
            n = max(0, min(rows_out, dim0 - s * rows_out)) * row
            if n:
                out[s, out_off : out_off + n] = full[s * rows_out * row : s * rows_out * row + n]
        out_off += rows_out * row
        exp_off += rows_in * row
    if out_off != out.shape[1] or exp_off != exposures[0].numel():
        raise AssertionError(
            f"ODC regroup layout mismatch for {layout.name}: wrote {out_off} of {out.shape[1]} "
            f"output and read {exp_off} of {exposures[0].numel()} exposed elements"
        )
