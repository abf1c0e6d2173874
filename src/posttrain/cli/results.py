"""``posttrain results``: rerun the measurements docs/results.md reports and rewrite it."""

from __future__ import annotations

from dataclasses import dataclass

from .options import add_command

__all__ = ["ResultsCommand", "add_parser"]


@dataclass(frozen=True)
class ResultsCommand:
    """``posttrain results``: the file to rewrite and what to rerun.

    Attributes:
        path: the file to rewrite.
        only: sections to rerun, keeping the rest (demo, profiles, ...: the section names of
            docs/results.md); profiles:NAME reruns one profile of the profiles section; readme
            reruns the commands README.md shows and rewrites the outputs it shows.
    """

    path: str = "docs/results.md"
    only: tuple[str, ...] | None = None


def _run(c: ResultsCommand) -> int:
    from posttrain.lab.results import run_results

    run_results(c.path, only=list(c.only) if c.only else None)
    return 0


def add_parser(sub) -> None:
    add_command(sub, "results", ResultsCommand, _run,
                help="rerun every measurement of docs/results.md and rewrite it (hours)")
