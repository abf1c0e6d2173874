"""The frozen reference policy of the KL term, sharded like the policy.

A full copy of the reference on every rank would cost each rank a whole model of memory, more
than the sharded policy itself. Instead the reference is built by the same data-parallel engine
as the policy, with every parameter frozen: each rank holds ``1 / world_size`` of it, and its
log-probs are computed in forward-only minibatches, balanced over the ranks like an update
minibatch (under ODC the ranks may run different numbers of microbatches; engines with a
rendezvous per layer get matching dummy forwards), then shared with every rank.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist

from posttrain.balance import CostModel, plan_minibatch
from posttrain.dp import build_engine
from posttrain.models import load_pretrained
from posttrain.rl import token_logprobs

from .config import RLConfig

__all__ = ["ShardedReference", "engine_logprobs"]


def engine_logprobs(engine, model, sequences: Sequence[torch.Tensor], prompt_lens: Sequence[int], cfg: RLConfig,
                    cost: CostModel | None, *, rank: int, world_size: int) -> tuple[list[torch.Tensor], int]:
    """Log-probs (at ``cfg.temperature``) of each sequence's response tokens under the model an
    engine shards, without a gradient: the sequences packed into microbatches and balanced over
    the ranks like an update minibatch, one forward per microbatch (under ODC the ranks may run
    different counts; engines with a rendezvous per layer get matching dummy forwards), then
    shared with every rank. A collective: every rank passes the same sequences and gets every
    result. Returns them and this rank's microbatch count. The reference's log-probs, and the
    policy's own where an update is not on-policy."""
    every = [len(s) - 1 for s in sequences]
    # forward only: a rollout longer than max_tokens (context parallelism's) runs whole, alone in
    # its microbatch (the longest first, each to the rank with the fewest so far); the rest are
    # packed and balanced as usual
    long = sorted((i for i, n in enumerate(every) if n > cfg.max_tokens), key=lambda i: -every[i])
    rest = [i for i, n in enumerate(every) if n <= cfg.max_tokens]
    per_rank: list[list[tuple[int, ...]]] = [[] for _ in range(world_size)]
    if rest:
        plan = plan_minibatch([every[i] for i in rest], world_size=world_size, max_tokens=cfg.max_tokens,
                              method=cfg.balance, cost=cost)
        per_rank = [[tuple(rest[j] for j in m.sequence_ids) for m in mbs if m.sequence_ids] for mbs in plan.ranks]
    for i in long:
        min(per_rank, key=len).append((i,))
    mine = per_rank[rank]
    busiest = max(len(m) for m in per_rank)
    out: dict[int, list[float]] = {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="no rank ran a backward")  # forward only, by design
        with engine.minibatch(0):
            for ids in engine.pad(mine, busiest):
                if ids is None:
                    engine.run_dummy(backward=False)
                    continue
                inputs = torch.cat([sequences[i][:-1] for i in ids]).unsqueeze(0).to(engine.device)
                lengths = [len(sequences[i]) - 1 for i in ids]
                starts = [sum(lengths[:j]) for j in range(len(ids))]
                # the response positions alone: the LM head runs on those rows only (as the update's)
                at = torch.cat([torch.arange(a + prompt_lens[i] - 1, a + n) for i, a, n in zip(ids, starts, lengths)])
                targets = torch.cat([sequences[i][prompt_lens[i]:] for i in ids]).to(engine.device)
                logits = model(inputs, document_lengths=lengths, logits_at=at.to(engine.device))[0]
                lp = token_logprobs(logits, targets, cfg.temperature).cpu()
                for i, part in zip(ids, lp.split([n + 1 - prompt_lens[i] for i, n in zip(ids, lengths)])):
                    out[i] = part.tolist()
    engine.after_forward_only()  # no backward comes for these forwards
    every: list = [None] * world_size
    dist.all_gather_object(every, out)
    merged = {i: v for part in every for i, v in part.items()}
    return [torch.tensor(merged[i]) for i in range(len(sequences))], len(mine)

class ShardedReference:
    """The policy at ``model_path``, frozen and sharded by ``cfg.engine`` (a collective to build).

    Attributes:
        model: the frozen module (its parameters are the engine's between calls).
        microbatches: forward microbatches this rank ran in the last :meth:`logprobs` call.
    """

    def __init__(self, model_path: str, cfg: RLConfig, cost: CostModel | None = None,
                 device: torch.device | None = None) -> None:
        model = load_pretrained(model_path)
        if device is not None and device.type != "cpu":
            model.to(device)
        model.requires_grad_(False)
        model.eval()
        self.model = model
        self.cfg = cfg
        self.cost = cost
        self.engine = build_engine(model, cfg.engine)
        self.microbatches = 0

    def logprobs(self, sequences: Sequence[torch.Tensor], prompt_lens: Sequence[int], *, rank: int,
                 world_size: int) -> list[torch.Tensor]:
        """The reference's log-probs of each sequence's response tokens (``sequences[i][prompt_lens[i]:]``).
        A collective: every rank passes the same sequences and gets every result."""
        out, self.microbatches = engine_logprobs(self.engine, self.model, sequences, prompt_lens, self.cfg, self.cost,
                                                 rank=rank, world_size=world_size)
        return out

    def close(self) -> None:
        self.engine.close()
