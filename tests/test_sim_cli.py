"""End-to-end: ``posttrain simulate`` / ``posttrain plan`` and the calibration plumbing.

A failure pinpoints the command wiring, its outputs (trace, PNG, JSON), or its input errors.
"""

from __future__ import annotations

import json

import pytest

from posttrain.cli import main


def test_simulate_odc_prints_both_and_writes_trace_and_png(tmp_path, capsys):
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    assert main(["simulate", "odc", "--world-size", "16", "--sequences-per-rank", "4", "--minibatches", "1",
                 "--cost-model", "1.5b", "--trace", str(trace), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "fsdp+same_micro" in out and "odc+diff_micro" in out and "speedup" in out
    assert json.loads(trace.read_text())["traceEvents"] and png.read_bytes()[:4] == b"\x89PNG"
    assert main(["simulate", "odc", "--world-size", "8", "--sequences-per-rank", "1", "--minibatches", "1",
                 "--cost-model", "1.5b", "--context-parallel", "auto", "--trace", "", "--plot", ""]) == 0
    out = capsys.readouterr().out
    assert "odc+cp (" in out and "split)" in out and "a prediction" in out


def test_simulate_pipeline_and_the_paper_table(tmp_path, capsys):
    chart = tmp_path / "p.png"
    assert main(["simulate", "pipeline", "--pp-size", "4", "--microbatches", "8", "--chunks", "2",
                 "--offload", "1", "--plot", str(chart)]) == 0
    out = capsys.readouterr().out
    assert "makespan" in out and "k = (D2H + H2D)" in out and chart.read_bytes()[:4] == b"\x89PNG"
    # zbv and the one-chunk schedules run with their own chunk count when --chunks is not given
    for name in ("zbv", "1f1b", "zb_h1"):
        assert main(["simulate", "pipeline", "--schedule", name, "--pp-size", "4", "--microbatches", "8", "--plot", ""]) == 0
    assert "zbv: 4 ranks x 2 chunks" in capsys.readouterr().out.split("1f1b:")[0]
    assert main(["simulate", "pipeline", "--paper-table"]) == 0
    assert "group_interleaved_zb  2  1  13,5,2" in capsys.readouterr().out


def test_simulate_table_small(tmp_path, capsys):
    out_json = tmp_path / "t.json"
    assert main(["simulate", "table", "--world-sizes", "8", "--cost-models", "1.5b", "--profiles", "longalign",
                 "--sequences-per-rank", "4", "--minibatches", "1", "--json", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())
    assert len(rows) == 1 and rows[0]["diff_micro"] > 1.0


def _plan_rows(out):
    """The table rows of plan pipeline: (recommended?, columns)."""
    rows = [line.split() for line in out.split("fastest that fit (* recommended):")[1].splitlines()[2:]]
    return [(r[0].startswith("*"), r) for r in rows]


def test_plan_odc_and_pipeline(capsys):
    assert main(["plan", "odc", "--world-size", "8", "--sequences-per-rank", "4", "--minibatches", "1"]) == 0
    out = capsys.readouterr().out
    assert "recommended: " in out
    assert main(["plan", "pipeline", "--pp-size", "4", "--microbatches", "8", "--memory-gib", "1.5"]) == 0
    out = capsys.readouterr().out
    # the assumptions it used, from the workload flags' defaults
    assert "assumptions (from the workload flags)" in out
    assert "F 10.00 ms, I 10.00 ms, W 10.00 ms, saved activations 256.00 MiB" in out
    assert "host link 21.00 GB/s" in out and "4 ranks, 8 microbatches per step, 1.5 GiB" in out
    rows = _plan_rows(out)
    assert rows and all(float(r[7]) <= 1.5 for _, r in rows)  # peak GiB within the budget
    assert sum(star for star, _ in rows) == 1 and out.count("recommended: ") == 1
    assert main(["plan", "pipeline", "--pp-size", "4", "--microbatches", "8", "--memory-gib", "0.01"]) == 1


def test_plan_odc_recommends_context_parallelism_where_a_split_pays_and_not_where_it_is_off(tmp_path, capsys):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([16000, 900, 800, 700, 600, 500, 400, 300]))
    argv = ["plan", "odc", "--lengths-file", str(lengths), "--world-size", "4", "--gpus-per-node", "4",
            "--sequences-per-rank", "2", "--minibatches", "1", "--cost-model", "1.5b", "--max-tokens", "8192,16384"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "recommended: odc with --balance diff_micro --max-tokens 8192 --context-parallel auto" in out \
        or "recommended: odc with --balance diff_micro --max-tokens 16384 --context-parallel auto" in out
    assert "is a prediction" in out
    assert main([*argv, "--context-parallel", "off"]) == 0
    out = capsys.readouterr().out
    assert "--context-parallel" not in out and "max-tokens 16384" in out


def test_plan_pipeline_recommends_no_offload_when_that_fits_as_fast_and_the_least_offload_otherwise(capsys):
    """Everything fits in 4 GiB: the pick offloads nothing, even where offloading ties on time (it
    once ranked "offload 3 of 4 chunks" first). In 0.3 GiB nothing fits without offload: the pick
    offloads the least among the fastest and states its predicted cost; the printed simulate
    command reproduces its step time."""
    assert main(["plan", "pipeline", "--pp-size", "4", "--microbatches", "8", "--memory-gib", "4", "--top", "8"]) == 0
    out = capsys.readouterr().out
    [(star, first), *_] = _plan_rows(out)
    assert star and first[4] == "0" and "offload 0 chunks per rank" in out and "why: fits without offload" in out
    assert any(r[4] != "0" and r[5] == first[5] for _, r in _plan_rows(out))  # an offloading tie, not picked
    assert main(["plan", "pipeline", "--pp-size", "4", "--microbatches", "8", "--memory-gib", "0.3", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "why: nothing fits without offload; this offloads the least" in out and "predicted cost of its offload" in out
    [best] = [r for star, r in _plan_rows(out) if star]
    assert best[4] != "0" and float(best[7]) <= 0.3
    see = out.split("see it: posttrain ")[1].splitlines()[0].split()
    assert main([*see, "--plot", ""]) == 0
    assert f"makespan {best[5]} ms" in capsys.readouterr().out


def test_recommend_pipeline_takes_the_least_offload_within_the_tolerance_of_the_fastest():
    from posttrain.sim.pipeline import PipelineWorkload
    from posttrain.sim.planner import plan_pipeline, recommend_pipeline

    fits, _ = plan_pipeline(num_ranks=4, num_microbatches=8, workload=PipelineWorkload(activation_bytes=2**30),
                            memory_budget=3 * 2**30)
    best, why = recommend_pipeline(fits)
    fastest = fits[0].makespan
    near = [r for r in fits if r.makespan <= 1.01 * fastest]
    assert best in near and best.offloaded_bytes == min(r.offloaded_bytes for r in near)
    assert any(r.offloaded_bytes == 0 for r in fits) and best.offloaded_bytes > 0  # offload buys speed here
    assert why.startswith("without offload the fastest that fits")
    with pytest.raises(ValueError, match="no configuration fits"):
        recommend_pipeline([])


def _metrics(path, *, split=True, copies=True):
    """A posttrain pipeline --calibration-out file by hand: 2 ranks, one stage each, 2 microbatches."""
    mib = 2**20
    if split:
        acts = {0: [("0F0", 0, .010), ("0F1", .010, .022), ("0I0", .05, .07), ("0W0", .07, .08), ("0I1", .08, .10),
                    ("0W1", .10, .11)],
                1: [("1F0", .02, .05), ("1I0", .05, .09), ("1W0", .09, .10), ("1F1", .10, .13), ("1I1", .13, .17),
                    ("1W1", .17, .19)]}
    else:
        acts = {0: [("0F0", 0, .010), ("0F1", .010, .012), ("0B0", .05, .08), ("0B1", .08, .11)],
                1: [("1F0", .02, .05), ("1B0", .05, .10), ("1F1", .10, .13), ("1B1", .13, .18)]}
    if copies:
        acts[0] += [("0OFFLOAD0", .2, .2 + 4 * mib / 8e9), ("0RELOAD0", .3, .3 + 4 * mib / 2e9)]
    ranks = [{"rank": r, "stages": [r], "losses": [1.0], "step_times": [0.2],
              "result": {"actions": acts[r], "chunk_bytes": {str(r): (4 if r == 0 else 6) * mib},
                         **({"weight_keep": {str(r): 0.0 if r == 0 else 0.5}} if split else {})}} for r in (0, 1)]
    path.write_text(json.dumps({"config": {"schedule": "zb_h1" if split else "1f1b", "num_ranks": 2, "batch": 2,
                                           "seq_len": 64}, "ranks": ranks}))
    return str(path)


def test_pipeline_workload_is_calibrated_from_a_runs_metrics(tmp_path):
    """Per stage the median time of each kind, summed over stages = the whole model per microbatch,
    an equal share per planned rank; saved bytes likewise; the host link the median of the copies."""
    from posttrain.lab.calibrate import pipeline_workload_from_metrics

    w, notes = pipeline_workload_from_metrics(_metrics(tmp_path / "m.json"), num_ranks=4, host_bandwidth=1e9)
    # F: stage 0 median(10, 12) = 11 ms, stage 1 30 ms; I: 20 + 40; W: 10 + (10, 20 -> 15)
    assert w.forward_s == pytest.approx(0.041 / 4) and w.input_grad_s == pytest.approx(0.060 / 4)
    assert w.weight_grad_s == pytest.approx(0.025 / 4) and w.activation_bytes == 10 * 2**20 / 4
    assert w.host_bandwidth == pytest.approx(5e9)  # median of 8 and 2 GB/s
    assert "zb_h1, 2 ranks, 2 stages, microbatches of 2 x 64 tokens" in notes[0]
    assert w.weight_keep == pytest.approx(0.3)  # stage 0 keeps none of 4 MiB, stage 1 half of 6 MiB
    assert "W keeps 0.30 of the saved activations after I" in notes[2]
    w, notes = pipeline_workload_from_metrics(_metrics(tmp_path / "b.json", split=False, copies=False), num_ranks=2,
                                              host_bandwidth=1e9)
    # B: stage 0 median(30, 30), stage 1 median(50, 50): 80 ms, split evenly
    assert w.input_grad_s == w.weight_grad_s == pytest.approx(0.040 / 2) and w.host_bandwidth == 1e9
    assert w.weight_keep == 1.0
    assert "split evenly" in notes[1] and "`host_gbps` (the run offloaded nothing)" in notes[2]


def test_plan_pipeline_calibrate_uses_the_run_and_refuses_what_it_replaces(tmp_path, capsys):
    path = _metrics(tmp_path / "m.json")
    assert main(["plan", "pipeline", "--pp-size", "4", "--microbatches", "8", "--memory-gib", "1", "--calibrate", path]) == 0
    out = capsys.readouterr().out
    assert f"assumptions (calibrated from {path}" in out and "F 10.25 ms, I 15.00 ms, W 6.25 ms" in out
    assert "host link: the median of the run's 2 copies" in out and "host link 5.00 GB/s" in out
    assert main(["plan", "pipeline", "--memory-gib", "1", "--calibrate", path, "--forward-ms", "3"]) == 2
    assert "--calibrate measures what --forward-ms would set" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    for f in (str(bad), str(tmp_path / "missing.json")):
        assert main(["plan", "pipeline", "--memory-gib", "1", "--calibrate", f]) == 2
        assert f"--calibrate={f}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["simulate", "odc", "--world-size", "0"], "at least 1 GPU"),
    (["simulate", "odc", "--inter-gbps", "-5"], "--inter-gbps"),
    (["simulate", "pipeline", "--host-gbps", "-1"], "--host-gbps"),
    (["simulate", "odc", "--lengths-file", "/nonexistent"], "does not exist"),
    (["plan", "pipeline", "--memory-gib", "-1"], "--memory-gib"),
    # flags a schedule would ignore, and counts and costs out of range, named by flag
    (["simulate", "pipeline", "--pp-size", "0"], "--pp-size=0 must be at least 1"),
    (["simulate", "pipeline", "--microbatches", "0"], "--microbatches=0 must be at least 1"),
    (["simulate", "pipeline", "--host-gbps", "0"], "--host-gbps=0.0 must be a positive"),
    (["simulate", "pipeline", "--forward-ms", "-1"], "--forward-ms=-1.0 must be a non-negative"),
    (["simulate", "pipeline", "--weight-ms", "nan"], "--weight-ms=nan"),
    (["simulate", "pipeline", "--activation-mib", "-2"], "--activation-mib=-2.0"),
    (["simulate", "pipeline", "--schedule", "zbv", "--chunks", "3"], "got --chunks=3: drop it"),
    (["simulate", "pipeline", "--schedule", "1f1b", "--chunks", "2"], "got --chunks=2: drop it"),
    (["simulate", "pipeline", "--schedule", "zb_h1", "--group-size", "2"], "got --group-size=2: drop it"),
    (["simulate", "pipeline", "--schedule", "interleaved_1f1b", "--group-size", "8"], "got --group-size=8: drop it"),
    (["simulate", "pipeline", "--group-size", "9"], "--group-size=9 must be in [1, --pp-size=8]"),
    (["simulate", "pipeline", "--offload", "3"], "--offload=3 must be between 0 and the 2 chunks"),
    (["simulate", "pipeline", "--offload", "-1"], "--offload=-1 must be between 0"),
    (["plan", "pipeline", "--pp-size", "0", "--memory-gib", "4"], "--pp-size=0 must be at least 1"),
    (["plan", "pipeline", "--microbatches", "0", "--memory-gib", "4"], "--microbatches=0 must be at least 1"),
    (["plan", "pipeline", "--host-gbps", "0", "--memory-gib", "4"], "--host-gbps"),
    (["plan", "pipeline", "--backward-ms", "-1", "--memory-gib", "4"], "--backward-ms"),
    (["plan", "pipeline", "--top", "0", "--memory-gib", "4"], "--top"),
    (["plan", "odc", "--top", "0"], "--top"),
])
def test_bad_input_exits_2_with_a_message(argv, message, capsys):
    extra = {"odc": ["--trace", "", "--plot", ""], "pipeline": ["--plot", ""]}.get(argv[1], []) if argv[0] == "simulate" else []
    assert main(argv + extra) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) <= 2  # one line (and a deprecation note)


def test_unknown_profile_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        main(["simulate", "odc", "--profile", "nope"])
    assert e.value.code == 2 and "longalign" in capsys.readouterr().err


@pytest.mark.parametrize("old", [["--model", "1.5b"], ["--stages", "4"]])
def test_dropped_spellings_are_refused(old, capsys):
    """One word per concept: --cost-model and --pp-size have no second spelling."""
    with pytest.raises(SystemExit) as e:
        main(["plan", "odc", "--world-size", "8", "--sequences-per-rank", "2", "--minibatches", "1", *old])
    assert e.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_calibration_plumbing_on_a_tiny_config(capsys):
    """Runs measure -> predict -> real runs and reports both numbers (tiny: no accuracy claim)."""
    from posttrain.lab.calibrate import calibrate_odc, calibrate_pipeline
    from posttrain.train.sft import TrainConfig
    from posttrain.train.sft.pipeline import PipelineConfig

    r = calibrate_odc(TrainConfig(steps=3, sequences=8, max_len=128, max_tokens=128, dim=32, num_layers=2),
                      repeats=1, iters=1)
    assert r["predicted"] > 0 and r["measured"]["speedup"] > 0
    assert "predicted" in capsys.readouterr().out
    p = calibrate_pipeline(PipelineConfig(schedule="group_interleaved", num_ranks=2, chunks=2, num_microbatches=4,
                                          offload="1", num_layers=4, steps=1))
    assert p["predicted"] == p["measured"] == [3, 3]


def test_simulate_pipeline_takes_what_w_keeps(capsys):
    """zbv at p=8, m=32, full offload: 3 chunk-microbatches at most when W keeps everything (its
    part offloaded on its own), 2.44 when W keeps the 0.44 a GPT block's linear inputs take."""
    base = ["simulate", "pipeline", "--schedule", "zbv", "--pp-size", "8", "--microbatches", "32", "--forward-ms", "1",
            "--backward-ms", "1", "--weight-ms", "1", "--offload", "2", "--host-gbps", "1000", "--plot", ""]
    peaks = {}
    for keep in ("1", "0.44"):
        assert main([*base, "--weight-keep", keep]) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["7"]]
        peaks[keep] = float(rows[0][1])
    assert peaks == {"1": 3.0, "0.44": 2.44}
    assert main([*base, "--weight-keep", "1.5"]) == 2
    assert "--weight-keep=1.5 must be between 0 and 1" in capsys.readouterr().err


def test_a_list_option_that_is_not_a_list_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["simulate", "table", "--world-sizes", "8,x"])
    assert e.value.code == 2
    assert "--world-sizes: invalid comma-separated int list value: '8,x'" in capsys.readouterr().err


