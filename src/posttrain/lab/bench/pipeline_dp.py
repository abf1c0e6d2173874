"""``posttrain bench pipeline-dp``: pipeline x data parallelism on long-tail data, three ways.

The same model (the embedded chat task's Llama shape, ``dim`` x ``num_layers``) and the same
long-tail records (prompt/completion pairs whose completions repeat 1 to 34 times: a few long,
most short) train on ``num_ranks x dp_size`` processes under

- ``fsdp+same_micro``: FSDP2 on each stage's data-parallel ranks, every pipeline the same microbatch count;
- ``odc-collective+same_micro``: flat ODC with a barrier at every gather and reduce (FSDP's
  rendezvous on ODC's transport);
- ``odc+diff_micro``: flat ODC, each pipeline its own microbatch count;

interleaved over rounds. A step's time is the slowest process's, from a common start to after the
optimizer step; tokens/s are the steps' tokens (after the first, a warm-up) over their summed
times. Ratios: the total gain over FSDP2, the part from transport and engine (collective ODC over
FSDP2), and ODC's own mechanism (``odc+diff_micro`` over ``odc-collective+same_micro``), medians
with the lowest and highest round.

With more processes than CPU cores the processes take turns on the cores, and a pipeline that
finishes early only hands its core to another: such a run measures nothing about imbalance. The
benchmark says so when it happens.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
from dataclasses import dataclass, replace

from .split import interleaved_rounds, log_split, split_ratios, write_result

__all__ = ["VARIANTS", "PipelineDPBench", "bench_pipeline_dp", "long_tail_records"]

VARIANTS = (("fsdp", "one-sided", "same_micro"), ("odc", "collective", "same_micro"), ("odc", "one-sided", "diff_micro"))


def long_tail_records(n: int, *, seed: int = 0) -> list[dict]:
    """Prompt/completion records of the chat task's text whose completions repeat the answer 1
    to 34 times (most once or twice)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        digits = " ".join(str(rng.randrange(10)) for _ in range(3))
        k = rng.choice([1, 1, 1, 1, 2, 2, 3, 5, 8, 13, 21, 34])
        out.append({"prompt": f"reverse {digits}", "completion": (" " + digits[::-1]) * k})
    return out


@dataclass(frozen=True)
class PipelineDPBench:
    """``posttrain bench pipeline-dp``: the pipeline, the model and data, and where the result goes.

    Attributes:
        num_ranks: pipeline ranks.
        dp_size: data-parallel pipelines (each stage sharded over its ``dp_size`` ranks).
        schedule: a schedule without a split backward.
        dim: model width.
        num_layers: decoder layers.
        sequences: records a step.
        max_tokens: microbatch token budget.
        steps: steps per run, the first a warm-up.
        repeats: interleaved rounds.
        offload: ``none``, ``full`` or the chunks per rank to offload.
        json: results file ('' for none).
    """

    num_ranks: int = 2
    dp_size: int = 2
    schedule: str = "1f1b"
    dim: int = 128
    num_layers: int = 4
    sequences: int = 32
    max_tokens: int = 128
    steps: int = 5
    repeats: int = 3
    offload: str = "none"
    json: str = "out/bench_pipeline_dp.json"

    def __post_init__(self) -> None:
        for name in ("num_ranks", "dp_size", "steps", "repeats", "sequences", "num_layers"):
            least = 2 if name in ("num_ranks", "dp_size", "steps") else 1
            if getattr(self, name) < least:
                raise ValueError(f"{name}={getattr(self, name)} is too small (at least {least})")

    def run(self, log=print) -> dict:
        """:func:`bench_pipeline_dp` of these options, written to ``json``."""
        return bench_pipeline_dp(self, log=log)


def bench_pipeline_dp(bench: PipelineDPBench, *, log=print) -> dict:
    """Run every variant ``repeats`` interleaved rounds; print and return tokens/s and ratios."""
    from posttrain.dp import EngineConfig
    from posttrain.lab.chat import make_chat_task
    from posttrain.train.sft.pipeline import PipelineConfig, run_pipeline

    ranks, dp_size, dim, layers, steps = bench.num_ranks, bench.dp_size, bench.dim, bench.num_layers, bench.steps
    sequences, max_tokens, schedule, repeats = bench.sequences, bench.max_tokens, bench.schedule, bench.repeats
    world = ranks * dp_size
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="posttrain-bench-ppdp-") as tmp:
        paths = make_chat_task(os.path.join(tmp, "task"), train_records=8, eval_records=1, dim=dim, layers=layers)
        data = os.path.join(tmp, "long_tail.jsonl")
        with open(data, "w") as f:
            for r in long_tail_records(max(64, sequences * steps)):
                f.write(json.dumps(r) + "\n")
        base = PipelineConfig(schedule=schedule, num_ranks=ranks, dp_size=dp_size, model_path=paths["model"], data=data,
                              sequences=sequences, max_tokens=max_tokens, steps=steps, offload=bench.offload,
                              skip_long=True)

        def measure(variant):
            dp, mode, balance = variant
            res = run_pipeline(replace(base, engine=EngineConfig(dp, mode=mode), balance=balance), timeout_s=3600)
            walls = [max(r["wall_times"][s] for r in res) for s in range(1, steps)]
            got = {"tokens_per_s": sum(res[0]["step_tokens"][1:]) / sum(walls),
                   "microbatches": [[r["microbatches"][s] for r in res if r["pp_rank"] == 0] for s in range(steps)]}
            return f"{dp}{'-collective' if mode == 'collective' else ''}+{balance}", got, got["tokens_per_s"]

        rounds = interleaved_rounds(repeats, VARIANTS, measure, log=log)
    names = list(rounds[0])
    result = {"tokens_per_s": {n: statistics.median(x[n]["tokens_per_s"] for x in rounds) for n in names},
              **split_ratios(rounds, names, lambda x: x["tokens_per_s"]),
              "microbatches": {n: rounds[0][n]["microbatches"] for n in names}, "rounds": rounds,
              "processes": world, "cores": cores, "oversubscribed": world > cores}
    log(f"pipeline x data parallel, {ranks} pipeline ranks x {dp_size} data-parallel ranks ({world} processes on {cores} cores), "
        f"{schedule}, llama {layers}x{dim}, {sequences} long-tail records a step, max_tokens {max_tokens}, "
        f"{steps - 1} steps (first excluded), median of {repeats} rounds")
    for n in names:
        log(f"  {n:28s} {result['tokens_per_s'][n]:8.0f} tokens/s   microbatches per pipeline, step 1: "
            f"{result['microbatches'][n][1] if steps > 1 else result['microbatches'][n][0]}")
    log_split(result, names, log)
    if world > cores:
        log(f"  note: {world} processes on {cores} cores take turns on the cores, so a pipeline that finishes early "
            "gains nothing: these ratios say nothing about imbalance; run with at least one core per process")
    write_result(result, bench.json, log)
    return result
