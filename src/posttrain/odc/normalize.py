"""Loss normalization that does not depend on how sequences are spread over ranks.

With gradient accumulation over microbatches of different sizes, and ranks running different
numbers of microbatches, "mean loss per microbatch, averaged over ranks" weights a token by the
size of the microbatch it landed in. The minibatch-global normalizer does not: each microbatch
contributes ``sum of its token losses / tokens in the whole minibatch`` and the summed gradient
is the gradient of the mean token loss over the minibatch, for any placement.

Under ODC, ``odc.minibatch(num_tokens=n)`` computes the global count during its entry barrier
(no extra collective). :func:`global_token_count` does the same for plain FSDP or DDP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["global_token_count"]


def global_token_count(local_tokens: int, group: dist.ProcessGroup | None = None) -> int:
    """Sum ``local_tokens`` over ``group`` (default: the world) with one all-reduce.

    Args:
        local_tokens: loss tokens this rank will process in the minibatch.
        group: the data-parallel group.
    """
    if local_tokens < 0:
        raise ValueError(f"local_tokens={local_tokens} must be non-negative")
    t = torch.tensor([local_tokens], dtype=torch.int64)
    dist.all_reduce(t, group=group)
    return int(t.item())
