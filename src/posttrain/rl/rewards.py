"""Rewards: the embedded verifiable task, or a user function ``module:function``.

A reward function is called as ``fn(prompt, response) -> float``: ``prompt`` is the record's
prompt (a string, or the chat messages before the answer), ``response`` the decoded response
without special tokens. It must return a finite number; an exception or a non-finite value is an
error naming the function and the sample.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

from posttrain.data.tasks import reverse_answer

__all__ = ["RewardFn", "call_reward", "load_reward", "reverse_digits_reward"]

RewardFn = Callable[[Any, str], float]


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return users[-1] if users else ""


def reverse_digits_reward(prompt: Any, response: str) -> float:
    """1 for the exact answer to the embedded task (``"reverse 3 1 4"`` -> ``"4 1 3"``), else 0."""
    return 1.0 if response.strip() == reverse_answer(_prompt_text(prompt)) else 0.0


def load_reward(spec: str) -> RewardFn:
    """``"reverse_digits"`` (the embedded task) or ``"module:function"`` (imported).

    Raises:
        ValueError: not importable, or not a callable.
    """
    if spec == "reverse_digits":
        return reverse_digits_reward
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"`reward` {spec!r}: give reverse_digits or module:function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"`reward` {spec!r}: cannot import it ({e})") from None
    if not callable(fn):
        raise ValueError(f"`reward` {spec!r} is not callable")
    return fn


def call_reward(fn: RewardFn, prompt: Any, response: str, *, name: str = "reward") -> float:
    """``fn(prompt, response)`` as a float; a clear error if it raises or returns non-finite."""
    try:
        value = fn(prompt, response)
    except Exception as e:  # the user's function: report, do not crash deep inside the loop
        raise ValueError(f"`reward` {name} raised {type(e).__name__}: {e} (response {response[:60]!r})") from None
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"`reward` {name} returned {value!r}, not a number (response {response[:60]!r})") from None
    if not math.isfinite(value):
        raise ValueError(f"`reward` {name} returned {value} (response {response[:60]!r}); rewards must be finite")
    return value
