"""The one place that reads private torch names: FSDP2 state and pipelining internals (torch 2.11-2.15).

ODC must expose each FSDP module's all-gather input *before* any rank gathers it, so it
needs the per-parameter padded shard data and dtypes that FSDP2 keeps on its param group. The
``AllGather`` / ``ReduceScatter`` ABCs that ``set_custom_all_gather`` / ``set_custom_reduce_scatter``
take are not re-exported by ``torch.distributed.fsdp`` either. Everything else goes through public
``FSDPModule`` methods. The pipeline runtime uses torch's split-backward functions
(``stage_backward_input`` / ``stage_backward_weight``) and its action type, which pipelining does
not re-export either; flat ODC walks module inputs and outputs with torch's pytree helpers and asks
whether a profiler records.

Releases differ in what is there (docs/torch.md has the table): a release's difference is found by
the attribute or method it has, never by its version string, and each is named below by the
releases that need it. A torch older than 2.11 is refused; a newer one than 2.15 is used with a
warning, since the first gather of every module is checked against FSDP2's own input
(``_comm.py``): a moved internal fails there with a clear message instead of ODC gathering garbage.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

#: The (major, minor) releases whose FSDP2 and pipelining internals this module reads (docs/torch.md).
SUPPORTED_TORCH = ((2, 11), (2, 12), (2, 13), (2, 14), (2, 15))


#: ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` under their torch 2.13 names (2.13 renamed
#: them and 2.13-2.14 warn on the old ones; 2.11 and 2.12 have only those).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def torch_version() -> tuple[int, int]:
    """The running torch's (major, minor) release."""
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[return-value]


