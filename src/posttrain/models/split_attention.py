"""Causal attention over a sequence split across ranks: the execution primitive of context
parallelism (the plan: :mod:`posttrain.balance.context`), and the models' per-sequence attention
of a packed microbatch whose first sequence is such a shard (:class:`SplitShard`): posttrain's GPT
calls :func:`packed_attention` itself; a ``transformers`` model reaches it through the attention
function registered under ``"posttrain"`` (:func:`use_split_attention`), no model code patched.

[Note: attention over a split sequence]
A sequence split into ``k`` shards (:func:`posttrain.balance.zigzag`) lives on the ``k`` ranks of
its group: each holds the queries, keys and values of its own tokens, at their positions in the
sequence. A query attends to every key at or before its position, wherever that key lives, so each
rank all-gathers the group's keys and values (and their positions) and orders them by position;
each run of its consecutive query positions (a zigzag shard has two) then attends to the keys
before it without a mask and to its own keys causally, the two blocks merged by their
log-sum-exps (:func:`causal_blocks`, :class:`_RunAttention`): the work of a causal split, not of
every query against every key (a device without such a kernel runs pieces of the runs over the
keys up to their last position, under the mask ``query position >= key position``). The all-gather's
backward sums every rank's gradient of a key or value and hands each owner its own rows (a
reduce-scatter), so the keys' and values' gradients come back exactly.

All-gather rather than a ring: the keys and values of grouped-query attention are a fraction of
the queries, a shard is at most ``max_tokens`` tokens, and one collective per layer and direction
is simpler to align across a group than ``k - 1`` ring steps; the memory is one sequence's keys and
values per layer at a time. The exchange goes through the group's process group, or through an
exchange object given in its place: the ODC trainers on the CPU give ranks of one host
``posttrain.odc.ShmRowExchange`` (copies through shared memory and a spinning barrier instead of
gloo's sockets).
"""

from __future__ import annotations

import bisect
import contextvars
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from posttrain._compat import (
    all_gather_single,
    cpu_attention_with_lse,
    cpu_attention_with_lse_backward,
    reduce_scatter_single,
)

__all__ = ["HF_ATTENTION", "CausalBlocks", "SplitShard", "causal_blocks", "packed_attention", "packed_call",
           "split_causal_attention", "use_split_attention"]

#: The position of padding rows: no query attends to it (no query's position is this large).
_PAD = torch.iinfo(torch.int64).max


class _GroupCollectives:
    """A process group's collectives as a split shard's exchange (what an exchange object given as
    ``SplitShard.group`` provides itself: ``rank``, ``size``, ``process_group``, and
    ``gather_spans`` / ``reduce_spans`` as :class:`posttrain.odc.ShmRowExchange` has them, which
    the ODC engines' ranks on one host use): an all-gather of tensors padded to the group's
    longest, in shard order, the ranges copied out of it; backward, the ranges copied into a
    padded buffer per rank and reduce-scattered."""

    def __init__(self, group) -> None:
        self.process_group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def gather_spans(self, x: torch.Tensor, lengths: list[int], spans: list[tuple[int, int, int]],
                     dim: int) -> torch.Tensor:
        if dim != 2:
            raise ValueError(f"the process group's exchange gathers along dim 2, not {dim}")
        longest = max(lengths)
        padded = (x if x.shape[2] == longest else F.pad(x, (0, 0, 0, longest - x.shape[2]))).contiguous()
        out = padded.new_empty((len(lengths) * padded.shape[0], *padded.shape[1:]))  # ranks' rows along dim 0
        all_gather_single(out, padded, group=self.process_group)
        pieces = out.chunk(len(lengths))
        return torch.cat([pieces[r][:, :, a:b] for r, a, b in spans], dim=2)

    def reduce_spans(self, grad: torch.Tensor, lengths: list[int], spans: list[tuple[int, int, int]],
                     dim: int) -> torch.Tensor:
        if dim != 2:
            raise ValueError(f"the process group's exchange reduces along dim 2, not {dim}")
        longest = max(lengths)
        shape = (len(lengths) * grad.shape[0], *grad.shape[1:2], longest, *grad.shape[3:])
        # (rows past a rank's length are padding: zeros, so that nothing but zeros is summed there)
        pieces = grad.new_zeros(shape) if min(lengths) < longest else grad.new_empty(shape)
        chunks = pieces.chunk(len(lengths))
        at = 0
        for r, a, b in spans:
            chunks[r][:, :, a:b].copy_(grad[:, :, at:at + b - a])
            at += b - a
        mine = pieces.new_empty((grad.shape[0], *pieces.shape[1:]))
        reduce_scatter_single(mine, pieces, group=self.process_group)
        return mine[:, :, : lengths[self.rank]]


