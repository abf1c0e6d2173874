"""The training loop: a GPT or Llama on synthetic or JSONL data, data parallel with FSDP2 or ODC.

Composes the mechanisms: :class:`TrainData` makes each minibatch, :mod:`posttrain.balance`
plans it (every rank computes the same plan, so the global token count needs no collective),
and the data-parallel engine runs it:

- ``dp="fsdp"``: FSDP2 with gloo collectives. Every rank must run the same number of
  microbatches, so a rank with fewer runs zero-weight dummy microbatches (one token) to keep
  the collectives matched - the cost FSDP pays for imbalance.
- ``dp="odc"``: ODC; each rank runs exactly its own microbatches.
- ``dp="odc-collective"``: ODC's transport with a barrier at every gather and reduce; padded
  with dummies like FSDP.
- ``dp="odc-flat"`` / ``"odc-flat-collective"``: the same two, on :func:`posttrain.odc.flat_shard`
  (flat per-block buffers and module hooks, no FSDP2); fp32 only, no checkpoints.

Losses are summed token losses divided by the minibatch's global token count, so every variant
computes the same gradient (FSDP2 averages over ranks, so its loss is scaled by the world size).

Timing (see :mod:`posttrain.timeline`): a step starts after a barrier outside the minibatch and
ends when the slowest rank has finished its optimizer step. Per rank, *compute* is time inside
microbatches minus the communication calls inside them; *wait* is the rest of the step
(communication, waiting for peers, the ODC sync), the optimizer step aside. Per-step figures
are exchanged with one small all-gather after the step, outside the timed region.

Checkpoints (``checkpoint_dir``) use ``torch.distributed.checkpoint``: model and optimizer as
sharded state dicts, plus the step and data position in ``posttrain.json``. A ``latest`` file
is replaced atomically only after every rank has written, so an interrupted save never hides
the previous checkpoint; the two newest checkpoints are kept.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import posttrain.odc as odc_mod
from posttrain._launch import RanksFailedError, run_ranks
from posttrain.balance import METHODS, FlopsCost, pack_sequences, plan_minibatch
from posttrain.data import PROFILES, load_jsonl, profile_lengths, synthetic_sequences
from posttrain.models import MODELS, GPTConfig, build_model, token_loss_sum
from posttrain.timeline import COMM_KINDS, Recorder, time_fsdp_comms

__all__ = [
    "DP_MODES", "TrainConfig", "TrainData", "ideal_compute_worker", "run_training", "summarize",
    "train_worker", "write_metrics",
]

DP_MODES = ("fsdp", "odc", "odc-collective", "odc-flat", "odc-flat-collective")
PRECISIONS = ("fp32", "bf16")
SYNTHETIC_VOCAB = 64


@dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Attributes:
        dp: data-parallel engine: ``fsdp``, ``odc``, ``odc-collective`` (both on FSDP2), or
            ``odc-flat``, ``odc-flat-collective`` (ODC without FSDP2: :func:`posttrain.odc.flat_shard`).
        balance: balancing method (``round_robin``, ``local_sort``, ``same_micro``, ``diff_micro``).
        profile: embedded length profile (``long_tail``, ``bimodal``, ``uniform``); unused with ``data``.
        data: a JSONL file of ``input_ids`` lines to train on instead of synthetic sequences.
        model: ``gpt`` (built in) or ``llama`` (``transformers.LlamaForCausalLM``, random init).
        precision: ``fp32``, or ``bf16`` (FSDP2 ``MixedPrecisionPolicy``: bf16 params, fp32 reduce).
        steps: optimizer steps (total, including those before a resumed checkpoint).
        sequences: sequences per minibatch, over all ranks.
        max_len: longest synthetic sequence.
        max_tokens: most tokens in one microbatch (at least ``max_len``).
        dim: model hidden size.
        num_layers: transformer blocks.
        optimizer: ``adamw`` or ``sgd`` (plain SGD shows gradient-scale errors that Adam hides).
        lr: learning rate.
        seed: data and initialization seed.
        checkpoint_dir: save checkpoints here and resume from the newest one found there.
        checkpoint_every: save every this many steps (0: only after the last step).
        progress: on rank 0, a progress bar (on a terminal) and a line every tenth of the run.
    """

    dp: Literal["fsdp", "odc", "odc-collective", "odc-flat", "odc-flat-collective"] = "odc"
    balance: Literal["round_robin", "local_sort", "same_micro", "diff_micro"] = "diff_micro"
    profile: Literal["long_tail", "bimodal", "uniform"] = "long_tail"
    data: str | None = None
    model: Literal["gpt", "llama"] = "gpt"
    precision: Literal["fp32", "bf16"] = "fp32"
    steps: int = 10
    sequences: int = 16
    max_len: int = 512
    max_tokens: int = 512
    dim: int = 128
    num_layers: int = 4
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-3
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    progress: bool = False

    def __post_init__(self) -> None:
        for name, choices in (("dp", DP_MODES), ("balance", METHODS), ("profile", PROFILES),
                              ("model", MODELS), ("precision", PRECISIONS), ("optimizer", ("adamw", "sgd"))):
            if getattr(self, name) not in choices:
                raise ValueError(f"--{name}={getattr(self, name)!r} is not one of {', '.join(choices)}")
        for name in ("steps", "sequences", "dim", "num_layers"):
            if getattr(self, name) < 1:
                flag = "layers" if name == "num_layers" else name
                raise ValueError(f"--{flag}={getattr(self, name)} must be at least 1")
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every={self.checkpoint_every} must be non-negative")
        if self.dp.startswith("odc-flat"):
            if self.precision != "fp32":
                raise ValueError(f"--dp {self.dp} trains in fp32 only; use --dp odc for --precision {self.precision}")
            if self.checkpoint_dir:
                raise ValueError(f"--dp {self.dp} does not checkpoint yet; use --dp odc with --checkpoint-dir")
        if not self.lr > 0:
            raise ValueError(f"--lr={self.lr} must be positive")
        if self.data is None:
            if self.max_len < 8:
                raise ValueError(f"--max-len={self.max_len} must be at least 8")
            if self.max_tokens < self.max_len:
                raise ValueError(
                    f"--max-tokens={self.max_tokens} is smaller than the longest sequence "
                    f"(--max-len={self.max_len}); raise --max-tokens"
                )
        elif self.max_tokens < 1:
            raise ValueError(f"--max-tokens={self.max_tokens} must be at least 1")

    def model_config(self, vocab_size: int = SYNTHETIC_VOCAB) -> GPTConfig:
        """The model shape: heads of about 32 channels (the most heads up to ``dim // 32`` that
        divide ``dim``)."""
        heads = max(1, self.dim // 32)
        while self.dim % heads:
            heads -= 1
        return GPTConfig(vocab_size=vocab_size, dim=self.dim, num_layers=self.num_layers,
                         num_heads=heads, max_seq_len=self.max_tokens)


#: Fields that decide which data each step sees; a resumed run must agree on them.
_DATA_FIELDS = ("profile", "data", "sequences", "max_len", "seed")


class TrainData:
    """The sequences of every step, identical on every rank.

    Synthetic: step ``k`` draws ``sequences`` lengths from the profile with a seed derived from
    ``(seed, k)``. JSONL: a seeded permutation per epoch; step ``k`` takes positions
    ``k*sequences .. (k+1)*sequences - 1`` of the concatenated epochs. Either way the data
    position after step ``k`` is ``(k+1) * sequences``, which a checkpoint records.
    """

    def __init__(self, cfg: TrainConfig, world_size: int) -> None:
        self.cfg = cfg
        self.file_sequences = None
        if cfg.data is not None:
            seqs = load_jsonl(cfg.data, max_tokens=cfg.max_tokens)
            if len(seqs) < world_size:
                raise ValueError(f"{cfg.data} holds {len(seqs)} sequences, fewer than the {world_size} ranks")
            if cfg.sequences > len(seqs):
                raise ValueError(f"--sequences={cfg.sequences} exceeds the {len(seqs)} sequences in {cfg.data}")
            self.file_sequences = seqs
            self.vocab_size = max(int(s.max()) for s in seqs) + 1
        else:
            self.vocab_size = SYNTHETIC_VOCAB
        if cfg.sequences < world_size:
            raise ValueError(f"--sequences={cfg.sequences} is fewer than the {world_size} ranks; every rank needs data")

    def minibatch(self, step: int) -> list[torch.Tensor]:
        cfg = self.cfg
        if self.file_sequences is None:
            seed = cfg.seed * 100_003 + step
            lengths = profile_lengths(cfg.profile, cfg.sequences, max_len=cfg.max_len, seed=seed)
            return synthetic_sequences([n + 1 for n in lengths], vocab_size=SYNTHETIC_VOCAB, seed=seed)
        n, out = len(self.file_sequences), []
        for pos in range(step * cfg.sequences, (step + 1) * cfg.sequences):
            epoch, i = divmod(pos, n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch))
            out.append(self.file_sequences[int(perm[i])])
        return out


