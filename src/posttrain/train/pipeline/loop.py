"""Short pipeline training runs on CPU processes: what ``posttrain pipeline`` and the tests run.

:func:`run_pipeline` forks one process per pipeline rank; each builds the same seeded model,
keeps its stages (:func:`~posttrain.pipeline.stages.split_model`), and trains ``steps`` steps of
``microbatches`` microbatches on the embedded synthetic counting task with a
:class:`~posttrain.pipeline.PipelineRunner`. :func:`reference_gradients` computes the same first
step's gradients in one process, for parity checks.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.nn.functional as F

from posttrain.data import synthetic_sequences
from posttrain.launch import run_job
from posttrain.models import build_model
from posttrain.pipeline import PipelineRunner, add_offload, add_send_recv, simulate
from posttrain.pipeline.stages import split_model
from posttrain.train.dp.checkpoint import resume, save_checkpoint

from .checkpoint import ColumnState, PipelineState
from .config import PipelineConfig
from .data import PipelineData, packed_loss

__all__ = [
    "build_pipeline_model", "check_model_and_data", "microbatch_loss", "predicted_peaks",
    "reference_gradients", "run_pipeline", "step_batch",
]


def step_batch(cfg: PipelineConfig, step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Inputs and targets of step ``step``, one ``(batch, seq_len)`` pair per microbatch."""
    seqs = synthetic_sequences([cfg.seq_len + 1] * (cfg.batch * cfg.num_microbatches), vocab_size=cfg.vocab_size,
                               seed=cfg.seed * 100_003 + step)
    data = torch.stack(seqs).view(cfg.num_microbatches, cfg.batch, cfg.seq_len + 1)
    return [d[:, :-1] for d in data], [d[:, 1:] for d in data]


def microbatch_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one microbatch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def build_pipeline_model(cfg: PipelineConfig):
    """The unsplit model of ``cfg``: ``model_path``'s with its weights, else the built-in one (seeded)."""
    if cfg.model_path:
        from posttrain.models import load_pretrained

        return load_pretrained(cfg.model_path)
    torch.manual_seed(cfg.seed)
    return build_model(cfg.model, cfg.model_config())


def _model_config(model):
    return getattr(model, "config", None) or getattr(model, "cfg", None)


def _tied_weight(model, stages: list) -> torch.nn.Parameter | None:
    """The parameter shared by the first stage (embedding) and the last (LM head), if any."""
    first = {id(p): p for p in stages[0].parameters()}
    shared = [p for p in stages[-1].parameters() if id(p) in first]
    return shared[0] if shared else None


def predicted_peaks(cfg: PipelineConfig, num_microbatches: int | None = None, *,
                    weight_keep: float | dict[int, float] = 1.0) -> list[float]:
    """Peak resident chunk-microbatches per rank that the schedule predicts, lowered as the runner
    runs it (offload, then sends and receives); ``num_microbatches``: instead of ``cfg``'s (a
    data-parallel replica's own count); ``weight_keep``: what a split backward keeps for ``W``
    (per stage: :func:`~posttrain.train.pipeline.report.measured_weight_keep` of a run; 1, the default, assumes everything)."""
    m = num_microbatches or cfg.num_microbatches
    sched = cfg.build(m)
    lowered = add_offload(sched.actions, sched.layout, m, cfg.policy())
    return simulate(add_send_recv(lowered, sched.layout), sched.layout, m, weight_keep=weight_keep).peaks()


