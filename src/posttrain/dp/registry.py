"""Engines by name: a new engine is one module that registers its class.

The registry knows names and classes only (``engine.py``'s configuration asks it which names
exist and what each engine can do; :func:`posttrain.dp.build_engine` builds by name), so it
imports none of the engines' modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["engine_class", "engine_names", "register_engine"]

_ENGINES: dict[str, type[Any]] = {}


def register_engine(name: str) -> Callable[[type[Any]], type[Any]]:
    """Class decorator: make an engine (a ``DataParallelEngine`` subclass) buildable by ``name``."""

    def add(cls: type[Any]) -> type[Any]:
        if name in _ENGINES and _ENGINES[name] is not cls:
            raise ValueError(f"a data-parallel engine named {name!r} is already registered")
        cls.name = name
        _ENGINES[name] = cls
        return cls

    return add


def engine_names() -> tuple[str, ...]:
    """Registered engine names."""
    return tuple(_ENGINES)


def engine_class(name: str) -> type[Any]:
    """The class registered as ``name``."""
    if name not in _ENGINES:
        raise ValueError(f"name={name!r} is not one of {', '.join(_ENGINES)}")
    return _ENGINES[name]
