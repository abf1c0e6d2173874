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

__all__ = ["PackedMicrobatch", "pack_sequences"]


@dataclass(frozen=True)
class PackedMicrobatch:
    """Attributes:
    inputs: ``(1, total)`` token ids (each sequence without its last token).
    targets: ``(1, total)`` next-token ids (each sequence without its first token).
    document_lengths: tokens of each packed sequence, in order.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    document_lengths: list[int]

    @property
    def num_tokens(self) -> int:
        """Loss tokens (one per target)."""
        return int(self.targets.numel())


def pack_sequences(sequences: Sequence[torch.Tensor]) -> PackedMicrobatch:
    """Pack 1-D (or ``(1, n)``) token sequences of at least 2 tokens each."""
    if not sequences:
        raise ValueError("nothing to pack: the microbatch has no sequences")
    flat = [s.reshape(-1) for s in sequences]
    for i, s in enumerate(flat):
        if s.numel() < 2:
            raise ValueError(f"sequence {i} has {s.numel()} token(s); next-token training needs at least 2")
    return PackedMicrobatch(
        inputs=torch.cat([s[:-1] for s in flat]).unsqueeze(0),
        targets=torch.cat([s[1:] for s in flat]).unsqueeze(0),
        document_lengths=[s.numel() - 1 for s in flat],
    )
