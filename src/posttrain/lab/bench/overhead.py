"""Where ODC's step loses to the ideal on this machine: the engine's per-microbatch work, and the optimizer.

    posttrain bench overhead                   # the bench's model (GPT 4x128, fp32), 2 ranks
    posttrain bench overhead --world-size 1    # one rank: FSDP2 with no peer; flat ODC alone
    posttrain bench overhead --dim 256 --json out/bench_overhead.json

Part 1 runs one microbatch (the first sequence of 300-700 tokens of the long-tail profile) forward
and backward on a plain unsharded model and, interleaved with it iteration by iteration, on the
same model under FSDP2 (inside an ODC minibatch on 2 ranks, or with FSDP2's own collectives, local
copies, on 1 rank) and under flat ODC (:func:`posttrain.odc.flat_shard`), each engine's microbatch
in a minibatch of its own; medians over ``repeats`` iterations of the minibatch entry, forward,
backward and exit, the engine's time beyond the plain model split into those phases, and the
median gather and push (scatter-accumulate) as the engine's communication hook times them; then,
untimed, the Python function calls (cProfile) and minor page faults per microbatch of each. Part 2
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
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from posttrain.dp import EngineConfig
from posttrain.launch import run_ranks
from posttrain.models import build_model
from posttrain.train.sft import TrainConfig, TrainData, build_training, microbatch_loss


def _worker(rank: int, world_size: int, dim: int, repeats: int) -> dict:
    cfg = TrainConfig(balance="diff_micro", progress=False, dim=dim, max_len=1024, max_tokens=1024)
    data = TrainData(cfg, 2)  # the same data whatever the world size
    seqs = [s for s in data.minibatch(0) if 300 < len(s) < 700][:1]
    torch.manual_seed(cfg.seed)
    plain = build_model(cfg.model, cfg.model_config(data.vocab_size))
    # sharded exactly as the training loop shards it
    fsdp = build_training(replace(cfg, engine=EngineConfig("odc-fsdp2" if world_size > 1 else "fsdp")), data.vocab_size)
    flat = build_training(replace(cfg, engine=EngineConfig("odc")), data.vocab_size)
    model = fsdp.model
    tokens = len(seqs[0]) - 1

    spans: dict[str, dict[str, list[float]]] = {}

    def hook_for(name: str):
        def hook(kind: str, start: float, end: float) -> None:
            spans.setdefault(name, {}).setdefault(kind, []).append(end - start)
        return hook

    fsdp.engine.set_comm_hook(hook_for("fsdp"))
    flat.engine.set_comm_hook(hook_for("flat"))

    def timed(m, ctx) -> tuple[float, float, float, float]:
        """(entry, forward, backward, exit) seconds of one microbatch in its own minibatch."""
        t0 = time.perf_counter()
        with ctx:
            t1 = time.perf_counter()
            loss = microbatch_loss(m, seqs, [0], 1.0)
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
        t4 = time.perf_counter()
        if ctx is plain_ctx:
            for p in m.parameters():
                p.grad = None
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3

    plain_ctx = contextlib.nullcontext()
    steps = {
        "plain": lambda: timed(plain, plain_ctx),
        "fsdp": lambda: timed(model, fsdp.engine.minibatch(tokens)),
        "flat": lambda: timed(flat.model, flat.engine.minibatch(tokens)),
    }
    for fn in steps.values():  # warm-up
        fn()
    spans.clear()
    runs: dict[str, list[tuple[float, ...]]] = {name: [] for name in steps}
    for i in range(repeats):  # interleaved: every engine sees the same machine state
        for name in (list(steps) if i % 2 == 0 else list(steps)[::-1]):
            dist.barrier()
            runs[name].append(steps[name]())
    phases = {name: [statistics.median(x) for x in zip(*r)] for name, r in runs.items()}
    comm = {name: {kind: (len(v) / repeats, statistics.median(v)) for kind, v in by_kind.items()}
            for name, by_kind in spans.items()}
    fsdp.engine.set_comm_hook(None)
    flat.engine.set_comm_hook(None)
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
    return {"tokens": len(seqs[0]) - 1, "phases_ms": {k: [x * 1e3 for x in v] for k, v in phases.items()},
            "comm": {k: {kind: [n, t * 1e3] for kind, (n, t) in v.items()} for k, v in comm.items()},
            "optimizer_ms": opt_ms,
            "python_calls": calls, "page_faults": faults, "parameters": len(list(model.parameters()))}


_KIND = {"gather": "gathers", "reduce": "gradient reductions"}


def describe(rank: int, r: dict, key: str, label: str) -> str:
    """One engine's line of rank ``rank``'s figures ``r`` (what :func:`_worker` returns)."""
    entry, fwd, bwd, exit_ = r["phases_ms"][key]
    _, pf, pb, _ = r["phases_ms"]["plain"]
    total, plain = entry + fwd + bwd + exit_, pf + pb
    c, f = r["python_calls"], r["page_faults"]
    comm = ", ".join(f"{n:.1f} {_KIND[kind]} of {t:.2f} ms" for kind, (n, t) in sorted(r["comm"].get(key, {}).items()))
    return (f"rank {rank}: one {r['tokens']}-token microbatch, {label} / plain: forward {fwd / pf:.2f}x, "
            f"backward {bwd / pb:.2f}x, with minibatch entry and exit {total / plain:.2f}x (plain {plain:.1f} ms, "
            f"{label} {total:.1f} ms); beyond plain {total - plain:+.2f} ms = entry {entry:.2f} + forward "
            f"{fwd - pf:+.2f} + backward {bwd - pb:+.2f} + exit {exit_:.2f}{'; ' + comm if comm else ''}; "
            f"Python calls {c[key]:.0f} (plain {c['plain']:.0f}), minor page faults {f[key]:.0f} "
            f"(plain {f['plain']:.0f})")


@dataclass(frozen=True)
class OverheadBench:
    """``posttrain bench overhead``: the model, the ranks, and where the result goes.

    Attributes:
        dim: the built-in GPT's width (4 blocks, fp32).
        world_size: 2: FSDP2 with ODC; 1: FSDP2 alone, and flat ODC with no peer.
        repeats: interleaved iterations of each engine; times are medians.
        json: results file, every rank's figures ('' for none).
    """

    dim: int = 128
    world_size: int = 2
    repeats: int = 30
    json: str = "out/bench_overhead.json"

    def __post_init__(self) -> None:
        if self.world_size not in (1, 2):
            raise ValueError(f"world_size={self.world_size} must be 1 or 2")
        if self.dim < 8:
            raise ValueError(f"dim={self.dim} must be at least 8")
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats} must be at least 1")

    def run(self, log=print) -> list[dict]:
        """:func:`bench_overhead` of these options, written to ``json``."""
        from .split import write_result

        results = bench_overhead(dim=self.dim, world_size=self.world_size, repeats=self.repeats, log=log)
        write_result({"dim": self.dim, "world_size": self.world_size, "repeats": self.repeats, "ranks": results},
                     self.json, log)
        return results


def bench_overhead(*, dim: int = 128, world_size: int = 2, repeats: int = 30, log=print) -> list[dict]:
    """Run the measurement on ``world_size`` ranks (1: FSDP2 alone, no peer; 2: FSDP2 with ODC);
    print one line per rank and engine and one for the optimizer; return every rank's figures."""
    OverheadBench(dim, world_size, repeats, json="")  # checks them
    what = "FSDP2+ODC" if world_size > 1 else "FSDP2 (1 rank)"
    results = run_ranks(_worker, world_size, dim, repeats, timeout_s=600)
    for rank, r in enumerate(results):
        for key, label in (("fsdp", what), ("flat", "flat ODC (no FSDP2)")):
            log(describe(rank, r, key, label))
        o = r["optimizer_ms"]
        log(f"rank {rank}: {r['parameters']} parameters; AdamW step on the FSDP2 shards, default loop / fused "
            f"{o['default'] / o['fused']:.1f}x, foreach / fused {o['foreach'] / o['fused']:.1f}x "
            f"(fused {o['fused']:.2f} ms)")
    return results
