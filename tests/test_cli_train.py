"""`posttrain train` and `posttrain demo` as a user runs them.

A failure pinpoints the entry point, its outputs, or its input errors.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch


@pytest.mark.slow
def test_demo_trains_every_variant_and_splits_the_speedup(run_cli, tmp_path):
    """A short demo: the four variants taking turns in one job (a progress line a round), a table
    with speedups and their intervals, the same final loss everywhere (the same updates), the three
    factors (pooled: they multiply to the total), the calibrated simulator's predictions at 8-64
    GPUs labelled as such, a timeline PNG with a panel per variant; in the JSON, each round's
    shared-memory barriers a step: FSDP2 over gloo passes none, flat ODC's collective mode one or
    more a layer, more than ODC's one-sided minibatch."""
    import json

    from posttrain.lab.demo import PREDICT_AT, VARIANTS

    png = tmp_path / "t.png"
    proc = run_cli("demo", "--rounds", "2", "--steps", "3", "--sequences", "8", "--max-len", "128", "--plot", str(png),
                   "--json", str(tmp_path / "d.json"))
    assert proc.returncode == 0, proc.stderr
    got = json.loads((tmp_path / "d.json").read_text())
    for r in got["rounds"]:
        assert r["FSDP2 + same_micro"]["barriers"] == 0
        assert r["flat ODC collective"]["barriers"] > r["flat ODC + diff_micro"]["barriers"] > 0
        for v in r.values():
            assert 0 <= v["barrier_late_s"] <= v["barrier_wait_s"] + 1e-3
            # the rest of a step's split: each part within the step, microbatches as many as a rank ran
            assert all(0 <= v[k] <= v["step_time_s"] for k in ("comm_s", "sync_s", "optimizer_s"))
            assert abs(v["gather_s"] + v["reduce_s"] - v["comm_s"]) < 1e-6
            assert v["sys_s"] >= 0 and v["page_faults"] >= 0
            assert 1 <= v["microbatches"] <= v["max_microbatches"]
    cal = got["calibration"]  # what the prediction was calibrated with
    assert cal["jitter"] >= 0 and cal["copies_per_layer_microbatch_s"] > 0
    assert set(cal["excess_per_step_s"]) == {"one-sided", "collective"}
    for mode in ("one-sided", "collective"):  # the calibration's own runs (barriers: entry and exit, and per layer)
        assert cal["barrier_wait_per_step_s"][mode] >= 0 and cal["comm_per_step_s"][mode] > 0
    lines = proc.stdout.splitlines()
    progress = [ln for ln in lines if ln.strip().startswith("round ")]
    assert [p.split(":")[0].strip() for p in progress] == ["round 1/2", "round 2/2"]
    assert all(label in progress[0] for label, *_ in VARIANTS)
    rows = {label: ln[len(label):].split() for label, *_ in VARIANTS for ln in lines if ln.startswith(label + " ")}
    assert set(rows) == {v[0] for v in VARIANTS}
    assert rows["FSDP2 + same_micro"][-2:] == ["1.00x", "1.00-1.00"]
    assert len({r[-3] for r in rows.values()}) == 1  # same final loss: same updates
    for r in rows.values():
        lo, hi = (float(x) for x in r[-1].split("-"))
        assert lo <= float(r[-2].rstrip("x")) <= hi
    got = {ln.split()[0]: float(ln.split()[1].rstrip("x")) for ln in lines
           if ln.strip().startswith(("transport ", "engine ", "mechanism "))}
    total = float(rows["flat ODC + diff_micro"][-2].rstrip("x"))
    assert got["transport"] * got["engine"] * got["mechanism"] == pytest.approx(total, rel=0.01)  # pooled: exact
    at = next(i for i, ln in enumerate(lines) if ln.startswith("PREDICTED, not measured"))
    predicted = [ln.split() for ln in lines[at + 2:at + 3 + len(PREDICT_AT)]]
    assert [int(p[0]) for p in predicted] == [2, *PREDICT_AT]  # the demo's own 2 ranks first, beside the measured
    assert predicted[0][3:5] == ["(measured", "above:"]
    assert all(float(p[1].rstrip("x")) > 0 and float(p[2].rstrip("x")) > 0 for p in predicted)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_the_demos_pooled_ratio_and_its_interval():
    """The demo's figures: a variant's tokens over its time summed over rounds, and the ratio's
    5th-95th percentile over rounds drawn with replacement (which holds the pooled ratio; one
    round: no spread)."""
    from posttrain.lab.bench.stepwise import pooled, pooled_ratio

    def steps(times):
        return [{"round": r, "batch": 1, "tokens": 100, "step_time_s": t} for r, t in enumerate(times)]

    raw = {"steps": {"a": steps([1.0, 2.0, 1.0]), "b": steps([0.5, 1.0, 1.0])}}
    assert pooled(raw) == {"a": 300 / 4.0, "b": 300 / 2.5}
    ratio, lo, hi = pooled_ratio(raw, "b", "a")
    assert ratio == pytest.approx(4.0 / 2.5) and 1.0 <= lo < ratio < hi <= 2.0  # (the rounds' own: 2.0, 2.0, 1.0)
    one = {"steps": {"a": steps([1.0]), "b": steps([0.5])}}
    assert pooled_ratio(one, "b", "a") == (2.0, 2.0, 2.0)