def _plan(cfg: TrainConfig, seqs: list[torch.Tensor], world_size: int, cost: FlopsCost):
    return plan_minibatch([len(s) - 1 for s in seqs], world_size=world_size, max_tokens=cfg.max_tokens,
                          method=cfg.balance, cost=cost)


def _microbatch_loss(model, seqs, ids, scale: float) -> torch.Tensor:
    packed = pack_sequences([seqs[i] for i in ids])
    logits = model(packed.inputs, document_lengths=packed.document_lengths)
    return token_loss_sum(logits, packed.targets) * scale


_DUMMY = torch.zeros(1, 1, dtype=torch.long)


def _build(cfg: TrainConfig, vocab_size: int):
    """The FSDP2-sharded model and its optimizer (``dp`` fsdp, odc, odc-collective)."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.model_config(vocab_size))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if cfg.precision == "bf16" else MixedPrecisionPolicy()
    for block in model.layers:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model, _optimizer(cfg, model.parameters())


def _build_flat(cfg: TrainConfig, vocab_size: int):
    """The model sharded by flat ODC (``dp`` odc-flat, odc-flat-collective), its handle and optimizer."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.model_config(vocab_size))
    handle = odc_mod.flat_shard(model, mode="collective" if cfg.dp == "odc-flat-collective" else "odc")
    return model, handle, _optimizer(cfg, handle.parameters())


