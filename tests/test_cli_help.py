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
