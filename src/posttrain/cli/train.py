"""``posttrain train``: data-parallel training on CPU processes or GPUs (or one rank under torchrun)."""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.train.sft import TrainConfig

from .options import add_command

__all__ = ["TrainCommand", "add_parser"]


@dataclass(frozen=True)
class TrainCommand:
    """``posttrain train``: one run, its processes and its pictures.

    Attributes:
        run: the training run.
        world_size: processes (default: one per GPU with ``device`` cuda, else 2; torchrun sets its own).
        plot: a per-rank timeline PNG of the last step.
        trace: the last step as a Chrome trace JSON (Perfetto).
    """

    run: TrainConfig = field(default_factory=lambda: TrainConfig(steps=20))
    world_size: int | None = None
    plot: str | None = None
    trace: str | None = None


def _run(c: TrainCommand) -> int:
    from dataclasses import replace

    from posttrain.lab.plots import plot_timelines
    from posttrain.spans import write_chrome_trace
    from posttrain.train.sft import run_training

    cfg = replace(c.run, progress=True)
    results = run_training(cfg, world_size=c.world_size, outputs={"`plot`": c.plot, "`trace`": c.trace})
    if results is None or not results[0]["metrics"]:
        return 0
    spans = {f"{cfg.engine.label}+{cfg.balance}": [s for r in results for s in r["spans"]]}
    if c.plot:
        last = results[0]["metrics"][-1]["step"]
        plot_timelines(spans, c.plot, title=f"step {last}: per-rank compute, communication and waiting")
        print(f"wrote {c.plot}")
    if c.trace:
        write_chrome_trace(spans, c.trace)
        print(f"wrote {c.trace} (chrome://tracing or ui.perfetto.dev; the simulator's traces open beside it)")
    return 0


def add_parser(sub) -> None:
    add_command(sub, "train", TrainCommand, _run, config_file=True,
                help="data-parallel training with FSDP2 or ODC on CPU processes or GPUs (or under torchrun)")