def pipeline_worker(rank: int, world_size: int, cfg: PipelineConfig, return_grads: bool = False) -> dict:
    """One rank of :func:`run_pipeline`."""
    sched = cfg.build()
    model = build_pipeline_model(cfg)
    stages = split_model(model, cfg.num_stages)
    mine = {s: stages[s] for s in range(cfg.num_stages) if sched.layout.rank_of(s) == rank}
    data = PipelineData(cfg, _model_config(model)) if cfg.data else None
    runner = PipelineRunner(mine, sched, loss_fn=packed_loss if data else microbatch_loss, offload=cfg.policy(),
                            weight_split=not cfg.no_weight_split,
                            static_shapes=data is None)
    params = list({id(p): p for mod in mine.values() for p in mod.parameters()}.values())
    opt = cfg.optim.build(params)
    # Tied input and output embeddings on two ranks: two copies whose gradients are summed after
    # every step (Megatron's embedding group), so they stay equal.
    tied, tie_group = _tied_weight(model, stages), None
    ends = sorted({sched.layout.rank_of(0), sched.layout.rank_of(cfg.num_stages - 1)})
    if tied is not None and len(ends) == 2:
        tie_group = dist.new_group(ends)  # every rank takes part in creating it
    state = PipelineState(model, params)
    done = resume(cfg, state, opt) if cfg.checkpoint_dir else 0
    losses, times, grads, result = [], [], {}, None
    for step in range(done, cfg.steps):
        opt.zero_grad(set_to_none=True)
        if data is not None:
            batch = data.step(step)
            result = runner.step(batch.inputs, batch.targets, extras=batch.extras, loss_divisor=batch.loss_divisor)
        else:
            inputs, targets = step_batch(cfg, step)
            result = runner.step(inputs, targets)
        if tie_group is not None and rank in ends:
            dist.all_reduce(tied.grad, group=tie_group)
        if step == 0 and return_grads:
            ids = {id(p) for p in params}
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if id(p) in ids and p.grad is not None}
        opt.step()
        losses.append(result.loss)
        times.append(result.step_time_s)
        due = step + 1 == cfg.steps or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0)
        if cfg.checkpoint_dir and due:
            save_checkpoint(cfg, state, opt, step, rank)
    if cfg.output_dir:
        # the tied weight's copy on the last stage's rank is not written twice
        skip = tied if tied is not None and rank != sched.layout.rank_of(0) else None
        _export(cfg, model, [p for p in params if p is not skip], rank, world_size)
    return {"rank": rank, "losses": losses, "step_times": times, "result": None if result is None else asdict(result),
            "grads": grads, "stages": sorted(mine), "resumed_from": done}


def _export(cfg: PipelineConfig, model, params: list, rank: int, world_size: int, group=None,
            skip: dict | None = None) -> None:
    """Write the trained model as a ``transformers`` directory: each pipeline rank's parameters
    are sent to the first in turn (one rank's part held at a time there), which writes one file
    per part. ``group``: the pipeline's ranks (default: the world)."""
    from transformers import AutoTokenizer

    from posttrain.models import save_pretrained, tied_names

    ids = {id(p) for p in params}
    own = {n: p.detach() for n, p in model.named_parameters() if id(p) in ids}
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world_size))

    def parts():
        for r, src in enumerate(ranks):
            box = [own if r == rank else None]
            dist.broadcast_object_list(box, src=src, group=group)
            yield box[0]

    tok = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.model_path)
    hf = getattr(model, "hf", model)
    save_pretrained(parts(), cfg.output_dir, config=hf.config, tokenizer=tok,
                    generation_config=getattr(hf, "generation_config", None),
                    skip=tied_names(model) if skip is None else skip,
                    write=rank == 0)
    dist.barrier(group=group)


