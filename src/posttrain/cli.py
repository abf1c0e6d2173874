"""posttrain command line.

    posttrain demo                          # ODC: tiny GPT, 2 CPU processes, long-tail lengths
    posttrain demo --steps 60 --world-size 4
    python -m posttrain demo                # the same without the console script
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from posttrain.demo import DEMO, run_demo

    cfg = replace(DEMO, steps=args.steps, sequences=args.sequences, max_len=args.max_len,
                  max_tokens=args.max_len, lr=args.lr, seed=args.seed)
    run_demo(cfg, world_size=args.world_size)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny GPT with ODC on CPU processes")
    demo.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    demo.add_argument("--world-size", type=int, default=2, help="CPU processes (default 2)")
    demo.add_argument("--sequences", type=int, default=12, help="sequences per minibatch (default 12)")
    demo.add_argument("--max-len", type=int, default=192, help="longest sequence (default 192)")
    demo.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    demo.add_argument("--seed", type=int, default=0, help="data and init seed (default 0)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"posttrain: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
