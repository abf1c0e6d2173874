"""End-to-end: ``posttrain simulate`` / ``posttrain plan`` and the calibration plumbing.

A failure pinpoints the command wiring, its outputs (trace, PNG, JSON), or its input errors.
"""

from __future__ import annotations

import json

import pytest

from posttrain.cli import main


def test_simulate_odc_prints_both_and_writes_trace_and_png(tmp_path, capsys):
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    assert main(["simulate", "odc", "--gpus", "16", "--sequences-per-gpu", "4", "--minibatches", "1",
                 "--cost-model", "1.5b", "--trace", str(trace), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "fsdp+same_micro" in out and "odc+diff_micro" in out and "speedup" in out
    assert json.loads(trace.read_text())["traceEvents"] and png.read_bytes()[:4] == b"\x89PNG"


def test_simulate_pipeline_and_the_paper_table(tmp_path, capsys):
    chart = tmp_path / "p.png"
    assert main(["simulate", "pipeline", "--ranks", "4", "--microbatches", "8", "--chunks", "2",
                 "--offload-chunks", "1", "--chart", str(chart)]) == 0
    out = capsys.readouterr().out
    assert "makespan" in out and "k = (D2H + H2D)" in out and chart.read_bytes()[:4] == b"\x89PNG"
    # zbv and the one-chunk schedules run with their own chunk count when --chunks is not given
    for name in ("zbv", "1f1b", "zb_h1"):
        assert main(["simulate", "pipeline", "--schedule", name, "--ranks", "4", "--microbatches", "8", "--chart", ""]) == 0
    assert "zbv: 4 ranks x 2 chunks" in capsys.readouterr().out.split("1f1b:")[0]
    assert main(["simulate", "pipeline", "--paper-table"]) == 0
    assert "group_interleaved_zb  2  1  13,5,2" in capsys.readouterr().out


def test_simulate_table_small(tmp_path, capsys):
    out_json = tmp_path / "t.json"
    assert main(["simulate", "table", "--gpus", "8", "--cost-models", "1.5b", "--profiles", "longalign",
                 "--sequences-per-gpu", "4", "--minibatches", "1", "--json", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())
    assert len(rows) == 1 and rows[0]["diff_micro"] > 1.0


def test_plan_odc_and_pipeline(capsys):
    assert main(["plan", "odc", "--gpus", "8", "--sequences-per-gpu", "4", "--minibatches", "1"]) == 0
    out = capsys.readouterr().out
    assert "recommended: " in out
    assert main(["plan", "pipeline", "--ranks", "4", "--microbatches", "8", "--memory-gib", "1.5"]) == 0
    out = capsys.readouterr().out
    assert "fit 1.5 GiB" in out
    rows = [r for r in (line.split() for line in out.splitlines()) if len(r) == 9 and r[0].isdigit()]
    assert rows and all(float(r[-2]) <= 1.5 for r in rows)  # peak GiB within the budget
    assert main(["plan", "pipeline", "--ranks", "4", "--microbatches", "8", "--memory-gib", "0.01"]) == 1


@pytest.mark.parametrize("argv, message", [
    (["simulate", "odc", "--gpus", "0"], "at least 1 GPU"),
    (["simulate", "odc", "--inter-gbps", "-5"], "--inter-gbps"),
    (["simulate", "pipeline", "--host-gbps", "-1"], "--host-gbps"),
    (["simulate", "odc", "--lengths-file", "/nonexistent"], "does not exist"),
    (["plan", "pipeline", "--memory-gib", "-1"], "--memory-gib"),
    (["simulate", "table", "--gpus", "8,x"], "comma-separated"),
    # flags a schedule would ignore, and counts and costs out of range, named by flag
    (["simulate", "pipeline", "--stages", "0"], "num_ranks=0 must be at least 1 (--ranks)"),
    (["simulate", "pipeline", "--microbatches", "0"], "(--microbatches)"),
    (["simulate", "pipeline", "--host-gbps", "0"], "--host-gbps=0.0 must be a positive"),
    (["simulate", "pipeline", "--forward-ms", "-1"], "--forward-ms=-1.0 must be a non-negative"),
    (["simulate", "pipeline", "--weight-ms", "nan"], "--weight-ms=nan"),
    (["simulate", "pipeline", "--activation-mib", "-2"], "--activation-mib=-2.0"),
    (["simulate", "pipeline", "--schedule", "zbv", "--chunks", "3"], "(--chunks)"),
    (["simulate", "pipeline", "--schedule", "1f1b", "--chunks", "2"], "(--chunks)"),
    (["simulate", "pipeline", "--schedule", "zb_h1", "--group-size", "2"], "(--group-size)"),
    (["simulate", "pipeline", "--schedule", "interleaved_1f1b", "--group-size", "8"], "(--group-size)"),
    (["simulate", "pipeline", "--group-size", "9"], "(--group-size)"),
    (["simulate", "pipeline", "--offload-chunks", "3"], "(--offload-chunks)"),
    (["simulate", "pipeline", "--offload-chunks", "-1"], "(--offload-chunks)"),
    (["plan", "pipeline", "--stages", "0", "--memory-gib", "4"], "num_ranks=0 must be at least 1 (--ranks)"),
    (["plan", "pipeline", "--microbatches", "0", "--memory-gib", "4"], "(--microbatches)"),
    (["plan", "pipeline", "--host-gbps", "0", "--memory-gib", "4"], "--host-gbps"),
    (["plan", "pipeline", "--backward-ms", "-1", "--memory-gib", "4"], "--backward-ms"),
    (["plan", "pipeline", "--top", "0", "--memory-gib", "4"], "--top"),
    (["plan", "odc", "--top", "0"], "--top"),
])
def test_bad_input_exits_2_with_a_message(argv, message, capsys):
    extra = {"odc": ["--trace", "", "--png", ""], "pipeline": ["--chart", ""]}.get(argv[1], []) if argv[0] == "simulate" else []
    assert main(argv + extra) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) <= 2  # one line (and a deprecation note)


def test_unknown_profile_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        main(["simulate", "odc", "--profile", "nope"])
    assert e.value.code == 2 and "longalign" in capsys.readouterr().err


@pytest.mark.parametrize("old,new", [(["--lengths", "swe_smith"], "--profile"), (["--model", "1.5b"], "--cost-model")])
def test_old_spellings_still_work_and_name_their_replacement(old, new, capsys):
    assert main(["plan", "odc", "--gpus", "8", "--sequences-per-gpu", "2", "--minibatches", "1", *old]) == 0
    captured = capsys.readouterr()
    assert f"{old[0]} is deprecated; use {new}" in captured.err and "recommended: " in captured.out


def test_calibration_plumbing_on_a_tiny_config(capsys):
    """Runs measure -> predict -> real runs and reports both numbers (tiny: no accuracy claim)."""
    from posttrain.lab.calibrate import calibrate_odc, calibrate_pipeline
    from posttrain.train.dp import TrainConfig
    from posttrain.train.pipeline import PipelineConfig

    r = calibrate_odc(TrainConfig(steps=3, sequences=8, max_len=128, max_tokens=128, dim=32, num_layers=2),
                      repeats=1, iters=1)
    assert r["predicted"] > 0 and r["measured"]["speedup"] > 0
    assert "predicted" in capsys.readouterr().out
    p = calibrate_pipeline(PipelineConfig(schedule="group_interleaved", num_ranks=2, chunks=2, num_microbatches=4,
                                          offload="1", num_layers=4, steps=1))
    assert p["predicted"] == p["measured"] == [3, 3]