def dp_pipeline_worker(rank: int, world_size: int, cfg: PipelineConfig, return_params: bool = False) -> dict:
    """One rank of a pipeline x data-parallel run (see :mod:`posttrain.train.pipeline.dp`)."""
    from posttrain.models import tied_names
    from posttrain.train.dp.loop import loss_units

    from .dp import PipelineGrid, TiedEmbedding, replica_plans, runnable, shard_stages

    grid = PipelineGrid(cfg.num_ranks, cfg.dp_size)
    model = build_pipeline_model(cfg)
    config = _model_config(model)
    stages = split_model(model, cfg.num_stages)
    layout = cfg.build().layout
    mine = {s: stages[s] for s in range(cfg.num_stages) if layout.rank_of(s) == grid.pp_rank}
    skip = tied_names(model)  # tied aliases, written once on export
    tied = _tied_weight(model, stages) is not None  # before sharding takes the parameters off the stages
    names = {id(p): n for n, p in model.named_parameters()}  # likewise (a tied weight: its first name)
    engine = shard_stages(mine, grid.dp_mesh, cfg.engine)
    first, last = layout.rank_of(0), layout.rank_of(cfg.num_stages - 1)
    tie = TiedEmbedding(grid, engine, first, last) if tied else None
    opt = cfg.optim.build(engine.parameters())
    data = PipelineData(cfg, config)
    runners: dict[int, PipelineRunner] = {}  # one per microbatch count, sharing the split check
    checked: dict[int, bool] = {}
    fits = runnable(cfg)
    losses, times, walls, micro, tokens, result, done = [], [], [], [], [], None, 0
    try:
        state = ColumnState(engine, names) if cfg.checkpoint_dir else None
        done = resume(cfg, state, opt) if state is not None else 0
        for step in range(done, cfg.steps):
            samples = data.data.minibatch(step)
            tokens.append(sum(len(x) - 1 for x in samples))
            plans = replica_plans([len(x) - 1 for x in samples], replicas=cfg.dp_size, max_tokens=cfg.max_tokens,
                                  method=cfg.balance, model_config=config, runnable=fits)
            sets = engine.pad(plans[grid.dp_rank], max(map(len, plans)))  # None: a dummy microbatch
            m = len(sets)
            if m not in runners:
                runners[m] = PipelineRunner(mine, cfg.build(m), loss_fn=packed_loss, offload=cfg.policy(),
                                            weight_split=not cfg.no_weight_split, split_checked=checked,
                                            sharded=engine, group=grid.pp_group, static_shapes=False)
                runners[m].store.is_weight = engine.holds
            dist.barrier()  # every replica starts the step together (timing: the slowest replica paces the step)
            t0 = time.perf_counter()
            with engine.minibatch(loss_units(samples, [i for s_ in sets if s_ for i in s_], cfg.loss_norm)) as mb:
                if mb.global_tokens == 0:
                    raise ValueError(f"step {step}: no trained token in its {len(samples)} records (all masked)")
                batch = data.pack(samples, sets, mb.loss_divisor)
                result = runners[m].step(batch.inputs, batch.targets, extras=batch.extras, loss_divisor=mb.loss_divisor)
            if tie is not None:
                tie.sync()
            opt.step()
            opt.zero_grad(set_to_none=True)
            walls.append(time.perf_counter() - t0)
            part = torch.tensor([result.loss or 0.0], dtype=torch.float64)  # each replica's last stage: its share
            dist.all_reduce(part)
            losses.append(float(part) * mb.loss_divisor / mb.global_tokens)  # the step's mean loss, on every rank
            times.append(result.step_time_s)
            micro.append(m)
            due = step + 1 == cfg.steps or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0)
            if state is not None and due:
                save_checkpoint(cfg, state, opt, step, rank)
    except BaseException:
        engine.close()
        raise
    engine.close(restore=True)  # the full parameters back on this rank's stages (a collective over the column)
    params = list({id(p): p for mod in mine.values() for p in mod.parameters()}.values())
    if cfg.output_dir and grid.dp_rank == 0:
        names = {id(p): n for n, p in model.named_parameters()}
        mine_params = [p for p in params if names.get(id(p), "").removeprefix("hf.") not in skip]
        _export(cfg, model, mine_params, grid.pp_rank, cfg.num_ranks, group=grid.pp_group, skip=skip)
    dist.barrier()
    ids = {id(p) for p in params}
    full = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in ids} if return_params else {}
    return {"rank": rank, "pp_rank": grid.pp_rank, "dp_rank": grid.dp_rank, "losses": losses, "step_times": times,
            "microbatches": micro, "result": None if result is None else asdict(result), "params": full,
            "stages": sorted(mine), "resumed_from": done, "wall_times": walls, "step_tokens": tokens,
            "odc": dict(engine.stats, units=len(engine.units)) if engine.stats else None}


