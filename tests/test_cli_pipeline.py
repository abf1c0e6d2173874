"""`posttrain pipeline`: measured and predicted peaks, the chart, and input errors."""

from __future__ import annotations

import pytest


def test_pipeline_reports_measured_and_predicted_peaks_and_draws_the_chart(cli_proc, tmp_path, cli):
    png, metrics = tmp_path / "p.png", tmp_path / "m.json"
    proc = cli_proc("pipeline", "--schedule", "group_interleaved", "--pp-size", "2", "--chunks", "2", "--group-size", "1",
                "--microbatches", "4", "--offload", "1", "--steps", "2", "--dim", "32", "--layers", "4",
                "--seq-len", "32", "--plot", str(png), "--calibration-out", str(metrics))
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.split() and line.split()[0] in ("0", "1")]
    assert len(rows) == 2
    for row in rows:  # peak units (measured) equals the schedule's prediction
        assert float(row[3]) == float(row[4]) and float(row[5]) > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the run's metrics calibrate the planner: measured times, saved bytes and copy bandwidth
    rc, out, err = cli("plan", "pipeline", "--pp-size", "2", "--microbatches", "4", "--memory-gib", "1",
                       "--calibrate", str(metrics))
    assert rc == 0, err
    assert f"calibrated from {metrics}: group_interleaved, 2 ranks, 4 stages" in out
    assert "host link: the median of the run's" in out and "recommended: " in out


def test_split_backward_frees_what_only_i_needs_and_the_report_says_what_w_kept(cli_proc):
    peaks = {}
    for extra in ([], ["--no-weight-split"]):
        proc = cli_proc("pipeline", "--schedule", "zbv", "--pp-size", "2", "--microbatches", "4", "--offload", "full",
                       "--steps", "2", "--dim", "32", "--seq-len", "32", "--plot", "", *extra)
        assert proc.returncode == 0, proc.stderr
        rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["0"], ["1"])]
        assert all(float(r[3]) == float(r[4]) for r in rows)  # measured = predicted with the measured fractions
        peaks[bool(extra)] = [float(r[2]) for r in rows]  # MiB
        kept = next(line for line in proc.stdout.splitlines() if line.startswith("kept for W after I"))
        assert ("0: 0.00, 1: 0." in kept) if not extra else ("0: 1.00, 1: 1.00" in kept)
    assert all(a < b for a, b in zip(peaks[False], peaks[True])), peaks


def test_pipeline_runs_a_share_of_each_offloaded_chunk_and_says_so(cli_proc):
    proc = cli_proc("pipeline", "--schedule", "gpipe", "--pp-size", "2", "--microbatches", "4", "--offload", "full",
                    "--offload-fraction", "0.5", "--steps", "1", "--dim", "32", "--seq-len", "32", "--plot", "")
    assert proc.returncode == 0, proc.stderr
    assert "offload full (0.5 of each)" in proc.stdout.splitlines()[0]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert len(rows) == 2 and all(float(r[5]) > 0 for r in rows)  # some bytes went to host memory on each rank


def test_pipeline_bad_input_is_a_clear_error(cli, capsys):
    rc, _, err = cli("pipeline", "--schedule", "interleaved_1f1b", "--pp-size", "4", "--chunks", "2", "--microbatches", "2")
    assert rc == 2 and "needs at least 4 microbatches" in err and "Traceback" not in err
    rc, _, err = cli("pipeline", "--schedule", "pipedream")  # argparse's own error for a bad choice
    assert rc == 2 and "gpipe" in err and "zbv" in err
    rc, _, err = cli("pipeline", "--pp-size", "2", "--layers", "1")  # a trainer's error, named by the flags
    assert rc == 2 and "--layers=1 cannot be cut into 2 stages" in err


@pytest.mark.parametrize("argv, message", [
    (["--schedule", "1f1b", "--group-size", "2"], "1f1b takes no group size, got --group-size=2: drop it"),
    (["--schedule", "gpipe", "--group-size", "2"], "got --group-size=2: drop it"),
    (["--schedule", "zb_h1", "--group-size", "1"], "got --group-size=1: drop it"),
    (["--schedule", "zbv", "--group-size", "2"], "got --group-size=2: drop it"),
    (["--schedule", "interleaved_1f1b", "--chunks", "2", "--group-size", "2"], "got --group-size=2: drop it"),
    (["--schedule", "zbv", "--chunks", "3"], "zbv runs 2 chunks per rank (a V), got --chunks=3: drop it"),
    (["--schedule", "zbv", "--chunks", "1"], "got --chunks=1: drop it"),
    (["--schedule", "1f1b", "--chunks", "2"], "got --chunks=2: drop it"),
    (["--schedule", "interleaved_1f1b", "--chunks", "0"], "--chunks=0 must be at least 1"),
    (["--pp-size", "0"], "--pp-size=0 must be at least 1"),
    (["--microbatches", "0"], "--microbatches=0 must be at least 1"),
    (["--schedule", "group_interleaved", "--chunks", "2", "--group-size", "3"], "--group-size=3 must be in [1, --pp-size=2]"),
    (["--offload", "3"], "--offload=3"),
])
def test_pipeline_flags_a_schedule_would_ignore_are_errors_naming_the_flag(cli, argv, message):
    """Refused in one line before any process starts (in-process: no rank is forked)."""
    rc, out, err = cli("pipeline", *argv, "--plot", "")
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1 and not out, (out, err)
