"""Balancing one minibatch of very unequal sequences over ranks: FSDP's best (every rank the
same number of microbatches) against ODC's (each rank its own count), by predicted cost.

    python examples/balance.py

(No processes: planning is pure Python. The methods and cost models: docs/odc.md, "Balancing".)
"""

import random

from posttrain.balance import QuadraticCost, plan_minibatch

random.seed(0)
lengths = [8000, 7600, 7000] + [random.randint(200, 1500) for _ in range(29)]  # three long, many short
rank = 0
for method in ("same_micro", "diff_micro"):
    plan = plan_minibatch(lengths, world_size=4, max_tokens=8192, method=method,
                          cost=QuadraticCost(scale=8000))
    print(method)
    print(plan.summary())                      # per-rank microbatches, tokens, cost, imbalance
    for mb in plan.microbatches_for(rank):     # counts may differ per rank under ODC
        print(f"  rank {rank} microbatch: sequences {list(mb.sequence_ids)}, {mb.num_tokens} tokens")
