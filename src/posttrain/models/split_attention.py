"""Causal attention over a sequence split across ranks: the execution primitive of context
parallelism (the plan: :mod:`posttrain.balance.context`; not yet wired into the models or the
engines).

[Note: attention over a split sequence]
A sequence split into ``k`` shards (:func:`posttrain.balance.zigzag`) lives on the ``k`` ranks of
its group: each holds the queries, keys and values of its own tokens, at their positions in the
sequence. A query attends to every key at or before its position, wherever that key lives, so each
rank all-gathers the group's keys and values (and their positions) and runs attention of its own
queries over all of them under the mask ``query position >= key position``. The all-gather's
backward sums every rank's gradient of a key or value and hands each owner its own rows (a
reduce-scatter), so the keys' and values' gradients come back exactly.

All-gather rather than a ring: the keys and values of grouped-query attention are a fraction of
the queries, a shard is at most ``max_tokens`` tokens, and one collective per layer and direction
is simpler to align across a group than ``k - 1`` ring steps; the memory is one sequence's keys and
values per layer at a time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from posttrain._compat import all_gather_single, reduce_scatter_single

__all__ = ["split_causal_attention"]

#: The position of padding rows: no query attends to it (no query's position is this large).
_PAD = torch.iinfo(torch.int64).max


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 2 of tensors padded to the group's longest, keeping each rank's true
    rows; backward: the sum over the group of the gathered rows' gradients, this rank's rows (a
    reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, lengths: list[int], group) -> torch.Tensor:
        longest = max(lengths)
        padded = F.pad(x, (0, 0, 0, longest - x.shape[2])).contiguous()
        out = padded.new_empty((len(lengths) * padded.shape[0], *padded.shape[1:]))  # ranks' rows along dim 0
        all_gather_single(out, padded, group=group)
        ctx.lengths, ctx.group = lengths, group
        return torch.cat([p[:, :, :n] for p, n in zip(out.chunk(len(lengths)), lengths)], dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        lengths, group = ctx.lengths, ctx.group
        longest = max(lengths)
        pieces = torch.cat([F.pad(g, (0, 0, 0, longest - n)) for g, n in zip(grad.split(lengths, dim=2), lengths)])
        mine = pieces.new_empty((grad.shape[0], *pieces.shape[1:]))
        reduce_scatter_single(mine, pieces, group=group)
        return mine[:, :, : lengths[dist.get_rank(group)]], None, None


def split_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, *,
                           group=None, scale: float | None = None) -> torch.Tensor:
    """This rank's queries attending, causally, to the keys and values of the whole split sequence.
    See [Note: attention over a split sequence]. A collective over ``group``: every rank of it
    calls this at the same point with its own shard.

    Args:
        q: ``(1, heads, t, head_dim)``, this rank's queries.
        k, v: ``(1, kv_heads, t, head_dim)``, this rank's keys and values (``heads`` a multiple of
            ``kv_heads``: grouped-query attention).
        positions: ``(t,)`` int64, the positions in the sequence of this rank's tokens.
        group: the ranks holding the sequence's shards (default: the world), in shard order.
        scale: the softmax scale (default ``head_dim ** -0.5``).

    Returns:
        ``(1, heads, t, head_dim)``.
    """
    if q.shape[0] != 1 or k.shape[2] != q.shape[2] or positions.shape != (q.shape[2],):
        raise ValueError(f"split attention takes one sequence's shard: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"positions {tuple(positions.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    world = dist.get_world_size(group)
    # the shape and position exchange goes on q's device: NCCL takes device tensors only
    count = torch.tensor([q.shape[2]], dtype=torch.int64, device=q.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)  # (shards may differ by a token)
    lengths = [int(c) for c in counts]
    longest = max(lengths)
    pos = torch.full((longest,), _PAD, dtype=torch.int64, device=q.device)
    pos[: q.shape[2]] = positions.to(q.device, torch.int64)
    every = [torch.empty_like(pos) for _ in range(world)]
    dist.all_gather(every, pos, group=group)
    key_pos = torch.cat([p[:n] for p, n in zip(every, lengths)])
    keys = _GatherRows.apply(k, lengths, group)
    values = _GatherRows.apply(v, lengths, group)
    if keys.shape[1] != q.shape[1]:  # grouped-query attention: each key/value head serves a block of query heads
        keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
        values = values.repeat_interleave(q.shape[1] // values.shape[1], dim=1)
    mask = positions.to(q.device)[:, None] >= key_pos[None, :]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
