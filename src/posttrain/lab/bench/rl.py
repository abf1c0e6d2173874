"""``posttrain bench rl``: the RL update phase on the same recorded rollouts, three ways.

RL makes its own imbalance: responses to the same prompts range from a few tokens to the length
limit. This benchmark replays one set of rollouts (recorded by ``posttrain rl --record`` or drawn
here with that shape: a share of responses cut at ``max_new_tokens``, the rest log-normal) through
:func:`posttrain.train.rl.update_minibatch` under

- ``fsdp+same_micro``: FSDP2, every rank the same number of microbatches;
- ``odc-collective+same_micro``: flat ODC with a rendezvous at every gather and reduce;
- ``odc+diff_micro``: flat ODC, each rank its own microbatch count;

interleaved over rounds, and reports update tokens/s, the total gain over FSDP2 and ODC's own
mechanism (``odc+diff_micro`` over ``odc-collective+same_micro``), medians with the lowest and
highest round. Only the update phase is timed: rollout does not depend on the engine.

Beside the measured mechanism it prints the simulator's prediction for the same response lengths
(``predict=True``): the update's plans under same_micro and diff_micro, replayed by
:func:`posttrain.lab.calibrate.predict_plans` with a per-layer cost fitted to this model's
forward and backward of the plans' own microbatch shapes (the RL loss, measured here) and flat
ODC's engine costs measured on equal-length sequences of the same model shape.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from posttrain.balance import FlopsCost, plan_minibatch
from posttrain.dp import EngineConfig, build_engine
from posttrain.launch import run_ranks
from posttrain.models import GPT, GPTConfig
from posttrain.rl import Rollout, policy_loss
from posttrain.train.rl import RLConfig, update_minibatch

from .split import interleaved_rounds, log_split, split_ratios, write_result

__all__ = ["VARIANTS", "RLBench", "bench_rl", "draw_rollouts", "predict_rl"]

VARIANTS = (("fsdp", "one-sided", "same_micro"), ("odc", "collective", "same_micro"), ("odc", "one-sided", "diff_micro"))


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
    engine = build_engine(model, cfg.engine)
    opt = torch.optim.AdamW(engine.parameters(), lr=1e-5, fused=True)
    cost = FlopsCost.from_config(model_cfg)
    times = []
    try:
        for k, step in enumerate(steps):
            rolls = _rollouts(step)
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


def _rollouts(step: list[dict]) -> list[Rollout]:
    return [Rollout(torch.tensor(s["ids"]), s["prompt_len"], s["advantage"], torch.zeros(len(s["ids"]) - s["prompt_len"]))
            for s in step]


def _compute_worker(rank: int, world_size: int, model_cfg: GPTConfig, shapes: list[list[tuple[int, int]]],
                    iters: int) -> list[float]:
    """Forward and backward of the RL loss on a plain model for each microbatch shape (a list of
    (prompt, response) lengths), every rank at once; the slowest rank's median seconds."""
    torch.manual_seed(0)
    model = GPT(model_cfg)
    g = torch.Generator().manual_seed(1)
    out = []
    for shape in shapes:
        rolls = [Rollout(torch.randint(0, model_cfg.vocab_size, (p + n,), generator=g), p, 1.0, torch.zeros(n))
                 for p, n in shape]
        times = []
        for _ in range(iters + 1):
            dist.barrier()
            t0 = time.perf_counter()
            policy_loss(model, rolls)[0].backward()
            times.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(times[1:])], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out.append(float(t))
    return out


def predict_rl(steps: list[list[dict]], *, model_cfg: GPTConfig, max_tokens: int, world_size: int = 2,
               iters: int = 3, max_shapes: int = 48, log=print) -> dict:
    """The calibrated simulator's headroom and mechanism for the update steps ``steps[1:]`` (see
    the module docstring)."""
    import random

    from posttrain.lab.calibrate import machine_from_shapes, predict_plans
    from posttrain.train.sft import TrainConfig

    cost = FlopsCost.from_config(model_cfg)
    plans = {m: [plan_minibatch([len(s["ids"]) - 1 for s in step], world_size=world_size, max_tokens=max_tokens,
                                method=m, cost=cost) for step in steps[1:]] for m in ("same_micro", "diff_micro")}
    shapes = sorted({tuple(sorted((step[i]["prompt_len"], len(step[i]["ids"]) - step[i]["prompt_len"])
                                  for i in mb.sequence_ids))
                     for m in plans for step, plan in zip(steps[1:], plans[m]) for mbs in plan.ranks for mb in mbs
                     if mb.sequence_ids})
    if len(shapes) > max_shapes:
        largest = max(shapes, key=lambda sh: sum(p + n for p, n in sh))
        shapes = sorted({largest, *random.Random(0).sample(shapes, max_shapes - 1)})
    log(f"calibrating the simulator: the RL loss on {len(shapes)} microbatch shapes ...", flush=True)
    seconds = run_ranks(_compute_worker, world_size, model_cfg, [list(sh) for sh in shapes], iters, timeout_s=3600)[0]
    # The fit is per token of the model's input: a rollout of p + n ids is p + n - 1 inputs.
    token_shapes = [[p + n - 1 for p, n in sh] for sh in shapes]
    ref = TrainConfig(model="gpt", dim=model_cfg.dim, num_layers=model_cfg.num_layers, max_tokens=max_tokens,
                      max_len=max_tokens, sequences=len(steps[0]), steps=4)
    machine = machine_from_shapes(ref, token_shapes, seconds, world_size=world_size, log=log)
    return predict_plans(plans["same_micro"], plans["diff_micro"], machine, num_layers=model_cfg.num_layers,
                         max_tokens=max_tokens, world_size=world_size)


