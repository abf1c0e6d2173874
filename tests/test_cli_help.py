"""Every command's help, read as a user reads it: no reStructuredText markup, no dead links to
docs, no doubled words, every choice list spelled out. A failure names the command and the text."""

from __future__ import annotations

import argparse
import os
import re

from posttrain.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _helps() -> dict[str, str]:
    parser = build_parser(None)
    out = {"posttrain": parser.format_help()}
    todo = [("posttrain", parser)]
    while todo:
        name, p = todo.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, sp in action.choices.items():
                    out[f"{name} {sub}"] = sp.format_help()
                    todo.append((f"{name} {sub}", sp))
    return out


def test_help_has_no_markup_dead_links_or_doubled_words():
    helps = _helps()
    assert len(helps) > 15, sorted(helps)
    for name, text in helps.items():
        flat = " ".join(text.split())
        assert ":mod:" not in flat and ":func:" not in flat and ":class:" not in flat and "``" not in flat, name
        for doc in re.findall(r"docs/[\w-]+\.md", flat):
            assert os.path.isfile(os.path.join(ROOT, doc)), (name, doc)
        options = " ".join(text.split("options:", 1)[-1].split())  # (a command list's "name  help" is no prose)
        doubled = re.findall(r"\b(\w{3,}) \1\b", options)
        assert not doubled, (name, doubled)
    assert "posttrain command line." not in helps["posttrain"]
    assert "zbv" in helps["posttrain pipeline"]  # the schedules are listed, not pointed at


def test_the_command_list_is_answered_without_importing_the_commands():
    """``posttrain --help``, a bare ``posttrain`` and a mistyped command list the commands from
    ``SUMMARIES`` without importing torch (a command's options come from the code it runs, which
    takes seconds to import); the summaries are the commands' own help, word for word."""
    import subprocess
    import sys

    from posttrain.cli import COMMANDS, SUMMARIES

    full = next(a for a in build_parser(None)._actions if isinstance(a, argparse._SubParsersAction))
    assert {c.dest: c.help for c in full._choices_actions} == SUMMARIES and list(SUMMARIES) == list(COMMANDS)
    probe = ("import sys\nfrom posttrain.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
             "    print('torch imported' if 'torch' in sys.modules else 'no torch', e.code)")
    for argv, code in ((["--help"], 0), ([], 2), (["trian"], 2)):
        proc = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=60)
        assert proc.stdout.strip().splitlines()[-1] == f"no torch {code}", (argv, proc.stdout, proc.stderr)
    proc = subprocess.run([sys.executable, "-c", probe, "--help"], capture_output=True, text=True, timeout=60)
    assert all(f"    {name}" in proc.stdout for name in COMMANDS) and SUMMARIES["rl"] in " ".join(proc.stdout.split())
