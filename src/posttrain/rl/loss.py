"""The policy-gradient loss of one packed microbatch of rollouts.

Per response token ``t`` of sample ``i`` (prompt tokens are masked out):

    ratio = exp(logp - logp_old)         (log-probabilities of softmax(logits / temperature), the
                                          distribution the responses were sampled from)
    pg    = -min(ratio * A_i, clip(ratio, 1 - eps_low, 1 + eps_high) * A_i)   (PPO's clipped surrogate;
                                                                          eps_high > eps_low: DAPO's clip-higher)
    kl    = exp(logp_ref - logp) - (logp_ref - logp) - 1                (the k3 estimator, >= 0; computed
                                                                          as expm1(d) - d, exact near 0)
    loss  = pg + kl_coef * kl

and the token losses are summed with weights that make the aggregation (``--loss-agg``) exact for
any placement of samples on ranks and microbatches, divided by the minibatch's global count (the
engine's loss divisor):

- ``token-mean``: weight 1; count: response tokens (the mean over every token of the minibatch);
- ``seq-mean-token-sum``: weight 1; count: samples (each sample's summed loss, averaged);
- ``seq-mean-token-mean``: weight 1 / (its response tokens); count: samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from posttrain.balance import shard_lengths, shard_positions
from posttrain.models.split_attention import SplitShard

__all__ = ["LOSS_AGGS", "Rollout", "clipped_surrogate", "loss_units", "policy_loss", "shard_policy_loss", "shard_units",
           "token_logprobs"]

LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


@dataclass
class Rollout:
    """One sampled response to a prompt, with what the update needs.

    Attributes:
        input_ids: prompt and response token ids (1-D).
        prompt_len: how many of them are the prompt.
        advantage: the sample's advantage.
        old_logprobs: log-probabilities of the response tokens under the policy that sampled them
            (``len(input_ids) - prompt_len`` values); ``None`` when the update is on-policy (one
            epoch, one minibatch: the weights that sampled are the ones updated), where the
            update's own forward gives them, detached, and the ratio is exactly 1.
        ref_logprobs: the same under the frozen reference policy (``None`` without KL).
        reward: its reward (reported, not used by the loss).
    """

    input_ids: torch.Tensor
    prompt_len: int
    advantage: float
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None = None
    reward: float = 0.0

    def __len__(self) -> int:
        return int(self.input_ids.numel())

    @property
    def response_len(self) -> int:
        return len(self) - self.prompt_len


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                   entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(logits / temperature)[target]`` per position (fp32): the log-probability
    under the distribution sampled at ``temperature``. With ``entropy``, also that distribution's
    entropy per position (detached), from the same log-softmax."""
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
    if not entropy:
        return -F.cross_entropy(scaled.flatten(0, -2), targets.flatten(), reduction="none").view(targets.shape)
    lsm = torch.log_softmax(scaled, dim=-1)
    logp = lsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        ent = -(lsm.exp() * lsm.clamp_min(-1e30)).sum(-1)  # (a zero probability adds 0, not nan)
    return logp, ent