def test_calibrate_reports_its_fit_and_exits_0_when_it_ran(monkeypatch, tmp_path, capsys):
    """A calibration outside the 10% target (a noisy machine) still ran: it says how well it fits
    and exits 0 (non-zero only when it could not run)."""
    import posttrain.lab.calibrate as cal
    from posttrain.cli.simulate import Calibrate, _calibrate

    monkeypatch.setattr(cal, "calibrate_odc", lambda *a, **k: {"error": 0.3})
    monkeypatch.setattr(cal, "calibrate_pipeline", lambda cfg: {"predicted": 2, "measured": 2 if cfg.chunks == 1 else 3})
    assert _calibrate(Calibrate(json=str(tmp_path / "c.json"))) == 0
    out = capsys.readouterr().out
    assert "fit: the calibrated speedup is +30.0% off the measured one (outside the 10%" in out
    assert "pipeline peaks predicted exactly for 1 of 4 schedules" in out


def test_simulate_pipeline_takes_a_share_of_each_offloaded_chunk_or_the_planners(cli):
    """`simulate pipeline --offload-fraction`: a given share, or `auto` (the planner's: on the H200's
    measured stage 0.15 of each microbatch, within 2%); a share without offload, or not a number,
    is one line before anything runs."""
    stage = ("simulate", "pipeline", "--schedule", "gpipe", "--pp-size", "1", "--microbatches", "8", "--forward-ms",
             "7.6", "--backward-ms", "15.2", "--weight-ms", "0", "--activation-mib", "1526", "--host-gbps", "55",
             "--offload", "full", "--plot", "")
    rc, out, err = cli(*stage, "--offload-fraction", "auto")
    assert rc == 0, err
    assert "offload 1 chunk per rank, 0.15 of each" in out and "hidden here: yes" in out
    rc, out, err = cli(*stage, "--offload-fraction", "0.5")
    assert rc == 0 and "0.50 of each" in out and "hidden here: no" in out
    rc, _, err = cli("simulate", "pipeline", "--offload-fraction", "0.5", "--plot", "")
    assert rc == 2 and "--offload-fraction=0.5 is a share of the offloaded chunks" in err
    rc, _, err = cli(*stage, "--offload-fraction", "most")
    assert rc == 2 and "--offload-fraction='most' is not a number in (0, 1] or auto" in err