def _optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:
    # The default on CPU is a per-parameter loop whose every op pays DTensor dispatch: AdamW's
    # step on the benchmark's model takes 4-8x as long that way as fused
    # (benchmarks/odc_overhead.py). DTensor has no sharding rule for fused SGD: SGD takes foreach.
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, fused=True)
    return torch.optim.SGD(params, lr=cfg.lr, foreach=True)


# ---------------------------------------------------------------------------- checkpoints
def _latest_checkpoint(root: str) -> tuple[str, dict] | None:
    pointer = os.path.join(root, "latest")
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        path = os.path.join(root, f.read().strip())
    try:
        with open(os.path.join(path, "posttrain.json")) as f:
            return path, json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint {path} named by {pointer} is unreadable: {e}") from None


def _save_checkpoint(cfg: TrainConfig, model, opt, step: int, rank: int) -> None:
    root = cfg.checkpoint_dir
    name = f"step-{step + 1:06d}"
    path = os.path.join(root, name)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    if rank == 0:
        meta = {"steps_done": step + 1, "data_position": (step + 1) * cfg.sequences,
                "config": {k: getattr(cfg, k) for k in _DATA_FIELDS}, "full_config": asdict(cfg)}
        with open(os.path.join(path, "posttrain.json"), "w") as f:
            json.dump(meta, f, indent=1)
        tmp = os.path.join(root, ".latest.tmp")
        with open(tmp, "w") as f:
            f.write(name)
        os.replace(tmp, os.path.join(root, "latest"))
        old = sorted(d for d in os.listdir(root) if d.startswith("step-") and d != name)
        for d in old[:-1]:  # keep this one and the previous
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    dist.barrier()


