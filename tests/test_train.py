"""The training loop over every data-parallel engine. A failure pinpoints an engine or balancing
method that computes a different gradient (the loss curves diverge), wrong time accounting, a
checkpoint that does not resume the same trajectory, or bad config handling."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from posttrain.dp import EngineConfig
from posttrain.launch import run_ranks
from posttrain.train.core import OptimConfig
from posttrain.train.sft import TrainConfig, TrainData, run_training, summarize, train_worker

# SGD: a gradient off by a constant factor changes the curve (Adam would normalize it away).
BASE = TrainConfig(steps=3, sequences=6, max_len=48, max_tokens=64, dim=32, num_layers=2, optim=OptimConfig("sgd", lr=0.5))
ADAMW = OptimConfig("adamw", lr=3e-3)


def E(name: str = "odc", **kw) -> EngineConfig:
    return EngineConfig(name, **kw)


def _losses(cfg, world_size=2):
    results = run_ranks(train_worker, world_size, cfg)
    return [step[0]["loss"] for step in zip(*(r["metrics"] for r in results))], results


def test_every_engine_and_method_follows_the_same_loss_curve():
    """Same data and global-token normalization: FSDP2 (padded with dummy microbatches), flat ODC
    and ODC on FSDP2 in both modes, under different plans, with activation checkpointing and as
    HSDP, all take the same optimizer steps."""
    want, _ = _losses(replace(BASE, engine=E("fsdp"), balance="same_micro"))
    for engine, balance in [(E("fsdp"), "round_robin"), (E("odc-fsdp2", mode="collective"), "same_micro"),
                            (E("odc-fsdp2"), "round_robin"), (E("odc-fsdp2"), "diff_micro"),
                            (E("odc", mode="collective"), "same_micro"), (E("odc"), "diff_micro"),
                            (E("odc", activation_checkpointing=True), "diff_micro"),
                            (E("fsdp", activation_checkpointing=True), "same_micro")]:
        got, _ = _losses(replace(BASE, engine=engine, balance=balance))
        assert got == pytest.approx(want, rel=1e-4), (engine, balance)


@pytest.mark.cuda
def test_fsdp2_on_cuda_follows_the_cpu_loss_curve():
    """One rank per GPU (NCCL for device tensors, gloo for the rest): the model, the batches and
    FSDP2's mesh on the device take the CPU run's steps."""
    world = min(2, torch.cuda.device_count())
    cfg = replace(BASE, engine=E("fsdp"), balance="same_micro")
    want = run_training(replace(cfg, device="cpu"), world_size=world, quiet=True)
    got = run_training(replace(cfg, device="cuda"), world_size=world, quiet=True)
    assert [r["loss"] for r in got[0]["metrics"]] == pytest.approx([r["loss"] for r in want[0]["metrics"]], rel=1e-3)


@pytest.mark.cuda
def test_fsdp2_on_cuda_checkpoints_and_resumes(tmp_path):
    """On the GPU: a checkpoint after 2 of 4 steps resumes to the uninterrupted curve (AdamW
    state included)."""
    world = min(2, torch.cuda.device_count())
    cfg = replace(BASE, engine=E("fsdp"), balance="same_micro", optim=ADAMW, steps=4, device="cuda")
    want = [r["loss"] for r in run_training(cfg, world_size=world, quiet=True)[0]["metrics"]]
    ckpt = str(tmp_path / "ckpt")
    run_training(replace(cfg, steps=2, checkpoint_dir=ckpt), world_size=world, quiet=True)
    rest = [r["loss"] for r in run_training(replace(cfg, checkpoint_dir=ckpt), world_size=world, quiet=True)[0]["metrics"]]
    assert rest == pytest.approx(want[2:], rel=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("engine", [E("odc"), E("odc-fsdp2")], ids=["odc", "odc-fsdp2"])
def test_odc_engines_on_cuda_follow_the_cpu_loss_curve(engine):
    """ODC's engines in the trainer with the model, batches and ODC's regions in GPU memory (the
    device transport): flat ODC on 2 ranks whatever the GPUs (two on one GPU share it over gloo),
    ODC on FSDP2 one rank per GPU (its evaluation gathers are FSDP2's: NCCL), unequal
    microbatch counts."""
    world = 2 if engine.name == "odc" else min(2, torch.cuda.device_count())
    cfg = replace(BASE, engine=engine, balance="diff_micro")
    want = run_training(replace(cfg, device="cpu"), world_size=world, quiet=True)
    got = run_training(replace(cfg, device="cuda"), world_size=world, quiet=True)
    assert [r["loss"] for r in got[0]["metrics"]] == pytest.approx([r["loss"] for r in want[0]["metrics"]], rel=1e-3)
    for r in got:  # the split of a step is timed by events on the GPU: communication measured, inside the step
        for row in r["metrics"]:
            if row["microbatches"]:
                # at world size 1 FSDP2 skips its all-gather and reduce-scatter (torch's own shortcut), so
                # ODC on FSDP2 on one GPU has nothing to time
                assert (0 < row["comm_s"]) == (world > 1), row
                assert row["compute_s"] + row["comm_s"] <= row["step_time_s"], row
    if engine.name == "odc":  # the side stream's gathers ahead ran (prefetch is on by default on a GPU), none wasted
        stats = [r["engine_stats"] for r in got]
        assert all(s["prefetch_unused"] == 0 for s in stats) and sum(s["prefetch_prefetched"] for s in stats) > 0, stats


@pytest.mark.cuda
def test_flat_odc_on_cuda_checkpoints_and_resumes(tmp_path):
    """Flat ODC's sharded checkpoint from GPU memory (2 ranks, sharing a GPU where there is one)
    resumes to the uninterrupted curve."""
    cfg = replace(BASE, engine=E("odc"), optim=ADAMW, steps=4, device="cuda")
    want = [r["loss"] for r in run_training(cfg, world_size=2, quiet=True)[0]["metrics"]]
    ckpt = str(tmp_path / "ckpt")
    run_training(replace(cfg, steps=2, checkpoint_dir=ckpt), world_size=2, quiet=True)
    rest = [r["loss"] for r in run_training(replace(cfg, checkpoint_dir=ckpt), world_size=2, quiet=True)[0]["metrics"]]
    assert rest == pytest.approx(want[2:], rel=1e-5)


def test_hsdp_replicas_follow_the_same_loss_curve():
    """4 ranks as 2 replicas x 2 shards (one gradient all-reduce across replicas per minibatch
    under ODC) take the same steps as 4 plain FSDP2 ranks."""
    cfg = replace(BASE, sequences=8)
    want, _ = _losses(replace(cfg, engine=E("fsdp"), balance="same_micro"), world_size=4)
    for dp in ("odc", "odc-fsdp2", "fsdp"):
        got, _ = _losses(replace(cfg, engine=E(dp, replicas=2)), world_size=4)
        assert got == pytest.approx(want, rel=1e-4), dp


@pytest.mark.parametrize("dp", ["odc", "odc-fsdp2"])
def test_deterministic_runs_are_bitwise_identical(dp):
    cfg = replace(BASE, engine=E(dp, deterministic=True), sequences=8)
    first, _ = _losses(cfg, world_size=3)
    second, _ = _losses(cfg, world_size=3)
    assert first == second


@pytest.mark.parametrize("dp", ["fsdp", "odc", "odc-fsdp2"])
def test_time_accounting_adds_up(dp):
    """compute + optimizer + wait is the step time on every rank; FSDP2's time goes into its
    collectives, ODC's into one sync per step; every rank sees the same global figures."""
    _, results = _losses(replace(BASE, engine=E(dp), balance="same_micro" if dp == "fsdp" else "diff_micro"))
    for step in zip(*(r["metrics"] for r in results)):
        assert len({(r["loss"], r["tokens"], r["step_time_s"]) for r in step}) == 1
        assert sum(r["rank_tokens"] for r in step) == step[0]["tokens"]
        for r in step:
            assert r["compute_s"] > 0 and r["wait_s"] >= 0 and 0 < r["utilization"] <= 1
            assert r["compute_s"] + r["optimizer_s"] + r["wait_s"] == pytest.approx(r["step_time_s"])
            if dp == "fsdp":
                assert r["comm_s"] > 0 and r["sync_s"] < 0.01
            else:
                assert r["sync_s"] > 0
    s = summarize(results)
    assert s["tokens_per_s"] > 0 and 0 < s["utilization"] <= 1 and 0 <= s["wait_share"] < 1
    steady = list(zip(*(r["metrics"] for r in results)))[1:]
    assert s["busiest_compute_s"] == pytest.approx(sum(max(r["compute_s"] for r in st) for st in steady) / len(steady))
    assert s["compute_s"] / len(results) <= s["busiest_compute_s"] <= s["step_time_s"]


def test_tokens_per_s_is_what_a_stopwatch_sees(tmp_path, monkeypatch):
    """The rate on the progress line and in the metrics counts the whole time between steps:
    writing the metrics (made slow here: 0.3 s a step) is in it; the step's own time is not."""
    import time

    from posttrain.train.core import MetricsLog

    real = MetricsLog.append

    def slow(self, rows):
        time.sleep(0.3)
        real(self, rows)

    monkeypatch.setattr(MetricsLog, "append", slow)  # (in the forked ranks too)
    results = run_training(replace(BASE, steps=4, metrics=str(tmp_path / "m.jsonl")), world_size=2, quiet=True)
    for r in results[0]["metrics"]:
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["wall_s"])
        assert r["wall_s"] >= r["step_time_s"]
        if r["step"]:  # the previous step's metrics write is in this step's wall time
            assert r["wall_s"] >= r["step_time_s"] + 0.3
    s = summarize(results)
    assert s["wall_tokens_per_s"] < s["tokens_per_s"]


