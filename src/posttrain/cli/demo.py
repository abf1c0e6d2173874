"""``posttrain demo``: the same tiny GPT trained four ways, and where the speedup comes from."""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.lab.demo import DEMO, ROUNDS
from posttrain.train.sft import TrainConfig

from .options import add_command

__all__ = ["DemoCommand", "add_parser"]


@dataclass(frozen=True)
class DemoCommand:
    """``posttrain demo``: the run every variant trains, its processes and its picture.

    Attributes:
        run: the run every variant trains (its engine and balancing method are the variants').
        world_size: CPU processes.
        rounds: passes over the same minibatches, the four variants taking turns a step at a time;
            figures are pooled over them, each ratio with a 90% interval.
        no_predict: skip the simulator's calibration and its predictions at 8-64 GPUs.
        plot: timeline PNG ('' for none).
        json: the result and every timed step as JSON ('' for none).
    """

    run: TrainConfig = field(default_factory=lambda: DEMO,
                             metadata={"fields": ("profile", "steps", "sequences", "max_len", "max_tokens", "dim",
                                                  "num_layers", "optim.lr", "seed")})
    world_size: int = 2
    rounds: int = ROUNDS
    no_predict: bool = False
    plot: str = "out/demo_timeline.png"
    json: str = ""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be at least 1")
        if self.rounds < 1:
            raise ValueError(f"rounds={self.rounds} must be at least 1")


def _run(c: DemoCommand) -> int:
    from posttrain.lab.demo import run_demo
    from posttrain.train.core import check_output_path

    check_output_path("`plot`", c.plot, directory=False)
    if c.json:
        check_output_path("`json`", c.json, directory=False)
    run_demo(c.run, world_size=c.world_size, rounds=c.rounds, predict=not c.no_predict, timeline_path=c.plot or None,
             json_path=c.json or None)
    return 0


def add_parser(sub) -> None:
    add_command(sub, "demo", DemoCommand, _run,
                help="FSDP2 and ODC on a tiny GPT, 2 CPU processes, step by step over rounds: table, factors, "
                     "predictions, timeline")
