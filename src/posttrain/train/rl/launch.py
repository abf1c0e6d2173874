"""Starting an RL run: forked processes on the CPU or one GPU each, or torchrun's ranks."""

from __future__ import annotations

import os
import time
from dataclasses import replace

from transformers import AutoTokenizer

from posttrain.dp import check_shard_hosts
from posttrain.models import check_model_dir
from posttrain.models.lora import check_model_targets
from posttrain.rl import load_rewards
from posttrain.text import count
from posttrain.train.core import check_run, claim_outputs, launch, launch_world, placement
from posttrain.train.core.context import check_shard_count

from .config import RLConfig
from .loop import load_prompts, prompt_limit, rl_worker

__all__ = ["run_rl"]


def run_rl(cfg: RLConfig, *, world_size: int | None = 2, quiet: bool = False) -> list[dict] | None:
    """Check ``cfg`` (model, prompts, reward, output paths) in this process, then run it on
    ``world_size`` forked processes (on the CPU, or one GPU each: ``cfg.device``; ``None``: one per
    GPU on CUDA, else 2) or on this process's rank under ``torchrun``; every rank's result
    (``{"metrics": [...]}``; ``[]`` when the checkpoint already holds every step; ``None`` on
    torchrun ranks other than 0)."""
    kind = cfg.device_kind  # (a device the run cannot use: one line, before anything else)
    world_size, lead = launch_world(world_size, kind)
    if cfg.model_path is None or cfg.prompts is None:
        raise ValueError("posttrain rl needs `model_path` (a transformers model directory) and `prompts` (a JSONL file)")
    check_model_dir(cfg.model_path)
    check_shard_hosts(cfg.engine, world_size)  # ODC's shard groups inside a node (torchrun over several)
    meta = check_run(cfg, {"`record`": cfg.record}, world_size)  # devices, outputs, a mismatched checkpoint: one line
    with claim_outputs(cfg, {"`record`": cfg.record}, lead=lead):  # no second run on these outputs meanwhile
        return _run_rl(cfg, world_size, lead, print if (lead and not quiet) else (lambda *a, **k: None), meta)


def _run_rl(cfg: RLConfig, world_size: int, lead: bool, say, meta: dict | None) -> list[dict] | None:
    if cfg.lora is not None:  # LoRA targets the model lacks: one line, before any work
        check_model_targets(cfg.lora, cfg.model_path)
    try:
        tok = AutoTokenizer.from_pretrained(cfg.model_path)
    except (OSError, ValueError) as e:
        raise ValueError(f"`model_path` {cfg.model_path}: no tokenizer transformers can load ({e})") from None
    check_shard_count(cfg, world_size, "rollout")
    prompts = load_prompts(cfg.prompts, tok, **prompt_limit(cfg, world_size))
    load_rewards(cfg.reward)
    if cfg.prompts_per_step < world_size:
        raise ValueError(f"prompts_per_step={cfg.prompts_per_step} is fewer than the {world_size} ranks")
    kind = cfg.device_kind
    where = placement(kind, world_size)
    say(f"posttrain rl: {cfg.advantage} with {cfg.engine.label}+{cfg.balance} updates on {where}, "
        f"{cfg.prompts_per_step} of {len(prompts)} prompts x {cfg.samples_per_prompt} samples per step, {cfg.steps} steps",
        flush=True)
    if meta is not None:
        if meta["steps_done"] >= cfg.steps:
            say(f"nothing to do: the checkpoint in {cfg.checkpoint_dir} already holds {meta['steps_done']} steps")
            return []
        say(f"resuming from {cfg.checkpoint_dir} after step {meta['steps_done']}")
    elif cfg.record and lead and os.path.exists(cfg.record):
        os.remove(cfg.record)  # a fresh record per run (a resumed run appends)
    began = time.perf_counter()
    results = launch(rl_worker, world_size, replace(cfg, device=kind), device=kind)
    if results is None:  # a torchrun rank other than 0
        return None
    m = results[0]["metrics"]
    k = max(1, len(m) // 4)  # a quarter of the run at each end (one step's mean reward is noisy)
    first, last = (sum(r["reward_mean"] for r in part) / len(part) for part in (m[:k], m[-k:]))
    walls = sorted(r["wall_s"] for r in m)
    say(f"reward {first:.3f} -> {last:.3f} (mean of the first and last {count(k, 'step')}) in "
        f"{time.perf_counter() - began:.0f} s; a step {walls[len(walls) // 2]:.3f} s by stopwatch (median), "
        f"{sum(r['tokens_per_s'] * r['wall_s'] for r in m) / sum(walls):.0f} tokens/s; rollout "
        f"{sum(r['rollout_tokens_per_s'] for r in m) / len(m):.0f} tokens/s, update "
        f"{sum(r['update_tokens_per_s'] for r in m) / len(m):.0f} tokens/s")
    if cfg.output_dir:
        say(f"wrote {cfg.output_dir}")
    return results