@pytest.mark.parametrize("dp", ["fsdp", "odc", "odc-fsdp2"])
def test_resumed_run_follows_the_uninterrupted_loss_curve_exactly(dp, tmp_path):
    """AdamW (optimizer state matters), checkpoint after 3 of 6 steps, a fresh job resumes:
    steps 3-5 give bitwise the same losses as one uninterrupted 6-step run."""
    cfg = replace(BASE, engine=E(dp), balance="diff_micro", optim=ADAMW, steps=6)
    want, _ = _losses(cfg)
    ckpt = str(tmp_path / "ckpt")
    first, _ = _losses(replace(cfg, steps=3, checkpoint_dir=ckpt))
    assert first == want[:3]
    meta = json.loads((tmp_path / "ckpt" / "step-000003" / "posttrain.json").read_text())
    assert meta["steps_done"] == 3 and meta["data_position"] == 3 * cfg.sequences
    assert (tmp_path / "ckpt" / "latest").read_text() == "step-000003"
    rest, results = _losses(replace(cfg, checkpoint_dir=ckpt))
    assert results[0]["resumed_from"] == 3
    assert [r["step"] for r in results[0]["metrics"]] == [3, 4, 5]
    assert rest == want[3:]


@pytest.mark.parametrize("first,then", [(2, 1), (1, 2)], ids=["2-to-1", "1-to-2"])
def test_flat_odc_resumes_on_another_world_size(first, then, tmp_path):
    """DCP reshards the flat shards and their AdamW state: the loss curve resumed on another
    number of ranks equals the uninterrupted one (to summation order)."""
    cfg = replace(BASE, engine=E("odc"), optim=ADAMW, steps=6)
    want, _ = _losses(cfg, world_size=first)
    ckpt = str(tmp_path / "ckpt")
    _losses(replace(cfg, steps=3, checkpoint_dir=ckpt), world_size=first)
    rest, results = _losses(replace(cfg, checkpoint_dir=ckpt), world_size=then)
    assert results[0]["resumed_from"] == 3
    assert rest == pytest.approx(want[3:], rel=1e-5)
    assert rest != _losses(replace(cfg, steps=3, seed=0), world_size=then)[0]  # not a fresh start