def test_demo_says_when_the_machine_is_too_busy_to_time(monkeypatch):
    from posttrain.lab import demo

    ticks = iter([(100, 1000), (130, 1200)])  # 30 of 200 ticks busy: 15%
    monkeypatch.setattr(demo, "_cpu_times", lambda: next(ticks))
    assert demo.busy_before(2, sample_s=0) is None
    ticks = iter([(100, 1000), (250, 1200)])  # 75%
    monkeypatch.setattr(demo, "_cpu_times", lambda: next(ticks))
    assert demo.busy_before(2, sample_s=0) == "other processes used 75% of the 2 cores in the second before the demo started"
    monkeypatch.setattr(demo, "_cpu_times", lambda: None)  # no /proc/stat: the load average
    monkeypatch.setattr(os, "getloadavg", lambda: (3.2, 1.0, 1.0))
    assert demo.busy_before(2) == ("the load average was 3.2 on 2 cores before the demo started: other work shares "
                                   "the CPUs")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # a real busy core, on this machine
    try:
        import time

        time.sleep(0.5)
        monkeypatch.undo()
        if (os.cpu_count() or 1) <= 2:  # one of at most two cores spinning: half the machine or more
            assert demo.busy_before() is not None
    finally:
        busy.kill()
        busy.wait()


