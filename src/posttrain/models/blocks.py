"""Where a model keeps its transformer blocks: the units that sharding engines gather and free
one at a time, and that activation checkpointing wraps."""

from __future__ import annotations

import functools

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_blocks", "find_blocks"]

# Attribute paths of the block list in common model classes, tried in order.
_PATHS = ("layers", "model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers", "transformer.blocks")


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's transformer blocks: ``model.layers`` (posttrain's models), ``model.model.layers``
    (``transformers`` Llama, Qwen2, Mistral, Gemma, ...), ``model.transformer.h`` (GPT-2), ...

    Raises:
        ValueError: no such list; name the blocks explicitly (``units=`` / the engine's argument).
    """
    for path in _PATHS:
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return obj
    raise ValueError(
        f"cannot find the transformer blocks of {type(model).__name__} (looked for {', '.join(_PATHS)}); "
        "pass the block modules explicitly"
    )


def checkpoint_blocks(blocks: nn.ModuleList | list[nn.Module]) -> None:
    """Activation checkpointing per block: each block's forward runs under non-reentrant
    :func:`torch.utils.checkpoint.checkpoint`, saving only its inputs and recomputing the rest
    in backward. Module hooks still fire once per call (the recomputation calls ``forward``,
    not the module), so sharding engines gather before the forward and again before backward
    exactly as without checkpointing. Idempotent."""
    for block in blocks:
        if getattr(block, "_posttrain_checkpointed", False):
            continue
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        block._posttrain_checkpointed = True
