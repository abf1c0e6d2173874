"""``posttrain results``: rerun the measurements docs/results.md reports and rewrite it."""

from __future__ import annotations

import argparse

__all__ = ["add_parser"]


def _run(args: argparse.Namespace) -> int:
    from posttrain.lab.results import run_results

    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    run_results(args.path, only=only)
    return 0


def add_parser(sub) -> None:
    from posttrain.lab.results import SECTIONS

    p = sub.add_parser("results", help="rerun every measurement of docs/results.md and rewrite it (hours)")
    p.add_argument("--path", default="docs/results.md", help="the file to rewrite (default docs/results.md)")
    p.add_argument("--only", default=None,
                   help=f"comma-separated sections to rerun, keeping the rest ({', '.join(s.name for s in SECTIONS)}); "
                        "profiles:NAME reruns one profile of the profiles section")
    p.set_defaults(func=_run)