@pytest.mark.parametrize("change,flag", [
    ({"num_layers": 3}, "num_layers=2"), ({"dim": 64}, "dim=32"), ({"model": "llama"}, "model='gpt'"),
    ({"optim": OptimConfig("sgd")}, "optim.name='adamw'"), ({"engine": E("fsdp")}, "resume with `engine.name` odc"),
])
def test_resume_refuses_another_model_optimizer_or_engine_in_one_line(change, flag, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    cfg = replace(BASE, steps=1, optim=ADAMW, checkpoint_dir=ckpt)
    run_ranks(train_worker, 2, cfg)
    with pytest.raises(ValueError, match=flag.replace("(", r"\(")) as info:
        run_training(replace(cfg, steps=2, **change), world_size=2, quiet=True)
    assert "\n" not in str(info.value)


def test_resume_refuses_a_checkpoint_of_different_data(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_ranks(train_worker, 2, replace(BASE, steps=1, checkpoint_dir=ckpt))
    with pytest.raises(ValueError, match="written with seed=0, this run has 1; resuming would replay different data"):
        run_training(replace(BASE, steps=2, seed=1, checkpoint_dir=ckpt), world_size=2, quiet=True)


def test_checkpoints_keep_the_two_newest(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_ranks(train_worker, 2, replace(BASE, steps=4, checkpoint_dir=str(ckpt), checkpoint_every=1))
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-")) == ["step-000003", "step-000004"]


def test_bf16_mixed_precision_trains_close_to_fp32():
    want, _ = _losses(replace(BASE, engine=E("odc")))
    got, _ = _losses(replace(BASE, engine=E("odc", precision="bf16")))
    assert got == pytest.approx(want, rel=0.05)


def test_transformers_llama_trains_the_same_under_fsdp_and_odc():
    cfg = replace(BASE, model="llama")
    want, _ = _losses(replace(cfg, engine=E("fsdp"), balance="same_micro"))
    got, _ = _losses(replace(cfg, engine=E("odc"), balance="diff_micro"))
    assert got == pytest.approx(want, rel=1e-4)


def test_jsonl_data_epochs_and_positions(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"input_ids": list(range(i, i + 5 + i))}) + "\n" for i in range(5)))
    cfg = replace(BASE, data=str(path), sequences=3)
    data = TrainData(cfg, 2)
    assert data.vocab_size == 4 + 5 + 4
    seen = [tuple(s.input_ids.tolist()) for k in range(5) for s in data.minibatch(k)]  # 15 positions = 3 epochs
    for epoch in range(3):
        assert len(set(seen[5 * epoch : 5 * epoch + 5])) == 5  # each epoch is a permutation
    assert seen[:5] != seen[5:10]  # reshuffled per epoch
    results = run_ranks(train_worker, 2, cfg)
    assert len(results[0]["metrics"]) == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"engine": ("ddp",)}, "name='ddp' is not one of fsdp, odc-fsdp2, odc"),
        ({"engine": ("fsdp", {"deterministic": True})}, "`deterministic` is for the ODC engines"),
        ({"engine": ("fsdp", {"mode": "collective"})}, "`mode` collective is for the ODC engines"),
        ({"engine": ("odc", {"replicas": 0})}, "replicas=0 must be at least 1"),
        ({"balance": "best"}, "balance='best' is not one of round_robin"),
        ({"profile": "zipf"}, "profile='zipf'"),
        ({"model": "bert"}, "model='bert' is not one of gpt, llama"),
        ({"engine": ("odc", {"precision": "fp8"})}, "precision='fp8' is not one of fp32, bf16"),
        ({"max_len": 100, "max_tokens": 64}, "max_tokens=64 is smaller than the longest sequence"),
        ({"steps": 0}, "steps=0 must be at least 1"),
        ({"num_layers": 0}, "num_layers=0 must be at least 1"),
        ({"checkpoint_every": -1}, "checkpoint_every=-1 must be non-negative"),
        ({"optim": ("lion",)}, "name='lion' is not one of adamw, sgd"),
    ],
)
def test_bad_config_names_the_parameter(kwargs, message):
    """The library and the trainers name parameters; the command line names flags (see
    test_cli_train's test_a_refused_value_is_named_by_its_flag)."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        sections = {"engine": EngineConfig, "optim": OptimConfig}  # (args, kwargs): a bad section fails as it is built
        replace(BASE, **{k: sections[k](*v[:1], **(v[1] if len(v) > 1 else {})) if k in sections else v
                         for k, v in kwargs.items()})


def test_more_ranks_than_sequences_is_refused_before_starting():
    with pytest.raises(ValueError, match="sequences=3 is fewer than the 4 ranks"):
        run_training(replace(BASE, sequences=3), world_size=4, quiet=True)


def test_sequence_longer_than_max_tokens_in_a_file_names_it(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [1] * n}) + "\n" for n in (10, 10, 90, 10)))
    with pytest.raises(ValueError, match=r"d.jsonl:3: a sequence of 90 tokens trains on 89, more than max_tokens=64"):
        run_training(replace(BASE, data=str(path), sequences=4, max_tokens=64), world_size=2, quiet=True)


def test_metrics_are_appended_as_the_run_goes_and_a_resumed_run_continues_them(tmp_path):
    csv_path, jsonl, tb = tmp_path / "m.csv", tmp_path / "m.jsonl", tmp_path / "tb"
    cfg = replace(BASE, steps=2, metrics=str(csv_path), checkpoint_dir=str(tmp_path / "ck"))
    run_training(cfg, world_size=2, quiet=True)
    lines = csv_path.read_text().splitlines()
    assert lines[0].startswith("step,rank,loss,tokens,tokens_per_s") and len(lines) == 1 + 2 * 2
    run_training(replace(cfg, steps=4), world_size=2, quiet=True)  # resumes after step 2
    lines = csv_path.read_text().splitlines()
    assert len(lines) == 1 + 4 * 2 and [ln.split(",")[:2] for ln in lines[1:]][::2] == [["0", "0"], ["1", "0"],
                                                                                     ["2", "0"], ["3", "0"]]
    results = run_training(replace(cfg, steps=2, metrics=str(jsonl), checkpoint_dir=None, tensorboard=str(tb)),
                           world_size=2, quiet=True)
    rows = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert [(r["step"], r["rank"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for row in rows:  # each rank's own figures, as that rank measured them (rank 0 writes them without a gather)
        mine = results[row["rank"]]["metrics"][row["step"]]
        for k in ("loss", "tokens", "step_time_s", "compute_s", "comm_s", "sync_s", "optimizer_s", "wait_s",
                  "utilization", "microbatches", "rank_tokens", "lr", "grad_norm"):
            assert row[k] == pytest.approx(mine[k], rel=1e-12), k
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([rows[0]["loss"], rows[2]["loss"]])
