"""One training loop, every data-parallel engine: FSDP2, ODC on FSDP2 and flat ODC behind
``posttrain.dp``, with the step's sequences balanced over the ranks by ``posttrain.balance``.
Each engine takes the same optimizer steps, so the losses printed agree.

    torchrun --standalone --nproc-per-node 2 examples/engines.py

(CPU processes over gloo; the engines: docs/odc.md, "One interface".)
"""

import gc

import torch
import torch.distributed as dist

import posttrain.dp
from posttrain.balance import QuadraticCost, plan_minibatch
from posttrain.models import GPT, GPTConfig, token_loss_sum

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


def step_sequences(step: int) -> list[torch.Tensor]:
    """The step's sequences, the same on every rank (a shared seed): lengths 8 to 200."""
    g = torch.Generator().manual_seed(step)
    return [torch.randint(0, 256, (int(torch.randint(8, 200, (), generator=g)),), generator=g) for _ in range(8)]


for name in ("fsdp", "odc-fsdp2", "odc"):
    torch.manual_seed(0)
    model = GPT(GPTConfig(max_seq_len=256))
    engine = posttrain.dp.build_engine(model, posttrain.dp.EngineConfig(name))
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-3)
    losses = []
    for step in range(3):
        seqs = step_sequences(step)
        plan = plan_minibatch([len(s) for s in seqs], world_size=world, max_tokens=256,
                              method="same_micro" if name == "fsdp" else "diff_micro", cost=QuadraticCost(scale=8000))
        my_microbatches = [m for m in plan.microbatches_for(rank) if m.sequence_ids]
        busiest = max(len([m for m in mbs if m.sequence_ids]) for mbs in plan.ranks)
        local_tokens = sum(len(seqs[i]) - 1 for m in my_microbatches for i in m.sequence_ids)
        total = torch.zeros(())

        def loss_sum(micro):
            out = 0
            for i in micro.sequence_ids:
                x = seqs[i].unsqueeze(0)
                out = out + token_loss_sum(engine.model(x[:, :-1]), x[:, 1:])
            return out

        with engine.minibatch(local_tokens) as mb:            # a collective at entry and exit
            for micro in engine.pad(my_microbatches, busiest):    # + None (a dummy) up to the busiest rank's
                if micro is None:                                 # count, on engines that need equal counts
                    engine.run_dummy()
                    continue
                loss = loss_sum(micro)
                total += loss.detach()
                (loss / mb.loss_divisor).backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total)
        losses.append(float(total) / mb.global_tokens)
    engine.close()
    if rank == 0:
        print(f"{name:10} losses {' '.join(f'{x:.4f}' for x in losses)}")
# FSDP2 keeps its modules in reference cycles that hold the process groups: free them while the
# interpreter runs (left to the interpreter's teardown, gloo's teardown sometimes aborts the process)
gc.collect()
dist.destroy_process_group()
