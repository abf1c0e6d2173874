"""posttrain command line.

    posttrain demo                          # ODC: tiny GPT, 2 CPU processes, long-tail lengths
    posttrain demo --steps 60 --world-size 4
    posttrain train --dp fsdp --balance same_micro --steps 20 --metrics out/fsdp.jsonl
    posttrain train --dp odc --balance diff_micro --profile bimodal --max-len 1024
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


def _train(args: argparse.Namespace) -> int:
    from posttrain.train import TrainConfig, run_training

    cfg = TrainConfig(
        dp=args.dp, balance=args.balance, profile=args.profile, steps=args.steps,
        sequences=args.sequences, max_len=args.max_len, max_tokens=args.max_tokens or args.max_len,
        dim=args.dim, num_layers=args.layers, optimizer=args.optimizer, lr=args.lr, seed=args.seed,
    )
    run_training(cfg, world_size=args.world_size, metrics_path=args.metrics)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from posttrain.balance import METHODS
    from posttrain.data import PROFILES
    from posttrain.train import DP_MODES

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

    train = sub.add_parser("train", help="train a GPT on synthetic data with FSDP2 or ODC")
    train.add_argument("--dp", choices=DP_MODES, default="odc", help="data-parallel engine (default odc)")
    train.add_argument("--balance", choices=METHODS, default="diff_micro", help="balancing method (default diff_micro)")
    train.add_argument("--profile", choices=PROFILES, default="long_tail", help="length profile (default long_tail)")
    train.add_argument("--world-size", type=int, default=2, help="CPU processes (default 2)")
    train.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    train.add_argument("--sequences", type=int, default=16, help="sequences per minibatch (default 16)")
    train.add_argument("--max-len", type=int, default=512, help="longest sequence (default 512)")
    train.add_argument("--max-tokens", type=int, default=None, help="tokens per microbatch (default: --max-len)")
    train.add_argument("--dim", type=int, default=128, help="model hidden size (default 128)")
    train.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    train.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="(default adamw)")
    train.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    train.add_argument("--seed", type=int, default=0, help="data and init seed (default 0)")
    train.add_argument("--metrics", default=None, help="write per-rank, per-step metrics to this JSONL file")
    train.set_defaults(func=_train)
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
