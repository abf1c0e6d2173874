"""``posttrain train``: data-parallel training on CPU processes (or one rank under torchrun)."""

from __future__ import annotations

import argparse

from .options import add_config_arguments, add_config_file_argument, config_from_args

__all__ = ["add_parser", "train_config"]


def train_config(args: argparse.Namespace, **overrides):
    """The :class:`~posttrain.train.sft.TrainConfig` of parsed ``TrainConfig`` options; ``--max-tokens``
    defaults to ``--max-len``."""
    from posttrain.train.sft import TrainConfig

    overrides.setdefault("max_tokens", getattr(args, "max_tokens", None) or args.max_len)
    return config_from_args(TrainConfig, args, **overrides)


def _run(args: argparse.Namespace) -> int:
    from posttrain.lab.plots import plot_timelines
    from posttrain.spans import write_chrome_trace
    from posttrain.train.sft import run_training

    cfg = train_config(args, progress=True)
    results = run_training(cfg, world_size=args.world_size,
                           outputs={"--plot": args.plot, "--trace": args.trace})
    if results is None or not results[0]["metrics"]:
        return 0
    spans = {f"{cfg.engine.label}+{cfg.balance}": [s for r in results for s in r["spans"]]}
    if args.plot:
        last = results[0]["metrics"][-1]["step"]
        plot_timelines(spans, args.plot, title=f"step {last}: per-rank compute, communication and waiting")
        print(f"wrote {args.plot}")
    if args.trace:
        write_chrome_trace(spans, args.trace)
        print(f"wrote {args.trace} (chrome://tracing or ui.perfetto.dev; the simulator's traces open beside it)")
    return 0


def add_parser(sub) -> None:
    from posttrain.train.sft import TrainConfig

    p = sub.add_parser("train", help="data-parallel training with FSDP2 or ODC on CPU processes (or under torchrun)")
    add_config_arguments(p, TrainConfig, defaults={"steps": 20, "max_tokens": None})
    p.add_argument("--world-size", type=int, default=2, help="CPU processes (default 2; torchrun sets its own)")
    add_config_file_argument(p)
    p.add_argument("--plot", default=None, help="write a per-rank timeline PNG of the last step")
    p.add_argument("--trace", default=None, help="write the last step as a Chrome trace JSON (Perfetto)")
    p.set_defaults(func=_run)