def _resume(cfg: TrainConfig, model, opt) -> int:
    """Load the newest checkpoint under ``cfg.checkpoint_dir``; the number of steps it holds."""
    found = _latest_checkpoint(cfg.checkpoint_dir)
    if found is None:
        return 0
    path, meta = found
    for k in _DATA_FIELDS:
        if meta["config"].get(k) != getattr(cfg, k):
            raise ValueError(
                f"checkpoint {path} was written with --{k.replace('_', '-')}={meta['config'].get(k)!r}, "
                f"this run has {getattr(cfg, k)!r}; resuming would replay different data"
            )
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    steps_done = int(meta["steps_done"])
    if meta["data_position"] != steps_done * cfg.sequences:
        raise ValueError(f"checkpoint {path}: data position {meta['data_position']} does not match "
                         f"{steps_done} steps of {cfg.sequences} sequences")
    return steps_done


# ---------------------------------------------------------------------------- the loop
_STAT_FIELDS = ("loss", "compute_s", "comm_s", "sync_s", "optimizer_s", "busy_s", "microbatches", "rank_tokens")


def train_worker(rank: int, world_size: int, cfg: TrainConfig) -> dict:
    """Run ``cfg`` on this rank (inside an initialized process group).

    Returns:
        ``{"metrics": [one dict per step], "events": the last step's Recorder events,
        "resumed_from": step}``.
        Every rank's metrics rows hold its own times and the step's global figures.
    """
    data = TrainData(cfg, world_size)
    rec = Recorder()
    odc = None
    if cfg.dp.startswith("odc-flat"):
        model, odc, opt = _build_flat(cfg, data.vocab_size)
    else:
        model, opt = _build(cfg, data.vocab_size)
        if cfg.dp == "fsdp":
            time_fsdp_comms([*model.layers, model], rec.add)
        else:
            odc = odc_mod.enable(model, mode="collective" if cfg.dp == "odc-collective" else "odc")
    if odc is not None:
        odc.on_comm = rec.add
    pad = cfg.dp not in ("odc", "odc-flat")  # engines with per-layer rendezvous need equal microbatch counts
    cost = FlopsCost.from_config(cfg.model_config(data.vocab_size))
    start = _resume(cfg, model, opt) if cfg.checkpoint_dir else 0
    bar = None
    if cfg.progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=f"{cfg.dp}+{cfg.balance}", unit="step", leave=False,
                   disable=None)  # no bar when stderr is not a terminal; step lines still print
        if start:
            bar.write(f"resumed from {cfg.checkpoint_dir} after step {start}")
    metrics = []
    try:
        for step in range(start, cfg.steps):
            seqs = data.minibatch(step)
            plan = _plan(cfg, seqs, world_size, cost)
            mine = [m for m in plan.microbatches_for(rank) if m.sequence_ids]
            rounds = max(len([m for m in mbs if m.sequence_ids]) for mbs in plan.ranks)
            total = sum(plan.rank_tokens)
            scale = (world_size if odc is None else 1.0) / total
            dist.barrier()  # step start, outside any minibatch
            t0 = time.perf_counter()
            rec.events.clear()  # keep one step's intervals: the timeline shows the last step
            loss_sum = torch.zeros((), dtype=torch.float64)
            ctx = odc.minibatch(num_tokens=sum(m.num_tokens for m in mine)) if odc else contextlib.nullcontext()
            with ctx:
                for j in range(rounds if pad else len(mine)):
                    with rec.span("microbatch"):
                        if j < len(mine):
                            loss = _microbatch_loss(model, seqs, mine[j].sequence_ids, scale)
                            loss_sum += loss.detach()
                        else:
                            loss = model(_DUMMY).sum() * 0.0  # keeps FSDP's collectives matched
                        loss.backward()
                t_sync = time.perf_counter()
            if odc is not None:
                rec.add("sync", t_sync, time.perf_counter())
            with rec.span("optimizer"):
                opt.step()
                opt.zero_grad()
            busy = time.perf_counter() - t0
            comm = sum(rec.total(k) for k in COMM_KINDS)
            mine_stats = torch.tensor(
                [loss_sum.item(), rec.total("microbatch") - comm, comm, rec.total("sync"),
                 rec.total("optimizer"), busy, len(mine), sum(m.num_tokens for m in mine)],
                dtype=torch.float64,
            )
            every = torch.empty(world_size * len(_STAT_FIELDS), dtype=torch.float64)
            dist.all_gather_single(every, mine_stats)
            every = every.view(world_size, len(_STAT_FIELDS))
            col = {name: every[:, i] for i, name in enumerate(_STAT_FIELDS)}
            step_time = float(col["busy_s"].max())
            loss = float(col["loss"].sum()) / (world_size if odc is None else 1.0)
            own = dict(zip(_STAT_FIELDS, mine_stats.tolist()))
            metrics.append({
                "step": step, "rank": rank, "loss": loss, "tokens": total,
                "tokens_per_s": total / step_time, "step_time_s": step_time,
                "compute_s": own["compute_s"], "comm_s": own["comm_s"], "sync_s": own["sync_s"],
                "optimizer_s": own["optimizer_s"],
                "wait_s": step_time - own["compute_s"] - own["optimizer_s"],
                "utilization": own["compute_s"] / step_time,
                "microbatches": len(mine), "rank_tokens": int(own["rank_tokens"]),
            })
            if cfg.checkpoint_dir and (step + 1 == cfg.steps or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0)):
                _save_checkpoint(cfg, model, opt, step, rank)
            if bar is not None and (step % max(1, cfg.steps // 10) == 0 or step + 1 == cfg.steps):
                util = float((col["compute_s"] / step_time).mean())
                bar.write(f"step {step:4d}  loss {loss:.4f}  {total:6d} tokens  {total / step_time:8.0f} tokens/s  "
                          f"util {util:.2f}  microbatches/rank {[int(x) for x in col['microbatches'].tolist()]}")
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{total / step_time:.0f}")
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        if odc is not None:
            odc.close()
    return {"metrics": metrics, "events": rec.events, "resumed_from": start}


def ideal_compute_worker(rank: int, world_size: int, cfg: TrainConfig) -> list[float]:
    """Per step, this rank's time to run forward+backward of *every* microbatch of the plan on
    an unsharded model with no communication at all. Run on ``world_size`` processes at once, so
    each measures under the same core and memory contention as training; the ideal bound is
    that time divided evenly over the ranks."""
    data = TrainData(cfg, world_size)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.model_config(data.vocab_size))
    if cfg.precision == "bf16":
        model = model.to(torch.bfloat16)
    cost = FlopsCost.from_config(cfg.model_config(data.vocab_size))
    out = []
    for step in range(cfg.steps):
        seqs = data.minibatch(step)
        plan = _plan(cfg, seqs, world_size, cost)
        dist.barrier()
        t0 = time.perf_counter()
        for mbs in plan.ranks:
            for m in mbs:
                if m.sequence_ids:
                    _microbatch_loss(model, seqs, m.sequence_ids, 1.0).backward()
        model.zero_grad()
        out.append(time.perf_counter() - t0)
    return out


def summarize(results: list[dict]) -> dict:
    """Aggregate ranks' metrics over the steps after the first (warm-up).

    Returns tokens/s, utilization (compute share of step time averaged over ranks), wait share,
    compute seconds per step summed over ranks, first and final loss, and mean step time.
    """
    steps = list(zip(*(r["metrics"] for r in results)))
    steady = steps[1:] or steps
    step_times = [s[0]["step_time_s"] for s in steady]
    util = [sum(r["utilization"] for r in s) / len(s) for s in steady]
    return {
        "tokens_per_s": sum(s[0]["tokens"] for s in steady) / sum(step_times),
        "utilization": sum(util) / len(util),
        "wait_share": sum(sum(r["wait_s"] for r in s) / (len(s) * s[0]["step_time_s"]) for s in steady) / len(steady),
        "compute_s": sum(sum(r["compute_s"] for r in s) for s in steady) / len(steady),
        "final_loss": steps[-1][0]["loss"],
        "first_loss": steps[0][0]["loss"],
        "step_time_s": sum(step_times) / len(step_times),
    }


def write_metrics(results: list[dict], path: str) -> None:
    """Every rank's per-step metrics to ``path``: CSV if it ends in ``.csv``, else JSON lines."""
    rows = [row for s in zip(*(r["metrics"] for r in results)) for row in s]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        if path.endswith(".csv"):
            if rows:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
        else:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                    and "MASTER_ADDR" in os.environ)


