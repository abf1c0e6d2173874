"""The step's recipe (learning-rate schedule, global gradient clipping, decoupled weight decay,
AdamW's betas and epsilon), the same on every engine: [Note: the step's recipe].

A failure pinpoints a schedule that is not a function of the step, a gradient norm that counts a
shard twice or misses one (replicas, unequal microbatch counts), clipping or decay applied to the
wrong elements (flat shards hold several parameters), or a flag that is not checked up front.
"""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import pairwise

import pytest
import torch

from posttrain.dp import EngineConfig, build_engine, decay_flags
from posttrain.launch import run_ranks
from posttrain.models import GPT, GPTConfig, token_loss_sum
from posttrain.train.core import OptimConfig
from posttrain.train.core.recipe import optimizer_step

CFG = GPTConfig(vocab_size=32, dim=16, num_layers=2, num_heads=2, max_seq_len=32)
ADAMW = OptimConfig(lr=0.05, lr_schedule="cosine", warmup_steps=1, min_lr_ratio=0.1, max_grad_norm=0.3,
                    weight_decay=0.2, adam_betas=(0.8, 0.95), adam_eps=1e-6)
# plain SGD moves by the clipped gradient itself: it checks the clipping that Adam's normalization hides
SGD = OptimConfig("sgd", lr=0.5, lr_schedule="linear", warmup_ratio=0.25, max_grad_norm=0.3)
STEPS = 4


