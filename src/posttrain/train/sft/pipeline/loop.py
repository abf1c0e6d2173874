"""Short pipeline training runs on CPU processes or GPUs: what ``posttrain pipeline`` and the tests run.

:func:`run_pipeline` forks one process per pipeline rank; each builds the same seeded model,
keeps its stages (:func:`~posttrain.pipeline.stages.split_model`), and trains ``steps`` steps of
``microbatches`` microbatches on the embedded synthetic counting task with a
:class:`~posttrain.pipeline.PipelineRunner`. :func:`reference_gradients` computes the same first
step's gradients in one process, for parity checks.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from posttrain.data import synthetic_sequences
from posttrain.device import allow_cudnn_attention, allow_tf32, rank_device, rank_kind, use
from posttrain.dp import Shards, decay_flags
from posttrain.launch import run_job
from posttrain.models import build_model, check_model_dir
from posttrain.pipeline import PipelineRunner, add_offload, add_send_recv, simulate
from posttrain.pipeline.stages import split_model
from posttrain.train.core import Trainer, check_run, claim_outputs, job_options
from posttrain.train.core.recipe import optimizer_step, with_copies

from .checkpoint import ColumnState, PipelineState
from .config import PipelineConfig
from .data import PipelineData, packed_loss
from .dp import RankStages

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
    torch.manual_seed(cfg.seed)
    if cfg.model_path:
        from posttrain.models import load_pretrained

        model = load_pretrained(cfg.model_path)
    else:
        model = build_model(cfg.model, cfg.model_config())
    if cfg.lora is not None:  # peft's adapters, the base frozen (seeded: every rank the same)
        from posttrain.models.lora import add_lora

        add_lora(model, cfg.lora, seed=cfg.seed)
    return model


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
    data-parallel pipeline's own count); ``weight_keep``: what a split backward keeps for ``W``
    (per stage: :func:`~posttrain.train.sft.pipeline.report.measured_weight_keep` of a run; 1, the
    default, assumes everything)."""
    m = num_microbatches or cfg.num_microbatches
    sched = cfg.build(m)
    lowered = add_offload(sched.actions, sched.layout, m, cfg.policy())
    return simulate(add_send_recv(lowered, sched.layout), sched.layout, m, weight_keep=weight_keep,
                    offload_fraction=cfg.offload_fraction).peaks()


class PipelineTrainer(Trainer):
    """One rank of a pipeline run without data parallelism (``dp_size`` 1): its stages, their
    optimizer and one :class:`~posttrain.pipeline.PipelineRunner`."""

    scalars = ("loss", "step_time_s", "lr", "grad_norm")

    def __init__(self, cfg: PipelineConfig, rank: int, world_size: int, *, return_grads: bool = False) -> None:
        self.device = place(cfg, rank)
        self.sched = sched = cfg.build()
        self.model = model = build_pipeline_model(cfg)
        stages = split_model(model, cfg.num_stages)
        self.mine = {s: stages[s].to(self.device) for s in range(cfg.num_stages) if sched.layout.rank_of(s) == rank}
        self.data = PipelineData(cfg, _model_config(model)) if cfg.data else None
        self.runner = PipelineRunner(self.mine, sched, loss_fn=packed_loss if self.data else microbatch_loss,
                                     offload=cfg.policy(), weight_split=not cfg.no_weight_split,
                                     static_shapes=self.data is None, device=self.device)
        self.params = list({id(p): p for mod in self.mine.values() for p in mod.parameters()}.values())
        # Tied input and output embeddings on two ranks: two copies whose gradients are summed after
        # every step (Megatron's embedding group), so they stay equal.
        self.tied, self.tie_group = _tied_weight(model, stages), None
        self.ends = sorted({sched.layout.rank_of(0), sched.layout.rank_of(cfg.num_stages - 1)})
        if self.tied is not None and len(self.ends) == 2:
            self.tie_group = dist.new_group(self.ends)  # every rank takes part in creating it
        self.return_grads = return_grads
        self.grads: dict[str, torch.Tensor] = {}
        self.result = None
        super().__init__(cfg, rank, world_size, state=PipelineState(model, self.params),
                         optimizer=cfg.optim.build([p for p in self.params if p.requires_grad]),
                         label=f"pipeline {cfg.schedule}")

    def train_step(self, step: int) -> dict:
        cfg, opt = self.cfg, self.optimizer
        opt.zero_grad(set_to_none=True)
        if self.data is not None:
            batch = self.data.step(step)
            result = self.runner.step(batch.inputs, batch.targets, extras=batch.extras, loss_divisor=batch.loss_divisor)
        else:
            inputs, targets = step_batch(cfg, step)
            result = self.runner.step(inputs, targets)
        if self.tie_group is not None and self.rank in self.ends:
            dist.all_reduce(self.tied.grad, group=self.tie_group)
        if step == 0 and self.return_grads:
            ids = {id(p) for p in self.params}
            self.grads = {n: p.grad.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()
                          if id(p) in ids and p.grad is not None}
        shards = Shards(self.params, decay_flags(self.params))
        tied = [self.tied] if self.tie_group is not None and self.rank in self.ends else []
        recipe = optimizer_step(opt, cfg.optim, step, cfg.steps, with_copies(shards, tied, 2), self.params[0].device,
                                loss=result.loss)
        self.result = result
        return {"step": step, "rank": self.rank, "loss": _step_loss(result.loss), "stage_loss": result.loss,
                "step_time_s": result.step_time_s, **recipe, "epoch": _epoch(cfg, step, self.data)}

    def progress_line(self, step: int, row: dict) -> str | None:
        return _progress_line(self.cfg, step, row)

    def export(self) -> None:
        # the tied weight's copy on the last stage's rank is not written twice
        skip = self.tied if self.tied is not None and self.rank != self.sched.layout.rank_of(0) else None
        mine = {id(p) for p in self.params if p is not skip}
        own = {n: p.detach().cpu() for n, p in self.model.named_parameters() if id(p) in mine}
        _export(self.cfg, self.model, own, self.rank, self.world_size)


