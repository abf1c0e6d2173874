"""FSDP2 engines: plain FSDP2 (the baseline), and ODC on FSDP2 (:func:`posttrain.odc.enable`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import posttrain.odc as odc
from posttrain._compat import AllGather, ReduceScatter, all_gather_single, reduce_scatter_single
from posttrain.spans import comm_span

from .engine import CommHook, DataParallelEngine, EngineConfig, MinibatchInfo, ensure_optimizer_state, mixed_precision
from .registry import register_engine

__all__ = ["FSDP2Engine", "ODCOnFSDP2Engine"]


def _untimed(kind: str, start: float, end: float) -> None:
    pass


class _Timed:
    def __init__(self, hook: CommHook) -> None:
        self._hook = hook

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class _TimedAllGather(_Timed, AllGather):
    """FSDP2's default all-gather (``dist.all_gather_single``), timed."""

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        with comm_span(self._hook, "gather"):
            return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class _TimedReduceScatter(_Timed, ReduceScatter):
    """FSDP2's default reduce-scatter (``dist.reduce_scatter_single``), timed."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        with comm_span(self._hook, "reduce"):
            return reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op,
                                         async_op=async_op)


@register_engine("fsdp")
class FSDP2Engine(DataParallelEngine):
    """FSDP2 (``fully_shard`` per block and on the root) with its collectives: every rank must
    run the same number of microbatches. FSDP2 averages gradients over the ranks (gloo has no
    pre-multiplied sum), so the loss divisor is the global token count over the world size."""

    checkpoint_format = "fsdp2"
    devices = ("cpu", "cuda")

    def __init__(self, model: nn.Module, config: EngineConfig, *, mesh: DeviceMesh | None = None,
                 units: Sequence[nn.Module] | None = None) -> None:
        super().__init__(model, config, mesh=mesh, units=units)
        mp = mixed_precision(config)
        for unit in self.units:
            fully_shard(unit, mesh=self.mesh, mp_policy=mp)
        self._modules = [m for m in model.modules() if isinstance(m, FSDPModule)]

    @classmethod
    def needs_equal_microbatches(cls, config: EngineConfig) -> bool:
        return True

    def parameters(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    @contextmanager
    def minibatch(self, num_tokens: int) -> Iterator[MinibatchInfo]:
        total = odc.global_token_count(num_tokens, self.group)
        yield MinibatchInfo(total, total / dist.get_world_size(self.group))

    def set_comm_hook(self, hook: CommHook | None) -> None:
        hook = hook or _untimed  # FSDP2 takes no None here: it would call it
        for m in self._modules:
            m.set_custom_all_gather(_TimedAllGather(hook))
            m.set_custom_reduce_scatter(_TimedReduceScatter(hook))

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        ensure_optimizer_state(optimizer)
        import torch.distributed.checkpoint.state_dict as dcp_sd

        msd, osd = dcp_sd.get_state_dict(self.model, optimizer)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        import torch.distributed.checkpoint.state_dict as dcp_sd

        dcp_sd.set_state_dict(self.model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def holds(self, tensor: torch.Tensor) -> bool:
        """Saved tensors in the storage of a parameter FSDP2 holds unsharded right now."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(not isinstance(p, DTensor) and p.untyped_storage().data_ptr() == ptr
                   for p in self.model.parameters())

    def after_forward_only(self) -> None:
        for m in self._modules:  # FSDP2 keeps the root unsharded after forward for a backward
            m.reshard()

    def close(self, *, restore: bool = False) -> None:
        if not restore:
            return
        for m in self.model.modules():  # every sharded parameter replaced by its full tensor
            for name, p in list(m._parameters.items()):
                if isinstance(p, DTensor):
                    m._parameters[name] = nn.Parameter(p.full_tensor().detach(), requires_grad=p.requires_grad)

    def iter_full_state(self, device: torch.device | None = None) -> Iterator[dict[str, torch.Tensor]]:
        # One FSDP module (a block, then what the root shards itself) at a time.
        owners = [n for n, m in self.model.named_modules() if isinstance(m, FSDPModule)]
        parts: dict[str, dict[str, torch.Tensor]] = {n: {} for n in owners}
        for key, value in self.model.state_dict().items():
            owner = max((n for n in owners if n == "" or key.startswith(n + ".")), key=len)
            parts[owner][key] = value
        where = device or torch.device("cpu")
        for owner in owners:  # (fresh tensors: a full_tensor() is one, a plain parameter is copied)
            yield {k: (v.full_tensor().detach() if isinstance(v, DTensor) else v.detach().clone()).to(where)
                   for k, v in parts[owner].items()}


@register_engine("odc-fsdp2")
class ODCOnFSDP2Engine(FSDP2Engine):
    """FSDP2 sharding with ODC's one-sided gather and scatter-accumulate
    (:func:`posttrain.odc.enable`), for models a user already shards with ``fully_shard``."""

    one_sided = True
    devices = ("cpu", "cuda")  # ODC's transport follows the parameters: host shared memory or GPU memory

    def __init__(self, model: nn.Module, config: EngineConfig, *, mesh: DeviceMesh | None = None,
                 units: Sequence[nn.Module] | None = None) -> None:
        super().__init__(model, config, mesh=mesh, units=units)
        self.handle = odc.enable(model, mode=config.mode, deterministic=config.deterministic)

    @classmethod
    def needs_equal_microbatches(cls, config: EngineConfig) -> bool:
        return config.mode == "collective"

    @contextmanager
    def minibatch(self, num_tokens: int) -> Iterator[MinibatchInfo]:
        with self.handle.minibatch(num_tokens=num_tokens) as mb:
            yield MinibatchInfo(mb.global_tokens, float(mb.global_tokens))

    def peer_failure(self) -> str | None:
        return self.handle.failed_peer()

    def set_comm_hook(self, hook: CommHook | None) -> None:
        self.handle.on_comm = hook

    @property
    def stats(self) -> dict[str, int]:
        return dict(self.handle.stats)

    def close(self, *, restore: bool = False) -> None:
        self.handle.close()
        super().close(restore=restore)