def test_schedules_warm_up_then_decay_as_a_function_of_the_step():
    const = OptimConfig(lr=1.0)
    assert [const.lr_at(s, 5) for s in range(5)] == [1.0] * 5
    warm = OptimConfig(lr=1.0, warmup_steps=2)
    assert [warm.lr_at(s, 5) for s in range(3)] == [0.5, 1.0, 1.0]
    lin = OptimConfig(lr=2.0, lr_schedule="linear", warmup_steps=1, min_lr_ratio=0.25)
    assert [lin.lr_at(s, 5) for s in range(5)] == pytest.approx([2.0, 2.0, 1.5, 1.0, 0.5])
    cos = OptimConfig(lr=1.0, lr_schedule="cosine", warmup_ratio=0.2)  # 2 of 10 steps
    got = [cos.lr_at(s, 10) for s in range(10)]
    assert got[:3] == pytest.approx([0.5, 1.0, 1.0]) and got[-1] == pytest.approx(0.0, abs=1e-12)
    assert got[5] == pytest.approx(0.5 * (1 + math.cos(math.pi * 3 / 7)))
    assert all(a >= b for a, b in pairwise(got[2:]))


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"lr_schedule": "step"}, "lr_schedule='step' is not one of constant, linear, cosine"),
    ({"warmup_steps": 2, "warmup_ratio": 0.1}, "give warmup_steps or warmup_ratio, not both"),
    ({"warmup_ratio": 1.0}, "warmup_ratio=1.0 must be in [0, 1)"),
    ({"min_lr_ratio": 2.0}, "min_lr_ratio=2.0 must be in [0, 1]"),
    ({"max_grad_norm": -1.0}, "max_grad_norm=-1.0 must be non-negative"),
    ({"name": "sgd", "weight_decay": 0.1}, "the sgd optimizer takes none"),
    ({"adam_betas": (0.9, 1.0)}, "adam_betas=0.9,1.0 must be two numbers in [0, 1)"),
    ({"adam_eps": 0.0}, "adam_eps=0.0 must be positive"),
])
def test_bad_recipe_values_are_refused_in_one_line(kwargs, needle):
    with pytest.raises(ValueError) as e:
        OptimConfig(**kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_warmup_as_long_as_the_run_is_refused_before_training(cli):
    rc, _, err = cli("train", "--steps", "5", "--warmup-steps", "5")
    assert rc == 2 and "the warm-up (5 steps) is as long as the run (5 steps)" in err
    assert len(err.strip().splitlines()) == 1
    rc, _, err = cli("train", "--lr-schedule", "step")
    assert rc == 2 and "argument --lr-schedule: invalid choice: 'step' (choose from 'constant', 'linear', 'cosine')" in err


def test_weight_decay_skips_one_dimensional_parameters():
    model = GPT(CFG)
    flags = dict(zip([n for n, _ in model.named_parameters()], decay_flags(list(model.parameters()))))
    assert flags and all(flags[n] == (1.0 if p.dim() >= 2 else 0.0) for n, p in model.named_parameters())
    assert any(f == 0.0 for f in flags.values()) and any(f == 1.0 for f in flags.values())


def test_the_run_s_adamw_settings_win_over_a_resumed_checkpoint_s_and_a_nan_norm_shows():
    """A checkpoint's optimizer groups come back with its own betas, eps and weight decay (torch's
    0.01 in checkpoints of older versions): the step sets this run's. A non-finite gradient gives
    a NaN norm, not 0, and stops the run before the update (or skips the update, if asked); so
    does a rank's non-finite loss."""
    from dataclasses import replace

    from posttrain.dp import Shards
    from posttrain.errors import RunError

    w = torch.nn.Parameter(torch.ones(2, 2))
    opt = torch.optim.AdamW([w], lr=1.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    w.grad = torch.ones(2, 2)
    got = optimizer_step(opt, ADAMW, 1, STEPS, [Shards([w], [1.0])], torch.device("cpu"))
    g = opt.param_groups[0]
    assert (g["betas"], g["eps"], g["weight_decay"]) == (ADAMW.adam_betas, ADAMW.adam_eps, 0.0)
    assert got["grad_norm"] == pytest.approx(2.0) and got["lr"] == ADAMW.lr_at(1, STEPS)
    before = w.detach().clone()
    w.grad = torch.full((2, 2), float("nan"))
    with pytest.raises(RunError, match=r"^step 2: the gradient norm is nan; stopped before updating the weights"):
        optimizer_step(opt, ADAMW, 2, STEPS, [Shards([w], [1.0])], torch.device("cpu"))
    assert torch.equal(w.detach(), before)
    skip = replace(ADAMW, on_nonfinite="skip")
    got = optimizer_step(opt, skip, 2, STEPS, [Shards([w], [1.0])], torch.device("cpu"))
    assert math.isnan(got["grad_norm"]) and got["skipped_update"] and w.grad is None and torch.equal(w.detach(), before)
    w.grad = torch.ones(2, 2)  # a finite gradient, an infinite loss
    with pytest.raises(RunError, match=r"^step 3: the loss is not finite on 1 rank; stopped"):
        optimizer_step(opt, ADAMW, 3, STEPS, [Shards([w], [1.0])], torch.device("cpu"), loss=float("inf"))
    assert optimizer_step(opt, skip, 3, STEPS, [Shards([w], [1.0])], torch.device("cpu"), loss=float("inf"))["skipped_update"]
    w.grad = torch.ones(2, 2)  # the loss as the trainers pass it: a tensor
    assert optimizer_step(opt, skip, 3, STEPS, [Shards([w], [1.0])], torch.device("cpu"),
                          loss=torch.tensor(float("nan"), dtype=torch.float64))["skipped_update"]
    assert torch.equal(w.detach(), before)


def _seqs(step: int, rank: int, count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randint(0, CFG.vocab_size, (1, 7 + 4 * i), generator=g) for i in range(count)]


def _recipe_worker(rank: int, world_size: int, name: str, replicas: int, counts: list[int], recipe: OptimConfig) -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = build_engine(model, EngineConfig(name, replicas=replicas))
    opt = recipe.build(engine.parameters())
    norms, lrs = [], []
    for step in range(STEPS):
        mine = _seqs(step, rank, counts[rank])
        with engine.minibatch(sum(s.shape[1] - 1 for s in mine)) as mb:
            for seq in engine.pad(mine, max(counts)):
                if seq is None:
                    engine.run_dummy()
                    continue
                (token_loss_sum(model(seq[:, :-1]), seq[:, 1:]) / mb.loss_divisor).backward()
        got = optimizer_step(opt, recipe, step, STEPS, [engine.shards()], engine.device)
        norms.append(got["grad_norm"])
        lrs.append(got["lr"])
    full = engine.full_state_dict()
    engine.close()
    return {"full": full, "norms": norms, "lrs": lrs}


def _reference(counts: list[int], recipe: OptimConfig) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process: torch's AdamW with a decay and a no-decay group (or SGD), torch's
    clip_grad_norm_, the schedule's learning rate set on the groups."""
    torch.manual_seed(0)
    model = GPT(CFG)
    params = list(model.parameters())
    if recipe.name == "adamw":
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": recipe.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=recipe.lr, betas=recipe.adam_betas, eps=recipe.adam_eps)
    else:
        opt = torch.optim.SGD(params, lr=recipe.lr)
    norms = []
    for step in range(STEPS):
        seqs = [s for r, c in enumerate(counts) for s in _seqs(step, r, c)]
        total = sum(s.shape[1] - 1 for s in seqs)
        for s in seqs:
            (token_loss_sum(model(s[:, :-1]), s[:, 1:]) / total).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, recipe.max_grad_norm)))
        for g in opt.param_groups:
            g["lr"] = recipe.lr_at(step, STEPS)
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}, norms


