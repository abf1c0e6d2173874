"""The training loop: one rank of a data-parallel run on any engine.

Composes the mechanisms: :class:`~posttrain.train.TrainData` makes each minibatch,
:mod:`posttrain.balance` plans it (every rank computes the same plan), and the data-parallel engine
(:mod:`posttrain.dp`) runs it. An engine whose ranks must run equal microbatch counts
(``equal_microbatches``: FSDP2, ODC's collective mode) gets zero-weight one-token dummy
microbatches on the ranks with fewer - the cost such engines pay for imbalance.

Each microbatch's summed loss is divided by the engine's loss divisor for the minibatch (see
[Note: data-parallel engines]), so every engine computes the same gradient: that of the mean
loss of the whole minibatch, for any placement of sequences on ranks and microbatches. What is
counted (``loss_agg``): ``token-mean``, the trained tokens (each token's loss counts once);
``seq-mean-token-mean``, the sequences with a trained token (each token's loss weighted by one over its
sequence's trained tokens). Balancing costs count every token, trained or not.

Timing (see :mod:`posttrain.spans`): a step starts after a barrier outside the minibatch and
ends when the slowest rank has finished its optimizer step. Per rank, *compute* is time inside
microbatches minus the communication calls inside them; *wait* is the rest of the step
(communication, waiting for peers, the minibatch sync), the optimizer step aside.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from posttrain.balance import (
    ContextPlan,
    FlopsCost,
    Plan,
    Shard,
    pack_sequences,
    pack_share,
    plan_context,
    plan_minibatch,
    shard_lengths,
    shard_positions,
)
from posttrain.device import (
    allow_cudnn_attention,
    allow_tf32,
    max_memory_allocated,
    rank_device,
    rank_kind,
    reset_peak_memory,
    synchronize,
    use,
)
from posttrain.dp import DataParallelEngine, build_engine
from posttrain.models import build_model, load_pretrained, tied_names, token_loss_sum
from posttrain.models.lora import add_lora, check_model_targets, write_model
from posttrain.models.split_attention import SplitShard
from posttrain.odc import barrier_totals
from posttrain.spans import COMM_KINDS, Recorder
from posttrain.train.core import Trainer
from posttrain.train.core.context import MIN_SPLIT_GAIN, SplitGroups, exchange_cost, group_failure
from posttrain.train.core.launch import local_world
from posttrain.train.core.recipe import optimizer_step

from .config import TrainConfig
from .metrics import gather_step_stats
from .minibatches import Sample, TrainData, load_tokenizer

__all__ = [
    "SFTTrainer",
    "Training",
    "build_training",
    "evaluate",
    "exchange_cost",
    "export_model",
    "group_failure",
    "loss_units",
    "microbatch_loss",
    "plan_context_step",
    "plan_step",
    "shard_loss",
    "shard_units",
    "step_cost",
    "train_worker",
]



@dataclass
class Training:
    """What one rank trains: the model (call it), its engine and the optimizer."""

    model: nn.Module
    engine: DataParallelEngine
    optimizer: torch.optim.Optimizer
    #: parameter names that alias another (tied embeddings), found before sharding
    tied: dict[str, str]


def build_training(cfg: TrainConfig, vocab_size: int, device: torch.device | None = None) -> Training:
    """The model of ``cfg`` (``model_path``'s weights, or seeded) on ``device`` (default: the
    CPU), sharded by ``cfg.engine``, and its optimizer (a collective)."""
    torch.manual_seed(cfg.seed)
    model = load_pretrained(cfg.model_path) if cfg.model_path else build_model(cfg.model, cfg.model_config(vocab_size))
    if cfg.lora is not None:  # peft's adapters; the base frozen (seeded: every rank the same)
        add_lora(model, cfg.lora, seed=cfg.seed)
    tied = tied_names(model)  # (before moving: ties are found by identity)
    if device is not None and device.type != "cpu":
        model.to(device)
    engine = build_engine(model, cfg.engine)
    trainable = [p for p in engine.parameters() if p.requires_grad]  # (no optimizer state for a frozen base)
    return Training(model, engine, cfg.optim.build(trainable), tied)


def check_lora(cfg: TrainConfig) -> None:
    """Refuse, before tokenizing, LoRA targets the model lacks (one line naming those it has):
    the model is built on the meta device, no weight is read."""
    if cfg.lora is not None:
        check_model_targets(cfg.lora, cfg.model_path, lambda: build_model(cfg.model, cfg.model_config()))


def step_cost(cfg: TrainConfig, vocab_size: int) -> FlopsCost:
    """The balancer's cost of a sequence: training FLOPs of the model ``cfg`` trains."""
    if cfg.model_path:
        from transformers import AutoConfig

        return FlopsCost.from_config(AutoConfig.from_pretrained(cfg.model_path))
    return FlopsCost.from_config(cfg.model_config(vocab_size))


