"""Starting a supervised fine-tuning run (forked CPU processes, or one rank under torchrun), and
exporting a data-parallel checkpoint."""

from __future__ import annotations

import math
import os
from dataclasses import replace

from posttrain.dp import check_shard_hosts, resolve_replicas
from posttrain.errors import writing
from posttrain.launch import run_job
from posttrain.text import count
from posttrain.train.core import (
    OutputLock,
    check_output_path,
    check_run,
    claim_outputs,
    config_from_dict,
    latest_checkpoint,
    launch,
    launch_world,
    placement,
)
from posttrain.train.core.checkpoint import load, verify_checkpoint

from .config import TrainConfig
from .loop import build_training, check_lora, export_model, train_worker
from .metrics import summarize
from .minibatches import TrainData, model_vocab_size

__all__ = ["export_checkpoint", "run_training"]


def run_training(cfg: TrainConfig, *, world_size: int | None = 2, quiet: bool = False,
                 outputs: dict[str, str | None] | None = None) -> list[dict] | None:
    """Train ``cfg`` on ``world_size`` forked processes (on the CPU, or one GPU each: ``cfg.device``),
    or on this process's rank when launched by ``torchrun`` (then ``world_size`` comes from
    torchrun and only rank 0 returns results and prints).

    Args:
        cfg: the run.
        world_size: processes (``None``: one per GPU on CUDA, else 2; ignored under torchrun).
        quiet: print nothing.
        outputs: more output files to check before training, ``{"`parameter`": path}``.

    Returns:
        Every rank's :func:`~posttrain.train.train_worker` result (None on torchrun ranks other than 0).
    """
    kind = cfg.device_kind  # (a device the run cannot use: one line, before anything else)
    world_size, lead = launch_world(world_size, kind)
    replicas = resolve_replicas(cfg.engine.replicas, world_size)  # (a number that does not divide it: one line)
    cfg = replace(cfg, engine=replace(cfg.engine, replicas=replicas))
    check_shard_hosts(cfg.engine, world_size)  # ODC's shard groups inside a node: one line, before any work
    check_run(cfg, outputs, world_size)  # a device, outputs, a mismatched checkpoint: one line, before any work
    with claim_outputs(cfg, outputs, lead=lead):  # no second run on these outputs while this one lives
        return _run_training(cfg, world_size, print if (lead and not quiet) else (lambda *a, **k: None))


def _run_training(cfg: TrainConfig, world_size: int, say) -> list[dict] | None:
    kind = cfg.device_kind
    check_lora(cfg)  # LoRA targets the model lacks: one line, before tokenizing
    # Tokenize (once, cached) and validate the data against the world size before starting ranks.
    data = TrainData(cfg, world_size, log=say)
    if cfg.epochs:
        steps = math.ceil(cfg.epochs * data.num_sequences / cfg.sequences)
        say(f"epochs {cfg.epochs:g} of {data.num_sequences} sequences, {cfg.sequences} a step: {steps} steps")
        cfg = replace(cfg, steps=steps, epochs=0.0)  # (checks the run again: a warm-up as long as the run)
    if data.dropped:
        say(f"skip_long: left out {data.dropped} of {len(data.dataset)} sequences longer than {cfg.longest + 1} tokens")
    if data.truncated:
        say(f"truncate: cut {data.truncated} of {len(data.dataset)} sequences to {cfg.longest + 1} tokens")
    source = cfg.data or f"{cfg.profile} synthetic"
    model = cfg.model_path or f"{cfg.model} {cfg.num_layers}x{cfg.dim}"
    where = placement(kind, world_size)
    if cfg.engine.replicas > 1:
        where += f" (HSDP: {cfg.engine.replicas} replicas of {count(world_size // cfg.engine.replicas, 'shard')})"
    say(f"posttrain: {cfg.engine.label}+{cfg.balance} on {where}, {model} "
        f"{cfg.engine.precision}, {cfg.sequences} {source} sequences per step, {count(cfg.steps, 'step')}", flush=True)
    results = launch(train_worker, world_size, replace(cfg, device=kind), device=kind)
    if results is None:
        return None
    if not results[0]["metrics"]:
        say(f"nothing to do: the checkpoint in {cfg.checkpoint_dir} already holds {results[0]['resumed_from']} steps")
        return results
    s = summarize(results)
    say(f"loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}; {s['wall_tokens_per_s']:.0f} tokens/s "
        f"({s['tokens_per_s']:.0f} in the steps' own time), utilization {s['utilization']:.2f} after the first step")
    if cfg.metrics:
        say(f"wrote {cfg.metrics}")
    return results


def _find_checkpoint(path: str) -> tuple[str, dict]:
    import json

    if os.path.isfile(os.path.join(path, "posttrain.json")):
        with open(os.path.join(path, "posttrain.json")) as f:
            return path, json.load(f)
    found = latest_checkpoint(path) if os.path.isdir(path) else None
    if found is None:
        raise ValueError(f"{path}: not a posttrain checkpoint (no posttrain.json, no 'latest' pointer)")
    return found


