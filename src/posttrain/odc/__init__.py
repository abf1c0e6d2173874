"""ODC: FSDP2 with on-demand (one-sided) communication.

Gather replaces all-gather and scatter-accumulate replaces reduce-scatter; ranks synchronize
once when entering and once when leaving a minibatch, and may run different numbers of
microbatches. See ``design/odc.md`` and [Note: ODC minibatch protocol] in ``_state.py``.

    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    with posttrain.odc.enable(model) as odc:
        for minibatch in loader:
            with odc.minibatch(num_tokens=local_tokens) as mb:
                for micro in minibatch:           # counts may differ per rank
                    (token_loss_sum(model, micro) / mb.global_tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
"""

from ._api import ODCConfig, enable
from ._flat import FlatODC, flat_shard
from ._state import ODC, Minibatch
from ._transport import BarrierMismatchError, PeerFailedError, ShmTransport
from .normalize import global_token_count

__all__ = [
    "ODC",
    "BarrierMismatchError",
    "FlatODC",
    "Minibatch",
    "ODCConfig",
    "PeerFailedError",
    "ShmTransport",
    "enable",
    "flat_shard",
    "global_token_count",
]
