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
])
def test_bad_input_exits_2_with_a_message(argv, message, capsys):
    assert main(argv + (["--trace", "", "--png", ""] if argv[:2] == ["simulate", "odc"] else [])) == 2
    assert message in capsys.readouterr().err


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
