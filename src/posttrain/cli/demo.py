"""``posttrain demo``: the same tiny GPT trained four ways, and where the speedup comes from."""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.lab.demo import DEMO
from posttrain.train.sft import TrainConfig

from .options import add_command

__all__ = ["DemoCommand", "add_parser"]


@dataclass(frozen=True)
class DemoCommand:
    """``posttrain demo``: the run every variant trains, its processes and its picture.

    Attributes:
        run: the run every variant trains (its engine and balancing method are the variants').
        world_size: CPU processes.
        plot: timeline PNG ('' for none).
    """

    run: TrainConfig = field(default_factory=lambda: DEMO,
                             metadata={"fields": ("steps", "sequences", "max_len", "optim.lr", "seed")})
    world_size: int = 2
    plot: str = "out/demo_timeline.png"


def _run(c: DemoCommand) -> int:
    from posttrain.lab.demo import run_demo

    run_demo(c.run, world_size=c.world_size, timeline_path=c.plot or None)
    return 0


def add_parser(sub) -> None:
    add_command(sub, "demo", DemoCommand, _run,
                help="FSDP2 and ODC on a tiny GPT, 2 CPU processes: table, factors, timeline")
