"""``posttrain chat-task DIR``: the embedded chat task (a small model directory and chat data) to
post-train; ``posttrain evaluate MODEL_DIR --data FILE``: exact-match accuracy of greedy answers."""

from __future__ import annotations

import argparse

__all__ = ["add_parser"]


def _make(args: argparse.Namespace) -> int:
    from posttrain.lab.chat import make_chat_task

    paths = make_chat_task(args.out_dir, train_records=args.records, eval_records=args.eval_records, seed=args.seed)
    print(f"wrote {paths['model']} (a random Llama and the task's tokenizer), {paths['train']} and {paths['eval']}")
    print(f"post-train it:  posttrain train --model-path {paths['model']} --data {paths['train']} "
          f"--eval-data {paths['eval']} --output-dir OUT")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from posttrain.lab.chat import exact_match

    got = exact_match(args.model_dir, args.data, limit=args.limit)
    for prompt, answer, reference in got["examples"]:
        print(f"  {prompt!r} -> {answer!r} (reference {reference!r})")
    print(f"exact match {got['accuracy']:.1%} of {got['n']} conversations")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("chat-task", help="write the embedded chat task: a small model directory and chat data")
    p.add_argument("out_dir", metavar="DIR")
    p.add_argument("--records", type=int, default=4000, help="training conversations (default 4000)")
    p.add_argument("--eval-records", type=int, default=64, help="held-out conversations (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make)
    p = sub.add_parser("evaluate", help="exact-match accuracy of a model's greedy answers to held-out chats")
    p.add_argument("model_dir", metavar="MODEL_DIR", help="a transformers model directory (e.g. --output-dir)")
    p.add_argument("--data", required=True, help="chat records whose last message is the reference answer")
    p.add_argument("--limit", type=int, default=None, help="grade at most this many")
    p.set_defaults(func=_evaluate)
