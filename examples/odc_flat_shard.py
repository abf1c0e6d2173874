"""Flat ODC on a plain PyTorch model: shard it, train a few steps in which the ranks run
different numbers of sequences, save a sharded checkpoint (out/examples/odc-checkpoint), and
put the full parameters back.

    torchrun --standalone --nproc-per-node 2 examples/odc_flat_shard.py

(CPU processes over gloo; on the ODC engine and its minibatch protocol: docs/odc.md.)
"""

import gc

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import posttrain.odc
from posttrain.models import GPT, GPTConfig, token_loss_sum

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)  # the same initial weights on every rank


def batches(steps: int):
    """This rank's sequences of each step: rank r runs r + 1 of them, of random lengths."""
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        yield [torch.randint(0, 256, (1, int(torch.randint(8, 64, (), generator=g))), generator=g)
               for _ in range(rank + 1)]


loader = batches(steps=4)
model = GPT(GPTConfig())                              # plain, unsharded
model = posttrain.odc.flat_shard(model)               # collective; returns the model, like fully_shard
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)   # this rank's flat shards (DTensors)
for minibatch in loader:                              # this rank's sequences of the step
    with model.minibatch(num_tokens=sum(seq.shape[1] - 1 for seq in minibatch)) as mb:
        for seq in minibatch:                         # counts may differ per rank
            (token_loss_sum(model(seq[:, :-1]), seq[:, 1:]) / mb.global_tokens).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # the global norm over every rank's shards
    optimizer.step()
    optimizer.zero_grad()
    if rank == 0:
        print(f"{mb.global_tokens} tokens on {dist.get_world_size()} ranks, gradient norm {float(norm):.3f}")
dcp.save(model.state_dict(), checkpoint_id="out/examples/odc-checkpoint")   # sharded; loads on any number of ranks
model.odc.close()                                     # full parameters back on the model (collective)
if rank == 0:
    print(f"done: {sum(p.numel() for p in model.parameters())} parameters back on the model")
# the sharded model's DTensors and the checkpoint's state hold the process group in reference cycles:
# free them while the interpreter runs (left to its teardown, gloo sometimes aborts the process)
gc.collect()
dist.destroy_process_group()
