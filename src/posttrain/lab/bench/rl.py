"""``posttrain bench rl``: the RL update phase on the same recorded rollouts, three ways.

RL makes its own imbalance: responses to the same prompts range from a few tokens to the length
limit. This benchmark replays one set of rollouts (recorded by ``posttrain rl --record`` or drawn
here with that shape: a share of responses cut at ``--max-new-tokens``, the rest log-normal) through
:func:`posttrain.train.rl.update_minibatch` under

- ``fsdp+same_micro``: FSDP2, every rank the same number of microbatches;
- ``odc-collective+same_micro``: flat ODC with a rendezvous at every gather and reduce;
- ``odc+diff_micro``: flat ODC, each rank its own microbatch count;

interleaved over rounds, and reports update tokens/s, the total gain over FSDP2 and ODC's own
mechanism (``odc+diff_micro`` over ``odc-collective+same_micro``), medians with the lowest and
highest round. Only the update phase is timed: rollout does not depend on the engine.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from posttrain.balance import FlopsCost
from posttrain.dp import build_engine
from posttrain.launch import run_ranks
from posttrain.models import GPT, GPTConfig
from posttrain.rl import Rollout
from posttrain.train.rl import RLConfig, update_minibatch

__all__ = ["VARIANTS", "bench_rl", "draw_rollouts"]

VARIANTS = (("fsdp", "odc", "same_micro"), ("odc", "collective", "same_micro"), ("odc", "odc", "diff_micro"))


def draw_rollouts(steps: int, samples: int, *, prompt_len: tuple[int, int] = (32, 128), max_new_tokens: int = 1024,
                  truncated: float = 0.25, vocab_size: int = 256, seed: int = 0) -> list[list[dict]]:
    """Per step, ``samples`` rollouts shaped like RL's: prompts uniform in ``prompt_len``;
    responses cut at ``max_new_tokens`` with probability ``truncated``, else log-normal with median
    ``max_new_tokens / 6``. Token ids and advantages are random (timing does not depend on them)."""
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(samples):
            p = rng.randint(*prompt_len)
            n = max_new_tokens if rng.random() < truncated else int(min(max_new_tokens, max(
                1, math.exp(math.log(max_new_tokens / 6) + 0.9 * rng.gauss(0, 1)))))
            step.append({"ids": [rng.randrange(vocab_size) for _ in range(p + n)], "prompt_len": p,
                         "advantage": rng.gauss(0, 1)})
        out.append(step)
    return out


def _worker(rank: int, world_size: int, cfg: RLConfig, model_cfg: GPTConfig, steps: list[list[dict]]) -> list[float]:
    torch.manual_seed(0)
    model = GPT(model_cfg)
    engine = build_engine(cfg.dp, model, cfg.engine_config())
    opt = torch.optim.AdamW(engine.parameters(), lr=1e-5, fused=True)
    cost = FlopsCost.from_config(model_cfg)
    times = []
    try:
        for k, step in enumerate(steps):
            rolls = [Rollout(torch.tensor(s["ids"]), s["prompt_len"], s["advantage"],
                             torch.zeros(len(s["ids"]) - s["prompt_len"])) for s in step]
            dist.barrier()
            t0 = time.perf_counter()
            update_minibatch(engine, model, opt, rolls, cfg, rank, world_size, cost)
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if k:  # step 0 warms up
                times.append(float(t))
    finally:
        engine.close()
    return times


def bench_rl(steps: list[list[dict]], *, model_cfg: GPTConfig, max_tokens: int, world_size: int = 2,
             repeats: int = 5, json_path: str | None = None, log=print) -> dict:
    """Replay ``steps`` (rollout dicts per step; the first is warm-up) under every variant,
    ``repeats`` interleaved rounds; print and return tokens/s and ratios."""
    tokens = sum(len(s["ids"]) - 1 for step in steps[1:] for s in step)
    base = RLConfig(max_tokens=max_tokens, samples_per_prompt=2, prompts_per_step=1)
    rounds = []
    for r in range(repeats):
        got = {}
        for dp, mode, balance in VARIANTS:
            cfg = replace(base, dp=dp, odc_mode=mode, balance=balance)
            name = f"{cfg.dp_label}+{balance}"
            times = run_ranks(_worker, world_size, cfg, model_cfg, steps, timeout_s=3600)[0]
            got[name] = tokens / sum(times)
            log(f"  round {r + 1}/{repeats}  {name:28s} {got[name]:8.0f} update tokens/s", flush=True)
        rounds.append(got)
    names = list(rounds[0])
    fsdp, coll, odc = names

    def ratio(a: str, b: str) -> tuple[float, float, float]:
        vals = [x[a] / x[b] for x in rounds]
        return statistics.median(vals), min(vals), max(vals)

    lengths = [len(s["ids"]) - s["prompt_len"] for step in steps for s in step]
    result = {
        "tokens_per_s": {n: statistics.median(x[n] for x in rounds) for n in names},
        "total": ratio(odc, fsdp), "mechanism": ratio(odc, coll), "transport_and_engine": ratio(coll, fsdp),
        "rounds": rounds, "response_lengths": {"mean": statistics.mean(lengths), "max": max(lengths)},
    }
    log(f"RL update phase, {world_size} ranks, gpt {model_cfg.num_layers}x{model_cfg.dim}, {len(steps[0])} samples a "
        f"step, responses mean {result['response_lengths']['mean']:.0f} max {result['response_lengths']['max']} tokens, "
        f"max_tokens {max_tokens}, {len(steps) - 1} steps (first excluded), median of {repeats} rounds")
    for n in names:
        log(f"  {n:28s} {result['tokens_per_s'][n]:8.0f} update tokens/s")
    for key, label in (("total", f"{odc} / {fsdp}"), ("transport_and_engine", f"{coll} / {fsdp}"),
                       ("mechanism", f"ODC's own: {odc} / {coll}")):
        m, lo, hi = result[key]
        log(f"  {key:22s} {m:5.2f}x  ({lo:.2f}-{hi:.2f})  {label}")
    if json_path:
        import os

        os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
        log(f"wrote {json_path}")
    return result
