"""ODC: sharded data parallelism with on-demand (one-sided) communication.

Gather replaces all-gather and scatter-accumulate replaces reduce-scatter; ranks synchronize
once when entering and once when leaving a minibatch, and may run different numbers of
microbatches. See [Note: ODC minibatch protocol] in ``_protocol.py``. Two engines:

- :func:`flat_shard`: ODC on flat per-unit buffers, no FSDP2 (the fast one); like FSDP2's
  ``fully_shard`` it returns the model, whose ``parameters()``, ``state_dict()`` and torch's
  ``clip_grad_norm_`` keep working;
- :func:`enable`: ODC on a model already sharded with FSDP2's ``fully_shard``.

    model = posttrain.odc.flat_shard(model)               # collective
    optimizer = torch.optim.AdamW(model.parameters())     # this rank's shards (DTensors)
    for minibatch in loader:
        with model.minibatch(num_tokens=local_tokens) as mb:
            for x, y in minibatch:                        # counts may differ per rank
                (token_loss_sum(model(x), y) / mb.global_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # the global norm
        optimizer.step()
        optimizer.zero_grad()
    model.odc.close()                                     # full parameters back on the model
"""

from ._exchange import ShmRowExchange, row_exchange
from ._flat import FlatODC, FlatUnit
from ._fsdp import ODC, enable
from ._module import FlatODCModule, flat_shard
from ._protocol import Minibatch
from ._transport import BarrierMismatchError, PeerFailedError, ShmTransport, barrier_totals
from .config import ODCConfig
from .normalize import global_token_count

__all__ = [
    "ODC",
    "BarrierMismatchError",
    "FlatODC",
    "FlatODCModule",
    "FlatUnit",
    "Minibatch",
    "ODCConfig",
    "PeerFailedError",
    "ShmRowExchange",
    "ShmTransport",
    "barrier_totals",
    "enable",
    "flat_shard",
    "global_token_count",
    "row_exchange",
]
