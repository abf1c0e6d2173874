"""Engines by name: a new engine is one module that registers its class."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .engine import DataParallelEngine, EngineConfig

__all__ = ["build_engine", "engine_class", "engine_names", "register_engine"]

_ENGINES: dict[str, type[DataParallelEngine]] = {}

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


def engine_class(name: str) -> type[DataParallelEngine]:
    """The class registered as ``name``."""
    if name not in _ENGINES:
        raise ValueError(f"name={name!r} is not one of {', '.join(_ENGINES)}")
    return _ENGINES[name]


def build_engine(model: nn.Module, config: EngineConfig | None = None, *, mesh: DeviceMesh | None = None,
                 units: Sequence[nn.Module] | None = None) -> DataParallelEngine:
    """Shard ``model`` with the engine ``config.name`` names (a collective over the mesh; see
    :class:`DataParallelEngine` for ``mesh`` and ``units``)."""
    config = config or EngineConfig()
    return engine_class(config.name)(model, config, mesh=mesh, units=units)
