"""ODC: sharded data parallelism with on-demand (one-sided) communication.

Gather replaces all-gather and scatter-accumulate replaces reduce-scatter; ranks synchronize
once when entering and once when leaving a minibatch, and may run different numbers of
microbatches. See [Note: ODC minibatch protocol] in ``_protocol.py``. Two engines:

- :func:`flat_shard`: ODC on flat per-unit buffers, no FSDP2 (the fast one);
- :func:`enable`: ODC on a model already sharded with FSDP2's ``fully_shard``.

    handle = posttrain.odc.flat_shard(model)              # collective
    optimizer = torch.optim.AdamW(handle.parameters())
    for minibatch in loader:
        with handle.minibatch(num_tokens=local_tokens) as mb:
            for micro in minibatch:                       # counts may differ per rank
                (token_loss_sum(model, micro) / mb.global_tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
    handle.close()                                        # full parameters back on the model
"""

from ._flat import FlatODC, FlatUnit, flat_shard
from ._fsdp import ODC, enable
from ._protocol import Minibatch
from ._transport import BarrierMismatchError, PeerFailedError, ShmTransport
from .config import ODCConfig
from .normalize import global_token_count

__all__ = [
    "ODC",
    "BarrierMismatchError",
    "FlatODC",
    "FlatUnit",
    "Minibatch",
    "ODCConfig",
    "PeerFailedError",
    "ShmTransport",
    "enable",
    "flat_shard",
    "global_token_count",
]
