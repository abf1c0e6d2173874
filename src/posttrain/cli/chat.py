"""``posttrain chat-task DIR``: the embedded chat task (a small model directory and chat data) to
post-train; ``posttrain evaluate MODEL_DIR --data FILE``: exact-match accuracy of greedy answers."""

from __future__ import annotations

from dataclasses import dataclass, field

from .options import add_command

__all__ = ["ChatTaskCommand", "EvaluateCommand", "add_parser"]


@dataclass(frozen=True)
class ChatTaskCommand:
    """``posttrain chat-task``: where the task goes and how much of it.

    Attributes:
        out_dir: the folder to write (model/, train.jsonl, eval.jsonl).
        records: training conversations.
        eval_records: held-out conversations.
        seed: the task's seed.
    """

    out_dir: str = field(default="", metadata={"positional": "DIR"})
    records: int = 4000
    eval_records: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("records", "eval_records"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")


@dataclass(frozen=True)
class EvaluateCommand:
    """``posttrain evaluate``: the model and the chats it answers.

    Attributes:
        model_dir: a transformers model directory (what a run's output directory holds).
        data: chat records whose last message is the reference answer.
        limit: grade at most this many.
    """

    model_dir: str = field(default="", metadata={"positional": "MODEL_DIR"})
    data: str = field(default="", metadata={"required": True})
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit={self.limit} must be at least 1")


def _make(c: ChatTaskCommand) -> int:
    from posttrain.lab.chat import make_chat_task

    paths = make_chat_task(c.out_dir, train_records=c.records, eval_records=c.eval_records, seed=c.seed)
    print(f"wrote {paths['model']} (a random Llama and the task's tokenizer), {paths['train']} and {paths['eval']}")
    print(f"post-train it:  posttrain train --model-path {paths['model']} --data {paths['train']} "
          f"--eval-data {paths['eval']} --output-dir OUT")
    return 0


def _evaluate(c: EvaluateCommand) -> int:
    from posttrain.lab.chat import exact_match

    got = exact_match(c.model_dir, c.data, limit=c.limit)
    for prompt, answer, reference in got["examples"]:
        print(f"  {prompt!r} -> {answer!r} (reference {reference!r})")
    print(f"exact match {got['accuracy']:.1%} of {got['n']} conversations")
    return 0


def add_parser(sub) -> None:
    add_command(sub, "chat-task", ChatTaskCommand, _make,
                help="write the embedded chat task: a small model directory and chat data")
    add_command(sub, "evaluate", EvaluateCommand, _evaluate,
                help="exact-match accuracy of a model's greedy answers to held-out chats")
