"""``posttrain rl``: GRPO/RLOO with rollouts by ``transformers`` ``generate`` and the policy
update on any data-parallel engine, on CPU processes or GPUs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from posttrain.train.rl import RLConfig

from .options import add_command

__all__ = ["RLCommand", "add_parser"]


@dataclass(frozen=True)
class RLCommand:
    """``posttrain rl``: one run, its processes, its picture and the default task.

    Attributes:
        run: the RL run.
        world_size: processes (default: one per GPU with ``device`` cuda, else 2; torchrun sets its own).
        plot: the mean reward per step as a PNG.
        task_dir: with ``random_weights``: where the embedded chat task is (made there if absent).
        random_weights: without ``model_path``, run the embedded chat task's untrained model on its
            prompts (random weights answer nothing right, so nothing learns: for trying the command).
    """

    run: RLConfig = field(default_factory=RLConfig)
    world_size: int | None = None
    plot: str | None = None
    task_dir: str = "out/chat"
    random_weights: bool = False


def _run(c: RLCommand) -> int:
    from posttrain.lab.plots import plot_reward_curve
    from posttrain.train.core import check_output_path
    from posttrain.train.rl import run_rl

    cfg = replace(c.run, progress=True)
    _ = cfg.device_kind  # a device the run cannot use: one line, before the task below is made
    if cfg.model_path is not None and c.random_weights:
        raise ValueError("`random_weights` runs the chat task's untrained model instead of `model_path`: give one of them")
    if cfg.model_path is None and not c.random_weights:
        raise ValueError("posttrain rl needs `model_path`: a transformers model directory to train (README: post-train "
                         "the embedded chat model with posttrain train, then give its --output-dir), or "
                         "`random_weights` to try the command on the chat task's untrained model (nothing learns)")
    if cfg.model_path is None:
        import os

        from posttrain.lab.chat import make_chat_task

        task = c.task_dir
        if not os.path.isfile(os.path.join(task, "model", "config.json")):
            from posttrain.train.core import under_torchrun

            if under_torchrun():  # every rank would write it at once
                raise ValueError(f"no chat task in {task}: make it first (posttrain chat-task {task}) or give --model-path")
            make_chat_task(task)
        print(f"--random-weights: the embedded chat task's untrained model in {task}/model. No answer is right, "
              f"every group is skipped and nothing learns; train it first (README: post-train a Hugging Face model) "
              f"and give --model-path", flush=True)
        cfg = replace(cfg, model_path=os.path.join(task, "model"), prompts=cfg.prompts or os.path.join(task, "train.jsonl"))
    check_output_path("`plot`", c.plot, directory=False)
    results = run_rl(cfg, world_size=c.world_size)
    if results is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    if not results:  # the checkpoint already holds every step
        if cfg.output_dir or c.plot:
            print(f"(nothing trained, so --output-dir/--plot not written; posttrain export {cfg.checkpoint_dir} OUT_DIR "
                  "writes the model)")
        return 0
    if c.plot:
        rows = results[0]["metrics"]
        plot_reward_curve(rows, c.plot, title=f"posttrain rl: {cfg.advantage}, {cfg.engine.label}+{cfg.balance}, "
                          f"{cfg.prompts_per_step} prompts x {cfg.samples_per_prompt} samples a step")
        print(f"wrote {c.plot}")
    return 0


def add_parser(sub) -> None:
    add_command(sub, "rl", RLCommand, _run, config_file=True,
                help="GRPO/RLOO: sample, reward, and update the policy on any data-parallel engine")
