"""An embedded chat task and a tokenizer trained for it: data a short CPU run visibly learns,
made on the spot (nothing downloaded).

The task: the user gives three digits, the assistant answers with them reversed
(``"reverse 3 1 4"`` -> ``"4 1 3"``), graded by exact match. A 2-layer, 64-wide Llama learns it
from random weights within 400 steps of 32 conversations (``tests/test_chat_task.py`` checks it);
variable lengths (``min_digits < max_digits``) take many more. The tokenizer is a byte-level BPE
trained on the task's own text, with ChatML turns (``<|im_start|>role\\n...<|im_end|>\\n``) as
its chat template and ``<|im_end|>`` as end of sequence.
"""

from __future__ import annotations

import random

__all__ = ["CHATML_TEMPLATE", "chat_task_records", "reverse_answer", "train_chat_tokenizer"]

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def reverse_answer(prompt: str) -> str:
    """The exact answer to a task prompt ``"reverse d d d"``."""
    return " ".join(reversed(prompt.split()[1:]))


def chat_task_records(n: int, *, seed: int = 0, min_digits: int = 3, max_digits: int = 3,
                      system: bool = True) -> list[dict]:
    """``n`` chat records ``{"messages": [system?, user, assistant]}`` of the reversal task."""
    if n < 0 or not 1 <= min_digits <= max_digits:
        raise ValueError(f"need n >= 0 and 1 <= min_digits <= max_digits, got {n}, {min_digits}, {max_digits}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        digits = [str(rng.randrange(10)) for _ in range(rng.randint(min_digits, max_digits))]
        prompt = "reverse " + " ".join(digits)
        msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": reverse_answer(prompt)}]
        if system:
            msgs.insert(0, {"role": "system", "content": "You reverse digits."})
        out.append({"messages": msgs})
    return out


def train_chat_tokenizer(texts: list[str] | None = None, *, vocab_size: int = 320):
    """A ``transformers`` fast tokenizer: byte-level BPE trained on ``texts`` (default: the
    task's own records), ChatML chat template, ``<|im_end|>`` as end of sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if texts is None:
        texts = [m["content"] for r in chat_task_records(500, seed=12345) for m in r["messages"]]
        texts += ["user", "assistant", "system"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(_SPECIAL),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML_TEMPLATE)
