"""``posttrain rl``: GRPO/RLOO with rollouts by ``transformers`` ``generate`` and the policy
update on any data-parallel engine, on CPU processes."""

from __future__ import annotations

import argparse

from .options import add_config_arguments, add_config_file_argument, config_from_args

__all__ = ["add_parser"]


def _run(args: argparse.Namespace) -> int:
    from posttrain.lab.plots import plot_reward_curve
    from posttrain.train.core import check_output_path
    from posttrain.train.rl import RLConfig, run_rl

    cfg = config_from_args(RLConfig, args, progress=True)
    if cfg.model_path is None:
        import os
        from dataclasses import replace

        from posttrain.lab.chat import make_chat_task

        task = args.task_dir
        if not os.path.isfile(os.path.join(task, "model", "config.json")):
            from posttrain.train.core import under_torchrun

            if under_torchrun():  # every rank would write it at once
                raise ValueError(f"no chat task in {task}: make it first (posttrain chat-task {task}) or give --model-path")
            make_chat_task(task)
        print(f"no --model-path: the embedded chat task's model in {task}/model (posttrain chat-task). From random "
              f"weights no answer is right and every group is skipped; train it first (README: post-train a "
              f"Hugging Face model) and give --model-path", flush=True)
        cfg = replace(cfg, model_path=os.path.join(task, "model"), prompts=cfg.prompts or os.path.join(task, "train.jsonl"))
    check_output_path("--plot", args.plot, directory=False)
    results = run_rl(cfg, world_size=args.world_size)
    if results is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    if not results:  # the checkpoint already holds every step
        if cfg.output_dir or args.plot:
            print(f"(nothing trained, so --output-dir/--plot not written; posttrain export {cfg.checkpoint_dir} OUT_DIR "
                  "writes the model)")
        return 0
    if args.plot:
        rows = results[0]["metrics"]
        plot_reward_curve(rows, args.plot, title=f"posttrain rl: {cfg.advantage}, {cfg.engine.label}+{cfg.balance}, "
                          f"{cfg.prompts_per_step} prompts x {cfg.samples_per_prompt} samples a step")
        print(f"wrote {args.plot}")
    return 0


def add_parser(sub) -> None:
    from posttrain.train.rl import RLConfig

    p = sub.add_parser("rl", help="GRPO/RLOO: sample, reward, and update the policy on any data-parallel engine")
    add_config_arguments(p, RLConfig)
    p.add_argument("--world-size", type=int, default=2, help="CPU processes (default 2)")
    p.add_argument("--plot", default=None, help="write the mean reward per step as a PNG")
    p.add_argument("--task-dir", default="out/chat",
                   help="without --model-path: where the embedded chat task is (made there if absent; default out/chat)")
    add_config_file_argument(p)
    p.set_defaults(func=_run)