def plan_step(cfg: TrainConfig, seqs: Sequence[Sample | torch.Tensor], world_size: int, cost: FlopsCost,
              method: str | None = None) -> Plan:
    """The balancing plan of one minibatch (lengths are the sequences' input tokens, trained or not)."""
    return plan_minibatch([len(s) - 1 for s in seqs], world_size=world_size, max_tokens=cfg.max_tokens,
                          method=method or cfg.balance, cost=cost)


def plan_context_step(cfg: TrainConfig, seqs: Sequence[Sample | torch.Tensor], world_size: int,
                      cost: FlopsCost) -> ContextPlan:
    """The plan of one minibatch with the costliest sequences split across ranks where that gains
    (``cfg.engine.context_parallel``; :func:`posttrain.balance.plan_context`)."""
    return plan_context([len(s) - 1 for s in seqs], world_size=world_size, max_tokens=cfg.max_tokens, cost=cost,
                        exchange=exchange_cost(cfg, cost, local_world(world_size) == world_size),
                        context_parallel=cfg.engine.context_parallel,
                        min_gain=MIN_SPLIT_GAIN)


def _sample(s: Sample | torch.Tensor) -> Sample:
    return s if isinstance(s, Sample) else Sample(s.reshape(-1))


def loss_units(seqs: Sequence[Sample | torch.Tensor], ids: Sequence[int], loss_agg: str = "token-mean") -> int:
    """What the loss of ``seqs[ids]`` is averaged over: trained tokens (``token-mean``), or
    sequences with a trained token (``seq-mean-token-mean``)."""
    samples = [_sample(seqs[i]) for i in ids]
    if loss_agg == "seq-mean-token-mean":
        return sum(1 for s in samples if s.trained)
    return sum(s.trained for s in samples)


def microbatch_loss(model: nn.Module, seqs: Sequence[Sample | torch.Tensor], ids: Sequence[int], scale: float,
                    loss_agg: str = "token-mean", device: torch.device | None = None) -> torch.Tensor:
    """The packed microbatch of ``seqs[ids]`` (moved to ``device``, default: left on the CPU):
    its summed loss times ``scale``, where a trained token's loss counts once (``token-mean``)
    or one over its sequence's trained tokens (``seq-mean-token-mean``)."""
    samples = [_sample(seqs[i]) for i in ids]
    packed = pack_sequences([s.input_ids for s in samples], [s.labels for s in samples])
    inputs, targets = packed.inputs, packed.targets
    weights = None
    if loss_agg == "seq-mean-token-mean":
        weights = torch.cat([torch.full((len(s) - 1,), 1.0 / max(1, s.trained)) for s in samples]).unsqueeze(0)
    if device is not None and device.type != "cpu":
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        weights = None if weights is None else weights.to(device, non_blocking=True)
    logits = model(inputs, document_lengths=packed.document_lengths)
    return token_loss_sum(logits, targets, weights) * scale