def clipped_surrogate(ratio: torch.Tensor, advantage: torch.Tensor, eps_low: float,
                      eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token loss ``-min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)`` and
    which tokens are on the clipped branch: those whose gradient the clip stops, a ratio above
    ``1 + eps_high`` with a positive advantage or below ``1 - eps_low`` with a negative one (a
    ratio outside the range on the other side keeps its gradient: the unclipped term is the min)."""
    pg = -torch.minimum(ratio * advantage, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantage)
    clipped = ((ratio > 1 + eps_high) & (advantage > 0)) | ((ratio < 1 - eps_low) & (advantage < 0))
    return pg, clipped


def loss_units(rollouts: Sequence[Rollout], agg: str) -> int:
    """The count the loss is averaged over (see the module docstring)."""
    if agg == "token-mean":
        return sum(r.response_len for r in rollouts)
    return len(rollouts)


def policy_loss(model, rollouts: Sequence[Rollout], *, clip_eps: float = 0.2, clip_eps_high: float | None = None,
                kl_coef: float = 0.0, agg: str = "token-mean", temperature: float = 1.0,
                device: torch.device | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The summed, weighted loss of ``rollouts`` packed into one microbatch (divide it by the
    minibatch's :func:`loss_units` before ``backward``), and sums for the step's statistics:
    ``tokens``, ``clipped`` tokens (on the clipped branch, :func:`clipped_surrogate`), ``kl``
    and ``entropy`` sums over response tokens. ``clip_eps`` bounds the ratio below (and above,
    unless ``clip_eps_high`` is given). Log-probabilities and entropy are those of the
    distribution sampled at ``temperature`` (the rollout's and the reference's must be too).
    ``device``: where the model is (the rollouts are moved there; default the CPU); the
    statistics come back in one transfer. ``model`` is called as posttrain's models are,
    ``model(tokens, document_lengths=..., logits_at=...)``, and gives logits at the response
    positions alone."""
    if agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg={agg!r} is not one of {', '.join(LOSS_AGGS)}")
    device = device or torch.device("cpu")
    inputs = torch.cat([r.input_ids[:-1] for r in rollouts]).unsqueeze(0).to(device, non_blocking=True)
    lengths = [len(r) - 1 for r in rollouts]
    # The response positions of each sample among the packed targets: the only logits the loss needs
    # (the LM head runs on those rows alone, as TRL's logits_to_keep does).
    pieces, targets, weights, adv, old, ref = [], [], [], [], [], []
    start = 0
    for r, n in zip(rollouts, lengths):
        first = start + r.prompt_len - 1  # target index of the first response token
        pieces.append(torch.arange(first, start + n))
        targets.append(r.input_ids[r.prompt_len:])
        k = r.response_len
        weights.append(torch.full((k,), 1.0 / k if agg == "seq-mean-token-mean" else 1.0))
        adv.append(torch.full((k,), float(r.advantage)))
        old.append(r.old_logprobs.float() if r.old_logprobs is not None else None)
        if kl_coef:
            ref.append(r.ref_logprobs.float())
        start += n
    idx = torch.cat(pieces).to(device, non_blocking=True)
    target = torch.cat(targets).to(device, non_blocking=True)
    if any(o is None for o in old) and not all(o is None for o in old):
        raise ValueError("policy_loss: some rollouts have old_logprobs and others not; give all or none")
    logits = model(inputs, document_lengths=lengths, logits_at=idx)[0]
    return _token_loss(logits, target, torch.cat(weights), torch.cat(adv), None if old[0] is None else torch.cat(old),
                       torch.cat(ref) if kl_coef else None, clip_eps=clip_eps, clip_eps_high=clip_eps_high,
                       kl_coef=kl_coef, temperature=temperature, device=device)