def check_torch_version() -> None:
    """Refuse a torch older than the oldest release whose internals are read here (one line); warn
    once for one newer than the newest."""
    version = torch_version()
    oldest, newest = SUPPORTED_TORCH[0], SUPPORTED_TORCH[-1]
    if version < oldest:
        raise RuntimeError(f"posttrain.odc on FSDP2 needs torch {oldest[0]}.{oldest[1]} or newer, found "
                           f"{torch.__version__}; install torch>={oldest[0]}.{oldest[1]},<2.16")
    if version > newest:
        warnings.warn(f"torch {torch.__version__} is newer than the releases posttrain.odc was checked on "
                      f"(2.11-{newest[0]}.{newest[1]}); its first gathers are checked against FSDP2's own",
                      stacklevel=2)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (``torch._C._current_graph_task_id``,
    which torch's own checkpointing asks, in every release 2.11-2.15): a module called now is an
    activation checkpoint's recomputation."""
    return torch._C._current_graph_task_id() != -1


#: Pipelining's names, imported when first asked for (``torch.distributed.pipelining`` imports
#: torch's compiler stack: about 0.7 s that every command not running a pipeline would pay).
_PIPELINING = {"stage_backward_input": ("torch.distributed.pipelining._backward", "stage_backward_input"),
               "stage_backward_weight": ("torch.distributed.pipelining._backward", "stage_backward_weight"),
               "TorchAction": ("torch.distributed.pipelining.schedules", "_Action"),
               "TorchComputationType": ("torch.distributed.pipelining.schedules", "_ComputationType")}


def __getattr__(name: str):
    if name in _PIPELINING:
        import importlib

        module, attr = _PIPELINING[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def profiler_enabled() -> bool:
    """Whether a torch profiler is recording (``torch.autograd._profiler_enabled``): ODC's labels
    of its gathers and pushes are entered only then, since each costs time even unrecorded."""
    return torch.autograd._profiler_enabled()


def cpu_attention_with_lse(q, k, v, causal: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's CPU flash kernel, ``(output, log-sum-exp per query row)`` (``aten::
    _scaled_dot_product_flash_attention_for_cpu``: every torch this project supports has it)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def cpu_attention_with_lse_backward(grad, q, k, v, out, lse, causal: bool,
                                    scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`cpu_attention_with_lse`'s query, key and value, given the output and
    log-sum-exp the gradient is taken at (those of a merge of blocks: the flash-attention identity)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal,
                                                                                scale=scale)


__all__ = [  # (and, imported when first asked for, the names of _PIPELINING)
    "AllGather", "ReduceScatter", "ShardedParamInfo", "check_torch_version", "cpu_attention_with_lse",
    "cpu_attention_with_lse_backward", "in_backward", "profiler_enabled",
    "reduces_unused_params", "sharded_params", "torch_version", "tree_flatten", "tree_map_only", "tree_unflatten",
]


@dataclass(frozen=True)
class ShardedParamInfo:
    """What ODC needs to know about one parameter of an FSDP param group."""

    param: nn.Parameter  # the sharded DTensor parameter
    padded_data: torch.Tensor  # flat local shard, padded to ceil(dim0 / shard_size) rows
    unsharded_shape: torch.Size
    param_dtype: torch.dtype  # dtype of the all-gather input (after mixed-precision cast)
    reduce_dtype: torch.dtype  # dtype gradients are reduced in
    requires_grad: bool


def _param_groups(state) -> list:
    """An FSDP state's param groups: a list from torch 2.12 on; 2.11 keeps one (or ``None``)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    if not hasattr(state, "_fsdp_param_group"):
        raise RuntimeError(f"torch {torch.__version__}: FSDP2's state has neither _fsdp_param_groups nor "
                           "_fsdp_param_group; posttrain.odc cannot read its shards (see docs/torch.md)")
    group = state._fsdp_param_group  # torch 2.11
    return [group] if group is not None else []


def _reduce_dtype(fp, mp, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype FSDP2 reduce-scatters ``fp``'s gradient in, as its lazy init will set it."""
    if mp.reduce_dtype is not None:
        return mp.reduce_dtype
    if hasattr(fp, "_has_sharded_grad_dtype_override"):
        # torch 2.15: without a reduce dtype, gradients are reduced in the parameter's grad dtype (its
        # own dtype unless overridden), no longer in param_dtype
        if fp._has_sharded_grad_dtype_override:
            if fp.sharded_grad_dtype is None:
                raise ValueError("a parameter's grad_dtype override is None (its gradient's dtype decided at "
                                 "run time); ODC on FSDP2 needs a fixed reduce dtype: set MixedPrecisionPolicy's "
                                 "reduce_dtype")
            return fp.sharded_grad_dtype
        return fp.sharded_param.dtype
    return param_dtype  # torch 2.11-2.14


def sharded_params(module: FSDPModule) -> list[ShardedParamInfo]:
    """The parameters of ``module``'s own FSDP param group, in all-gather layout order."""
    groups = _param_groups(module._get_fsdp_state())
    if len(groups) > 1:
        raise ValueError(
            f"{type(module).__name__} has {len(groups)} FSDP param groups (shard_placement_fn "
            "with per-parameter meshes); ODC supports one param group per fully_shard call"
        )
    if not groups:
        return []
    infos = []
    for fp in groups[0].fsdp_params:
        # Each parameter's own policy (torch 2.15 keeps none on the group; every release has it here).
        mp = fp.mp_policy
        orig = fp.sharded_param.dtype
        # Same clamping as FSDPParam.init_dtype_attrs (which only runs at lazy init).
        param_dtype = mp.param_dtype if (mp.param_dtype is not None and orig.is_floating_point) else orig
        infos.append(
            ShardedParamInfo(
                param=fp.sharded_param,
                padded_data=fp._sharded_param_data,
                unsharded_shape=fp._orig_size,
                param_dtype=param_dtype,
                reduce_dtype=_reduce_dtype(fp, mp, param_dtype),
                requires_grad=fp.sharded_param.requires_grad,
            )
        )
    return infos


def reduces_unused_params(module: FSDPModule) -> bool:
    """Ask FSDP2 to reduce-scatter every trainable parameter, used by a backward or not (a zero
    gradient for the unused), so that ODC's rows have a fixed layout. ``False`` where FSDP2 cannot
    (torch 2.11 and 2.12 have no ``set_reduce_scatter_unused_params`` and leave a parameter without
    a gradient out of the reduce-scatter)."""
    setter = getattr(module, "set_reduce_scatter_unused_params", None)
    if setter is None:
        return False
    setter(True, recurse=False)
    return True
