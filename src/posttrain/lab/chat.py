"""The embedded chat task end to end: make a model directory and data to post-train, and grade a
trained model by exact match on held-out conversations.

:func:`make_chat_task` writes ``model/`` (a small random ``transformers`` Llama with the task's
tokenizer, saved with ``save_pretrained``: the shape of a real checkpoint directory), and
``train.jsonl`` / ``eval.jsonl`` of chat records (:mod:`posttrain.data.tasks`). :func:`exact_match`
answers every held-out conversation with greedy decoding (``transformers`` ``generate``) and
compares the answer with the record's last assistant message.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from posttrain.data.tasks import chat_task_records, train_chat_tokenizer

__all__ = ["exact_match", "make_chat_task"]


def make_chat_task(out_dir: str | os.PathLike, *, train_records: int = 4000, eval_records: int = 64, dim: int = 64,
                   layers: int = 2, seed: int = 0) -> dict[str, str]:
    """Write ``model/``, ``train.jsonl`` and ``eval.jsonl`` under ``out_dir``; their paths."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_chat_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=dim, intermediate_size=4 * dim, num_hidden_layers=layers,
                         num_attention_heads=max(1, dim // 32), num_key_value_heads=max(1, dim // 32),
                         max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    paths = {"model": str(out / "model")}
    for name, n, s in (("train", train_records, seed + 1), ("eval", eval_records, seed + 2)):
        path = out / f"{name}.jsonl"
        with open(path, "w") as f:
            for r in chat_task_records(n, seed=s):
                f.write(json.dumps(r) + "\n")
        paths[name] = str(path)
    return paths


def exact_match(model_dir: str, data: str, *, limit: int | None = None, max_new_tokens: int = 32) -> dict:
    """Greedy answers to the held-out conversations of ``data`` (chat records, the last message
    the assistant's reference): ``{"accuracy", "n", "examples": [(prompt, answer, reference)]}``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    records = []
    with open(data) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = json.loads(line)
            msgs = r.get("messages") if isinstance(r, dict) else None
            if not msgs or msgs[-1].get("role") != "assistant":
                raise ValueError(f"{data}:{lineno}: expected chat 'messages' ending with the assistant's reference")
            records.append(msgs)
            if limit is not None and len(records) >= limit:
                break
    if not records:
        raise ValueError(f"{data}: no conversations")
    correct, examples = 0, []
    with torch.no_grad():
        for msgs in records:
            ids = tok.apply_chat_template(msgs[:-1], add_generation_prompt=True, return_tensors="pt", return_dict=True)
            out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
            reference = msgs[-1]["content"].strip()
            correct += answer == reference
            if len(examples) < 3:
                examples.append((msgs[-2]["content"], answer, reference))
    return {"accuracy": correct / len(records), "n": len(records), "examples": examples}
