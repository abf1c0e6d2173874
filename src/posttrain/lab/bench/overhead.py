"""Where ODC's step loses to the ideal on this machine: the engine's per-microbatch work, and the optimizer.

    posttrain bench overhead                   # the bench's model (GPT 4x128, fp32), 2 ranks
    posttrain bench overhead --world-size 1    # one rank: FSDP2 with no peer; flat ODC alone
    posttrain bench overhead --dim 256

Part 1 runs one microbatch (the first sequence of 300-700 tokens of the long-tail profile) forward
and backward on a plain unsharded model and, alternating with it, on the same model under FSDP2
(inside an ODC minibatch on 2 ranks, or with FSDP2's own collectives, local copies, on 1 rank)
and under flat ODC (:func:`posttrain.odc.flat_shard`, inside a minibatch);
medians of 10 runs, best of 3 alternating rounds; then, untimed, the Python function calls
(cProfile) and minor page faults per microbatch of each. Part 2
times AdamW's step on the sharded (DTensor) parameters with the default per-parameter loop, with
``foreach`` and with ``fused``. Both print ratios; the absolute times only give scale.
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
import resource
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from posttrain.launch import run_ranks
from posttrain.models import build_model
from posttrain.train.dp import TrainConfig, TrainData, build_training, microbatch_loss


def _worker(rank: int, world_size: int, dim: int) -> dict:
    cfg = TrainConfig(dp="odc", balance="diff_micro", progress=False, dim=dim, max_len=1024, max_tokens=1024)
    data = TrainData(cfg, 2)  # the same data whatever the world size
    seqs = [s for s in data.minibatch(0) if 300 < len(s) < 700][:1]
    torch.manual_seed(cfg.seed)
    plain = build_model(cfg.model, cfg.model_config(data.vocab_size))
    # sharded exactly as the training loop shards it
    fsdp = build_training(replace(cfg, dp="odc-fsdp2" if world_size > 1 else "fsdp"), data.vocab_size)
    flat = build_training(replace(cfg, dp="odc"), data.vocab_size)
    model = fsdp.model
    tokens = len(seqs[0]) - 1

    def timed(m, ctx):
        with ctx:
            t0 = time.perf_counter()
            loss = microbatch_loss(m, seqs, [0], 1.0)
            t1 = time.perf_counter()
            loss.backward()
            return t1 - t0, time.perf_counter() - t1

    steps = {
        "plain": lambda: timed(plain, contextlib.nullcontext()),
        "fsdp": lambda: timed(model, fsdp.engine.minibatch(tokens)),
        "flat": lambda: timed(flat.model, flat.engine.minibatch(tokens)),
    }
    best = {}
    for _ in range(3):
        for name, fn in steps.items():
            runs = []
            for _ in range(10):
                dist.barrier()
                runs.append(fn())
            fwd, bwd = (statistics.median(x) for x in zip(*runs))
            if name not in best or fwd + bwd < sum(best[name]):
                best[name] = (fwd, bwd)
    calls, faults = {}, {}
    for name, fn in steps.items():
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            fn()
        prof.disable()
        calls[name] = pstats.Stats(prof).total_calls / 5
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(5):
            fn()
        faults[name] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5
    fsdp.engine.close()
    flat.engine.close()

    opt_ms = {}
    for name, kw in (("default", {}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kw)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        times = []
        for _ in range(12):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        opt_ms[name] = statistics.median(times) * 1e3
    return {"tokens": len(seqs[0]) - 1, "microbatch_ms": {k: [x * 1e3 for x in v] for k, v in best.items()},
            "optimizer_ms": opt_ms,
            "python_calls": calls, "page_faults": faults, "parameters": len(list(model.parameters()))}


def bench_overhead(*, dim: int = 128, world_size: int = 2, log=print) -> list[dict]:
    """Run the measurement on ``world_size`` ranks (1: FSDP2 alone, no peer; 2: FSDP2 with ODC);
    print one line per rank and engine and one for the optimizer; return every rank's figures."""
    if world_size not in (1, 2):
        raise ValueError(f"--world-size={world_size} must be 1 or 2")
    if dim < 8:
        raise ValueError(f"--dim={dim} must be at least 8")
    what = "FSDP2+ODC" if world_size > 1 else "FSDP2 (1 rank)"
    results = run_ranks(_worker, world_size, dim, timeout_s=600)
    for rank, r in enumerate(results):
        p = sum(r["microbatch_ms"]["plain"])
        c, f = r["python_calls"], r["page_faults"]
        for key, label in (("fsdp", what), ("flat", "flat ODC (no FSDP2)")):
            (ef, eb) = r["microbatch_ms"][key]
            (pf, pb) = r["microbatch_ms"]["plain"]
            log(f"rank {rank}: one {r['tokens']}-token microbatch, {label} / plain: forward {ef / pf:.2f}x, "
                f"backward {eb / pb:.2f}x, both {(ef + eb) / p:.2f}x (plain {p:.1f} ms, {label} {ef + eb:.1f} ms); "
                f"Python calls {c[key]:.0f} (plain {c['plain']:.0f}), minor page faults {f[key]:.0f} "
                f"(plain {f['plain']:.0f})")
        o = r["optimizer_ms"]
        log(f"rank {rank}: {r['parameters']} parameters; AdamW step on the FSDP2 shards, default loop / fused "
            f"{o['default'] / o['fused']:.1f}x, foreach / fused {o['foreach'] / o['fused']:.1f}x "
            f"(fused {o['fused']:.2f} ms)")
    return results
