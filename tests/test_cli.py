"""End-to-end: the CLI as a user runs it. A failure pinpoints the entry point or the demo."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "posttrain", *args], capture_output=True, text=True, timeout=300, env=ENV
    )


def test_demo_trains_every_variant_and_splits_the_speedup(tmp_path):
    """A short demo: four runs, a table with speedups, the same final loss everywhere, the three
    factors (which multiply to the total), a timeline PNG."""
    from posttrain.lab.demo import VARIANTS

    png = tmp_path / "t.png"
    proc = _run("demo", "--steps", "6", "--timeline", str(png))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    rows = {label: ln[len(label):].split() for label, *_ in VARIANTS for ln in lines if ln.startswith(label + " ")}
    assert set(rows) == {v[0] for v in VARIANTS}
    assert rows["FSDP2 + same_micro"][-1] == "1.00x"
    assert len({r[-2] for r in rows.values()}) == 1  # same final loss: same gradients
    got = {ln.split()[0]: float(ln.split()[1].rstrip("x")) for ln in lines
           if ln.strip().startswith(("transport ", "engine ", "mechanism "))}
    total = float(rows["flat ODC + diff_micro"][-1].rstrip("x"))
    assert got["transport"] * got["engine"] * got["mechanism"] == pytest.approx(total, rel=0.03)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_bad_demo_input_is_a_clear_error():
    proc = _run("demo", "--world-size", "0")
    assert proc.returncode == 2
    assert "--world-size=0 must be at least 1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_command_lists_choices():
    proc = _run("fly")
    assert proc.returncode != 0 and "demo" in proc.stderr


def test_train_fsdp_writes_metrics_timeline_and_trace(tmp_path):
    """`posttrain train` with FSDP2 and same_micro: step lines, a CSV row per rank and step, a PNG,
    and a Chrome trace of the last step with both ranks' compute and communication."""
    import csv
    import json

    metrics, png, trace = tmp_path / "m.csv", tmp_path / "t.png", tmp_path / "t.json"
    proc = _run("train", "--dp", "fsdp", "--balance", "same_micro", "--steps", "3", "--sequences", "6",
                "--max-len", "64", "--dim", "32", "--layers", "2", "--metrics", str(metrics), "--timeline", str(png),
                "--trace", str(trace))
    assert proc.returncode == 0, proc.stderr
    assert sum(line.startswith("step") for line in proc.stdout.splitlines()) == 3
    rows = list(csv.DictReader(metrics.open()))
    assert len(rows) == 6 and {r["rank"] for r in rows} == {"0", "1"}
    assert all(float(r["step_time_s"]) > 0 and float(r["comm_s"]) > 0 for r in rows)
    assert png.stat().st_size > 10_000
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {(e["cat"], e["tid"] // 4) for e in events} >= {("compute", 0), ("compute", 1), ("comm", 0), ("comm", 1)}


def test_train_under_torchrun(tmp_path):
    """torchrun starts the processes; posttrain runs one rank in each and rank 0 reports."""
    import json

    metrics = tmp_path / "m.jsonl"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "posttrain", "train", "--steps", "2",
           "--sequences", "4", "--max-len", "32", "--dim", "32", "--layers", "1", "--metrics", str(metrics)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          env={**ENV, "OMP_NUM_THREADS": "1"}) as p:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # torchrun and its ranks
            raise
    proc = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("posttrain: odc+diff_micro on 2 CPU processes") == 1  # rank 0 only
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert sorted((r["step"], r["rank"]) for r in rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_bench_odc_runs_every_variant_and_both_bounds_and_splits_the_gain(tmp_path):
    import json

    out = tmp_path / "b.json"
    proc = _run("bench", "odc", "--steps", "2", "--sequences", "4", "--max-len", "64", "--dim", "32",
                "--layers", "1", "--repeats", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    median, spread, fac = got["median"], got["spread"], got["factors"]
    assert set(median) == {"fsdp+round_robin", "fsdp+same_micro", "odc-fsdp2-collective+same_micro",
                           "odc-fsdp2+round_robin", "odc-fsdp2+diff_micro", "odc-collective+same_micro",
                           "odc+diff_micro", "even", "partition"}
    assert median["fsdp+same_micro"]["vs_fsdp_same_micro"] == 1.0
    assert median["partition"]["vs_partition"] == 1.0 and median["odc+diff_micro"]["tokens_per_s"] > 0
    refs = {"vs_fsdp_same_micro": "fsdp+same_micro", "vs_partition": "partition"}
    for name in median:  # each round's ratio is reported; the median lies within their range
        for key, ref in refs.items():
            per_round = [r[name]["tokens_per_s"] / r[ref]["tokens_per_s"] for r in got["rounds"]]
            assert spread[name][key] == [min(per_round), max(per_round)]
            assert min(per_round) <= median[name][key] <= max(per_round)
    for r in got["rounds"]:  # the three factors multiply to the total, round by round
        tp = {k: v["tokens_per_s"] for k, v in r.items()}
        assert tp["odc+diff_micro"] / tp["fsdp+same_micro"] == pytest.approx(
            tp["odc-fsdp2-collective+same_micro"] / tp["fsdp+same_micro"]
            * tp["odc-collective+same_micro"] / tp["odc-fsdp2-collective+same_micro"]
            * tp["odc+diff_micro"] / tp["odc-collective+same_micro"])
    assert set(fac) >= {"total", "transport", "engine", "mechanism", "headroom", "partition_vs_even"}
    for r in got["rounds"]:  # whole sequences never divide more evenly than all compute does
        assert r["partition"]["tokens_per_s"] <= 1.25 * r["even"]["tokens_per_s"]
    for line in ("transport", "engine", "mechanism", "headroom", "captured"):
        assert f"  {line}" in proc.stdout
    assert "partition bound" in proc.stdout and "even bound" in proc.stdout


def test_bench_odc_sweep_reports_every_point_with_predictions(tmp_path):
    import json

    out = tmp_path / "s.json"
    proc = _run("bench", "odc", "--sweep", "--sequences-per-rank", "1,2", "--sweep-max-tokens", "64,128", "--steps",
                "2", "--max-len", "64", "--dim", "32", "--layers", "1", "--repeats", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    points = json.loads(out.read_text())["points"]
    assert [(p["sequences_per_rank"], p["max_tokens"]) for p in points] == [(1, 64), (1, 128), (2, 64), (2, 128)]
    for p in points:
        assert p["headroom"][0] > 0 and p["mechanism"][0] > 0
        assert p["predicted"]["headroom"] > 0 and p["predicted"]["mechanism"] > 0
    assert "pred head" in proc.stdout
    proc = _run("bench", "odc", "--sweep", "--sweep-max-tokens", "32", "--max-len", "64")
    assert proc.returncode == 2 and "is below --max-len=64" in proc.stderr


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_odc_overhead_benchmark_reports_every_rank(world_size):
    proc = _run("bench", "overhead", "--dim", "32", "--world-size", world_size)
    assert proc.returncode == 0, proc.stderr
    for rank in range(int(world_size)):
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"rank {rank}:")]
        assert len(lines) == 3, proc.stdout
        assert "FSDP2" in lines[0] and "flat ODC" in lines[1] and "AdamW step" in lines[2]
        assert all("Python calls" in ln and "/ plain:" in ln for ln in lines[:2])


def test_bad_data_inputs_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2\n')
    proc = _run("train", "--data", str(bad), "--sequences", "2")
    assert proc.returncode == 2 and f"{bad}:2: not valid JSON" in proc.stderr and "Traceback" not in proc.stderr
    proc = _run("train", "--world-size", "4", "--sequences", "3")
    assert proc.returncode == 2 and "--sequences=3 is fewer than the 4 ranks" in proc.stderr


def test_train_bad_choice_and_budget():
    proc = _run("train", "--balance", "best")
    assert proc.returncode == 2 and "invalid choice: 'best'" in proc.stderr and "diff_micro" in proc.stderr
    proc = _run("train", "--max-len", "100", "--max-tokens", "50")
    assert proc.returncode == 2 and "--max-tokens=50 is smaller than the longest sequence" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_pipeline_reports_measured_and_predicted_peaks_and_draws_the_chart(tmp_path):
    png = tmp_path / "p.png"
    proc = _run("pipeline", "--schedule", "group_interleaved", "--ranks", "2", "--chunks", "2", "--group-size", "1",
                "--microbatches", "4", "--offload", "1", "--steps", "2", "--dim", "32", "--layers", "4",
                "--seq-len", "32", "--chart", str(png))
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.split() and line.split()[0] in ("0", "1")]
    assert len(rows) == 2
    for row in rows:  # peak units (measured) equals the schedule's prediction
        assert float(row[3]) == float(row[4]) and float(row[5]) > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pipeline_bad_input_is_a_clear_error():
    proc = _run("pipeline", "--schedule", "interleaved_1f1b", "--ranks", "4", "--chunks", "2", "--microbatches", "2")
    assert proc.returncode == 2 and "needs at least 4 microbatches" in proc.stderr and "Traceback" not in proc.stderr
    proc = _run("pipeline", "--schedule", "pipedream")
    assert proc.returncode == 2 and "gpipe" in proc.stderr and "zbv" in proc.stderr
    proc = _run("pipeline", "--stages", "2", "--layers", "1")  # the old spelling of --ranks still works
    assert "--stages is deprecated; use --ranks" in proc.stderr
    assert proc.returncode == 2 and "cannot be cut into 2 stages" in proc.stderr


def test_bench_pipeline_tiny(tmp_path):
    out = tmp_path / "b.json"
    proc = _run("bench", "pipeline", "--ranks", "2", "--dim", "32", "--layers", "4", "--seq-len", "32",
                "--repeats", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    import json

    res = json.loads(out.read_text())
    assert {r["schedule"] for r in res["memory"]} == {"1f1b", "interleaved_1f1b", "group_interleaved",
                                                      "group_interleaved_zb", "interleaved_zb"}
    assert {r["group_size"] for r in res["memory"] if r["schedule"] == "group_interleaved_zb"} == {1}
    assert all(r["peak_units"] == r["predicted_units"] for r in res["memory"])
    assert [r["schedule"] for r in res["timing"]] == ["1f1b", "interleaved_1f1b"]
    assert all(r["max_grad_diff"] == 0.0 and r["ratio"] > 0 for r in res["timing"])
    proc = _run("bench", "pipeline", "--ranks", "two")
    assert proc.returncode == 2 and "comma-separated" in proc.stderr


def test_bench_transport_prints_both_ratios(tmp_path):
    out = tmp_path / "t.json"
    proc = _run("bench", "transport", "--sizes-mib", "0.25", "--iters", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "shm gather" in proc.stdout and out.exists()
    proc = _run("bench", "transport", "--iters", "0")
    assert proc.returncode == 2 and "--iters=0" in proc.stderr


def test_bench_balance_prints_every_method_and_the_targets(tmp_path):
    out = tmp_path / "b.json"
    proc = _run("bench", "balance", "--world-sizes", "2,4", "--seeds", "1", "--profiles", "long_tail", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    for method in ("round_robin", "local_sort", "same_micro", "diff_micro"):
        assert f" {method} " in proc.stdout
    assert "targets" in proc.stdout and out.exists()
    proc = _run("bench", "balance", "--world-sizes", "2,x")
    assert proc.returncode == 2 and "--world-sizes" in proc.stderr and "Traceback" not in proc.stderr