def _torchrun_results(cfg: TrainConfig) -> list[dict] | None:
    """Run this process's rank under torchrun; rank 0 gets every rank's results, others None."""
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group("gloo")
    try:
        mine = train_worker(dist.get_rank(), dist.get_world_size(), cfg)
        every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, every, dst=0)
        return every
    finally:
        dist.destroy_process_group()


def run_training(cfg: TrainConfig, *, world_size: int = 2, metrics_path: str | None = None,
                 quiet: bool = False) -> list[dict] | None:
    """Train ``cfg`` on ``world_size`` forked CPU processes, or on this process's rank when
    launched by ``torchrun`` (then ``world_size`` comes from torchrun and only rank 0 returns
    results and prints).

    Args:
        cfg: the run.
        world_size: CPU processes (ignored under torchrun).
        metrics_path: every rank's per-step metrics, as CSV (``.csv``) or JSON lines.
        quiet: print nothing.

    Returns:
        Every rank's :func:`train_worker` result (None on torchrun ranks other than 0).
    """
    if world_size < 1:
        raise ValueError(f"--world-size={world_size} must be at least 1")
    if _under_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
        lead = int(os.environ["RANK"]) == 0
    else:
        lead = True
    TrainData(cfg, world_size)  # validate data against the world size before starting ranks
    if cfg.checkpoint_dir:
        _latest_checkpoint(cfg.checkpoint_dir)  # an unreadable checkpoint fails here, clearly
    say = print if (lead and not quiet) else (lambda *a, **k: None)
    source = cfg.data or f"{cfg.profile} synthetic"
    say(f"posttrain: {cfg.dp}+{cfg.balance} on {world_size} CPU processes, {cfg.model} {cfg.num_layers}x{cfg.dim} "
        f"{cfg.precision}, {cfg.sequences} {source} sequences per step, {cfg.steps} steps", flush=True)
    if _under_torchrun():
        results = _torchrun_results(cfg)
        if results is None:
            return None
    else:
        try:
            results = run_ranks(train_worker, world_size, cfg, timeout_s=24 * 3600)
        except RanksFailedError as e:
            if e.value_error() is None:
                raise
            raise ValueError(e.value_error()) from None
    if not results[0]["metrics"]:
        say(f"nothing to do: the checkpoint in {cfg.checkpoint_dir} already holds {results[0]['resumed_from']} steps")
        return results
    s = summarize(results)
    say(f"loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}; {s['tokens_per_s']:.0f} tokens/s, "
        f"utilization {s['utilization']:.2f} after the first step")
    if metrics_path:
        write_metrics(results, metrics_path)
        say(f"wrote {metrics_path}")
    return results
