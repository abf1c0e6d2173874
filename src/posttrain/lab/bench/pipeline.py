"""``posttrain bench pipeline``: activation memory per schedule and offload policy, and our runner vs torch's.

Part 1 runs :func:`~posttrain.train.sft.pipeline.run_pipeline` for 2 and 4 stages across 1F1B,
interleaved 1F1B and group-interleaved (2 chunks per rank, group size 1) with offload none, half
(1 of 2 chunks) and full, and prints each run's largest per-rank peak of saved activations
(measured by the saved-tensor hooks, MiB and chunk-microbatches) and its ratio to the same
schedule without offload.

Part 2 builds, in the same processes and on the same stage modules, our
:class:`~posttrain.pipeline.PipelineRunner` (no offload) and torch's ``Schedule1F1B`` /
``ScheduleInterleaved1F1B`` over ``torch.distributed.pipelining.PipelineStage``; checks that both
produce the same gradients; then times them alternately, a barrier before every step, and prints
the median step-time ratio torch / ours (>= 1 means ours is at least as fast).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist

from posttrain.launch import run_ranks
from posttrain.pipeline import PipelineRunner
from posttrain.pipeline.stages import split_model
from posttrain.train.sft.pipeline import (
    PipelineConfig,
    build_pipeline_model,
    measured_weight_keep,
    microbatch_loss,
    predicted_peaks,
    run_pipeline,
    step_batch,
)

__all__ = ["PipelineBench", "bench_pipeline"]

# (schedule, chunks, group size): None is the stage count
MEMORY_SCHEDULES = (("1f1b", 1, None), ("interleaved_1f1b", 2, None), ("group_interleaved", 2, 1),
                    ("group_interleaved_zb", 2, 1), ("interleaved_zb", 2, 1))


def _memory_rows(base: PipelineConfig, rank_counts, out) -> list[dict]:
    rows = []
    for p in rank_counts:
        for name, chunks, group in MEMORY_SCHEDULES:
            offloads = ("none", "full") if chunks == 1 else ("none", "1", "full")
            base_peak = None
            for off in offloads:
                cfg = replace(base, schedule=name, num_ranks=p, chunks=chunks, group_size=group, offload=off, steps=2,
                              num_microbatches=2 * p, num_layers=max(base.num_layers, p * chunks))
                res = run_pipeline(cfg)
                peak_mib = max(r["result"]["rank_peak_bytes"] for r in res) / 2**20
                units = max(r["result"]["peak_units"] for r in res)
                base_peak = base_peak or peak_mib
                predicted = max(predicted_peaks(cfg, weight_keep=measured_weight_keep(res)))
                row = {"ranks": p, "schedule": name, "chunks": chunks, "group_size": group, "offload": off,
                       "peak_mib": peak_mib, "peak_units": round(units, 9), "predicted_units": predicted,
                       "vs_none": peak_mib / base_peak}
                rows.append(row)
                out(f"{p:>6} {name:>20} {off:>7} {peak_mib:>9.2f} {units:>6.2f} {row['predicted_units']:>9.2f} "
                    f"{row['vs_none']:>7.2f}")
    return rows


def _timing_worker(rank: int, world: int, cfg: PipelineConfig, repeats: int) -> dict:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleInterleaved1F1B

    sched = cfg.build()
    model = build_pipeline_model(cfg)
    stages = split_model(model, cfg.num_stages)
    mine = {s: stages[s] for s in range(cfg.num_stages) if sched.layout.rank_of(s) == rank}
    ours = PipelineRunner(mine, sched, loss_fn=microbatch_loss)
    tstages = [PipelineStage(mine[s], s, cfg.num_stages, torch.device("cpu")) for s in sorted(mine)]
    theirs = (Schedule1F1B(tstages[0], cfg.num_microbatches, loss_fn=microbatch_loss) if cfg.num_chunks == 1
              else ScheduleInterleaved1F1B(tstages, cfg.num_microbatches, loss_fn=microbatch_loss))
    inputs, targets = step_batch(cfg, 0)
    x, y = torch.cat(inputs), torch.cat(targets)
    params = [p for m in mine.values() for p in m.parameters()]

    def run_ours():
        ours.step(inputs, targets)

    def run_torch():
        if 0 in mine:
            theirs.step(x)
        elif cfg.num_stages - 1 in mine:
            theirs.step(target=y, losses=[])
        else:
            theirs.step()

    grads = {}
    for name, fn in (("ours", run_ours), ("torch", run_torch)):  # warm-up, and the parity check
        for p in params:
            p.grad = None
        fn()
        grads[name] = [p.grad.clone() for p in params]
    max_diff = max((a - b).abs().max().item() for a, b in zip(grads["ours"], grads["torch"]))
    times: dict[str, list[float]] = {"ours": [], "torch": []}
    for i in range(repeats):
        order = (("ours", run_ours), ("torch", run_torch)) if i % 2 == 0 else (("torch", run_torch), ("ours", run_ours))
        for name, fn in order:
            for p in params:
                p.grad = None
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    return {"times": times, "max_grad_diff": max_diff}


@dataclass(frozen=True)
class PipelineBench:
    """``posttrain bench pipeline``: the model, the pipeline sizes, and where the result goes.

    Attributes:
        pipeline: the model and batch every run shares (its schedule, sizes and offload are the
            benchmark's).
        pp_sizes: pipeline sizes (ranks) to run, each at least 2.
        repeats: timed steps per runtime, alternating.
        json: results file ('' for none).
    """

    pipeline: PipelineConfig = field(
        default_factory=lambda: PipelineConfig(dim=128, num_layers=8, seq_len=256),
        metadata={"fields": ("model", "dim", "num_layers", "seq_len", "batch", "seed")})
    pp_sizes: tuple[int, ...] = (2, 4)
    repeats: int = 7
    json: str = "out/bench_pipeline.json"

    def __post_init__(self) -> None:
        if not self.pp_sizes or min(self.pp_sizes) < 2:
            raise ValueError(f"pp_sizes={','.join(map(str, self.pp_sizes))}: a pipeline needs at least 2 ranks")
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats} must be at least 1")

    def run(self, log=print) -> dict:
        """:func:`bench_pipeline` of these options, written to ``json``."""
        from .split import write_result

        result = bench_pipeline(self.pipeline, rank_counts=self.pp_sizes, repeats=self.repeats, out=log)
        write_result(result, self.json, log)
        return result


def bench_pipeline(base: PipelineConfig, *, rank_counts=(2, 4), repeats: int = 7, out=print) -> dict:
    """Run both parts (see the module docstring) on pipelines of ``rank_counts`` ranks; returns
    the results."""
    PipelineBench(base, tuple(rank_counts), repeats, json="")  # checks them
    out("Saved-activation peak per rank (largest rank), measured by the hooks; vs_none: MiB ratio to no offload")
    out(f"{'ranks':>6} {'schedule':>20} {'offload':>7} {'peak MiB':>9} {'units':>6} {'predicted':>9} {'vs_none':>7}")
    memory = _memory_rows(base, rank_counts, out)
    out("")
    out("Step time, our runner (no offload) vs torch.distributed.pipelining on the same stages "
        f"(median of {repeats} alternating steps)")
    out(f"{'ranks':>6} {'schedule':>18} {'torch s':>8} {'ours s':>8} {'torch/ours':>10} {'max |grad diff|':>15}")
    timing = []
    for p in rank_counts:
        for name, chunks in (("1f1b", 1), ("interleaved_1f1b", 2)):
            cfg = replace(base, schedule=name, num_ranks=p, chunks=chunks, offload="none",
                          num_microbatches=2 * p, num_layers=max(base.num_layers, p * chunks))
            res = run_ranks(_timing_worker, p, cfg, repeats, timeout_s=600)
            # the step of a pipeline ends when its slowest rank ends: max over ranks per step
            per_step = {k: [max(r["times"][k][i] for r in res) for i in range(repeats)] for k in ("ours", "torch")}
            med = {k: statistics.median(v) for k, v in per_step.items()}
            diff = max(r["max_grad_diff"] for r in res)
            row = {"ranks": p, "schedule": name, "torch_s": med["torch"], "ours_s": med["ours"],
                   "ratio": med["torch"] / med["ours"], "max_grad_diff": diff}
            timing.append(row)
            out(f"{p:>6} {name:>18} {med['torch']:>8.3f} {med['ours']:>8.3f} {row['ratio']:>10.3f} {diff:>15.2e}")
    return {"config": asdict(base), "memory": memory, "timing": timing}
