"""The RL loop: one rank of a GRPO/RLOO run whose policy update runs on any data-parallel engine.

Each step:

1. rollout: the engine's full parameters are loaded into this rank's unsharded rollout copy (a
   collective, a part at a time); the rank samples ``samples_per_prompt`` responses for its share
   of the step's prompts (every ``world_size``-th, all in one left-padded batch) and scores
   them with the reward function;
2. every rank receives every rank's samples (one all-gather of token ids and numbers), so all
   compute the same advantages and the same balancing plans (with ``kl_coef``, the frozen
   reference's log-probs are computed then, sharded like the policy: :mod:`.reference`); groups whose rewards are all equal
   have zero advantage and are left out of the update (counted);
3. update: ``ppo_epochs`` passes, each over the samples split into ``minibatches``; every
   minibatch is balanced (``balance``) and run under the engine, its loss aggregated as
   ``loss_agg`` says over the whole minibatch whatever the placement (see :mod:`posttrain.rl.loss`).
   The ratio's old log-probs: with one epoch and one minibatch (on-policy) the update's own forward,
   detached (the ratio is 1); otherwise one packed forward per microbatch under the policy's engine
   before the first update, balanced like the reference's.

Rollout time and tokens/s are reported apart from the update's, and the whole step by stopwatch
(``wall_s``, ``tokens_per_s``).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from posttrain.balance import ContextPlan, FlopsCost, plan_context, plan_minibatch
from posttrain.device import allow_cudnn_attention, allow_tf32, rank_device, rank_kind, use
from posttrain.dp import DataParallelEngine, build_engine
from posttrain.models import load_pretrained
from posttrain.models.lora import add_lora, merged, write_model
from posttrain.rl import (
    HFRollout,
    Rollout,
    call_reward,
    compute_advantages,
    load_rewards,
    loss_units,
    policy_loss,
    shard_policy_loss,
    shard_units,
)
from posttrain.text import count
from posttrain.train.core import Trainer, local_world
from posttrain.train.core.context import MIN_SPLIT_GAIN, SplitGroups, exchange_cost, group_failure
from posttrain.train.core.recipe import optimizer_step

from .config import RLConfig
from .reference import ShardedReference, engine_logprobs

__all__ = ["RL_SCALARS", "Prompt", "RLTrainer", "load_prompts", "prompt_limit", "rl_worker", "update_minibatch"]

#: The per-step figures written to TensorBoard.
RL_SCALARS = ("reward_mean", "reward_std", "response_len_mean", "kl", "clip_fraction", "entropy",
              "rollout_tokens_per_s", "update_tokens_per_s", "tokens_per_s", "wall_s", "lr", "grad_norm")

@dataclass(frozen=True)
class Prompt:
    """A prompt as given (``raw``: a string or chat messages), its token ids, where it was read
    and the record's other fields (what reward functions may take)."""

    raw: object
    ids: list[int]
    where: str
    fields: dict = field(default_factory=dict)


