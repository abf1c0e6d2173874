"""Pack several sequences into one microbatch without attention crossing their boundaries.

A packed microbatch lays the sequences' inputs end to end in a ``(1, total)`` tensor, their
next-token targets likewise, and keeps the per-sequence lengths: models that accept
``document_lengths`` (``posttrain.models.GPT``) restart positions and run causal attention per
sequence, so the logits equal those of running each sequence alone and attention costs
``sum(n_i^2)``, not ``(sum n_i)^2``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["PackedMicrobatch", "pack_sequences", "pack_share", "shard_lengths", "shard_positions", "zigzag"]


@dataclass(frozen=True)
class PackedMicrobatch:
    """Attributes:
    inputs: ``(1, total)`` token ids (each sequence without its last token).
    targets: ``(1, total)`` next-token ids (each sequence without its first token); ``-100`` where
        a token is not trained. The last token of a sequence is never an input, so no target
        is predicted across a sequence boundary.
    document_lengths: tokens of each packed sequence, in order.
    shard_positions: where the first sequence is one shard of a sequence split across ranks
        (context parallelism): the positions in the whole sequence of its input tokens, which
        are those positions' inputs and targets of the whole sequence; else ``None``.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    document_lengths: list[int]
    shard_positions: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Input tokens (one per target position, trained or not)."""
        return int(self.targets.numel())

    @property
    def num_trained(self) -> int:
        """Trained targets."""
        return int((self.targets != -100).sum())


def pack_sequences(sequences: Sequence[torch.Tensor],
                   labels: Sequence[torch.Tensor | None] | None = None, *,
                   shard: tuple[int, int] | None = None) -> PackedMicrobatch:
    """Pack 1-D (or ``(1, n)``) token sequences of at least 2 tokens each.

    Args:
        sequences: token ids.
        labels: per sequence, the labels of its tokens (``-100``: not trained; ``None``: every
            token trained), as ``transformers`` takes them: the targets are ``labels[1:]``.
        shard: ``(index, k)``: the first sequence enters as its shard ``index`` of ``k``
            (:func:`~posttrain.balance.zigzag` of its input tokens), with ``shard_positions``.
    """
    if not sequences:
        raise ValueError("nothing to pack: the microbatch has no sequences")
    flat = [s.reshape(-1) for s in sequences]
    for i, s in enumerate(flat):
        if s.numel() < 2:
            raise ValueError(f"sequence {i} has {s.numel()} token(s); next-token training needs at least 2")
    if labels is None:
        labels = [None] * len(flat)
    if len(labels) != len(flat):
        raise ValueError(f"{len(labels)} label sequences for {len(flat)} sequences")
    targets = []
    for i, (s, lab) in enumerate(zip(flat, labels)):
        if lab is not None and lab.numel() != s.numel():
            raise ValueError(f"sequence {i} has {s.numel()} tokens but {lab.numel()} labels")
        targets.append((s if lab is None else lab.reshape(-1))[1:])
    inputs = [s[:-1] for s in flat]
    positions = None
    if shard is not None:
        index, k = shard
        if not 0 <= index < k:
            raise ValueError(f"shard {index} of {k} does not exist")
        positions = shard_positions(inputs[0].numel(), index, k)
        inputs[0], targets[0] = inputs[0][positions], targets[0][positions]
    return PackedMicrobatch(
        inputs=torch.cat(inputs).unsqueeze(0),
        targets=torch.cat(targets).unsqueeze(0),
        document_lengths=[s.numel() for s in inputs],
        shard_positions=positions,
    )


def pack_share(lengths: Sequence[int], ids: Sequence[int], max_tokens: int, *, sort: bool = True) -> list[list[int]]:
    """A rank's sequences ``ids`` packed into microbatches of at most ``max_tokens``: longest first
    (or in the order given, ``sort=False``), each into the first microbatch with room (as
    ``diff_micro`` packs a rank's share)."""
    order = sorted(ids, key=lambda i: -lengths[i]) if sort else list(ids)
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return bins


def zigzag(n: int, k: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The token ranges ``[start, end)`` of shard ``i``'s two chunks (``i`` and ``2k-1-i`` of ``2k``
    near-equal chunks of a sequence of ``n`` tokens; the larger chunks first)."""
    if k < 1 or n < 2 * k:
        raise ValueError(f"a sequence of {n} tokens cannot be cut into 2 x {k} chunks")
    base, extra = divmod(n, 2 * k)
    bounds = [0]
    for c in range(2 * k):
        bounds.append(bounds[-1] + base + (1 if c < extra else 0))
    return [((bounds[i], bounds[i + 1]), (bounds[2 * k - 1 - i], bounds[2 * k - i])) for i in range(k)]


def shard_positions(n: int, index: int, k: int) -> torch.Tensor:
    """The positions (int64, ascending) of shard ``index`` of ``k`` of a sequence of ``n`` tokens
    (:func:`zigzag`'s two chunks)."""
    (a0, a1), (b0, b1) = zigzag(n, k)[index]
    return torch.cat([torch.arange(a0, a1), torch.arange(b0, b1)])


def shard_lengths(n: int, k: int) -> list[int]:
    """Tokens of each of the ``k`` shards of a sequence of ``n`` tokens (:func:`zigzag`)."""
    return [(a1 - a0) + (b1 - b0) for (a0, a1), (b0, b1) in zigzag(n, k)]
