"""Advantages from rewards of grouped samples: GRPO and RLOO.

Rewards come in groups, one per prompt, of ``group_size`` samples each, laid out group after
group. A group whose rewards are all equal carries no signal (every advantage is zero); it is
reported so the loop can skip and count it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ESTIMATORS", "Advantages", "compute_advantages"]

ESTIMATORS = ("grpo", "rloo")


@dataclass(frozen=True)
class Advantages:
    """Attributes:
    values: one advantage per sample.
    zero_groups: indices of groups whose rewards were all equal (zero advantage).
    """

    values: list[float]
    zero_groups: list[int]


def compute_advantages(rewards: Sequence[float], group_size: int, *, estimator: str = "grpo",
                       normalize_std: bool = True, eps: float = 1e-6) -> Advantages:
    """Per-sample advantages.

    - ``grpo``: reward minus its group's mean, divided by the group's standard deviation
      (unbiased) when ``normalize_std``;
    - ``rloo``: reward minus the mean of the *other* samples of its group (leave one out).

    Raises:
        ValueError: an unknown estimator, a reward count that is not a multiple of ``group_size``,
            a group of one (neither estimator has a baseline then), or a non-finite reward.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage={estimator!r} is not one of {', '.join(ESTIMATORS)}")
    if group_size < 2:
        raise ValueError(f"samples_per_prompt={group_size}: {estimator.upper()} compares the samples of a prompt "
                         "with each other and needs at least 2")
    r = torch.tensor(list(rewards), dtype=torch.float64)
    if r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards are not groups of {group_size}")
    if not torch.isfinite(r).all():
        raise ValueError("a reward is not finite")
    g = r.view(-1, group_size)
    mean = g.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        adv = g - mean
        if normalize_std:
            adv = adv / (g.std(dim=1, keepdim=True) + eps)
    else:
        adv = (g - mean) * group_size / (group_size - 1)  # r_i - mean of the others
    flat = (g == g[:, :1]).all(dim=1)
    adv[flat] = 0.0
    return Advantages(values=adv.flatten().tolist(), zero_groups=torch.nonzero(flat).flatten().tolist())