def _progress_line(cfg: PipelineConfig, step: int, row: dict) -> str | None:
    """Every tenth of the run and the last step: the step's loss and time (both pipeline trainers)."""
    if not (step % max(1, cfg.steps // 10) == 0 or step + 1 == cfg.steps):
        return None
    extra = f"  microbatches {row['microbatches']}" if "microbatches" in row else ""
    return (f"step {step:4d}  loss {row['loss']:.4f}  lr {row['lr']:.2e}  grad norm {row['grad_norm']:.3f}  "
            f"step {row['step_time_s']:.3f}s{extra}")


def _epoch(cfg: PipelineConfig, step: int, data: PipelineData | None) -> float | None:
    """Records seen after step ``step`` over the usable records (``None`` on synthetic data)."""
    n = data.data.num_sequences if data is not None else 0
    return (step + 1) * cfg.sequences / n if n else None


def _step_loss(part: float | None, scale: float = 1.0) -> float:
    """The step's loss on every rank: the sum of what each pipeline's last stage computed (a
    collective), times ``scale``."""
    t = torch.tensor([part or 0.0], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) * scale


def place(cfg: PipelineConfig, rank: int) -> torch.device:
    """This rank's device (the launcher's resolution of ``cfg.device``), made current, with the
    run's TF32 and attention-kernel settings."""
    device = rank_device(rank_kind(cfg.device), rank)
    use(device)
    allow_tf32(device, cfg.tf32)
    allow_cudnn_attention(device, cfg.cudnn_attention)
    return device


def pipeline_worker(rank: int, world_size: int, cfg: PipelineConfig, return_grads: bool = False) -> dict:
    """One rank of :func:`run_pipeline` (``dp_size`` 1)."""
    trainer = PipelineTrainer(cfg, rank, world_size, return_grads=return_grads)
    rows = trainer.run()
    result = trainer.result
    return {"rank": rank, "losses": [r["stage_loss"] for r in rows], "step_times": [r["step_time_s"] for r in rows],
            "grad_norms": [r["grad_norm"] for r in rows],
            "result": None if result is None else asdict(result), "grads": trainer.grads,
            "stages": sorted(trainer.mine), "resumed_from": trainer.resumed_from}


def _export(cfg: PipelineConfig, model, own: dict[str, torch.Tensor], rank: int, world_size: int, group=None,
            skip: dict | None = None) -> None:
    """Write the trained model as a ``transformers`` directory from every pipeline rank's ``own``
    full parameters (by name in ``model``): each is sent to the first rank in turn (one rank's part
    held at a time there), which writes one file per part. ``group``: the pipeline's ranks
    (default: the world)."""
    from transformers import AutoTokenizer

    from posttrain.models import tied_names
    from posttrain.models.lora import write_model

    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world_size))

    def parts():
        for r, src in enumerate(ranks):
            box = [own if r == rank else None]
            dist.broadcast_object_list(box, src=src, group=group)
            yield box[0]

    tok = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.model_path)
    hf = getattr(model, "hf", model)
    write_model(parts(), cfg.output_dir, cfg.lora, cfg.merge_lora, config=hf.config, tokenizer=tok,
                generation_config=getattr(hf, "generation_config", None),
                skip=tied_names(model) if skip is None else skip, base=cfg.model_path, write=rank == 0)
    dist.barrier(group=group)