@pytest.mark.full
@pytest.mark.parametrize("recipe", [ADAMW, SGD], ids=["adamw", "sgd"])
@pytest.mark.parametrize(("name", "replicas", "counts"), [
    ("fsdp", 1, [1, 3]), ("odc", 1, [1, 3]), ("odc-fsdp2", 1, [3, 0]), ("odc", 2, [2, 1, 0, 1]), ("fsdp", 2, [1, 2, 2, 1]),
    ("odc-fsdp2", 1, [3]), ("odc", 1, [3])],
    ids=["fsdp", "odc", "odc-fsdp2", "odc-hsdp-2x2", "fsdp-hsdp-2x2", "odc-fsdp2-one-rank", "odc-one-rank"])
def test_every_engine_takes_the_single_process_recipe_step(name, replicas, counts, recipe):
    """Unequal microbatch counts (a rank with none included): the global norm before clipping,
    the clipped update, the decay of matrices only and the schedule equal one process's torch
    optimizer (AdamW with two parameter groups) and clip_grad_norm_. (Adam turns the ~1e-9
    summation-order noise of the attention key bias, whose gradient is about zero, into updates
    of ~1e-5: the tolerance allows that; a decay step is lr x weight_decay x |w| ~ 1e-3.)"""
    want, norms = _reference(counts, recipe)
    assert max(norms) > recipe.max_grad_norm  # clipping acts
    tol = {"rtol": 1e-4, "atol": 5e-5} if recipe.name == "adamw" else {"rtol": 1e-5, "atol": 1e-6}
    for got in run_ranks(_recipe_worker, len(counts), name, replicas, counts, recipe):
        assert got["norms"] == pytest.approx(norms, rel=1e-5)
        assert got["lrs"] == [recipe.lr_at(s, STEPS) for s in range(STEPS)]
        for k, v in want.items():
            torch.testing.assert_close(got["full"][k], v, **tol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.full
@pytest.mark.parametrize("dp", ["fsdp", "odc"])
def test_a_resumed_run_follows_the_uninterrupted_schedule_and_steps(dp, tmp_path):
    """The SFT trainer with warm-up, cosine decay, clipping and weight decay, checkpoints after
    steps 3 and 6 of 6; with the last checkpoint removed (a run killed after step 5), a fresh job
    resumes after step 3: steps 3-5 take the same learning rates, gradient norms and losses."""
    from posttrain.dp import EngineConfig
    from posttrain.train.sft import TrainConfig, train_worker

    ckpt = tmp_path / "ckpt"
    cfg = TrainConfig(steps=6, sequences=6, max_len=48, max_tokens=64, dim=32, num_layers=2, engine=EngineConfig(dp),
                      balance="diff_micro", checkpoint_dir=str(ckpt), checkpoint_every=3,
                      optim=OptimConfig(lr=3e-3, lr_schedule="cosine", warmup_steps=2, max_grad_norm=0.5,
                                        weight_decay=0.1))
    rows = run_ranks(train_worker, 2, cfg)[0]["metrics"]
    assert [r["lr"] for r in rows] == [cfg.optim.lr_at(s, 6) for s in range(6)]
    assert any(r["grad_norm"] > 0.5 for r in rows)  # clipping acted
    import shutil

    shutil.rmtree(ckpt / "step-000006")
    (ckpt / "latest").write_text("step-000003")
    resumed = run_ranks(train_worker, 2, cfg)[0]
    assert resumed["resumed_from"] == 3
    for key in ("step", "lr", "grad_norm", "loss"):
        assert [r[key] for r in resumed["metrics"]] == [r[key] for r in rows[3:]], key


@pytest.mark.full
def test_mfu_is_the_step_s_model_flops_over_the_peak_given_or_measured():
    """``mfu`` = the step's model FLOPs (the balancer's FlopsCost of each sequence) / wall time /
    (peak x ranks); without ``peak_tflops`` the peak is a matrix product measured at the start."""
    from posttrain.device import matmul_tflops
    from posttrain.train.sft import TrainConfig, TrainData, train_worker
    from posttrain.train.sft.loop import step_cost

    cfg = TrainConfig(steps=2, sequences=4, max_len=48, max_tokens=64, dim=32, num_layers=2, peak_tflops=0.5)
    rows = run_ranks(train_worker, 2, cfg)[0]["metrics"]
    data = TrainData(cfg, 2)
    cost = step_cost(cfg, data.vocab_size)
    for r in rows:
        flops = sum(cost(len(s) - 1) for s in data.minibatch(r["step"]))
        assert r["mfu"] == pytest.approx(flops / r["wall_s"] / (0.5e12 * 2), rel=1e-9)  # over the stopwatch time
    measured = run_ranks(train_worker, 2, replace(cfg, peak_tflops=0.0))[0]["metrics"]
    assert 0 < measured[0]["mfu"] < 1.5 and matmul_tflops(torch.device("cpu")) > 0


def test_epochs_and_steps_exclude_each_other_and_epochs_need_data(cli):
    rc, _, err = cli("train", "--epochs", "1", "--steps", "5")
    assert rc == 2 and err.strip() == "posttrain: error: give --epochs or --steps, not both"
    rc, _, err = cli("train", "--epochs", "1")
    assert rc == 2 and err.strip() == "posttrain: error: --epochs needs --data (synthetic sequences have no epochs)"


@pytest.mark.full
def test_epochs_set_the_steps_and_each_epoch_covers_every_record_once(tmp_path):
    """1.5 epochs of 10 records at 4 a step: 4 steps; the first 10 records trained are the 10
    records (a seeded shuffle); the metrics say the epoch."""
    import json

    from posttrain.train.sft import TrainConfig, TrainData, run_training

    path = tmp_path / "ids.jsonl"
    records = [[1 + i, 2 + i, 3 + i, 4 + i, 5 + (i % 3)] for i in range(10)]
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in records))
    cfg = TrainConfig(data=str(path), vocab_size=32, sequences=4, max_tokens=16, dim=32, num_layers=1, epochs=1.5)
    results = run_training(cfg, world_size=2, quiet=True)
    rows = results[0]["metrics"]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["epoch"] for r in rows] == pytest.approx([0.4, 0.8, 1.2, 1.6])
    data = TrainData(replace(cfg, steps=4, epochs=0.0), 2)
    seen = [tuple(s.input_ids.tolist()) for step in range(3) for s in data.minibatch(step)][:10]
    assert sorted(seen) == sorted(tuple(r) for r in records)
