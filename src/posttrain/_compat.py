"""The one place that reads private torch names (torch 2.13): FSDP2 state and pipelining internals.

ODC must expose each FSDP module's all-gather input *before* any rank gathers it, so it
needs the per-parameter padded shard data and dtypes that FSDP2 keeps on its param group. The
``AllGather`` / ``ReduceScatter`` ABCs that ``set_custom_all_gather`` / ``set_custom_reduce_scatter``
take are not re-exported by ``torch.distributed.fsdp`` either. Everything else goes through public
``FSDPModule`` methods. The pipeline runtime uses torch's split-backward functions
(``stage_backward_input`` / ``stage_backward_weight``) and its action type, which pipelining does
not re-export either; flat ODC walks module inputs and outputs with torch's pytree helpers and asks
whether a profiler records. If
torch moves these names, the
version check below fails with a clear message instead of ODC gathering garbage (and the
first gather of every module is also checked against FSDP2's own input, see ``_comm.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.pipelining.schedules import _Action as TorchAction
from torch.distributed.pipelining.schedules import _ComputationType as TorchComputationType
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

#: (major, minor) versions whose FSDP2 internals this module was written and tested against.
SUPPORTED_TORCH = ((2, 13),)


#: ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` under their torch 2.13 names (2.13 renamed
#: them and warns on the old ones; the GPU machines of this project run 2.11, which has only those).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def check_torch_version() -> None:
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version not in SUPPORTED_TORCH:
        raise RuntimeError(
            f"posttrain.odc supports torch {', '.join(f'{a}.{b}' for a, b in SUPPORTED_TORCH)}, "
            f"found {torch.__version__}; install torch==2.13.0"
        )


def profiler_enabled() -> bool:
    """Whether a torch profiler is recording (``torch.autograd._profiler_enabled``): ODC's labels
    of its gathers and pushes are entered only then, since each costs time even unrecorded."""
    return torch.autograd._profiler_enabled()


__all__ = [
    "AllGather", "ReduceScatter", "ShardedParamInfo", "TorchAction", "TorchComputationType", "check_torch_version",
    "profiler_enabled",
    "sharded_params", "stage_backward_input", "stage_backward_weight", "tree_flatten", "tree_map_only", "tree_unflatten",
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


def sharded_params(module: FSDPModule) -> list[ShardedParamInfo]:
    """The parameters of ``module``'s own FSDP param group, in all-gather layout order."""
    state = module._get_fsdp_state()
    groups = state._fsdp_param_groups
    if len(groups) > 1:
        raise ValueError(
            f"{type(module).__name__} has {len(groups)} FSDP param groups (shard_placement_fn "
            "with per-parameter meshes); ODC supports one param group per fully_shard call"
        )
    if not groups:
        return []
    group = groups[0]
    mp = group.mp_policy
    infos = []
    for fp in group.fsdp_params:
        orig = fp.sharded_param.dtype
        # Same clamping as FSDPParam.init_dtype_attrs (which only runs at lazy init).
        param_dtype = mp.param_dtype if (mp.param_dtype is not None and orig.is_floating_point) else orig
        reduce_dtype = mp.reduce_dtype or param_dtype
        infos.append(
            ShardedParamInfo(
                param=fp.sharded_param,
                padded_data=fp._sharded_param_data,
                unsharded_shape=fp._orig_size,
                param_dtype=param_dtype,
                reduce_dtype=reduce_dtype,
                requires_grad=fp.sharded_param.requires_grad,
            )
        )
    return infos
