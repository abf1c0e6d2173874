"""``posttrain rl``: GRPO/RLOO with rollouts by ``transformers`` ``generate`` and the policy
update on any data-parallel engine, on CPU processes."""

from __future__ import annotations

import argparse

from .options import add_config_arguments, add_config_file_argument, config_from_args

__all__ = ["add_parser"]


def _run(args: argparse.Namespace) -> int:
    from posttrain.train.rl import RLConfig, run_rl

    run_rl(config_from_args(RLConfig, args, progress=True), world_size=args.world_size)
    return 0


def add_parser(sub) -> None:
    from posttrain.train.rl import RLConfig

    p = sub.add_parser("rl", help="GRPO/RLOO: sample, reward, and update the policy on any data-parallel engine")
    add_config_arguments(p, RLConfig)
    p.add_argument("--world-size", type=int, default=2, help="CPU processes (default 2)")
    add_config_file_argument(p)
    p.set_defaults(func=_run)
