"""Records in, token ids and labels out: the data formats ``posttrain train`` reads.

A record (one JSONL line, one row of a ``datasets`` table) is one of:

- chat: ``{"messages": [{"role": ..., "content": ...}, ...]}``, rendered by the tokenizer's chat
  template; the assistant turns are trained (their text and the template's end-of-turn marks);
- ``{"prompt": str, "completion": str}``: the completion is trained (an end-of-sequence token
  is appended when the tokenizer has one);
- ``{"text": str}``: every token is trained (end-of-sequence appended);
- pre-tokenized ``{"input_ids": [int, ...]}`` with optional ``{"labels": [...]}``, ``-100``
  where a token is not trained (the ``transformers`` convention: ``labels[i]`` is the target the
  model predicts at position ``i - 1``).

``train_on_prompt=True`` trains every token whatever the format says.

How chat masks are found: the conversation is rendered once, and once per assistant turn up to
that turn with and without it (``add_generation_prompt=True`` before it); the characters the turn
adds are its span, and a token is trained when it starts inside a span (token offsets from a fast
tokenizer). This needs a template that renders a conversation prefix by prefix (each render a
prefix of the next), which the common templates do; one that rewrites earlier turns is refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FORMATS", "IGNORE_INDEX", "Encoded", "encode_record", "record_format"]

#: The label of a token that is not trained.
IGNORE_INDEX = -100
FORMATS = ("messages", "prompt_completion", "text", "input_ids")


@dataclass(frozen=True)
class Encoded:
    """One record as token ids and labels of the same length (``IGNORE_INDEX``: not trained)."""

    input_ids: list[int]
    labels: list[int]

    @property
    def trained(self) -> int:
        """How many next-token targets are trained (the first position is never a target)."""
        return sum(1 for t in self.labels[1:] if t != IGNORE_INDEX)


def record_format(record: Any) -> str:
    """Which of :data:`FORMATS` ``record`` is.

    Raises:
        ValueError: not an object, or none of the formats' keys.
    """
    if not isinstance(record, Mapping):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        return "messages"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    if "input_ids" in record:
        return "input_ids"
    raise ValueError(f"expected one of 'messages', 'prompt'+'completion', 'text' or 'input_ids'; got keys "
                     f"{', '.join(map(repr, record)) or 'none'}")


def _ids(tokenizer, text: str, *, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _with_eos(tokenizer, ids: list[int]) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return [*ids, eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {'role', 'content'} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} must be an object with string 'role' and 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("the conversation has no assistant message: nothing to train on")


#: The roles every chat template is taken to know (templates that name only some, such as Llama
#: 3's, which tests for ``system`` alone, print the others as they are).
STANDARD_ROLES = ("system", "user", "assistant", "tool")
_ROLE_TEST = re.compile(r"""role['"]?\]?\s*==\s*['"]([A-Za-z_][\w-]*)['"]""")


def template_roles(template: str) -> tuple[str, ...]:
    """The roles a chat template knows: :data:`STANDARD_ROLES` and those it compares a message's
    role with (``message['role'] == 'ipython'``), in that order."""
    named = sorted(set(_ROLE_TEST.findall(template)) - set(STANDARD_ROLES))
    return (*STANDARD_ROLES, *named)


def _encode_messages(messages: list[dict], tokenizer, train_on_prompt: bool) -> Encoded:
    _check_messages(messages)
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise ValueError("chat 'messages' need a tokenizer with a chat template (tokenizer_config.json "
                         "'chat_template'); this tokenizer has none")
    known = template_roles(template if isinstance(template, str) else str(template))
    for i, m in enumerate(messages):
        if m["role"] not in known:
            raise ValueError(f"message {i} has role {m['role']!r}, which the chat template does not know "
                             f"(roles: {', '.join(known)})")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("chat masks need a fast tokenizer (token offsets); this one is not")

    def render(msgs: list[dict], generation_prompt: bool) -> str:
        if not msgs:
            return ""
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)

    full = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, after = render(messages[:i], True), render(messages[: i + 1], False)
        if not (after.startswith(before) and full.startswith(after)):
            raise ValueError(f"the chat template does not render this conversation prefix by prefix (around "
                             f"message {i}), so its assistant tokens cannot be located; give pre-tokenized "
                             "'input_ids' with 'labels' instead")
        spans.append((len(before), len(after)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if train_on_prompt:
        return Encoded(ids, list(ids))
    labels = [t if any(a <= start < b for a, b in spans) else IGNORE_INDEX
              for t, (start, _end) in zip(ids, enc["offset_mapping"])]
    return Encoded(ids, labels)


#: Token ids are stored as 64-bit integers; the model's vocabulary is checked once it is known.
_MAX_ID = 2**63 - 1


def _check_ids(key: str, ids: list, *, ignore: bool) -> None:
    """Refuse the first entry of ``ids`` that is not a token id (an integer in [0, 2**63), or
    ``IGNORE_INDEX`` in labels), naming it and its position."""
    for pos, t in enumerate(ids):
        if isinstance(t, int) and not isinstance(t, bool) and (0 <= t <= _MAX_ID or (ignore and t == IGNORE_INDEX)):
            continue
        what = f"{IGNORE_INDEX} where not trained, " if ignore else ""
        raise ValueError(f"'{key}'[{pos}] is {json.dumps(t)}, not a token id ({what}an integer from 0 to 2**63-1)")


def encode_record(record: Any, tokenizer=None, *, train_on_prompt: bool = False) -> Encoded:
    """``record`` as token ids and labels (see the module docstring).

    Args:
        record: one record.
        tokenizer: a ``transformers`` tokenizer; needed by every format but ``input_ids``.
        train_on_prompt: train every token.

    Raises:
        ValueError: a malformed record, a missing tokenizer, or fewer than 2 tokens; the message
            does not say where (the caller adds ``file:line``).
    """
    kind = record_format(record)
    if kind != "input_ids" and tokenizer is None:
        raise ValueError(f"a {kind!r} record needs a tokenizer: give `tokenizer` DIR, or a `model_path` "
                         "directory with tokenizer files")
    if kind == "messages":
        out = _encode_messages(record["messages"], tokenizer, train_on_prompt)
    elif kind == "prompt_completion":
        prompt, completion = record["prompt"], record["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError("'prompt' and 'completion' must be strings")
        p = _ids(tokenizer, prompt, special=True)
        c = _with_eos(tokenizer, _ids(tokenizer, completion, special=False))
        ids = p + c
        out = Encoded(ids, list(ids) if train_on_prompt else [IGNORE_INDEX] * len(p) + c)
    elif kind == "text":
        if not isinstance(record["text"], str):
            raise ValueError("'text' must be a string")
        ids = _with_eos(tokenizer, _ids(tokenizer, record["text"], special=True))
        out = Encoded(ids, list(ids))
    else:
        ids = record["input_ids"]
        if not isinstance(ids, list):
            raise ValueError("'input_ids' must be a list of non-negative token ids")
        _check_ids("input_ids", ids, ignore=False)
        labels = record.get("labels")
        if labels is None or train_on_prompt:
            labels = list(ids)
        elif not isinstance(labels, list) or len(labels) != len(ids):
            raise ValueError(f"'labels' must be a list of {len(ids)} token ids (one per input id), {IGNORE_INDEX} "
                             "where not trained")
        else:
            _check_ids("labels", labels, ignore=True)
        out = Encoded(list(ids), list(labels))
    if len(out.input_ids) < 2:
        raise ValueError(f"a sequence needs at least 2 tokens, got {len(out.input_ids)}")
    return out