def shard_units(sample: Sample | torch.Tensor, shard: Shard, loss_agg: str = "token-mean") -> int:
    """What a shard adds to its rank's loss units: its trained targets (``token-mean``), or, on the
    first shard of a sequence with a trained token, the sequence (``seq-mean-token-mean``)."""
    s = _sample(sample)
    if loss_agg == "seq-mean-token-mean":
        return int(shard.index == 0 and s.trained > 0)
    packed = pack_sequences([s.input_ids], [s.labels], shard=(shard.index, shard.num_shards))
    return packed.num_trained


def shard_loss(model: nn.Module, sample: Sample | torch.Tensor, shard: Shard, group, loss_agg: str = "token-mean",
               device: torch.device | None = None) -> torch.Tensor:
    """This rank's shard of a split sequence as a microbatch (a collective over ``group``, the
    shard's ranks): its summed loss, weighted as :func:`microbatch_loss` weighs a whole sequence."""
    s = _sample(sample)
    packed = pack_sequences([s.input_ids], [s.labels], shard=(shard.index, shard.num_shards))
    inputs, targets, positions = packed.inputs, packed.targets, packed.shard_positions
    weights = None
    if loss_agg == "seq-mean-token-mean":
        weights = torch.full(targets.shape, 1.0 / max(1, s.trained))
    if device is not None and device.type != "cpu":
        inputs, targets, positions = (t.to(device, non_blocking=True) for t in (inputs, targets, positions))
        weights = None if weights is None else weights.to(device, non_blocking=True)
    n, k = len(s) - 1, shard.num_shards  # (every rank knows the whole split: nothing to exchange per layer)
    key_positions = torch.cat([shard_positions(n, i, k) for i in range(k)]).to(positions.device)
    logits = model(inputs, document_lengths=packed.document_lengths,
                   split=SplitShard(positions, group, shard_lengths(n, k), key_positions))
    return token_loss_sum(logits, targets, weights)


def export_model(cfg: TrainConfig, engine: DataParallelEngine, model: nn.Module, rank: int,
                 tied: dict[str, str]) -> str | None:
    """Write ``cfg.output_dir`` from the engine's shards (a collective; rank 0 writes); ``tied``:
    :func:`~posttrain.models.tied_names` of the model before it was sharded."""
    from transformers import GenerationConfig

    tokenizer, _ = load_tokenizer(cfg)
    hf = model.hf
    gen = None
    if cfg.model_path:
        try:
            gen = GenerationConfig.from_pretrained(cfg.model_path)
        except OSError:
            gen = getattr(hf, "generation_config", None)
    out = write_model(engine.iter_full_state(), cfg.output_dir, cfg.lora, cfg.merge_lora, config=hf.config,
                      tokenizer=tokenizer, generation_config=gen, skip=tied, base=cfg.model_path, write=rank == 0)
    dist.barrier()
    return out


def evaluate(cfg: TrainConfig, engine: DataParallelEngine, samples: list[Sample], rank: int,
             world_size: int) -> float | None:
    """The loss on ``samples`` (averaged as ``cfg.loss_agg`` says; a collective). Each rank takes
    every ``world_size``-th sequence by length and packs them under ``max_tokens``, outside any
    minibatch: every rank runs as many forwards as the busiest (outside a minibatch a sharded
    forward is a collective on every engine)."""
    if not samples:
        return None
    lengths = [len(s) - 1 for s in samples]
    order = sorted(range(len(samples)), key=lambda i: -lengths[i])
    packs = [pack_share(lengths, order[r::world_size], cfg.max_tokens) for r in range(world_size)]
    total = torch.zeros(2, dtype=torch.float64)  # loss sum, units
    with torch.no_grad():
        for j in range(max(len(p) for p in packs)):
            if j < len(packs[rank]):
                ids = packs[rank][j]
                total[0] += microbatch_loss(engine.model, samples, ids, 1.0, cfg.loss_agg, engine.device).double().cpu()
                total[1] += loss_units(samples, ids, cfg.loss_agg)
            else:
                engine.run_dummy(backward=False)
    dist.all_reduce(total)
    return float(total[0] / total[1]) if total[1] > 0 else None


