"""The configuration of one RL run (``posttrain rl``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from posttrain.balance import METHODS, shard_lengths
from posttrain.rl import ESTIMATORS, LOSS_AGGS
from posttrain.train.core.config import LoraFields, OptimConfig, RunConfig

__all__ = ["RLConfig"]


@dataclass(frozen=True)
class RLConfig(LoraFields, RunConfig):
    """One GRPO/RLOO run (the engine, optimizer, checkpoint and output fields:
    :class:`~posttrain.train.core.RunConfig`).

    Attributes:
        model_path: the policy: a local ``transformers`` causal LM directory with its tokenizer.
        prompts: a JSONL file of ``{"prompt": str}`` or ``{"messages": [...]}`` records (chat
            prompts are rendered with the template's generation prompt).
        reward: ``reverse_digits`` (the embedded task), ``math_answer`` (the record's ``answer``
            checked by math-verify) or ``module:function`` called with
            ``(prompt, response)`` and the record's other fields it names (docs/rl.md); several,
            comma-separated, are summed with ``reward_weights`` (each one's mean in the metrics).
        reward_weights: one weight per reward (default 1 each).
        balance: balancing method of each update minibatch.
        samples_per_prompt: responses sampled per prompt (a group).
        prompts_per_step: prompts per step, over all ranks.
        temperature: sampling temperature; the rollout's, the policy's and the reference's
            log-probabilities are all taken at it (logits divided by it), so the update is the
            policy gradient of the distribution that was sampled (top-p's truncation is not
            modelled, as in TRL and verl).
        top_p: nucleus sampling threshold.
        max_new_tokens: longest response.
        generate_batch: ``step``: all of a rank's prompts of a step in one sampling batch
            (left-padded; more batches only beyond 65,536 padded tokens); ``prompt``: one batch per
            prompt (its samples together, no padding: what posttrain did before; ``posttrain bench
            rl-e2e`` compares the two).
        sampler: ``posttrain``: posttrain's own decoding loop on the rollout model's forward and KV
            cache (:func:`posttrain.rl.rollout.sample`: rows that ended leave the batch, and only
            temperature and top-p shape the draw); ``generate``: ``transformers``' ``generate``
            (which also applies the model's ``generation_config`` defaults).
        advantage: ``grpo`` (group mean baseline) or ``rloo`` (leave-one-out baseline).
        scale_rewards: ``std``: GRPO divides by the group's standard deviation; ``none``: it does not.
        clip_eps: PPO ratio clipping, both sides (the shorthand for ``clip_eps_low`` and
            ``clip_eps_high``).
        clip_eps_low: the ratio's lower bound is 1 - this (default ``clip_eps``).
        clip_eps_high: the ratio's upper bound is 1 + this (default ``clip_eps``; DAPO's
            clip-higher takes it above ``clip_eps_low``, e.g. 0.28 with 0.2).
        ppo_epochs: passes over each rollout batch.
        minibatches: optimizer steps per pass (the rollouts split evenly).
        kl_coef: weight of the k3 KL estimate to the frozen initial policy (0: no reference).
        skip_equal_reward_groups: leave a group whose rewards are all equal (zero advantage) out
            of the update, as the step's count of them says; without it such groups are trained
            (their KL term with ``kl_coef``) and count in the loss's divisor, as TRL does.
        loss_agg: ``token-mean``, ``seq-mean-token-sum`` or ``seq-mean-token-mean``.
        steps: rollout-and-update steps.
        max_tokens: most tokens in one update microbatch or shard; a prompt plus
            ``max_new_tokens`` must fit it, or with context parallelism (``engine.context_parallel``)
            the longest sequence its shards hold (:meth:`longest`).
        checkpoint_dir: save checkpoints (policy and optimizer, sharded) here and resume from the
            newest one found there; the step's prompts and sampling seeds follow from ``seed``
            and the step, so a resumed run samples what the uninterrupted one would have.
        record: append every step's rollouts (token ids, prompt length, advantage) here as JSON
            lines, for ``posttrain bench rl --rollouts``.
    """

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    steps: int = 20
    model_path: str | None = None
    prompts: str | None = None
    reward: str = "reverse_digits"
    reward_weights: tuple[float, ...] | None = None
    balance: Literal["round_robin", "local_sort", "same_micro", "diff_micro"] = "diff_micro"
    samples_per_prompt: int = 4
    prompts_per_step: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    generate_batch: Literal["step", "prompt"] = "step"
    sampler: Literal["posttrain", "generate"] = "posttrain"
    advantage: Literal["grpo", "rloo"] = "grpo"
    scale_rewards: Literal["std", "none"] = "std"
    clip_eps: float = 0.2
    clip_eps_low: float | None = field(default=None, metadata={"derived": True})
    clip_eps_high: float | None = field(default=None, metadata={"derived": True})
    ppo_epochs: int = 1
    minibatches: int = 1
    kl_coef: float = 0.0
    skip_equal_reward_groups: bool = True
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    max_tokens: int = 1024
    record: str | None = None

    TRAINER: ClassVar[str] = "the RL trainer"
    DATA_FIELDS: ClassVar[tuple[str, ...]] = ("prompts", "prompts_per_step", "seed")

    def state_fields(self) -> tuple[str, ...]:
        return ("model_path", *super().state_fields())

    def longest(self, world_size: int) -> int:
        """The longest rollout (input tokens) the update takes on ``world_size`` ranks:
        ``max_tokens``, or with context parallelism the longest sequence whose shards over the
        ranks it may use (all for ``auto``, else its shard count) hold at most ``max_tokens`` each."""
        cp = self.engine.context_parallel
        if cp == "off":
            return self.max_tokens
        k = world_size if cp == "auto" else min(int(cp), world_size)
        n = k * self.max_tokens
        while n > self.max_tokens and max(shard_lengths(n, k)) > self.max_tokens:
            n -= 1
        return max(n, self.max_tokens)

    def __post_init__(self) -> None:
        for name in ("clip_eps_low", "clip_eps_high"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.clip_eps)
        super().__post_init__()
        if self.engine.context_parallel != "off" and self.balance != "diff_micro":
            raise ValueError(f"`context_parallel` splits rollouts within diff_micro's plan; balance={self.balance!r} "
                             "does not take it (use `balance` diff_micro)")
        for name, choices in (("balance", METHODS), ("advantage", ESTIMATORS), ("loss_agg", LOSS_AGGS),
                              ("scale_rewards", ("std", "none")),
                              ("sampler", ("posttrain", "generate"))):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {', '.join(choices)}")
        for name in ("prompts_per_step", "ppo_epochs", "minibatches", "max_new_tokens", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.samples_per_prompt < 2:
            raise ValueError(f"samples_per_prompt={self.samples_per_prompt}: {self.advantage.upper()} compares the "
                             "samples of a prompt with each other and needs at least 2")
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"clip_eps={self.clip_eps} must be in (0, 1)")
        if not 0 < self.clip_eps_low < 1:
            raise ValueError(f"clip_eps_low={self.clip_eps_low} must be in (0, 1)")
        if not self.clip_eps_high > 0:
            raise ValueError(f"clip_eps_high={self.clip_eps_high} must be positive")
        if self.reward_weights is not None:
            count = len([s for s in self.reward.split(",") if s.strip()])
            if len(self.reward_weights) != count:
                raise ValueError(f"reward_weights={','.join(map(str, self.reward_weights))}: {len(self.reward_weights)} "
                                 f"weights for the {count} reward(s) of `reward`")
            if not all(math.isfinite(w) for w in self.reward_weights):
                raise ValueError("`reward_weights` must be finite numbers")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef={self.kl_coef} must be non-negative")
        if self.minibatches > self.prompts_per_step * self.samples_per_prompt:
            raise ValueError(f"minibatches={self.minibatches} exceeds the {self.prompts_per_step * self.samples_per_prompt} "
                             "samples of a step")

    @property
    def sequences_per_step(self) -> int:
        """Prompts a step consumes (a checkpoint's data position counts them)."""
        return self.prompts_per_step
