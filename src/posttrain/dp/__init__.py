"""Data-parallel engines behind one interface, chosen by name. See [Note: data-parallel engines].

    engine = posttrain.dp.build_engine(model, EngineConfig("odc", precision="bf16"))
    optimizer = torch.optim.AdamW(engine.parameters())
    with engine.minibatch(local_tokens) as mb:
        for micro in engine.pad(my_microbatches, busiest):   # + None up to the busiest rank's count
            if micro is None:                                 # where the engine needs equal counts
                engine.run_dummy()
                continue
            (loss_sum(micro) / mb.loss_divisor).backward()
    optimizer.step()

Engines: ``fsdp`` (FSDP2, the baseline), ``odc`` (flat ODC, :func:`posttrain.odc.flat_shard`),
``odc-fsdp2`` (ODC on FSDP2, :func:`posttrain.odc.enable`).
"""

from .engine import (
    CommHook,
    DataParallelEngine,
    EngineConfig,
    MinibatchInfo,
    Shards,
    build_engine,
    check_shard_hosts,
    decay_flags,
    ensure_optimizer_state,
    resolve_replicas,
)
from .fsdp import FSDP2Engine, ODCOnFSDP2Engine  # registers fsdp and odc-fsdp2
from .odc_flat import FlatODCEngine  # registers odc
from .registry import engine_class, engine_names, register_engine

__all__ = [
    "CommHook",
    "DataParallelEngine",
    "EngineConfig",
    "FSDP2Engine",
    "FlatODCEngine",
    "MinibatchInfo",
    "ODCOnFSDP2Engine",
    "Shards",
    "build_engine",
    "check_shard_hosts",
    "decay_flags",
    "engine_class",
    "engine_names",
    "ensure_optimizer_state",
    "register_engine",
    "resolve_replicas",
]