def _exchange(group):
    """``group``'s exchange: an exchange object as it is, a process group (or ``None``, the world)
    through its collectives."""
    return group if hasattr(group, "gather_spans") else _GroupCollectives(group)


def _process_group(group):
    return getattr(group, "process_group", group)


def _rank_spans(segments: list[tuple[int, int]], lengths: list[int]) -> list[tuple[int, int, int]]:
    """``segments`` (row ranges of the ranks' rows concatenated in shard order) as ``(rank, start,
    end)`` ranges of each rank's own rows, cut where a segment crosses from one rank to the next."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    out = []
    for a, b in segments:
        while a < b:
            r = bisect.bisect_right(starts, a) - 1
            end = min(b, starts[r + 1])
            out.append((r, a - starts[r], end - starts[r]))
            a = end
    return out


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 2, keeping each rank's rows in the order ``segments`` gives (row
    ranges of the ranks' rows concatenated in shard order; default: shard order), each range one
    block copy; backward: the sum over the group of the gathered rows' gradients, this rank's rows
    (a reduce-scatter). The exchange does both (``gather_spans`` / ``reduce_spans``: the
    shared-memory one copies each range straight into place, a process group's collectives go
    through padded buffers in shard order). (Block copies instead of concatenating in shard order
    and then selecting the rows one by one: at 4,096 tokens the selection and its gradient's
    scatter were about a third of a split's own operations.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, lengths: list[int], group,
                segments: list[tuple[int, int]] | None = None) -> torch.Tensor:
        ex = _exchange(group)
        spans = _rank_spans(segments or [(0, sum(lengths))], lengths)
        ctx.lengths, ctx.ex, ctx.spans = lengths, ex, spans
        return ex.gather_spans(x, lengths, spans, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.ex.reduce_spans(grad, ctx.lengths, ctx.spans, dim=2), None, None, None


def split_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, *,
                           group=None, scale: float | None = None, lengths: list[int] | None = None,
                           key_positions: torch.Tensor | None = None,
                           blocks: CausalBlocks | None = None) -> torch.Tensor:
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
        lengths, key_positions: every shard's token count and the positions of all of them in
            shard order, where the caller knows them (the plan gives them to every rank); else
            exchanged here, two more collectives a call.
        blocks: :func:`causal_blocks` of ``positions`` and ``key_positions``, where the caller
            has it (a :class:`SplitShard` keeps it); else computed here.

    Returns:
        ``(1, heads, t, head_dim)``.
    """
    if q.shape[0] != 1 or k.shape[2] != q.shape[2] or positions.shape != (q.shape[2],):
        raise ValueError(f"split attention takes one sequence's shard: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"positions {tuple(positions.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if (lengths is None) != (key_positions is None):
        raise ValueError("give both lengths and key_positions, or neither")
    if lengths is None:
        lengths, key_positions = _exchange_positions(positions.to(q.device, torch.int64), group)
    key_pos = key_positions.to(q.device)
    if blocks is None:
        blocks = causal_blocks(positions, key_pos)
    # keys and values in one collective each way (the exchange is latency-bound on a CPU's gloo),
    # gathered in position order: a query run's keys are then a prefix
    keys, values = _GatherRows.apply(torch.cat([k, v], dim=1), lengths, group, blocks.segments).chunk(2, dim=1)
    if keys.shape[1] != q.shape[1]:  # grouped-query attention: each key/value head serves a block of query heads
        # (repeated, not SDPA's enable_gqa: with a mask that would leave a GPU only its math kernel)
        keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
        values = values.repeat_interleave(q.shape[1] // values.shape[1], dim=1)
    lse_kernel = _LSE_ATTENTION.get(q.device.type)
    if lse_kernel is not None:
        return _RunAttention.apply(q, keys, values, blocks.runs, scale, lse_kernel)
    pos = positions.to(q.device)
    if blocks.order is not None:  # (the masks compare positions: the keys' in the gathered order)
        key_pos = key_pos.index_select(0, blocks.order.to(q.device))
    out = [F.scaled_dot_product_attention(q[:, :, a:b], keys[:, :, :m], values[:, :, :m],
                                          attn_mask=pos[a:b, None] >= key_pos[None, :m], scale=scale)
           for a, b, m in blocks.pieces]
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


#: The fewest query rows of a piece of a split shard's attention under a mask (:func:`causal_blocks`):
#: smaller pieces mask less work but make more calls.
PIECE_ROWS = 64


class CausalBlocks(NamedTuple):
    """How :func:`split_causal_attention` runs a shard's queries against the gathered keys
    (:func:`causal_blocks`).

    Attributes:
        order: the order that sorts the gathered keys by position (``None``: they already are).
        runs: ``(start, end, before, upto)`` per run of consecutive query positions, at most
            half the shard (a zigzag shard's two chunks, also where they are adjacent): its queries
            ``start:end`` see the first ``upto`` sorted keys, of which the first ``before`` come
            before its first position. (The middle shard's adjacent chunks as one run, a causal
            square twice as long, took the CPU's flash kernel 15-20% longer than the other
            shard's two at 1,024 tokens, and 4% at 4,096, so the group waited for it at every
            layer: ``scripts/split_attention_probe.py``.)
        pieces: ``(start, end, upto)``: the runs cut into pieces of an eighth of the shard (at
            least :data:`PIECE_ROWS` rows, at most half the shard), each attending to the first
            ``upto`` sorted keys under a mask.
        segments: ``order`` as ranges of consecutive gathered rows, ``(start, end)`` (a zigzag
            shard's chunks: a few), so that the gather puts the keys in order with block copies.

    A run's own keys are exactly its positions (``upto - before == end - start``: the shard holds
    every position from its first to its last), so it is a mask-free block over the keys before
    it plus a causal square.
    """

    order: torch.Tensor | None
    runs: list[tuple[int, int, int, int]]
    pieces: list[tuple[int, int, int]]
    segments: list[tuple[int, int]]


def causal_blocks(positions: torch.Tensor, key_positions: torch.Tensor) -> CausalBlocks:
    """The runs and pieces of a shard's queries (its ``positions``) over the gathered keys
    (``key_positions``, in shard order; the sorting order on their device, the rest host values
    from one transfer). Where the
    device has an attention kernel that returns its log-sum-exp (the CPU's), a run attends to the
    keys before it without a mask and to its own keys causally, the two merged by their
    log-sum-exps (:class:`_RunAttention`): exactly a causal split's work, ``1 / k`` of the
    sequence's at ``k`` shards. Otherwise each piece attends to every key up to its last position
    under a mask, of which only the triangle at its end is masked: about ``1 + 1 / 8k`` of that
    (``(2k + 1) / 2k`` for shards under ``16 x PIECE_ROWS`` tokens). One masked call over every
    key would compute the whole sequence's work on every rank."""
    qpos = positions.tolist()
    kpos = key_positions.tolist()
    order = sorted(range(len(kpos)), key=kpos.__getitem__)
    ordered = [kpos[i] for i in order]
    half = -(-len(qpos) // 2)
    piece = min(half, max(PIECE_ROWS, -(-len(qpos) // 8)))
    runs, pieces = [], []
    start = cut = 0
    for i in range(1, len(qpos) + 1):
        end_run = i == len(qpos) or qpos[i] != qpos[i - 1] + 1 or i - start == half
        if end_run or i - cut == piece:
            pieces.append((cut, i, bisect.bisect_right(ordered, qpos[i - 1])))
            cut = i
        if end_run:
            runs.append((start, i, bisect.bisect_left(ordered, qpos[start]), bisect.bisect_right(ordered, qpos[i - 1])))
            start = i
    segments: list[tuple[int, int]] = []
    for i in order:  # (runs of consecutive gathered rows)
        if segments and segments[-1][1] == i:
            segments[-1] = (segments[-1][0], i + 1)
        else:
            segments.append((i, i + 1))
    sorted_order = None if order == list(range(len(order))) else torch.tensor(order, device=key_positions.device)
    return CausalBlocks(sorted_order, runs, pieces, segments)


#: Per device type, an attention kernel returning ``(output, log-sum-exp)`` and its backward taking
#: the merged output and log-sum-exp (the flash-attention identity: a block's gradients need only
#: those). A device without one (CUDA: not yet run on a GPU) takes the masked pieces.
_LSE_ATTENTION = {"cpu": (cpu_attention_with_lse, cpu_attention_with_lse_backward)}


class _RunAttention(torch.autograd.Function):
    """Each run of a shard's queries over the keys before it (no mask) and its own keys (causal),
    merged by log-sum-exp; backward: each block's gradients from the merged output and
    log-sum-exp (exact)."""

    @staticmethod
    def forward(ctx, q, keys, values, runs, scale, kernel):
        fwd, _ = kernel
        lses = []
        out = torch.empty_like(q)  # (each run's rows written in place: no concatenation)
        for begin, end, before, upto in runs:
            qr, dst = q[:, :, begin:end], out[:, :, begin:end]
            parts = [fwd(qr, keys[:, :, a:b], values[:, :, a:b], causal, scale)
                     for a, b, causal in ((0, before, False), (before, upto, True)) if b > a]
            if len(parts) == 1:
                dst.copy_(parts[0][0])
                lse = parts[0][1]
            else:  # the two blocks merged by their log-sum-exps, in fp32
                (o0, lse0), (o1, lse1) = parts
                lse = torch.logaddexp(lse0, lse1)
                w0, w1 = (torch.exp(part - lse).unsqueeze(-1) for part in (lse0, lse1))
                if q.dtype == torch.float32:
                    torch.mul(o0, w0, out=dst).addcmul_(o1, w1)
                else:
                    dst.copy_((o0.float() * w0).addcmul_(o1.float(), w1))
            lses.append(lse)
        ctx.save_for_backward(q, keys, values, out, *lses)  # (the output once, sliced per run in backward)
        ctx.runs, ctx.scale, ctx.kernel = runs, scale, kernel
        return out

    @staticmethod
    def backward(ctx, grad):
        q, keys, values, out, *lses = ctx.saved_tensors
        runs, scale = ctx.runs, ctx.scale
        _, bwd = ctx.kernel
        # summed in fp32 over blocks and runs (bf16 inputs: one rounding at the end); a row's first
        # gradient is copied in, later ones added (the runs go up the positions, and a run's blocks
        # cover the keys 0..upto: keys below ``seen`` have a gradient already), the keys after the
        # last run's zeroed: no buffer is zero-filled first
        dq, dk, dv = (torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (q, keys, values))
        seen = 0
        for (begin, end, before, upto), lse in zip(runs, lses):
            g = grad[:, :, begin:end].contiguous()
            for j, (a, b, causal) in enumerate(((0, before, False), (before, upto, True))):
                if b > a:
                    gq, gk, gv = bwd(g, q[:, :, begin:end], keys[:, :, a:b], values[:, :, a:b], out[:, :, begin:end], lse,
                                     causal, scale)
                    if j == 0 or before == 0:  # (the run's first block: its queries' first gradient)
                        dq[:, :, begin:end].copy_(gq)
                    else:
                        dq[:, :, begin:end] += gq
                    old = min(b, max(a, seen))  # keys a..old have a gradient, old..b none yet
                    for buf, part in ((dk, gk), (dv, gv)):
                        if old > a:
                            buf[:, :, a:old] += part[:, :, :old - a]
                        if b > old:
                            buf[:, :, old:b].copy_(part[:, :, old - a:])
                    seen = max(seen, b)
        dk[:, :, seen:].zero_()
        dv[:, :, seen:].zero_()
        return dq.to(q.dtype), dk.to(keys.dtype), dv.to(values.dtype), None, None, None


def _exchange_positions(positions: torch.Tensor, group) -> tuple[list[int], torch.Tensor]:
    """Every shard's token count and every shard's positions in shard order (two all-gathers, on
    the positions' device: NCCL takes device tensors only)."""
    group = _process_group(group)
    world = dist.get_world_size(group)
    count = torch.tensor([positions.numel()], dtype=torch.int64, device=positions.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)  # (shards may differ by a token)
    lengths = [int(c) for c in counts]
    pos = torch.full((max(lengths),), _PAD, dtype=torch.int64, device=positions.device)
    pos[: positions.numel()] = positions
    every = [torch.empty_like(pos) for _ in range(world)]
    dist.all_gather(every, pos, group=group)
    return lengths, torch.cat([p[:n] for p, n in zip(every, lengths)])


@dataclass(frozen=True, eq=False)
class SplitShard:
    """The first sequence of a packed microbatch is this rank's shard of a sequence split across
    ``group`` (see [Note: attention over a split sequence]).

    Attributes:
        positions: ``(t,)`` int64, the positions in the whole sequence of the shard's tokens (its
            length is the first of the microbatch's ``document_lengths``).
        group: the process group of the ranks holding the sequence's shards, in shard order
            (``None``: the world), or an exchange among them (``posttrain.odc.ShmRowExchange``:
            through shared memory on one host).
        lengths, key_positions: every shard's token count and all shards' positions in shard
            order, where the caller knows them (a plan does): saves their exchange at every layer.
    """

    positions: torch.Tensor
    group: Any = None
    lengths: list[int] | None = None
    key_positions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.positions.dim() != 1 or self.positions.dtype != torch.int64 or self.positions.numel() < 1:
            raise ValueError(f"SplitShard.positions must be a non-empty 1-D int64 tensor, got "
                             f"{self.positions.dtype} of shape {tuple(self.positions.shape)}")

    @functools.cached_property
    def blocks(self) -> CausalBlocks | None:
        """:func:`causal_blocks` of the shard, once for all its layers (``None`` until the key
        positions are known: without them every call exchanges them)."""
        return None if self.key_positions is None else causal_blocks(self.positions, self.key_positions)


def check_split(document_lengths: list[int] | None, split: SplitShard | None) -> None:
    """Refuse a split shard that is not the first sequence of a packed microbatch."""
    if split is None:
        return
    if not document_lengths or document_lengths[0] != split.positions.numel():
        raise ValueError(f"a split shard of {split.positions.numel()} tokens must be the first packed sequence "
                         f"(document_lengths {document_lengths})")


#: A packed sequence joins a padded batch whose longest sequence is ``L`` tokens when padding it to
#: ``L`` at most doubles its attention work (``L^2 <= PAD_WASTE * n^2``), or when ``L`` is at most
#: :data:`SHORT` tokens (then a call's fixed cost outweighs any padding).
PAD_WASTE = 2.0
SHORT = 64


def _length_groups(lengths: list[int]) -> list[list[int]]:
    """Sequence indices in groups that run as one padded batch each, longest first (see
    :data:`PAD_WASTE` and :data:`SHORT`)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        top = lengths[groups[-1][0]] if groups else None
        if top is not None and (top <= SHORT or top * top <= PAD_WASTE * lengths[i] ** 2):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@functools.lru_cache(maxsize=64)
def _attention_plan(lengths: tuple[int, ...], first: int, batch: bool,
                    device: torch.device) -> tuple[list[tuple[int, int, int]], list[tuple]]:
    """How :func:`packed_attention` runs the sequences ``first..`` of a microbatch of ``lengths``:
    ``(index, start, length)`` of each sequence run alone, and for each padded batch its members,
    their lengths, the rows to gather (``(members, longest)``, a padding row repeating its
    sequence's last) and the gathered rows to keep. The same for every layer and every microbatch of
    these lengths: built once."""
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    rest = list(range(first, len(lengths)))
    groups = _length_groups([lengths[i] for i in rest]) if batch else [[j] for j in range(len(rest))]
    alone, batches = [], []
    for group in groups:
        members = [rest[j] for j in group]
        if len(members) == 1:
            alone.append((members[0], starts[members[0]], lengths[members[0]]))
            continue
        lens = [lengths[i] for i in members]
        longest = max(lens)
        rows = torch.tensor([[starts[i] + min(j, lengths[i] - 1) for j in range(longest)] for i in members],
                            device=device)
        keep = torch.tensor([j * longest + r for j, n in enumerate(lens) for r in range(n)], device=device)
        batches.append((members, lens, rows, keep))
    return alone, batches


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_lengths: list[int],
                     split: SplitShard | None = None, *, scale: float | None = None,
                     batch: bool = True) -> torch.Tensor:
    """Causal attention per packed sequence (never across), ``(1, heads, t, d)`` queries against
    ``(1, kv_heads, t, d)`` keys and values; the first sequence over its whole split sequence
    where ``split`` is given (a collective over ``split.group``). Costs about ``sum(n_i^2)``, not the
    ``(sum n_i)^2`` of a block-diagonal mask: with ``batch``, sequences of similar length run
    together as one batch, each right-padded to the longest (:func:`_length_groups`; exact: a
    padding row sits after every real row of its sequence, so causally no real query sees it, and
    its output is dropped), a sequence far longer than the rest on its own; without, one call per
    sequence."""
    check_split(document_lengths, split)
    gqa = q.shape[1] != k.shape[1]
    pieces: dict[int, torch.Tensor] = {}  # sequence index -> (heads, n, d)
    if split is not None:
        n = document_lengths[0]
        pieces[0] = split_causal_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], split.positions, group=split.group,
                                           scale=scale, lengths=split.lengths, key_positions=split.key_positions,
                                           blocks=split.blocks)[0]
    alone, batches = _attention_plan(tuple(document_lengths), int(split is not None), batch, q.device)
    for i, a, n in alone:
        pieces[i] = F.scaled_dot_product_attention(q[:, :, a:a + n], k[:, :, a:a + n], v[:, :, a:a + n],
                                                   is_causal=True, scale=scale, enable_gqa=gqa)[0]
    for members, lens, rows, keep in batches:
        def gather(x: torch.Tensor) -> torch.Tensor:  # (1, h, t, d) -> (members, h, longest, d)
            return x[0].index_select(1, rows.reshape(-1)).unflatten(1, rows.shape).transpose(0, 1)

        out = F.scaled_dot_product_attention(gather(q), gather(k), gather(v), is_causal=True, scale=scale,
                                             enable_gqa=gqa)
        for i, o in zip(members, out.transpose(0, 1).flatten(1, 2).index_select(1, keep).split(lens, dim=1)):
            pieces[i] = o
    return torch.cat([pieces[i] for i in range(len(document_lengths))], dim=1).unsqueeze(0)


#: The name under which :func:`use_split_attention` registers posttrain's attention with ``transformers``.
HF_ATTENTION = "posttrain"


@dataclass(frozen=True, eq=False)
class _Packing:
    document_lengths: list[int]
    split: SplitShard | None


def _hf_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                  posttrain_packing: _Packing | None = None, **kwargs):
    """``transformers``' attention function signature: packed input through :func:`packed_attention`,
    anything else (generation, padding masks) through ``transformers``' own SDPA function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if posttrain_packing is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1 or dropout:
        raise ValueError("posttrain's packed attention takes one packed row (batch 1) and no attention dropout")
    out = packed_attention(query, key, value, posttrain_packing.document_lengths, posttrain_packing.split,
                           scale=scaling)
    return out.transpose(1, 2).contiguous(), None


#: Set while a packed call runs (:func:`packed_call`): its attention needs no mask.
_PACKED_CALL = contextvars.ContextVar("posttrain_packed_call", default=False)


@contextmanager
def packed_call() -> Iterator[None]:
    """Around a ``transformers`` model's packed forward: the mask function registered under
    ``"posttrain"`` returns no mask, since :func:`packed_attention` attends per sequence (left to
    ``transformers``, packed position ids build a ``t x t`` block-diagonal mask the attention would
    ignore)."""
    token = _PACKED_CALL.set(True)
    try:
        yield
    finally:
        _PACKED_CALL.reset(token)


def _hf_mask(*args, **kwargs):
    from transformers.masking_utils import sdpa_mask

    return None if _PACKED_CALL.get() else sdpa_mask(*args, **kwargs)


def use_split_attention(hf_model) -> None:
    """Point a ``transformers`` model's attention at :func:`packed_attention` (registered as
    ``"posttrain"``, with ``transformers``' SDPA mask for unpacked calls and none inside
    :func:`packed_call`). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(HF_ATTENTION, _hf_attention)
    AttentionMaskInterface.register(HF_ATTENTION, _hf_mask)
    if getattr(hf_model.config, "_attn_implementation", None) == HF_ATTENTION:
        return
    if hasattr(hf_model, "set_attn_implementation"):
        hf_model.set_attn_implementation(HF_ATTENTION)
    else:
        hf_model.config._attn_implementation = HF_ATTENTION


def hf_packing(document_lengths: list[int], split: SplitShard | None) -> _Packing:
    """The keyword ``transformers`` hands through to :func:`_hf_attention`."""
    check_split(document_lengths, split)
    return _Packing(list(document_lengths), split)