def _measured_peak(device: torch.device, precision: str) -> float:
    """Every rank's matrix-product rate in the compute dtype, averaged (a collective)."""
    from posttrain.device import matmul_tflops

    rate = torch.tensor([matmul_tflops(device, torch.bfloat16 if precision == "bf16" else torch.float32)],
                        dtype=torch.float64, device=device)
    dist.all_reduce(rate)
    return float(rate) / dist.get_world_size()


class SFTTrainer(Trainer):
    """One rank of a supervised fine-tuning run on a data-parallel engine (see the module docstring)."""

    scalars = ("loss", "eval_loss", "tokens_per_s", "step_time_s", "utilization", "lr", "grad_norm", "mfu")

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int) -> None:
        # the launcher's resolution (auto in a rank started elsewhere: its process group's device)
        kind = rank_kind(cfg.device)
        if kind != "cpu":
            _ = cfg.device_kind  # (a trainer or engine that does not run there: one line)
        self.device = rank_device(kind, rank)
        use(self.device)
        allow_tf32(self.device, cfg.tf32)
        allow_cudnn_attention(self.device, cfg.cudnn_attention)
        self.data = TrainData(cfg, world_size)
        self.rec = Recorder(rank, self.device)  # (on a GPU: spans timed by events on the stream)
        self.training = build_training(cfg, self.data.vocab_size, self.device)
        self.engine = self.training.engine
        self.engine.set_comm_hook(self.rec)
        self.eval_samples = self.data.eval_samples()
        self.cost = step_cost(cfg, self.data.vocab_size)
        #: the peak rate mfu divides by (TFLOP/s a device): given, or the ranks' mean of a short matmul
        self.peak_tflops = cfg.peak_tflops or _measured_peak(self.device, cfg.engine.precision)
        self._stats: dict[str, torch.Tensor] = {}
        self._ended: float | None = None  # when the previous step ended (its wall time starts there)
        self._groups = SplitGroups(rank, self.device, self.engine.peer_failure)  # split sequences' exchanges
        super().__init__(cfg, rank, world_size, state=self.engine, optimizer=self.training.optimizer,
                         label=f"{cfg.engine.label}+{cfg.balance}")

    def train_step(self, step: int) -> dict:
        cfg, rank, world_size, engine, rec = self.cfg, self.rank, self.world_size, self.engine, self.rec
        began = time.perf_counter()
        seqs = self.data.minibatch(step)
        if cfg.engine.context_parallel == "off":
            plan, shards = plan_step(cfg, seqs, world_size, self.cost), ()
        else:
            plan = plan_context_step(cfg, seqs, world_size, self.cost)
            shards = plan.shards_for(rank)
            self._groups.make(plan.groups)
        mine = [m for m in plan.microbatches_for(rank) if m.sequence_ids]
        busiest = max(len([m for m in mbs if m.sequence_ids]) for mbs in plan.ranks)
        total = sum(plan.rank_tokens)
        units = loss_units(seqs, range(len(seqs)), cfg.loss_agg)
        dist.barrier()  # step start, outside any minibatch
        reset_peak_memory(self.device)
        bar0 = barrier_totals()
        use0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        rec.clear()  # keep one step's spans: the timeline shows the last step
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        own_units = (sum(loss_units(seqs, m.sequence_ids, cfg.loss_agg) for m in mine)
                     + sum(shard_units(seqs[sh.sequence_id], sh, cfg.loss_agg) for sh in shards))
        with engine.minibatch(own_units) as mb:
            if mb.global_tokens != units:
                raise AssertionError(f"the engine counts {mb.global_tokens} loss units in step {step}, the data {units}")
            divisor = mb.loss_divisor if units else 1.0  # nothing trained: a zero gradient
            for sh in shards:  # first, in the order every rank runs them: a group's shards run together
                with rec.span("microbatch"):
                    try:
                        token_loss = shard_loss(engine.model, seqs[sh.sequence_id], sh, self._groups[sh.group],
                                                cfg.loss_agg, self.device)
                        loss_sum += token_loss.detach()
                        (token_loss / divisor).backward()
                    except RuntimeError as exc:
                        raise group_failure(engine, sh, exc) from exc
            for micro in engine.pad(mine, busiest):
                with rec.span("microbatch"):
                    if micro is None:
                        engine.run_dummy()
                        continue
                    token_loss = microbatch_loss(engine.model, seqs, micro.sequence_ids, 1.0, cfg.loss_agg,
                                                 self.device)
                    loss_sum += token_loss.detach()
                    (token_loss / divisor).backward()
            t_sync = time.perf_counter()
        rec.add("sync", t_sync, time.perf_counter())
        with rec.span("optimizer"):
            recipe = optimizer_step(self.optimizer, cfg.optim, step, cfg.steps, [engine.shards()], self.device,
                                    loss=loss_sum)
            synchronize(self.device)  # once a step: the step's time includes its queued kernels
        rec.resolve()  # (device-timed spans: their kernels have run)
        busy = time.perf_counter() - t0
        bar = {k: v - bar0[k] for k, v in barrier_totals().items()}
        use = resource.getrusage(resource.RUSAGE_SELF)
        peak = max_memory_allocated(self.device)  # this rank's, over the step (None on the CPU)
        peak_gib = None if peak is None else peak / 2**30
        comm = sum(rec.total(k) for k in COMM_KINDS)
        own = {"loss": loss_sum.item(), "compute_s": rec.total("microbatch") - comm, "comm_s": comm,
               "gather_s": rec.total("gather"), "reduce_s": rec.total("reduce"),
               "sync_s": rec.total("sync"), "optimizer_s": rec.total("optimizer"), "busy_s": busy,
               "microbatches": len(mine) + len(shards),
               "rank_tokens": sum(m.num_tokens for m in mine) + sum(sh.num_tokens for sh in shards),
               "peak_memory_gib": float("nan") if peak_gib is None else peak_gib,
               "barriers": bar["barriers"], "barrier_wait_s": bar["wait_s"], "barrier_late_s": bar["late_s"],
               "sys_s": use.ru_stime - use0.ru_stime, "page_faults": use.ru_minflt - use0.ru_minflt}
        col = self._stats = gather_step_stats(own, world_size)
        step_time = float(col["busy_s"].max())
        # What a stopwatch sees: the time since the previous step ended (its metrics, checkpoint
        # and export included), or, in a run's first step, since this one began.
        ended = time.perf_counter()
        wall = ended - (self._ended if self._ended is not None else began)
        self._ended = ended
        row = {
            "step": step, "rank": rank, "loss": float(col["loss"].sum()) / max(1, units), "tokens": total,
            "tokens_per_s": total / wall, "wall_s": wall, "step_time_s": step_time,
            "compute_s": own["compute_s"], "comm_s": own["comm_s"], "sync_s": own["sync_s"],
            "optimizer_s": own["optimizer_s"], "wait_s": step_time - own["compute_s"] - own["optimizer_s"],
            "utilization": own["compute_s"] / step_time,
            "microbatches": len(mine) + len(shards), "rank_tokens": int(own["rank_tokens"]), "eval_loss": None,
            "split_sequences": len(plan.split) if isinstance(plan, ContextPlan) else 0,
            "lr": recipe["lr"], "grad_norm": recipe["grad_norm"], "skipped_update": recipe["skipped_update"],
            "epoch": (step + 1) * cfg.sequences / self.data.num_sequences if self.data.num_sequences else None,
            "mfu": sum(self.cost(len(s) - 1) for s in seqs) / wall / (self.peak_tflops * 1e12 * world_size),
            "peak_memory_gib": peak_gib,
            "barriers": int(own["barriers"]), "barrier_wait_s": own["barrier_wait_s"],
            "barrier_late_s": own["barrier_late_s"],
        }
        if self.eval_samples and cfg.due(step, cfg.eval_every):
            row["eval_loss"] = evaluate(cfg, engine, self.eval_samples, rank, world_size)
        return row

    #: Row fields each rank measures for itself (the rest are the step's, equal on every rank).
    OWN_FIELDS = ("compute_s", "comm_s", "gather_s", "reduce_s", "sync_s", "optimizer_s", "microbatches", "rank_tokens",
                  "peak_memory_gib", "barriers", "barrier_wait_s", "barrier_late_s", "sys_s", "page_faults")

    def every_rank_rows(self, row: dict) -> list[dict]:
        """Every rank's row from the step's gathered stats (what each rank measured), without a
        gather of the rows; the step's wall time and rates are rank 0's."""
        col, out = self._stats, []
        for r in range(self.world_size):
            own = {k: (int(col[k][r]) if k in ("microbatches", "rank_tokens", "barriers", "page_faults")
                       else float(col[k][r]))
                   for k in self.OWN_FIELDS}
            if own["peak_memory_gib"] != own["peak_memory_gib"]:  # NaN: the CPU keeps no peak
                own["peak_memory_gib"] = None
            out.append({**row, "rank": r, **own, "wait_s": row["step_time_s"] - own["compute_s"] - own["optimizer_s"],
                        "utilization": own["compute_s"] / row["step_time_s"]})
        return out

    def progress_line(self, step: int, row: dict) -> str | None:
        if not (step % max(1, self.cfg.steps // 10) == 0 or step + 1 == self.cfg.steps or row["eval_loss"] is not None
                or row["skipped_update"]):
            return None
        col, ev = self._stats, row["eval_loss"]
        util = float((col["compute_s"] / row["step_time_s"]).mean())
        return (f"step {step:4d}  loss {row['loss']:.4f}  {row['tokens']:6d} tokens  {row['tokens_per_s']:8.0f} tokens/s  "
                f"lr {row['lr']:.2e}  grad norm {row['grad_norm']:.3f}  "
                f"util {util:.2f}  mfu {row['mfu']:.1%}  microbatches/rank {[int(x) for x in col['microbatches'].tolist()]}"
                + (f"  eval loss {ev:.4f}" if ev is not None else "")
                + ("  (not finite: update skipped)" if row["skipped_update"] else ""))

    def export(self) -> None:
        export_model(self.cfg, self.engine, self.training.model, self.rank, self.training.tied)

    def close(self) -> None:
        self._groups.close()
        self.engine.close()


def train_worker(rank: int, world_size: int, cfg: TrainConfig) -> dict:
    """Run ``cfg`` on this rank (inside an initialized process group).

    Returns:
        ``{"metrics": [one dict per step], "spans": the last step's spans (:class:`~posttrain.spans.Span`),
        "resumed_from": step, "engine_stats": the engine's communication counters,
        "optimizer_state_numel": elements of this rank's optimizer state tensors}``. Every rank's
        metrics rows hold its own times and the step's global figures.
    """
    trainer = SFTTrainer(cfg, rank, world_size)
    rows = trainer.run()
    return {"metrics": rows, "spans": list(trainer.rec.spans), "resumed_from": trainer.resumed_from,
            "engine_stats": dict(trainer.engine.stats), "optimizer_state_numel": optimizer_state_numel(trainer.optimizer)}


def optimizer_state_numel(optimizer: torch.optim.Optimizer) -> int:
    """Elements of the per-parameter state tensors this rank's optimizer holds (AdamW's two
    moments; scalars such as the step count left out; a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() >= 1:
                total += (v.to_local() if isinstance(v, DTensor) else v).numel()
    return total
