"""What splitting a sequence across 2 ranks costs beyond half its work: the exchange price of the
context-parallel plan, measured.

``python -m posttrain.lab.bench.cp_exchange [--lengths 256,1024,4096] [--reps 5]``: posttrain's GPT
(``TrainConfig``'s default shape, fp32, the CPU) runs one sequence's forward and backward whole on
each of 2 ranks at once (their mean) and split over them (:func:`posttrain.train.sft.loop.shard_loss`;
the slower rank), the split both over
gloo's collectives and through the shared-memory exchange the ODC trainers use on one host
(:class:`posttrain.odc.ShmRowExchange`), interleaved ``reps`` times; per length, the median times
and the overhead: the median over repetitions of ``split - whole / 2``, each repetition's runs
back to back. The overheads, in the cost model's units (FLOPs, at the
rate the whole runs measured), are fitted per exchange as ``fixed + per_token * n / 2`` (least
squares): ``fixed`` over the layers' exchanges gives the FLOPs one costs, ``per_token`` over the
bytes of keys and values moved gives the FLOPs per byte
(:data:`posttrain.train.core.context.FLOPS_PER_EXCHANGED_BYTE` and ``FLOPS_PER_EXCHANGE_CALL`` hold
the CPU's from this command).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from posttrain.launch import run_ranks

__all__ = ["main", "measure", "measured_config"]


def _worker(rank: int, world: int, lengths: list[int], reps: int, cfg=None) -> dict:
    from posttrain.balance.context import Shard, shard_lengths
    from posttrain.models import GPT
    from posttrain.train.sft.loop import microbatch_loss, shard_loss

    cfg = measured_config(lengths, cfg)
    torch.manual_seed(0)
    model = GPT(cfg.model_config())
    from posttrain.odc import row_exchange

    group = dist.new_group(list(range(world)))
    exchanges = {"split": group, "split-shm": row_exchange(dist.new_group(list(range(world))))}
    out: dict = {}
    for n in lengths:
        seq = torch.randint(0, model.cfg.vocab_size, (n + 1,))
        times: dict[str, list[float]] = {"whole": [], "split": [], "split-shm": []}
        for rep in range(reps + 1):  # (the first of each: warm-up)
            for mode in times:
                dist.barrier()
                t = time.perf_counter()
                if mode != "whole":
                    shard = Shard(0, rank, 2, (0, 1), shard_lengths(n, 2)[rank], 0.0)
                    shard_loss(model, seq, shard, exchanges[mode]).backward()
                else:  # every rank at once, as in training (one rank alone runs faster: it has the
                    # memory bandwidth and cache to itself, which made the split look dearer)
                    microbatch_loss(model, [seq], [0], 1.0).backward()
                dist.barrier()
                if rep:
                    times[mode].append(time.perf_counter() - t)
        out[n] = times
    exchanges["split-shm"].close()
    return out


def measured_config(lengths: list[int], cfg=None):
    """The model measured: ``cfg``'s GPT shape (default: ``TrainConfig``'s), fp32, sequences up
    to the longest of ``lengths``."""
    from dataclasses import replace

    from posttrain.train.sft import TrainConfig

    base = cfg or TrainConfig()
    if base.model != "gpt" or base.engine.precision != "fp32":
        raise ValueError(f"the exchange is measured on posttrain's GPT in fp32 (got {base.model}, "
                         f"{base.engine.precision})")
    return replace(base, data=None, max_len=max(lengths), max_tokens=max(lengths))


def measure(lengths: list[int], reps: int = 5, cfg=None) -> dict:
    """Median whole and split seconds per length, the overheads (``overhead_s (mode)``: the median
    of the repetitions' ``paired_overhead_s (mode)``; in FLOPs too) and the fit (see the module
    docstring), on ``cfg``'s model shape (default: ``TrainConfig``'s)."""
    from posttrain.balance import FlopsCost

    ranks = run_ranks(_worker, 2, lengths, reps, cfg, timeout_s=1800)
    # per repetition, the whole sequence: the ranks' mean (each ran its own copy at once); a split:
    # the slower rank (its ranks meet at every layer's exchange, so they end together). The overhead
    # is the median of each repetition's split minus half its whole, run back to back: the
    # difference of two separate medians moved with the machine between them (at 4,096 tokens one
    # calibration measured 18 ms where others measured 48-58)
    per_rep = {n: {"whole": [statistics.mean(r[n]["whole"][i] for r in ranks) for i in range(reps)],
                   **{m: [max(r[n][m][i] for r in ranks) for i in range(reps)] for m in ("split", "split-shm")}}
               for n in lengths}
    times = {n: {k: statistics.median(v) for k, v in per_rep[n].items()} for n in lengths}
    paired = {n: {m: [s - w / 2 for s, w in zip(per_rep[n][m], per_rep[n]["whole"])] for m in ("split", "split-shm")}
              for n in lengths}
    cost = FlopsCost.from_config(measured_config(lengths, cfg).model_config())
    shape = cost.shape
    kv_bytes = 2 * shape.num_layers * shape.kv_heads * shape.head_dim * 4  # (fp32)
    out: dict = {"lengths": {}, "fit": {}}
    for mode in ("split", "split-shm"):
        rows, over = [], []
        for n in lengths:
            t = times[n]
            rate = cost(n) / t["whole"]
            seconds = statistics.median(paired[n][mode])
            extra = seconds * rate
            row = out["lengths"].setdefault(n, {**t, "flops_per_s": rate})
            row[f"overhead_flops ({mode})"] = extra
            row[f"overhead_s ({mode})"] = seconds
            row[f"paired_overhead_s ({mode})"] = paired[n][mode]
            rows.append([1.0, n / 2])
            over.append(extra)
        a = torch.tensor(rows, dtype=torch.float64)
        fixed, per_token = torch.linalg.lstsq(a, torch.tensor(over, dtype=torch.float64)[:, None]).solution[:, 0].tolist()
        out["fit"][mode] = {"fixed_flops": fixed, "per_token_flops": per_token,
                            # an all-gather forward, a reduce-scatter backward
                            "flops_per_call": fixed / (2 * shape.num_layers),
                            "flops_per_byte": per_token / (2 * kv_bytes)}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="256,1024,4096")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if min(lengths) < 4 or args.reps < 1:
        p.error("lengths of at least 4 tokens and --reps of at least 1")
    res = measure(lengths, args.reps)
    print(f"{'tokens':>7} {'exchange':>9} {'whole s':>8} {'split s':>8} {'split/whole':>11} {'overhead GFLOP':>15}")
    for n, r in res["lengths"].items():
        for mode, name in (("split", "gloo"), ("split-shm", "shm")):
            print(f"{n:7d} {name:>9} {r['whole']:8.3f} {r[mode]:8.3f} {r[mode] / r['whole']:11.2f} "
                  f"{r[f'overhead_flops ({mode})'] / 1e9:15.2f}")
    for mode, name in (("split", "gloo"), ("split-shm", "shm")):
        f = res["fit"][mode]
        print(f"fit ({name}): {f['fixed_flops'] / 1e9:.2f} GFLOP a split + {f['per_token_flops'] / 1e6:.2f} MFLOP a "
              f"token received: {f['flops_per_call'] / 1e6:.0f} MFLOP an exchange, {f['flops_per_byte']:.0f} FLOPs a byte")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
