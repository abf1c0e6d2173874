"""The runnable examples under examples/, and the code shown in README.md and docs/: every Python
block shown is an excerpt of an example (its first line names which), so what a reader copies
is code that runs here."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
SOURCE = re.compile(r"^# from examples/(\S+\.py) \(runs as: (.+)\)$")


def _blocks() -> list[tuple[str, int, list[str]]]:
    """(file, line number, lines) of every ```python block in README.md and docs/*.md."""
    out = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() == "```python":
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
                out.append((doc.relative_to(ROOT).as_posix(), i + 1, lines[i + 1:end]))
    return out


def test_every_python_block_shown_is_an_excerpt_of_a_runnable_example():
    blocks = _blocks()
    assert len(blocks) >= 5
    for doc, at, lines in blocks:
        head = SOURCE.match(lines[0]) if lines else None
        assert head, f"{doc}:{at}: the block's first line should be '# from examples/NAME.py (runs as: ...)'"
        name, command = head.groups()
        assert name in EXAMPLES, f"{doc}:{at}: examples/{name} does not exist"
        assert f"examples/{name}" in command
        source = [ln.strip() for ln in (ROOT / "examples" / name).read_text().splitlines()]
        assert command in "\n".join(source), f"{doc}:{at}: examples/{name} does not say it runs as {command}"
        at_line = 0
        for line in lines[1:]:
            if not line.strip():
                continue
            try:
                at_line = source.index(line.strip(), at_line) + 1
            except ValueError:
                pytest.fail(f"{doc}:{at}: {line.strip()!r} is not in examples/{name} (after line {at_line})")


def _run(name: str, tmp_path) -> str:
    """Run examples/NAME as its docstring says (torchrun with 2 CPU processes, or python) from a
    scratch folder; its standard output."""
    path = ROOT / "examples" / name
    if "torchrun" in path.read_text().split('"""')[1]:
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        cmd = [torchrun, "--standalone", "--nproc-per-node", "2", str(path)]
    else:
        cmd = [sys.executable, str(path)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                          start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"}) as p:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            raise
    assert p.returncode == 0, f"examples/{name} failed:\n{err[-4000:]}"
    return out


@pytest.mark.parametrize("name", EXAMPLES)
@pytest.mark.slow
def test_example_runs(name, tmp_path):
    out = _run(name, tmp_path)
    if name == "odc_flat_shard.py":
        assert out.count("tokens on 2 ranks, gradient norm") == 4 and "parameters back on the model" in out
        assert (tmp_path / "out" / "examples" / "odc-checkpoint" / ".metadata").is_file()
    elif name == "engines.py":
        losses = {line.split()[0]: line.split()[2:] for line in out.splitlines() if " losses " in line}
        assert set(losses) == {"fsdp", "odc-fsdp2", "odc"}
        assert losses["odc"] == losses["fsdp"] == losses["odc-fsdp2"]  # the same steps, to 4 decimals
    elif name == "pipeline_offload.py":
        lines = out.splitlines()
        plain = [ln for ln in lines if "no offload" in ln]
        for ln in plain:  # measured = predicted
            predicted = re.search(r"predicted (\d+)\): peak (\d+) ", ln)
            assert predicted and predicted.group(1) == predicted.group(2), ln
        peak = {(ln.split(",")[0], "no offload" in ln): int(re.search(r"peak (\d+)", ln).group(1)) for ln in lines}
        assert peak[("rank 0", False)] < peak[("rank 0", True)]  # offload lowers rank 0's peak
        losses = {re.search(r"loss (\S+)", ln).group(1) for ln in lines if "loss" in ln}
        assert len(losses) == 1  # offload changes where activations wait, not the result
    elif name == "balance.py":
        imbalance = [float(x) for x in re.findall(r"imbalance ([\d.]+)", out)]
        assert len(imbalance) == 2 and imbalance[1] <= imbalance[0]  # diff_micro's never worse than same_micro's
    else:
        pytest.fail(f"examples/{name} has no check here: add one")
