"""PipeOffload: a GPT cut into 4 stages over 2 pipeline ranks (2 chunks each), one interleaved
step as it is and one with the first chunk's saved activations offloaded to host memory: the
peak of saved activations each rank holds (measured by the runner's saved-tensor hooks; without
offload beside the schedule's own prediction), and the same loss.

    torchrun --standalone --nproc-per-node 2 examples/pipeline_offload.py

(CPU processes over gloo; schedules, offload and the runner: docs/pipeline.md.)
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from posttrain.models import GPT, GPTConfig
from posttrain.pipeline import OffloadPolicy, PipelineRunner, build_schedule, split_model

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)  # the same model on every rank: each keeps its own stages


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


model = GPT(GPTConfig(num_layers=4, max_seq_len=64))
g = torch.Generator().manual_seed(1)
tokens = [torch.randint(0, 256, (1, 65), generator=g) for _ in range(8)]  # 8 microbatches of 64 tokens
microbatch_inputs, microbatch_targets = [t[:, :-1] for t in tokens], [t[:, 1:] for t in tokens]

lines = []
for offload in (None, OffloadPolicy(chunks=1)):
    sched = build_schedule("interleaved_1f1b", num_ranks=2, num_microbatches=8, num_chunks=2)
    stages = split_model(model, 4)                        # GPT or any Llama-layout transformers decoder
    mine = {s: stages[s] for s in range(4) if sched.layout.rank_of(s) == rank}
    runner = PipelineRunner(mine, sched, loss_fn=loss_fn, offload=offload)
    result = runner.step(microbatch_inputs, microbatch_targets)   # grads in the stages' .grad
    label = f"no offload (predicted {sched.predicted_peaks[rank]})" if offload is None else "offload 1 chunk"
    line = (f"rank {rank}, {label}: peak {result.peak_units:g} chunk-microbatches resident "
            f"({result.offloaded_bytes / 2**20:.2f} MiB copied to host)")
    if result.loss is not None:
        line += f", loss {result.loss:.4f}"
    lines.append(line)
    for stage in stages:
        stage.zero_grad()
every = [None] * dist.get_world_size()
dist.all_gather_object(every, lines)   # printed by rank 0 in rank order (two ranks' prints could interleave)
if rank == 0:
    print("\n".join(ln for mine in every for ln in mine))
dist.destroy_process_group()