class PipelineDPTrainer(Trainer):
    """One rank of a pipeline x data-parallel run (see :mod:`posttrain.train.sft.pipeline.dp`): its
    column's engine shards its stages; a runner per microbatch count."""

    scalars = ("loss", "step_time_s", "lr", "grad_norm")

    def __init__(self, cfg: PipelineConfig, rank: int, world_size: int, *, return_params: bool = False) -> None:
        from posttrain.models import tied_names

        from .dp import PipelineGrid, TiedEmbedding, runnable, shard_stages

        self.device = place(cfg, rank)
        self.grid = grid = PipelineGrid(cfg.num_ranks, cfg.dp_size, self.device.type)
        self.model = model = build_pipeline_model(cfg)
        self.model_config = _model_config(model)
        stages = split_model(model, cfg.num_stages)
        layout = cfg.build().layout
        self.mine = {s: stages[s].to(self.device) for s in range(cfg.num_stages) if layout.rank_of(s) == grid.pp_rank}
        self.skip = tied_names(model)  # tied aliases, written once on export
        tied_weight = _tied_weight(model, stages)  # before sharding takes the parameters off the stages
        tied = tied_weight is not None
        self.names = {id(p): n for n, p in model.named_parameters()}  # likewise (a tied weight: its first name)
        # the engine's full parameters are named in its container of the stages: their names in the model; a
        # tied weight is written by the rank of the first stage only (elsewhere it is the LM head's copy)
        self.model_names = {n: self.names[id(p)] for n, p in RankStages(self.mine).named_parameters()
                            if not (p is tied_weight and 0 not in self.mine)}
        self.engine = engine = shard_stages(self.mine, grid.dp_mesh, cfg.engine)
        try:
            first, last = layout.rank_of(0), layout.rank_of(cfg.num_stages - 1)
            self.tie = TiedEmbedding(grid, engine, first, last) if tied else None
            self.data = PipelineData(cfg, self.model_config)
        except BaseException:
            engine.close()
            raise
        self.runners: dict[int, PipelineRunner] = {}  # one per microbatch count, sharing the split check
        self.checked: dict[int, bool] = {}
        self.fits = runnable(cfg)
        self.return_params = return_params
        self.result = None
        self.params: dict[str, torch.Tensor] = {}
        super().__init__(cfg, rank, world_size, state=ColumnState(engine, self.names),
                         optimizer=cfg.optim.build([p for p in engine.parameters() if p.requires_grad]),
                         label=f"pipeline {cfg.schedule} x dp")

    def train_step(self, step: int) -> dict:
        from posttrain.train.sft.loop import loss_units

        from .dp import pipeline_plans

        cfg, engine, grid = self.cfg, self.engine, self.grid
        samples = self.data.data.minibatch(step)
        plans = pipeline_plans([len(x) - 1 for x in samples], pipelines=cfg.dp_size, max_tokens=cfg.max_tokens,
                              method=cfg.balance, model_config=self.model_config, runnable=self.fits)
        sets = engine.pad(plans[grid.dp_rank], max(map(len, plans)))  # None: a dummy microbatch
        m = len(sets)
        if m not in self.runners:
            self.runners[m] = PipelineRunner(self.mine, cfg.build(m), loss_fn=packed_loss, offload=cfg.policy(),
                                             weight_split=not cfg.no_weight_split, split_checked=self.checked,
                                             sharded=engine, group=grid.pp_group, static_shapes=False,
                                             device=self.device)
            self.runners[m].store.is_weight = engine.holds
        batch = self.data.pack(samples, sets, 0.0)  # (the divisor comes from the minibatch below)
        dist.barrier()  # every pipeline starts the step together (timing: the slowest pipeline paces the step)
        t0 = time.perf_counter()
        with engine.minibatch(loss_units(samples, [i for s_ in sets if s_ for i in s_], cfg.loss_agg)) as mb:
            if mb.global_tokens == 0:
                raise ValueError(f"step {step}: no trained token in its {len(samples)} records (all masked)")
            result = self.runners[m].step(batch.inputs, batch.targets, extras=batch.extras, loss_divisor=mb.loss_divisor)
        if self.tie is not None:
            self.tie.sync()
        shards = with_copies(engine.shards(), self.tie.shards if self.tie is not None else [], 2)
        recipe = optimizer_step(self.optimizer, cfg.optim, step, cfg.steps, shards, engine.device, loss=result.loss)
        wall = time.perf_counter() - t0
        self.result = result
        # each pipeline's last stage holds its share of the summed loss over the divisor
        loss = _step_loss(result.loss, mb.loss_divisor / mb.global_tokens)
        return {"step": step, "rank": self.rank, "loss": loss, "step_time_s": result.step_time_s, "wall_time_s": wall,
                "microbatches": m, "tokens": sum(len(x) - 1 for x in samples), **recipe,
                "epoch": _epoch(cfg, step, self.data)}

    def progress_line(self, step: int, row: dict) -> str | None:
        return _progress_line(self.cfg, step, row)

    def export(self) -> None:
        own = {}
        for part in self.engine.iter_full_state():  # a collective over the column (parts on the CPU)
            own.update({self.model_names[n]: v for n, v in part.items() if n in self.model_names})
        if self.grid.dp_rank == 0:  # one pipeline writes: the full parameters over its pipeline
            _export(self.cfg, self.model, own, self.grid.pp_rank, self.cfg.num_ranks, group=self.grid.pp_group,
                    skip=self.skip)
        dist.barrier()

    def finish(self) -> None:
        if self.return_params:
            self.engine.close(restore=True)  # the full parameters back on this rank's stages (a collective)
            params = {id(p) for mod in self.mine.values() for p in mod.parameters()}
            self.params = {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters() if id(p) in params}

    def close(self) -> None:
        self.engine.close()


