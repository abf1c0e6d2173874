"""Rewards: the embedded verifiable task, or a user function ``module:function``.

A reward function is called as ``fn(prompt, response, **fields) -> float``: ``prompt`` is the
record's prompt (a string, or the chat messages before the answer), ``response`` the decoded
response without special tokens, and ``fields`` the record's other fields (a reference
``answer``, test cases, ...), as TRL passes them. A function gets the fields it names as
parameters (all of them with ``**kwargs``); one that takes only ``(prompt, response)`` is called
with those two. It must return a finite number; an exception or a non-finite value is an error
naming the function, the record and the value.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

from posttrain.data.tasks import reverse_answer

__all__ = ["RewardFn", "call_reward", "load_reward", "load_rewards", "math_answer_reward", "reverse_digits_reward"]

RewardFn = Callable[[Any, str], float]


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return users[-1] if users else ""


def reverse_digits_reward(prompt: Any, response: str) -> float:
    """1 for the exact answer to the embedded task (``"reverse 3 1 4"`` -> ``"4 1 3"``), else 0."""
    return 1.0 if response.strip() == reverse_answer(_prompt_text(prompt)) else 0.0


def math_answer_reward(prompt: Any, response: str, answer: Any) -> float:
    """1 when the response's final answer equals the record's ``answer`` mathematically
    (``math-verify``: LaTeX or plain expressions, ``\\boxed{}``, fractions, radicals and decimals
    compared as values), else 0. ``answer``: the record's field of that name (LaTeX may come
    without ``$``)."""
    from math_verify import parse, verify

    gold = str(answer)
    if "\\" in gold and "$" not in gold:
        gold = f"${gold}$"
    return 1.0 if verify(parse(gold), parse(response)) else 0.0


#: Rewards by name (``reward`` takes these or ``module:function``).
BUILTIN = {"reverse_digits": reverse_digits_reward, "math_answer": math_answer_reward}


def load_reward(spec: str) -> RewardFn:
    """A built-in reward by name (``reverse_digits``: the embedded task; ``math_answer``: the
    record's ``answer`` checked by ``math-verify``) or ``"module:function"`` (imported).

    Raises:
        ValueError: not importable, or not a callable.
    """
    if spec in BUILTIN:
        return BUILTIN[spec]
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"`reward` {spec!r}: give {', '.join(BUILTIN)} or module:function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"`reward` {spec!r}: cannot import it ({e})") from None
    if not callable(fn):
        raise ValueError(f"`reward` {spec!r} is not callable")
    return fn


def load_rewards(spec: str) -> list[tuple[str, RewardFn]]:
    """``(name, function)`` of each comma-separated reward of ``spec`` (:func:`load_reward`)."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ValueError(f"`reward` is empty: give {', '.join(BUILTIN)} or module:function")
    return [(name, load_reward(name)) for name in names]


@functools.lru_cache(maxsize=64)
def _takes(fn: RewardFn) -> tuple[bool, frozenset[str]]:
    """Whether ``fn`` takes ``**kwargs``, and the parameter names it takes by keyword (read once
    per function: a reward is called for every sample of every step)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the two arguments only
        return False, frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True, frozenset()
    return False, frozenset(n for n, p in params.items() if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                                         inspect.Parameter.KEYWORD_ONLY))


def _fields_for(fn: RewardFn, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The record fields ``fn`` takes: those it names as parameters, or all with ``**kwargs``."""
    try:
        every, named = _takes(fn)
    except TypeError:  # (an unhashable callable: read its signature each time)
        every, named = _takes.__wrapped__(fn)
    if every:
        return dict(fields)
    return {k: v for k, v in fields.items() if k in named and k not in ("prompt", "response")}


def call_reward(fn: RewardFn, prompt: Any, response: str, *, name: str = "reward",
                fields: Mapping[str, Any] | None = None, where: str = "") -> float:
    """``fn(prompt, response, **fields it takes)`` as a float; a clear error (naming the
    function, the record ``where`` and the value) if it raises or returns a non-finite value."""
    at = f"{where}, " if where else ""
    try:
        value = fn(prompt, response, **_fields_for(fn, fields or {}))
    except Exception as e:  # the user's function: report, do not crash deep inside the loop
        raise ValueError(f"`reward` {name} raised {type(e).__name__}: {e} ({at}response {response[:60]!r})") from None
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"`reward` {name} returned {value!r}, not a number ({at}response {response[:60]!r})") from None
    if not math.isfinite(value):
        raise ValueError(f"`reward` {name} returned {value} ({at}response {response[:60]!r}); rewards must be "
                         "finite")
    return value
