"""End-to-end: the CLI as a user runs it. A failure pinpoints the entry point or the demo."""

from __future__ import annotations

import os
import subprocess
import sys

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "posttrain", *args], capture_output=True, text=True, timeout=300, env=ENV
    )


def test_demo_trains_and_reports():
    """A short demo run: per-step loss and tokens/s, unequal microbatch counts, falling loss."""
    proc = _run("demo", "--steps", "12")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step")]
    assert len(lines) == 12
    assert "tokens/s" in lines[0] and "microbatches per rank" in lines[0]
    first, last = proc.stdout.splitlines()[-1].split("loss ")[1].split(";")[0].split(" -> ")
    assert float(last) < float(first)


def test_bad_demo_input_is_a_clear_error():
    proc = _run("demo", "--world-size", "0")
    assert proc.returncode == 2
    assert "--world-size=0 must be at least 1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_command_lists_choices():
    proc = _run("fly")
    assert proc.returncode != 0 and "demo" in proc.stderr


def test_train_fsdp_writes_metrics(tmp_path):
    """`posttrain train` with FSDP2 and same_micro: per-step lines and a JSONL line per rank and step."""
    import json

    metrics = tmp_path / "m.jsonl"
    proc = _run("train", "--dp", "fsdp", "--balance", "same_micro", "--steps", "3", "--sequences", "6",
                "--max-len", "64", "--dim", "32", "--layers", "2", "--metrics", str(metrics))
    assert proc.returncode == 0, proc.stderr
    assert sum(line.startswith("step") for line in proc.stdout.splitlines()) == 3
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == 6 and {r["rank"] for r in rows} == {0, 1}
    assert all(r["step_time_s"] > 0 and r["tokens"] > 0 for r in rows)


def test_train_bad_choice_and_budget():
    proc = _run("train", "--balance", "best")
    assert proc.returncode == 2 and "invalid choice: 'best'" in proc.stderr and "diff_micro" in proc.stderr
    proc = _run("train", "--max-len", "100", "--max-tokens", "50")
    assert proc.returncode == 2 and "--max-tokens=50 is smaller than the longest sequence" in proc.stderr
    assert "Traceback" not in proc.stderr