def test_the_demo_runs_on_cpu_processes_where_a_gpu_is_visible(monkeypatch):
    # Left to `auto`, the 4- and 8-rank demos on a one-GPU machine put every rank on that GPU, and
    # what they measured was not ODC on CPU cores (issue 47). On CUDA it is refused when its FSDP2
    # variants would share a GPU, before any process starts.
    from dataclasses import replace

    from posttrain import device
    from posttrain.lab import demo

    monkeypatch.setattr(device, "_cuda_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    assert demo.DEMO.device_kind == "cpu"
    assert replace(demo.DEMO, device="auto").device_kind == "cuda"  # (what it was)
    with pytest.raises(ValueError, match="world_size=4 ranks on this host but it has 1 cuda device"):
        demo.run_demo(replace(demo.DEMO, device="cuda"), world_size=4, log=lambda *a, **k: None)


def test_bad_demo_input_is_a_clear_error(cli):
    rc, _, err = cli("demo", "--world-size", "0")
    assert rc == 2 and "--world-size=0 must be at least 1" in err and len(err.strip().splitlines()) == 1
    rc, _, err = cli("demo", "--rounds", "0")
    assert rc == 2 and "--rounds=0 must be at least 1" in err


def test_unknown_command_lists_choices(run_cli):
    proc = run_cli("fly")
    assert proc.returncode != 0 and "demo" in proc.stderr


def test_train_fsdp_writes_metrics_timeline_and_trace(run_cli, tmp_path):
    """`posttrain train` with FSDP2 and same_micro: step lines, a CSV row per rank and step, a PNG,
    and a Chrome trace of the last step with both ranks' compute and communication."""
    import csv
    import json

    metrics, png, trace = tmp_path / "m.csv", tmp_path / "t.png", tmp_path / "t.json"
    proc = run_cli("train", "--dp", "fsdp", "--balance", "same_micro", "--steps", "3", "--sequences", "6",
                "--max-len", "64", "--dim", "32", "--layers", "2", "--metrics", str(metrics), "--plot", str(png),
                "--trace", str(trace))
    assert proc.returncode == 0, proc.stderr
    assert sum(line.startswith("step") for line in proc.stdout.splitlines()) == 3
    rows = list(csv.DictReader(metrics.open()))
    assert len(rows) == 6 and {r["rank"] for r in rows} == {"0", "1"}
    assert all(float(r["step_time_s"]) > 0 and float(r["comm_s"]) > 0 for r in rows)
    assert png.stat().st_size > 10_000
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {(e["cat"], e["tid"] // 4) for e in events} >= {("compute", 0), ("compute", 1), ("comm", 0), ("comm", 1)}


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 -m posttrain ARGS``: its ranks killed on a timeout."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "posttrain", *args]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}) as p:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # torchrun and its ranks
            raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def test_train_under_torchrun(tmp_path):
    """torchrun starts the processes; posttrain runs one rank in each and rank 0 reports."""
    import json

    metrics = tmp_path / "m.jsonl"
    proc = _torchrun("train", "--steps", "2", "--sequences", "4", "--max-len", "32", "--dim", "32", "--layers", "1",
                     "--metrics", str(metrics))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("posttrain: odc+diff_micro on 2 CPU processes") == 1  # rank 0 only
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert sorted((r["step"], r["rank"]) for r in rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.slow
def test_rl_under_torchrun(tmp_path, tiny_model):
    """The trainer core's launch serves every trainer: RL under torchrun, rank 0 reporting and
    writing the record once."""
    import json

    from posttrain.data.tasks import chat_task_records

    prompts, record = tmp_path / "p.jsonl", tmp_path / "r.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in chat_task_records(4, seed=1)))
    proc = _torchrun("rl", "--model-path", tiny_model("llama"), "--prompts", str(prompts), "--samples-per-prompt", "2",
                     "--prompts-per-step", "2", "--max-new-tokens", "4", "--steps", "2", "--max-tokens", "128",
                     "--record", str(record))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("posttrain rl: grpo with odc+diff_micro updates on 2 CPU processes") == 1
    assert sum(line.startswith("reward ") for line in proc.stdout.splitlines()) == 1  # the summary, once
    assert "nothing trained" not in proc.stdout
    assert [json.loads(line)["step"] for line in record.read_text().splitlines()] == [0, 1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(tmp_path, *args: str) -> list[subprocess.CompletedProcess]:
    """``posttrain ARGS`` under ``torchrun --nnodes 2 --nproc-per-node 2`` on this machine, each node
    in its own UTS and mount namespace (its own hostname and ``/dev/shm``), as two hosts would be;
    the two nodes' completed processes. Skips where namespaces are not permitted."""
    if subprocess.run(["unshare", "--uts", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --uts --mount is not permitted here (needs root)")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    procs = []
    for node in (0, 1):
        script = (f"hostname node{node} && mount -t tmpfs tmpfs /dev/shm && exec {torchrun} --nnodes 2 "
                  f"--nproc-per-node 2 --node-rank {node} --master-addr 127.0.0.1 --master-port {port} -m posttrain "
                  + " ".join(args))
        procs.append(subprocess.Popen(["unshare", "--uts", "--mount", "sh", "-c", script], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True, env=env,
                                      cwd=tmp_path))
    done = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, signal.SIGKILL)  # each node's torchrun and its ranks
            raise
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


@pytest.mark.slow
def test_two_nodes_shard_within_each_node_and_train_like_one_process(tmp_path, run_cli):
    """torchrun over two "hosts": ``--replicas auto`` (the default) makes HSDP with flat ODC
    inside each node, and the run takes the single-process reference's steps; 1-D ODC across the
    nodes is refused in one line before any work. (ODC on FSDP2 as HSDP: tests/test_train.py.)"""
    dp = "odc"
    import json

    run = ("train", "--steps", "3", "--sequences", "8", "--max-len", "32", "--dim", "32", "--layers", "1",
           "--dp", dp, "--lr", "3e-3")
    ref = run_cli(*run, "--world-size", "1", "--metrics", str(tmp_path / "ref.jsonl"))
    assert ref.returncode == 0, ref.stderr
    nodes = _two_nodes(tmp_path, *run, "--metrics", "two.jsonl")
    assert [n.returncode for n in nodes] == [0, 0], nodes[0].stderr[-3000:] + nodes[1].stderr[-3000:]
    assert "on 4 CPU processes (HSDP: 2 replicas of 2 shards)" in nodes[0].stdout

    def losses(path):
        return [r["loss"] for r in map(json.loads, open(path)) if r["rank"] == 0]

    want = losses(tmp_path / "ref.jsonl")
    assert len(want) == 3 and losses(tmp_path / "two.jsonl") == pytest.approx(want, rel=1e-4)
    refused = _two_nodes(tmp_path, *run, "--replicas", "1")
    assert all(n.returncode for n in refused)
    err = refused[0].stderr
    assert ("posttrain: error: --dp odc shards over groups of 4 ranks, which would span nodes (4 ranks, 2 on each "
            "node); ODC shares one host's memory, so shard within each node: --replicas 2 (or auto)") in err, err
    assert "Traceback (most recent call last):\n  File" not in err.split("posttrain: error:")[0]  # no rank traceback


def test_odc_on_fsdp2_with_one_rank_replicas_is_refused_before_any_rank(cli):
    rc, out, err = cli("train", "--dp", "odc-fsdp2", "--world-size", "2", "--replicas", "2", "--steps", "1")
    assert rc == 2 and "--dp odc-fsdp2 with 2 replicas of one rank each" in err and "posttrain:" not in out


def test_replicas_auto_follows_torchrun_nodes(monkeypatch):
    from posttrain.dp import EngineConfig, check_shard_hosts, resolve_replicas

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resolve_replicas("auto", 4) == 1 and resolve_replicas(2, 4) == 2  # not under torchrun: one replica
    check_shard_hosts(EngineConfig("odc", replicas=1), 4)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_replicas("auto", 8) == 4  # one replica per node
    assert resolve_replicas("auto", 4) == 1  # a data-parallel world that is not the job's (pipeline stages)
    check_shard_hosts(EngineConfig("odc"), 8)
    check_shard_hosts(EngineConfig("fsdp", replicas=1), 8)  # NCCL/gloo collectives span nodes
    with pytest.raises(ValueError, match="groups of 8 ranks, which would span nodes"):
        check_shard_hosts(EngineConfig("odc-fsdp2", replicas=1), 8)
    with pytest.raises(ValueError, match="does not divide the 8"):
        resolve_replicas(3, 8)


def test_bad_data_inputs_are_clear_errors(cli, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2\n')
    rc, _, err = cli("train", "--data", str(bad), "--sequences", "2")
    last = err.strip().splitlines()[-1]  # (above it, in this process: the datasets library's progress bar)
    assert rc == 2 and f"{bad}:2: not valid JSON" in last and "Traceback" not in err
    rc, _, err = cli("train", "--world-size", "4", "--sequences", "3")
    assert rc == 2 and "--sequences=3 is fewer than the 4 ranks" in err


def test_train_bad_choice_and_budget(cli):
    rc, _, err = cli("train", "--balance", "best")  # argparse's own error
    assert rc == 2 and "invalid choice: 'best'" in err and "diff_micro" in err
    rc, _, err = cli("train", "--max-len", "100", "--max-tokens", "50")
    assert rc == 2 and "--max-tokens=50 is smaller than the longest sequence" in err
    assert len(err.strip().splitlines()) == 1


def test_config_file_sets_flags_and_the_command_line_wins(cli, tmp_path):
    toml = tmp_path / "run.toml"
    metrics = tmp_path / "m.jsonl"
    toml.write_text(f'dp = "fsdp"\nbalance = "same_micro"\nsteps = 1\nsequences = 4\nmax-len = 64\ndim = 32\n'
                    f'layers = 1\nmetrics = "{metrics}"\n')
    rc, out, err = cli("train", "--config", str(toml))
    assert rc == 0, err
    assert "fsdp+same_micro on 2 CPU processes, gpt 1x32" in out and "sequences per step, 1 step" in out
    assert len(metrics.read_text().splitlines()) == 2  # one step, two ranks
    rc, out, err = cli("train", "--config", str(toml), "--steps", "2", "--dp", "odc")
    assert rc == 0, err
    assert "odc+same_micro" in out and len(metrics.read_text().splitlines()) == 4


@pytest.mark.parametrize("text, message", [
    ("stepz = 3\n", "unknown key 'stepz'"),
    ('steps = "many"\n', "steps='many' is not a int"),
    ('dp = "ddp"\n', "dp='ddp' is not one of"),
    ("deterministic = 1\n", "deterministic must be true or false"),
    ("steps = [1\n", "not valid TOML"),
])
def test_config_file_errors_name_the_key(cli, tmp_path, text, message):
    toml = tmp_path / "run.toml"
    toml.write_text(text)
    rc, _, err = cli("train", "--config", str(toml))
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command, cls", [("train", "posttrain.cli.train:TrainCommand"),
                                          ("rl", "posttrain.cli.rl:RLCommand"),
                                          ("pipeline", "posttrain.cli.pipeline:PipelineCommand")])
def test_every_trainer_takes_the_engine_and_optimizer_sections_from_the_same_flags(command, cls):
    """One definition per flag: the engine and optimizer sections (EngineConfig, OptimConfig) give
    every trainer the same flags, and a section's unset flags keep the trainer's own default."""
    import importlib

    from posttrain.cli import build_parser
    from posttrain.cli.options import config_from_args

    module, name = cls.split(":")
    command_cls = getattr(importlib.import_module(module), name)
    default_lr = command_cls().run.optim.lr
    # (the pipeline does not offer the engine options it refuses so far: precision, activation
    # checkpointing, replicas)
    extra = [] if command == "pipeline" else ["--activation-checkpointing", "--replicas", "2"]
    args = build_parser(command).parse_args([command, "--dp", "fsdp", *extra, "--optimizer", "sgd"])
    parsed = {k: getattr(args, k) for k in ("run.engine.name", "run.optim.name", "run.optim.lr")}
    assert parsed == {"run.engine.name": "fsdp", "run.optim.name": "sgd", "run.optim.lr": default_lr}
    if command == "pipeline":
        assert not hasattr(args, "run.engine.replicas") and not hasattr(args, "run.engine.precision")
    else:
        cfg = config_from_args(command_cls, args).run
        assert cfg.engine.name == "fsdp" and cfg.engine.replicas == 2 and cfg.engine.activation_checkpointing
        assert cfg.optim == type(cfg.optim)("sgd", lr=default_lr)


@pytest.mark.parametrize("argv, message", [
    (["--max-len", "100", "--max-tokens", "64"],
     "--max-tokens=64 is smaller than the longest sequence (--max-len=100); raise --max-tokens"),
    (["--layers", "0"], "--layers=0 must be at least 1"),
    (["--max-tokens", "0"], "--max-tokens=0 is smaller than the longest sequence"),
    (["--model", "llama", "--dim", "7"], "--dim=7 gives attention heads of 7 channels, and llama's rotary position "
                                         "embeddings need an even number; give a multiple of 32 as --dim"),
    (["--dp", "fsdp", "--deterministic"], "--deterministic is for the ODC engines (--dp odc or odc-fsdp2)"),
    (["--replicas", "0"], "--replicas=0 must be at least 1"),
    (["--sequences", "3", "--world-size", "4"], "--sequences=3 is fewer than the 4 ranks"),  # refused at run time
    (["--dp", "fsdp", "--checkpoint-dir", "CKPT"], "which --dp='fsdp' cannot load"),  # a dotted engine.name
    pytest.param(["--device", "cuda"], "--device='cuda' but torch", id="cuda-without-cuda",
                 marks=pytest.mark.skipif(torch.cuda.device_count() > 0, reason="for a machine without CUDA")),
])
def test_a_refused_value_is_named_by_its_flag(cli, argv, message, tmp_path):
    """The trainers and the library name parameters (max_tokens=64); the command line writes each
    as its flag, from the table its options are built from."""
    if "CKPT" in argv:  # a flat ODC checkpoint under a path that holds "x=": the path is left as it is
        from posttrain.launch import run_ranks
        from posttrain.train.sft import TrainConfig, train_worker

        ckpt = os.path.join(tmp_path, "lr=0.5", "ckpt")
        run_ranks(train_worker, 2, TrainConfig(steps=1, sequences=4, max_len=32, max_tokens=32, dim=32, num_layers=1,
                                               checkpoint_dir=ckpt))
        argv = [a.replace("CKPT", ckpt) for a in argv] + ["--steps", "2", "--sequences", "4", "--max-len", "32",
                                                           "--dim", "32", "--layers", "1"]
    rc, _, err = cli("train", *argv)
    assert rc == 2 and message in err, err
    assert "--lr=0.5" not in err


def _commands():
    """Every runnable command: its words and its parser (every subcommand of every command)."""
    import argparse

    from posttrain.cli import build_parser

    def walk(parser, words):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield words, parser
        for a in subs:
            for name, p in a.choices.items():
                yield from walk(p, [*words, name])

    return list(walk(build_parser(), []))


def test_help_is_plain_text_naming_only_the_commands_own_flags(monkeypatch):
    """Every command's options come from a configuration dataclass, and its help from the
    docstring: a parameter it cites shows as its flag, a clause about a parameter the command
    does not offer is left out, and no RST role, literal quotes or field name reaches the user."""
    import re

    monkeypatch.setenv("COLUMNS", "400")  # no wrapping inside a flag
    commands = _commands()
    assert {" ".join(w) for w, _ in commands} >= {"train", "rl", "pipeline", "demo", "bench odc", "bench rl",
                                                   "bench pipeline-dp", "simulate table", "simulate calibrate",
                                                   "plan pipeline", "plan odc"}
    for words, parser in commands:
        out = parser.format_help()
        assert not re.search(r"``|:(mod|class|func|meth|attr):`", out), (words, out)
        own = {o for a in parser._actions for o in a.option_strings}
        # a flag of another command is cited with that command: "posttrain rl --record"
        cited = set(re.findall(r"(?<!posttrain )(?<![a-z] )(--[a-z][a-z0-9-]*)", out))
        others = {m for m in re.findall(r"posttrain [a-z -]*?(--[a-z][a-z0-9-]*)", out)}
        assert cited - own - others == set(), (words, cited - own - others)
        fields = {a.dest.rsplit(".", 1)[-1] for a in parser._actions if "_" in a.dest.rsplit(".", 1)[-1]}
        prose = "\n".join(line.split("  ", 2)[-1] for line in out.splitlines() if line.startswith("   "))
        assert not {f for f in fields if re.search(rf"(?<![\w-]){f}(?![\w-])", prose)}, (words, fields)
    pipeline = dict((" ".join(w), p) for w, p in commands)["pipeline"].format_help()
    assert "(--pp-size x --dp-size processes)" in pipeline