def _token_loss(logits: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, adv: torch.Tensor,
                old: torch.Tensor | None, ref: torch.Tensor | None, *, clip_eps: float, clip_eps_high: float | None,
                kl_coef: float, temperature: float, device: torch.device) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted loss sum and statistics of response tokens from their ``logits`` (one row a
    token) and their targets, weights, advantages, old log-probs (``None``: on-policy) and
    reference log-probs (``None`` without KL); see :func:`policy_loss`."""
    logp, entropy = token_logprobs(logits, target, temperature, entropy=True)
    w, a = (x.to(device, non_blocking=True) for x in (weights, adv))
    # on-policy: this forward's own, detached (ratio 1, gradient d logp)
    old_lp = logp.detach() if old is None else old.to(device, non_blocking=True)
    ratio = torch.exp(logp - old_lp)
    pg, clipped = clipped_surrogate(ratio, a, clip_eps, clip_eps if clip_eps_high is None else clip_eps_high)
    loss_tok = pg
    sums = {"clipped": clipped.sum()}
    if kl_coef:
        d = ref.to(device, non_blocking=True) - logp
        # exp(d) - 1 - d with expm1: near the reference (|d| ~ 1e-3, kl ~ 5e-7) the plain form
        # loses most of kl's digits to the cancellation against 1 in fp32 (an error of ~1e-7 a token)
        kl = torch.expm1(d) - d
        loss_tok = loss_tok + kl_coef * kl
        sums["kl"] = kl.detach().sum()
    sums["entropy"] = entropy.sum()
    with torch.no_grad():
        values = torch.stack([v.float() for v in sums.values()]).tolist()  # (one transfer from the device)
    return (loss_tok * w).sum(), {"tokens": float(target.numel()), **dict(zip(sums, values))}


def shard_units(rollout: Rollout, index: int, num_shards: int, agg: str) -> int:
    """What shard ``index`` of ``num_shards`` of ``rollout`` (split across ranks: context
    parallelism) adds to its rank's loss units: its response targets (``token-mean``), or, on the
    first shard, the sample (the ``seq-mean`` aggregations)."""
    if agg != "token-mean":
        return int(index == 0)
    return int((shard_positions(len(rollout) - 1, index, num_shards) >= rollout.prompt_len - 1).sum())


def shard_policy_loss(model, rollout: Rollout, index: int, num_shards: int, group, *, clip_eps: float = 0.2,
                      clip_eps_high: float | None = None, kl_coef: float = 0.0, agg: str = "token-mean",
                      temperature: float = 1.0, device: torch.device | None = None
                      ) -> tuple[torch.Tensor, dict[str, float]]:
    """:func:`policy_loss` of this rank's shard ``index`` of ``num_shards`` of ``rollout``, split
    across the ranks of ``group`` (a process group or an exchange, in shard order: a collective
    over them, every layer's attention seeing the whole sequence): the shard's response tokens'
    weighted loss and statistics, so that the shards' sums over the group are the whole
    rollout's."""
    if agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg={agg!r} is not one of {', '.join(LOSS_AGGS)}")
    device = device or torch.device("cpu")
    n, first = len(rollout) - 1, rollout.prompt_len - 1  # inputs are input_ids[:-1]; targets shift by one
    positions = shard_positions(n, index, num_shards)
    keys = torch.cat([shard_positions(n, i, num_shards) for i in range(num_shards)])
    local = torch.nonzero(positions >= first).flatten()  # the shard's rows whose targets are response tokens
    at = positions[local] - first  # their index among the response's tokens
    k = rollout.response_len
    weights = torch.full((len(at),), 1.0 / k if agg == "seq-mean-token-mean" else 1.0)
    adv = torch.full((len(at),), float(rollout.advantage))
    old = None if rollout.old_logprobs is None else rollout.old_logprobs.float()[at]
    ref = rollout.ref_logprobs.float()[at] if kl_coef else None
    target = rollout.input_ids[positions[local] + 1]
    inputs = rollout.input_ids[positions].unsqueeze(0).to(device, non_blocking=True)
    split = SplitShard(positions.to(device), group, shard_lengths(n, num_shards), keys.to(device))
    # a shard without response tokens still runs its forward and backward (its exchanges are
    # collectives): one row of logits, weighted 0
    rows = local if len(local) else torch.tensor([len(positions) - 1])
    logits = model(inputs, document_lengths=[len(positions)], split=split, logits_at=rows.to(device))[0]
    if not len(local):
        return logits.sum() * 0.0, {"tokens": 0.0, "clipped": 0.0, "entropy": 0.0, **({"kl": 0.0} if kl_coef else {})}
    return _token_loss(logits, target.to(device), weights, adv, old, ref, clip_eps=clip_eps,
                       clip_eps_high=clip_eps_high, kl_coef=kl_coef, temperature=temperature, device=device)
