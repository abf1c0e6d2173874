"""Engines by name: a new engine is one module that registers its class."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .engine import DataParallelEngine, EngineConfig

__all__ = ["DP_ALIASES", "build_engine", "engine_class", "engine_names", "register_engine", "resolve_dp"]

_ENGINES: dict[str, type[DataParallelEngine]] = {}

#: ``--dp`` spellings that name an engine and a mode (today's and earlier values).
DP_ALIASES: dict[str, tuple[str, str]] = {
    "odc-collective": ("odc", "collective"),
    "odc-flat": ("odc", "odc"),
    "odc-flat-collective": ("odc", "collective"),
    "odc-fsdp2-collective": ("odc-fsdp2", "collective"),
}


def register_engine(name: str) -> Callable[[type[DataParallelEngine]], type[DataParallelEngine]]:
    """Class decorator: make an engine buildable by ``name``."""

    def add(cls: type[DataParallelEngine]) -> type[DataParallelEngine]:
        if name in _ENGINES and _ENGINES[name] is not cls:
            raise ValueError(f"a data-parallel engine named {name!r} is already registered")
        cls.name = name
        _ENGINES[name] = cls
        return cls

    return add


def engine_names() -> tuple[str, ...]:
    """Registered engine names."""
    return tuple(_ENGINES)


def resolve_dp(dp: str, mode: str = "odc") -> tuple[str, str]:
    """``(engine name, mode)`` for a ``--dp`` value, aliases included."""
    if dp in DP_ALIASES:
        return DP_ALIASES[dp]
    if dp not in _ENGINES:
        raise ValueError(f"--dp={dp!r} is not one of {', '.join([*_ENGINES, *DP_ALIASES])}")
    return dp, mode


def engine_class(name: str) -> type[DataParallelEngine]:
    """The class registered as ``name`` (aliases resolved)."""
    return _ENGINES[resolve_dp(name)[0]]


def build_engine(name: str, model: nn.Module, config: EngineConfig | None = None, *,
                 mesh: DeviceMesh | None = None, units: Sequence[nn.Module] | None = None) -> DataParallelEngine:
    """Shard ``model`` with the engine registered as ``name`` (a collective over the mesh; see
    :class:`DataParallelEngine` for ``mesh`` and ``units``)."""
    engine, mode = resolve_dp(name, (config or EngineConfig()).mode)
    config = config or EngineConfig()
    if mode != config.mode:
        from dataclasses import replace

        config = replace(config, mode=mode)
    return _ENGINES[engine](model, config, mesh=mesh, units=units)
