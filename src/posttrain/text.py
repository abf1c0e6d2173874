"""Counted nouns for what the command line prints ("1 chunk", "2 chunks")."""

from __future__ import annotations

__all__ = ["count"]


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1 (``plural``: where adding an s is wrong):
    ``count(1, "chunk")`` is ``"1 chunk"``, ``count(2, "CPU process", "CPU processes")``
    ``"2 CPU processes"``."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"
