"""``posttrain demo``: the same tiny GPT trained four ways, and where the speedup comes from."""

from __future__ import annotations

import argparse

from .options import add_config_arguments

__all__ = ["add_parser"]


def _run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from posttrain.lab.demo import DEMO, run_demo

    cfg = replace(DEMO, steps=args.steps, sequences=args.sequences, max_len=args.max_len, max_tokens=args.max_len,
                  optim=replace(DEMO.optim, lr=getattr(args, "optim.lr")), seed=args.seed)
    run_demo(cfg, world_size=args.world_size, timeline_path=args.plot or None)
    return 0


def add_parser(sub) -> None:
    from posttrain.lab.demo import DEMO
    from posttrain.train.core import config_value
    from posttrain.train.sft import TrainConfig

    p = sub.add_parser("demo", help="FSDP2 and ODC on a tiny GPT, 2 CPU processes: table, factors, timeline")
    add_config_arguments(p, TrainConfig, fields=("steps", "sequences", "max_len", "optim.lr", "seed"),
                         defaults={k: config_value(DEMO, k) for k in ("steps", "sequences", "max_len", "optim.lr", "seed")})
    p.add_argument("--world-size", type=int, default=2, help="CPU processes (default 2)")
    p.add_argument("--plot", default="out/demo_timeline.png", help="timeline PNG ('' for none)")
    p.set_defaults(func=_run)