def dp_pipeline_worker(rank: int, world_size: int, cfg: PipelineConfig, return_params: bool = False) -> dict:
    """One rank of a pipeline x data-parallel run (see :mod:`posttrain.train.sft.pipeline.dp`)."""
    trainer = PipelineDPTrainer(cfg, rank, world_size, return_params=return_params)
    rows = trainer.run()
    engine, result = trainer.engine, trainer.result
    return {"rank": rank, "pp_rank": trainer.grid.pp_rank, "dp_rank": trainer.grid.dp_rank,
            "losses": [r["loss"] for r in rows], "step_times": [r["step_time_s"] for r in rows],
            "grad_norms": [r["grad_norm"] for r in rows], "microbatches": [r["microbatches"] for r in rows],
            "result": None if result is None else asdict(result),
            "params": trainer.params, "stages": sorted(trainer.mine), "resumed_from": trainer.resumed_from,
            "wall_times": [r["wall_time_s"] for r in rows], "step_tokens": [r["tokens"] for r in rows],
            "engine": dict(engine.stats, units=len(engine.units)) if engine.stats else None}


def run_pipeline(cfg: PipelineConfig, *, return_grads: bool = False, timeout_s: float = 300.0) -> list[dict]:
    """Run ``cfg`` on ``cfg.num_ranks`` (x ``dp_size``) processes, on the CPU or GPUs (``cfg.device``);
    one dict per rank (see :func:`pipeline_worker`).

    Resumes from ``cfg.checkpoint_dir`` when it holds a checkpoint; ``[]`` when that checkpoint
    already holds ``cfg.steps`` steps.

    Raises:
        ValueError: bad configuration, or a rank rejected its input.
    """
    cfg.build()  # schedule errors surface here, before any process starts
    # devices, unwritable outputs, a mismatched checkpoint: one line, before any data is read
    meta = check_run(cfg, world_size=cfg.num_ranks * cfg.dp_size)
    with claim_outputs(cfg):  # no second run on these outputs while this one lives
        cfg = resolve_epochs(cfg)
        if cfg.model_path:
            check_model_and_data(cfg)
        if meta is not None and meta["steps_done"] >= cfg.steps:
            return []  # nothing left to do
        kind = cfg.device_kind
        world = cfg.num_ranks * cfg.dp_size
        how = job_options(kind, world)
        cfg = replace(cfg, device=kind)
        if cfg.dp_size > 1:
            out = run_job(dp_pipeline_worker, world, cfg, return_grads, timeout_s=timeout_s, **how)
            return [out[r] for r in range(world)]
        out = run_job(pipeline_worker, cfg.num_ranks, cfg, return_grads, timeout_s=timeout_s, **how)
        return [out[r] for r in range(cfg.num_ranks)]