def _export_worker(rank: int, world_size: int, cfg: TrainConfig, path: str, vocab_size: int) -> str | None:
    run = build_training(cfg, vocab_size)
    try:
        state = run.engine.state_dict(run.optimizer)
        load(state, path)
        run.engine.load_state_dict(state, run.optimizer)
        with writing(f"OUT_DIR {cfg.output_dir}", cfg.output_dir):
            return export_model(cfg, run.engine, run.model, rank, run.tied)
    finally:
        run.engine.close()


def export_checkpoint(checkpoint: str, out_dir: str, *, log=print) -> str:
    """Turn a training or RL checkpoint (a ``--checkpoint-dir``, or one ``step-N`` folder in it) into
    a ``transformers`` model directory at ``out_dir``, on one process (DCP reshards to it).

    The run must have trained a ``transformers`` model (``--model-path``, whose directory still
    gives the config and tokenizer, or ``--model llama``)."""
    from dataclasses import replace

    path, meta = _find_checkpoint(checkpoint)
    verify_checkpoint(path, meta)
    saved = meta.get("full_config")
    if not saved:
        raise ValueError(f"{path}: the checkpoint does not record its run's configuration; it cannot be exported")
    if meta.get("checkpoint_format") == "pipeline":
        return _export_pipeline_checkpoint(path, meta, out_dir, log=log)
    kw = dict(saved)
    if "prompts" in saved:  # an RL run's: the model, engine and optimizer are what export needs of it
        kw = {k: v for k, v in saved.items() if k in ("model_path", "engine", "optim", "seed", "steps", "lora_rank",
                                                      "lora_alpha", "lora_dropout", "lora_targets", "merge_lora")}
    cfg = config_from_dict(TrainConfig, kw)
    cfg = replace(cfg, engine=replace(cfg.engine, replicas=1), output_dir=out_dir, save_every=0, checkpoint_dir=None,
                  progress=False)
    if cfg.model_path and not os.path.isdir(cfg.model_path):
        raise ValueError(f"{path} was trained from `model_path` {cfg.model_path}, which is gone; export needs its "
                         "config and tokenizer")
    check_output_path("OUT_DIR", out_dir, directory=True)
    # The vocabulary: the model's with --model-path; else that of the run's data (synthetic, or
    # the data file's, which must still be there).
    vocab = model_vocab_size(cfg) or TrainData(cfg, 1).vocab_size
    log(f"exporting {path} ({meta['steps_done']} steps) to {out_dir}")
    with OutputLock("OUT_DIR", out_dir):
        run_job(_export_worker, 1, cfg, path, vocab, timeout_s=24 * 3600)
    return out_dir


def _export_pipeline_checkpoint(path: str, meta: dict, out_dir: str, *, log=print) -> str:
    """A ``posttrain pipeline`` checkpoint holds parameters under the model's own names: load them
    into the unsplit model on this process and write it."""
    saved = meta["full_config"]
    model_path = saved.get("model_path")
    if not model_path:
        raise ValueError(f"{path}: a pipeline run of the built-in model; export needs a `model_path` run")
    if not os.path.isdir(model_path):
        raise ValueError(f"{path} was trained from `model_path` {model_path}, which is gone; export needs its config "
                         "and tokenizer")
    check_output_path("OUT_DIR", out_dir, directory=True)
    log(f"exporting {path} ({meta['steps_done']} steps) to {out_dir}")
    with OutputLock("OUT_DIR", out_dir):
        _write_pipeline_export(path, saved, model_path, out_dir)
    return out_dir


def _write_pipeline_export(path: str, saved: dict, model_path: str, out_dir: str) -> None:
    from transformers import AutoTokenizer

    from posttrain.models import load_pretrained, tied_names
    from posttrain.models.lora import LoraSpec, add_lora, write_model

    model = load_pretrained(model_path)
    spec = None
    if saved.get("lora_rank"):  # the run's adapters: their names are what the checkpoint holds
        spec = LoraSpec(saved["lora_rank"], saved.get("lora_alpha", 0.0), saved.get("lora_dropout", 0.0),
                        tuple(saved.get("lora_targets") or ()))
        add_lora(model, spec, seed=saved.get("seed", 0))
    # (with adapters: only they are read; the frozen base is model_path's, which a pipeline x DP
    # checkpoint of a flat ODC column does not hold)
    state = {"model": {n: p.detach() for n, p in model.named_parameters() if spec is None or p.requires_grad}}
    load(state, path, no_dist=True)
    tok = AutoTokenizer.from_pretrained(saved.get("tokenizer") or model_path)
    with writing(f"OUT_DIR {out_dir}", out_dir):
        write_model([state["model"]], out_dir, spec, bool(saved.get("merge_lora")), config=model.config,
                    tokenizer=tok, generation_config=getattr(model.hf, "generation_config", None),
                    skip=tied_names(model), base=model_path)