def load_prompts(path: str, tokenizer, *, max_new_tokens: int, max_tokens: int,
                 limit: str = "max_tokens") -> list[Prompt]:
    """The prompts of a JSONL file, tokenized (chat prompts with the generation prompt).

    Raises:
        ValueError: a missing file, a bad line, or a prompt so long that prompt plus
            ``max_new_tokens`` exceeds ``max_tokens + 1`` (named by file and line; ``limit``
            names what ``max_tokens`` is).
    """
    out = []
    try:
        f = open(path)
    except OSError as e:
        raise ValueError(f"`prompts` {path}: {e.strerror}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if isinstance(rec, dict) and isinstance(rec.get("messages"), list) and rec["messages"]:
                msgs = rec["messages"]
                if msgs[-1].get("role") == "assistant":
                    msgs = msgs[:-1]  # a reference answer: not part of the prompt
                ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
                ids, raw = list(ids["input_ids"]), msgs
            elif isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
                ids, raw = list(tokenizer(rec["prompt"])["input_ids"]), rec["prompt"]
            else:
                raise ValueError(f"{where}: expected {{\"prompt\": str}} or {{\"messages\": [...]}}")
            if not ids:
                raise ValueError(f"{where}: the prompt is empty")
            if len(ids) + max_new_tokens > max_tokens + 1:
                raise ValueError(f"{where}: a prompt of {len(ids)} tokens plus max_new_tokens={max_new_tokens} "
                                 f"exceeds {limit}={max_tokens} + 1; raise `max_tokens` or shorten it")
            fields = {k: v for k, v in rec.items() if k not in ("prompt", "messages")}
            out.append(Prompt(raw, ids, where, fields))
    if not out:
        raise ValueError(f"`prompts` {path}: no prompts")
    return out


def prompt_limit(cfg: RLConfig, world_size: int) -> dict:
    """:func:`load_prompts`' length arguments for ``cfg`` on ``world_size`` ranks: a rollout
    fits ``max_tokens``, or with context parallelism the longest its shards hold."""
    longest = cfg.longest(world_size)
    what = "max_tokens" if longest == cfg.max_tokens else f"the longest split rollout (max_tokens={cfg.max_tokens} x shards)"
    return {"max_new_tokens": cfg.max_new_tokens, "max_tokens": longest, "limit": what}


def _stat_sum(values: Sequence[float]) -> list[float]:
    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def update_minibatch(engine: DataParallelEngine, model: nn.Module, optimizer: torch.optim.Optimizer,
                     rollouts: Sequence[Rollout], cfg: RLConfig, rank: int, world_size: int,
                     cost: FlopsCost, *, step: int = 0, groups: SplitGroups | None = None) -> dict[str, float]:
    """One optimizer step on ``rollouts`` (identical on every rank): balanced over the ranks,
    run under ``engine``, the loss aggregated over the whole minibatch, then the step's recipe
    (learning rate of training step ``step``, clipping, weight decay: [Note: the step's recipe]).
    With context parallelism (``cfg.engine.context_parallel``) the plan may split the costliest
    rollouts across ranks (always those longer than ``max_tokens``); every rank runs its shards
    first, with ``groups``' exchanges (default: made for this call). Returns the global
    ``tokens``, ``clipped``, ``kl`` and ``entropy`` sums, this rank's ``microbatches``, the
    ``lr`` and the ``grad_norm`` before clipping."""
    lengths = [len(r) - 1 for r in rollouts]
    shards, own_groups = (), None
    if cfg.engine.context_parallel == "off":
        plan = plan_minibatch(lengths, world_size=world_size, max_tokens=cfg.max_tokens, method=cfg.balance, cost=cost)
    else:
        plan = plan_context(lengths, world_size=world_size, max_tokens=cfg.max_tokens, cost=cost,
                            exchange=exchange_cost(cfg, cost, local_world(world_size) == world_size),
                            context_parallel=cfg.engine.context_parallel, min_gain=MIN_SPLIT_GAIN)
        shards = plan.shards_for(rank)
        if groups is None:  # (made for this call, closed at its end)
            groups = own_groups = SplitGroups(rank, engine.device, engine.peer_failure)
        groups.make(plan.groups)
    mine = [m for m in plan.microbatches_for(rank) if m.sequence_ids]
    busiest = max(len([m for m in mbs if m.sequence_ids]) for mbs in plan.ranks)
    units = loss_units(rollouts, cfg.loss_agg)
    own = (sum(loss_units([rollouts[i] for i in m.sequence_ids], cfg.loss_agg) for m in mine)
           + sum(shard_units(rollouts[sh.sequence_id], sh.index, sh.num_shards, cfg.loss_agg) for sh in shards))
    sums = {"tokens": 0.0, "clipped": 0.0, "kl": 0.0, "entropy": 0.0}
    with engine.minibatch(own) as mb:
        if mb.global_tokens != units:
            raise AssertionError(f"the engine counts {mb.global_tokens} loss units, the rollouts {units}")
        for sh in shards:  # first, in the order every rank runs them: a group's shards run together
            try:
                loss, st = shard_policy_loss(model, rollouts[sh.sequence_id], sh.index, sh.num_shards,
                                             groups[sh.group], clip_eps=cfg.clip_eps_low,
                                             clip_eps_high=cfg.clip_eps_high, kl_coef=cfg.kl_coef,
                                             agg=cfg.loss_agg, temperature=cfg.temperature, device=engine.device)
                for k, v in st.items():
                    sums[k] += v
                (loss / mb.loss_divisor).backward()
            except RuntimeError as exc:
                raise group_failure(engine, sh, exc) from exc
        for micro in engine.pad(mine, busiest):
            if micro is None:
                engine.run_dummy()
                continue
            loss, st = policy_loss(model, [rollouts[i] for i in micro.sequence_ids], clip_eps=cfg.clip_eps_low,
                                   clip_eps_high=cfg.clip_eps_high, kl_coef=cfg.kl_coef, agg=cfg.loss_agg,
                                   temperature=cfg.temperature, device=engine.device)
            for k, v in st.items():
                sums[k] += v
            (loss / mb.loss_divisor).backward()
    if own_groups is not None:
        own_groups.close()
    recipe = optimizer_step(optimizer, cfg.optim, step, cfg.steps, [engine.shards()], engine.device)
    keys = list(sums)
    return {**dict(zip(keys, _stat_sum([sums[k] for k in keys]))), "microbatches": float(len(mine) + len(shards)),
            "split_sequences": float(len(plan.split) if isinstance(plan, ContextPlan) else 0), **recipe}


class RLTrainer(Trainer):
    """One rank of a GRPO/RLOO run (see the module docstring); its rows hold the step's global figures."""

    scalars = RL_SCALARS
    rows_per_rank = False

    def __init__(self, cfg: RLConfig, rank: int, world_size: int) -> None:
        from transformers import AutoTokenizer

        from posttrain.models import tied_names

        # the launcher's resolution (auto in a rank started elsewhere: its process group's device)
        self.device = rank_device(rank_kind(cfg.device), rank)
        use(self.device)
        allow_tf32(self.device, cfg.tf32)
        allow_cudnn_attention(self.device, cfg.cudnn_attention)
        self.tok = AutoTokenizer.from_pretrained(cfg.model_path)
        self.prompts = load_prompts(cfg.prompts, self.tok, **prompt_limit(cfg, world_size))
        self.rewards = load_rewards(cfg.reward)
        self.weights = cfg.reward_weights or (1.0,) * len(self.rewards)
        self.policy = load_pretrained(cfg.model_path)
        if cfg.lora is not None:  # peft's adapters on the policy; the rollout model gets them merged
            add_lora(self.policy, cfg.lora, seed=cfg.seed)
        self.tied = tied_names(self.policy)
        self.cost = FlopsCost.from_config(self.policy.config)
        self.engine = build_engine(self.policy.to(self.device), cfg.engine)
        self._groups = SplitGroups(rank, self.device, self.engine.peer_failure)  # split rollouts' exchanges
        self.reference = None
        try:
            self.rollout = HFRollout(load_pretrained(cfg.model_path).hf.to(self.device), eos_token_id=self.tok.eos_token_id,
                                     pad_token_id=self.tok.pad_token_id, temperature=cfg.temperature, top_p=cfg.top_p,
                                     max_new_tokens=cfg.max_new_tokens, per_prompt=cfg.generate_batch == "prompt",
                                     use_generate=cfg.sampler == "generate")
            self.reference = ShardedReference(cfg.model_path, cfg, self.cost, self.device) if cfg.kl_coef else None
        except BaseException:
            self.close()
            raise
        #: one epoch, one minibatch: the weights that sampled are the ones the update starts from, so the
        #: update's own forward gives the old log-probs (detached) and no other forward is needed
        self.on_policy = cfg.ppo_epochs == 1 and cfg.minibatches == 1
        self._ended: float | None = None  # when the previous step ended (its wall time starts there)
        trainable = [p for p in self.engine.parameters() if p.requires_grad]
        super().__init__(cfg, rank, world_size, state=self.engine, optimizer=cfg.optim.build(trainable),
                         label=f"rl {cfg.engine.label}+{cfg.balance}")

    def _stopwatch(self, began: float) -> float:
        """What a stopwatch sees of this step: the time since the previous step ended (its metrics,
        checkpoint and export included), or, in a run's first step, since this one began."""
        ended = time.perf_counter()
        wall = ended - (self._ended if self._ended is not None else began)
        self._ended = ended
        return wall

    def train_step(self, step: int) -> dict:
        cfg, rank, world_size, engine = self.cfg, self.rank, self.world_size, self.engine
        began = time.perf_counter()
        n = cfg.samples_per_prompt
        rng = random.Random(cfg.seed * 1_000_003 + step)
        batch = [self.prompts[(step * cfg.prompts_per_step + k) % len(self.prompts)] for k in range(cfg.prompts_per_step)]
        rng.shuffle(batch)
        dist.barrier()
        t0 = time.perf_counter()
        self.rollout.wake()
        parts = engine.iter_full_state(self.device)  # (GPU to GPU on a GPU: no round trip through the host)
        self.rollout.load_weights(parts if cfg.lora is None else merged(parts, cfg.lora.scale))
        mine = list(range(rank, len(batch), world_size))
        responses = self.rollout.generate([batch[i].ids for i in mine], n, seed=cfg.seed * 7919 + step * 131 + rank)
        local = []
        for k, resp in enumerate(responses):
            p = batch[mine[k // n]]
            seq = torch.tensor(p.ids + resp, dtype=torch.long)
            text = self.tok.decode(resp, skip_special_tokens=True)
            parts = [call_reward(fn, p.raw, text, name=name, fields=p.fields, where=p.where) for name, fn in self.rewards]
            local.append({"prompt": mine[k // n], "sample": k % n, "ids": seq.tolist(), "prompt_len": len(p.ids),
                          "reward": sum(w * r for w, r in zip(self.weights, parts)), "parts": parts, "len": len(resp)})
        self.rollout.sleep()
        t_gen = time.perf_counter() - t0
        every: list = [None] * world_size
        dist.all_gather_object(every, local)
        samples = sorted((s for part in every for s in part), key=lambda s: (s["prompt"], s["sample"]))
        adv = compute_advantages([s["reward"] for s in samples], n, estimator=cfg.advantage,
                                 normalize_std=cfg.scale_rewards == "std")
        zero = set(adv.zero_groups)
        skip = zero if cfg.skip_equal_reward_groups else set()
        t_ref = time.perf_counter()
        kept = [s for s in samples if s["prompt"] not in skip]
        kept_ids = [torch.tensor(s["ids"]) for s in kept]
        if self.reference is not None and kept:  # (a skipped group is not trained: no reference needed)
            lps = self.reference.logprobs(kept_ids, [s["prompt_len"] for s in kept], rank=rank, world_size=world_size)
            for s, lp in zip(kept, lps):
                s["ref"] = lp
        t_ref = time.perf_counter() - t_ref
        t_old = time.perf_counter()
        if not self.on_policy and kept:
            # the sampling weights' log-probs, before the first update changes them: packed, balanced,
            # one forward per microbatch under the policy's engine (on-policy, the update's own forward
            # gives them: Rollout.old_logprobs None)
            lps, _ = engine_logprobs(engine, self.policy, kept_ids, [s["prompt_len"] for s in kept], cfg, self.cost,
                                     rank=rank, world_size=world_size)
            for s, lp in zip(kept, lps):
                s["old"] = lp
        t_old = time.perf_counter() - t_old
        rollouts = [Rollout(ids, s["prompt_len"], a, s.get("old"), s.get("ref"), s["reward"])
                    for ids, s, a in zip(kept_ids, kept, (a for s, a in zip(samples, adv.values)
                                                          if s["prompt"] not in skip))]
        if cfg.record and rank == 0:
            with open(cfg.record, "a") as f:
                f.write(json.dumps({"step": step, "samples": [
                    {"ids": s["ids"], "prompt_len": s["prompt_len"], "advantage": a}
                    for s, a in zip(samples, adv.values)]}) + "\n")
        t1 = time.perf_counter()
        totals = {"tokens": 0.0, "clipped": 0.0, "kl": 0.0, "entropy": 0.0}
        updates = skipped = split = 0
        norms: list[float] = []
        if rollouts:
            for epoch in range(cfg.ppo_epochs):
                order = list(range(len(rollouts)))
                random.Random(cfg.seed * 31 + step * 17 + epoch).shuffle(order)
                size = -(-len(order) // cfg.minibatches)
                for start in range(0, len(order), size):
                    part = [rollouts[i] for i in order[start:start + size]]
                    st = update_minibatch(engine, self.policy, self.optimizer, part, cfg, rank, world_size, self.cost,
                                          step=step, groups=self._groups)
                    for k in totals:
                        totals[k] += st[k]
                    norms.append(st["grad_norm"])
                    updates += 1
                    skipped += int(st["skipped_update"])
                    split += int(st["split_sequences"])
        t_upd = time.perf_counter() - t1 + t_old
        wall = self._stopwatch(began)
        gen_max = torch.tensor([t_gen, t_upd, t_ref, wall], dtype=torch.float64)
        dist.all_reduce(gen_max, op=dist.ReduceOp.MAX)  # (the slowest rank's: every rank's row is the same)
        rewards = torch.tensor([s["reward"] for s in samples], dtype=torch.float64)
        lens = torch.tensor([s["len"] for s in samples], dtype=torch.float64)
        tok_n = max(1.0, totals["tokens"])
        return {
            "step": step, "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
            **({f"reward_mean/{name}": statistics.fmean(s["parts"][i] for s in samples)
                for i, (name, _) in enumerate(self.rewards)} if len(self.rewards) > 1 else {}),
            "response_len_mean": float(lens.mean()), "response_len_max": int(lens.max()),
            "zero_advantage_groups": len(zero), "updates": updates, "skipped_updates": skipped,
            "split_sequences": split,
            "lr": cfg.optim.lr_at(step, cfg.steps), "grad_norm": statistics.fmean(norms) if norms else None,
            "kl": totals["kl"] / tok_n if cfg.kl_coef else None, "clip_fraction": totals["clipped"] / tok_n,
            "entropy": totals["entropy"] / tok_n,
            "rollout_s": float(gen_max[0]), "update_s": float(gen_max[1]), "wall_s": float(gen_max[3]),
            "tokens_per_s": sum(len(r) for r in rollouts) * cfg.ppo_epochs / float(gen_max[3]),
            "reference_s": float(gen_max[2]) if self.reference is not None else None,
            "rollout_tokens_per_s": float(lens.sum()) / max(1e-9, float(gen_max[0])),
            "update_tokens_per_s": sum(len(r) - 1 for r in rollouts) * cfg.ppo_epochs / max(1e-9, float(gen_max[1])),
        }

    def progress_line(self, step: int, row: dict) -> str:
        norm = f"  grad norm {row['grad_norm']:.3f}" if row["grad_norm"] is not None else ""
        if row.get("skipped_updates"):
            norm += f"  (not finite: {count(row['skipped_updates'], 'update')} skipped)"
        return (f"step {step:4d}  reward {row['reward_mean']:.3f}  len {row['response_len_mean']:.1f}  "
                f"lr {row['lr']:.2e}{norm}  step {row['wall_s']:.2f}s  "
                f"rollout {row['rollout_s']:.2f}s  update {row['update_s']:.2f}s "
                f"({row['update_tokens_per_s']:.0f} tokens/s)  equal-reward groups {row['zero_advantage_groups']}"
                + (" (skipped)" if self.cfg.skip_equal_reward_groups else " (trained)"))

    def export(self) -> None:
        cfg = self.cfg
        write_model(self.engine.iter_full_state(), cfg.output_dir, cfg.lora, cfg.merge_lora, config=self.policy.config,
                    tokenizer=self.tok, generation_config=getattr(self.rollout.model, "generation_config", None),
                    skip=self.tied, base=cfg.model_path, write=self.rank == 0)
        dist.barrier()

    def close(self) -> None:
        self._groups.close()
        self.engine.close()
        if self.reference is not None:
            self.reference.close()


def rl_worker(rank: int, world_size: int, cfg: RLConfig) -> dict:
    """Run ``cfg`` on this rank (inside an initialized process group), resuming from
    ``cfg.checkpoint_dir`` when it holds a checkpoint. Returns ``{"metrics": [...], "resumed_from": N}``,
    one dict per step run with the step's global figures."""
    trainer = RLTrainer(cfg, rank, world_size)
    rows = trainer.run()
    return {"metrics": rows, "resumed_from": trainer.resumed_from}