def resolve_epochs(cfg: PipelineConfig, *, log=None) -> PipelineConfig:
    """``cfg`` with ``steps`` set from ``epochs`` (``ceil(epochs x usable records / sequences)``),
    tokenizing the data (once, cached) to count its usable records; ``cfg`` itself without
    ``epochs``. ``log``: where to say what it found."""
    if not cfg.epochs:
        return cfg
    from dataclasses import replace

    from transformers import AutoConfig

    check_model_dir(cfg.model_path)
    try:
        config = AutoConfig.from_pretrained(cfg.model_path)
    except (OSError, ValueError) as e:
        raise ValueError(f"`model_path` {cfg.model_path}: not a transformers model directory ({e})") from None
    n = PipelineData(cfg, config, log=log).data.num_sequences
    steps = math.ceil(cfg.epochs * n / cfg.sequences)
    if log is not None:
        log(f"epochs {cfg.epochs:g} of {n} records, {cfg.sequences} a step: {steps} steps")
    return replace(cfg, steps=steps, epochs=0.0)  # (checks the run again: a warm-up as long as the run)


def check_model_and_data(cfg: PipelineConfig, *, log=None) -> None:
    """Refuse, in this process and before any rank starts, what would fail later: a model
    directory that does not load as a causal LM or has fewer decoder layers than stages,
    unreadable data, or a step whose records do not fit in the microbatches (output paths:
    :func:`posttrain.train.core.check_run`). Tokenizes the data into its cache once, so the ranks only read it."""
    from transformers import AutoConfig

    check_model_dir(cfg.model_path)
    try:
        config = AutoConfig.from_pretrained(cfg.model_path)
    except (OSError, ValueError) as e:
        raise ValueError(f"`model_path` {cfg.model_path}: not a transformers model directory ({e})") from None
    layers = getattr(config, "num_hidden_layers", None)
    if layers is not None and layers < cfg.num_stages:
        raise ValueError(f"`model_path` {cfg.model_path} has {layers} decoder layers, fewer than the {cfg.num_stages} "
                         f"stages (`num_ranks` {cfg.num_ranks} x `chunks` {cfg.num_chunks}): every stage needs one")
    layout = cfg.build().layout
    if (cfg.dp_size > 1 and getattr(config, "tie_word_embeddings", False)
            and layout.rank_of(0) == layout.rank_of(cfg.num_stages - 1)):
        where, instead = ((f"`schedule` {cfg.schedule}, which puts the first and the last stage on one rank,",
                           "use another schedule") if cfg.num_ranks > 1 else
                          ("one pipeline rank", "use posttrain train for data parallelism alone"))
        raise ValueError(f"`model_path` {cfg.model_path} ties its input and output embeddings, which `dp_size` with "
                         f"{where} does not support yet; {instead}")
    if cfg.data:
        data = PipelineData(cfg, config, log=log)
        fits = None
        for step in range(cfg.steps):
            if cfg.dp_size == 1:
                data.step(step)
                continue
            from posttrain.train.sft.loop import loss_units

            from .dp import pipeline_plans, runnable

            fits = fits or runnable(cfg)
            samples = data.data.minibatch(step)
            if loss_units(samples, range(len(samples)), cfg.loss_agg) == 0:
                raise ValueError(f"step {step}: no trained token in its {len(samples)} records (all masked)")
            try:
                pipeline_plans([len(x) - 1 for x in samples], pipelines=cfg.dp_size, max_tokens=cfg.max_tokens,
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
