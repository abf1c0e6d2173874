"""The README's shown outputs, rerun from its shown commands (``posttrain results --only readme``).

A command block the README shows is marked by ``<!-- commands: NAME -->`` at the end of the line
above its fenced bash block (a heading or prose line: the marker does not show); the output it
shows is the fenced block below a line ending in ``<!-- output: NAME -->``. Rerunning runs
every marked block's commands as written, in the README's order, in one scratch folder (the
commands name relative paths, and later blocks use what earlier ones wrote), keeps the lines of
their output that :data:`KEEP` selects for the block, and rewrites the output block; the README
is rewritten after each block. The picture the RL block draws replaces docs/rl_reward.png.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Callable, Sequence

from posttrain.lab.commands import run_posttrain

__all__ = ["KEEP", "readme_commands", "run_readme"]

#: Per block, the lines of its commands' output that the README shows.
KEEP = {
    "sft": r"^step +(299|399) |^exact match",
    "rl": r"^reward ",
    "pipeline": r"^loss .* ->|^exact match",
}
#: Pictures a block writes (in the scratch folder) that the README shows from the repository.
PICTURES = {"rl": ("out/rl_reward.png", "docs/rl_reward.png")}

_COMMANDS = re.compile(r"<!-- commands: (\S+) -->\n\n?```bash\n(.*?)\n```", re.S)
_OUTPUT = re.compile(r"(<!-- output: (\S+) -->\n\n?```\n)(.*?)(\n?```)", re.S)


def readme_commands(text: str) -> dict[str, list[list[str]]]:
    """Block name -> its commands, each as the argument list a shell would pass (continuation
    lines joined, ``#`` comments dropped), in the README's order.

    Raises:
        ValueError: a marked block holding something other than ``posttrain`` commands.
    """
    out = {}
    for m in _COMMANDS.finditer(text):
        lines = []
        for line in m.group(2).replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if not argv:
                continue
            if argv[0] != "posttrain":
                raise ValueError(f"README block {m.group(1)!r}: {line.strip()!r} is not a posttrain command")
            lines.append(argv)
        out[m.group(1)] = lines
    return out


def readme_outputs(text: str) -> dict[str, str]:
    """Block name -> the output the README shows for it."""
    return {m.group(2): m.group(3) for m in _OUTPUT.finditer(text)}


def _posttrain(argv: Sequence[str], cwd: str, log: Callable[[str], None]) -> list[str]:
    return run_posttrain(argv[1:], log, cwd=cwd)


def run_readme(path: str = "README.md", *, log: Callable[[str], None] = print,
               run: Callable[[Sequence[str], str, Callable[[str], None]], list[str]] = _posttrain) -> str:
    """Rerun every marked block of ``path`` and rewrite the outputs it shows; returns the text.

    Raises:
        ValueError: an output block without commands or without a :data:`KEEP` rule, or one whose
            commands printed nothing it keeps.
    """
    with open(path) as f:
        text = f.read()
    commands, shown = readme_commands(text), readme_outputs(text)
    for name in shown:
        if name not in commands or name not in KEEP:
            raise ValueError(f"{path}: output block {name!r} has no commands block or no KEEP rule")
    root = os.path.dirname(os.path.abspath(path))
    with tempfile.TemporaryDirectory(prefix="posttrain-readme-") as work:
        for name, argvs in commands.items():
            printed = [line for argv in argvs for line in run(argv, work, log)]
            if name not in shown:
                continue
            kept = [line.rstrip() for line in printed if re.match(KEEP[name], line)]
            if not kept:
                raise ValueError(f"{path}: the commands of block {name!r} printed nothing its output keeps")
            text = _OUTPUT.sub(lambda m, n=name, k=kept: m.group(1) + "\n".join(k) + "\n```"
                               if m.group(2) == n else m.group(0), text)
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)
            log(f"  rewrote the {name} output in {path}")
            if name in PICTURES and os.path.exists(os.path.join(work, PICTURES[name][0])):
                shutil.copyfile(os.path.join(work, PICTURES[name][0]), os.path.join(root, PICTURES[name][1]))
                log(f"  wrote {PICTURES[name][1]}")
    return text