def bench_rl(steps: list[list[dict]], *, model_cfg: GPTConfig, max_tokens: int, world_size: int = 2,
             repeats: int = 5, predict: bool = True, json_path: str | None = None, log=print) -> dict:
    """Replay ``steps`` (rollout dicts per step; the first is warm-up) under every variant,
    ``repeats`` interleaved rounds; print and return tokens/s and ratios, and with ``predict``
    the calibrated simulator's prediction for the same plans (``result["predicted"]``)."""
    tokens = sum(len(s["ids"]) - 1 for step in steps[1:] for s in step)
    base = RLConfig(max_tokens=max_tokens, samples_per_prompt=2, prompts_per_step=1)

    def measure(variant):
        dp, mode, balance = variant
        cfg = replace(base, engine=EngineConfig(dp, mode=mode), balance=balance)
        speed = tokens / sum(run_ranks(_worker, world_size, cfg, model_cfg, steps, timeout_s=3600)[0])
        return f"{cfg.engine.label}+{balance}", speed, speed

    rounds = interleaved_rounds(repeats, VARIANTS, measure, unit="update tokens/s", log=log)
    predicted = (predict_rl(steps, model_cfg=model_cfg, max_tokens=max_tokens, world_size=world_size, log=log)
                 if predict else None)
    names = list(rounds[0])
    lengths = [len(s["ids"]) - s["prompt_len"] for step in steps for s in step]
    result = {
        "tokens_per_s": {n: statistics.median(x[n] for x in rounds) for n in names},
        **split_ratios(rounds, names), "rounds": rounds,
        "response_lengths": {"mean": statistics.mean(lengths), "max": max(lengths)},
        "predicted": predicted,
    }
    log(f"RL update phase, {world_size} ranks, gpt {model_cfg.num_layers}x{model_cfg.dim}, {len(steps[0])} samples a "
        f"step, responses mean {result['response_lengths']['mean']:.0f} max {result['response_lengths']['max']} tokens, "
        f"max_tokens {max_tokens}, {len(steps) - 1} steps (first excluded), median of {repeats} rounds")
    for n in names:
        log(f"  {n:28s} {result['tokens_per_s'][n]:8.0f} update tokens/s")
    log_split(result, names, log)
    if predicted:
        log(f"  simulator              {predicted['mechanism']:5.2f}x  ODC's own, predicted for the same plans "
            f"(headroom {predicted['headroom']:.2f}x: collective+same_micro over the best whole-sequence partition)")
    write_result(result, json_path, log)
    return result


@dataclass(frozen=True)
class RLBench:
    """``posttrain bench rl``: the rollouts replayed, the model, and where the result goes.

    Attributes:
        rollouts: a ``posttrain rl --record`` file to replay (default: rollouts drawn with RL's
            shape).
        steps: drawn rollouts: update steps, the first a warm-up.
        samples: drawn rollouts: rollouts a step.
        max_new_tokens: drawn rollouts: the response length limit.
        max_tokens: microbatch token budget (default: the longest rollout).
        dim: the built-in GPT's width.
        num_layers: the built-in GPT's blocks.
        seed: drawn rollouts: their seed.
        world_size: CPU processes.
        repeats: interleaved rounds.
        no_predict: skip the calibrated simulator's prediction.
        json: results file ('' for none).
    """

    rollouts: str | None = None
    steps: int = 6
    samples: int = 32
    max_new_tokens: int = 1024
    max_tokens: int | None = None
    dim: int = 128
    num_layers: int = 4
    seed: int = 0
    world_size: int = 2
    repeats: int = 5
    no_predict: bool = False
    json: str = "out/bench_rl.json"

    def __post_init__(self) -> None:
        for name in ("samples", "max_new_tokens", "dim", "num_layers", "world_size", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.steps < 2:
            raise ValueError(f"steps={self.steps} must be at least 2 (the first warms up)")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be at least 1")

    def load(self) -> list[list[dict]]:
        """The rollouts of every step: read from ``rollouts``, or drawn."""
        if not self.rollouts:
            return draw_rollouts(self.steps, self.samples, max_new_tokens=self.max_new_tokens, seed=self.seed)
        try:
            with open(self.rollouts) as f:
                steps = [json.loads(line)["samples"] for line in f if line.strip()]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"rollouts={self.rollouts}: not the `record` file of an RL run ({e})") from None
        if len(steps) < 2:
            raise ValueError(f"rollouts={self.rollouts}: needs 2 or more steps (the first warms up)")
        return steps

    def run(self, log=print) -> dict:
        """:func:`bench_rl` on :meth:`load`'s rollouts, written to ``json``."""
        steps = self.load()
        longest = max(len(s["ids"]) for step in steps for s in step)
        max_tokens = self.max_tokens or longest
        if longest - 1 > max_tokens:
            raise ValueError(f"max_tokens={max_tokens} is below the longest rollout ({longest} tokens)")
        vocab = max(max(s["ids"]) for step in steps for s in step) + 1
        model_cfg = GPTConfig(vocab_size=max(vocab, 2), dim=self.dim, num_layers=self.num_layers,
                              num_heads=max(1, self.dim // 32), max_seq_len=max_tokens)
        return bench_rl(steps, model_cfg=model_cfg, max_tokens=max_tokens, world_size=self.world_size,
                        repeats=self.repeats, predict=not self.no_predict, json_path=self.json or None, log=log)
