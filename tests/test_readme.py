"""The README shows what its commands print: `posttrain results --only readme` reruns the commands
it shows (parsed from the README itself) and rewrites the outputs it shows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from posttrain.lab.readme import KEEP, readme_commands, readme_outputs, run_readme

ROOT = Path(__file__).resolve().parent.parent


def test_every_output_the_readme_shows_comes_from_commands_it_shows():
    text = (ROOT / "README.md").read_text()
    commands, shown = readme_commands(text), readme_outputs(text)
    assert set(shown) == {"sft", "rl", "pipeline"} and set(shown) <= set(commands)
    assert list(commands) == ["sft", "rl", "pipeline"]  # rerun in this order: each uses what the one before wrote
    from posttrain.cli import build_parser

    for name, argvs in commands.items():
        for argv in argvs:
            build_parser(argv[1]).parse_args(argv[1:])  # options the command has (argparse exits otherwise)
        lines = shown[name].splitlines()
        assert lines and all(re.match(KEEP[name], line) for line in lines), (name, lines)
    assert len(text.splitlines()) <= 150


def test_rerunning_rewrites_each_output_from_its_commands(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("intro\n\n## Train <!-- commands: sft -->\n\n```bash\nposttrain chat-task out/chat   # a task\n"
                      "posttrain train --steps 2 \\\n    --lr 1e-3\n```\n\nIt prints: <!-- output: sft -->\n\n```\nold\n```\n\n"
                      "then <!-- commands: rl -->\n\n```bash\nposttrain rl --plot out/rl_reward.png\n```\n"
                      "<!-- output: rl -->\n```\nold rl\n```\nend\n")
    (tmp_path / "docs").mkdir()
    ran, cwds = [], set()

    def fake(argv, cwd, log):
        ran.append(argv)
        cwds.add(cwd)
        if argv[1] == "rl":
            (Path(cwd) / "out").mkdir(exist_ok=True)
            (Path(cwd) / "out" / "rl_reward.png").write_bytes(b"png")
            return ["step    0  reward 0.1", "reward 0.100 -> 0.500 (mean of the first and last 1 step) in 3 s"]
        if argv[1] == "chat-task":
            return ["wrote out/chat"]
        return ["step  299  loss 0.1", "noise", "step  399  loss 0.05", "exact match 100.0% of 64 conversations"]

    text = run_readme(str(readme), log=lambda *a: None, run=fake)
    assert ran == [["posttrain", "chat-task", "out/chat"], ["posttrain", "train", "--steps", "2", "--lr", "1e-3"],
                   ["posttrain", "rl", "--plot", "out/rl_reward.png"]]
    assert len(cwds) == 1  # one scratch folder: later blocks use what earlier ones wrote
    assert readme_outputs(text) == {
        "sft": "step  299  loss 0.1\nstep  399  loss 0.05\nexact match 100.0% of 64 conversations",
        "rl": "reward 0.100 -> 0.500 (mean of the first and last 1 step) in 3 s"}
    assert readme.read_text() == text and text.endswith("```\nend\n")
    assert (tmp_path / "docs" / "rl_reward.png").read_bytes() == b"png"  # the picture the README shows


def test_a_block_that_is_not_posttrain_or_prints_nothing_kept_is_refused(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("x <!-- commands: sft -->\n\n```bash\nrm -rf /\n```\n")
    with pytest.raises(ValueError, match="'rm -rf /' is not a posttrain command"):
        run_readme(str(readme), log=lambda *a: None, run=lambda *a: [])
    readme.write_text("x <!-- commands: sft -->\n\n```bash\nposttrain train\n```\ny <!-- output: sft -->\n```\nold\n```\n")
    with pytest.raises(ValueError, match="printed nothing its output keeps"):
        run_readme(str(readme), log=lambda *a: None, run=lambda *a: ["nothing"])
