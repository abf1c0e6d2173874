"""Reinforcement learning from verifiable rewards: advantages (GRPO, RLOO), the clipped
policy-gradient loss with an optional KL to a reference, rollout engines and rewards. The loop
that composes them with a data-parallel engine is :mod:`posttrain.train.rl`."""

from __future__ import annotations

from .advantages import ESTIMATORS, Advantages, compute_advantages
from .loss import (
    LOSS_AGGS,
    Rollout,
    clipped_surrogate,
    loss_units,
    policy_loss,
    shard_policy_loss,
    shard_units,
    token_logprobs,
)
from .rewards import call_reward, load_reward, load_rewards, reverse_digits_reward
from .rollout import HFRollout, RolloutEngine, sample

__all__ = [
    "ESTIMATORS",
    "LOSS_AGGS",
    "Advantages",
    "HFRollout",
    "Rollout",
    "RolloutEngine",
    "call_reward",
    "clipped_surrogate",
    "compute_advantages",
    "load_reward",
    "load_rewards",
    "loss_units",
    "policy_loss",
    "reverse_digits_reward",
    "sample",
    "shard_policy_loss",
    "shard_units",
    "token_logprobs",
]