def run_pipeline(cfg: PipelineConfig, *, return_grads: bool = False, timeout_s: float = 300.0) -> list[dict]:
    """Run ``cfg`` on ``cfg.num_ranks`` forked CPU processes; one dict per rank (see :func:`pipeline_worker`).

    Resumes from ``cfg.checkpoint_dir`` when it holds a checkpoint; ``[]`` when that checkpoint
    already holds ``cfg.steps`` steps.

    Raises:
        ValueError: bad configuration, or a rank rejected its input.
    """
    cfg.build()  # schedule errors surface here, before any process starts
    if cfg.model_path:
        check_model_and_data(cfg)
    if cfg.checkpoint_dir:
        from posttrain.train.dp.checkpoint import check_resumable
        from posttrain.train.dp.launch import check_output_path

        check_output_path("--checkpoint-dir", cfg.checkpoint_dir, directory=True)
        meta = check_resumable(cfg)  # an unreadable or mismatched checkpoint fails here, in one line
        if meta is not None and meta["steps_done"] >= cfg.steps:
            return []  # nothing left to do
    if cfg.dp_size > 1:
        world = cfg.num_ranks * cfg.dp_size
        out = run_job(dp_pipeline_worker, world, cfg, return_grads, timeout_s=timeout_s)
        return [out[r] for r in range(world)]
    out = run_job(pipeline_worker, cfg.num_ranks, cfg, return_grads, timeout_s=timeout_s)
    return [out[r] for r in range(cfg.num_ranks)]


def check_model_and_data(cfg: PipelineConfig, *, log=None) -> None:
    """Refuse, in this process and before any rank starts, what would fail later: a model
    directory that does not load as a causal LM or has fewer decoder layers than stages, an
    output path that cannot be written, unreadable data, or a step whose records do not fit in
    the microbatches. Tokenizes the data into its cache once, so the ranks only read it."""
    from transformers import AutoConfig

    from posttrain.train.dp.launch import check_output_path

    check_output_path("--output-dir", cfg.output_dir, directory=True)
    try:
        config = AutoConfig.from_pretrained(cfg.model_path)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model-path {cfg.model_path}: not a transformers model directory ({e})") from None
    layers = getattr(config, "num_hidden_layers", None)
    if layers is not None and layers < cfg.num_stages:
        raise ValueError(f"--model-path {cfg.model_path} has {layers} decoder layers, fewer than the {cfg.num_stages} "
                         f"stages (--ranks {cfg.num_ranks} x --chunks {cfg.num_chunks}): every stage needs one")
    layout = cfg.build().layout
    if (cfg.dp_size > 1 and getattr(config, "tie_word_embeddings", False)
            and layout.rank_of(0) == layout.rank_of(cfg.num_stages - 1)):
        where, instead = ((f"--schedule {cfg.schedule}, which puts the first and the last stage on one rank,",
                           "use another schedule") if cfg.num_ranks > 1 else
                          ("one pipeline rank", "use posttrain train for data parallelism alone"))
        raise ValueError(f"--model-path {cfg.model_path} ties its input and output embeddings, which --dp-size with "
                         f"{where} does not support yet; {instead}")
    if cfg.data:
        data = PipelineData(cfg, config, log=log)
        fits = None
        for step in range(cfg.steps):
            if cfg.dp_size == 1:
                data.step(step)
                continue
            from posttrain.train.dp.loop import loss_units

            from .dp import replica_plans, runnable

            fits = fits or runnable(cfg)
            samples = data.data.minibatch(step)
            if loss_units(samples, range(len(samples)), cfg.loss_norm) == 0:
                raise ValueError(f"step {step}: no trained token in its {len(samples)} records (all masked)")
            try:
                replica_plans([len(x) - 1 for x in samples], replicas=cfg.dp_size, max_tokens=cfg.max_tokens,
                              method=cfg.balance, model_config=config, runnable=fits)
            except ValueError as e:
                raise ValueError(f"step {step}: {e}") from None


def reference_gradients(cfg: PipelineConfig) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean microbatch loss and gradients of the first step, in one process without a pipeline."""
    model = build_pipeline_model(cfg)
    inputs, targets = step_batch(cfg, 0)
    total = torch.zeros(())
    for x, y in zip(inputs, targets):
        loss = microbatch_loss(model(x), y) / cfg.num_microbatches
        loss.backward()
        total += loss.detach()
    return float(total), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
