"""Record formats, loss masks and the tokenized cache. A failure names a format that trains the
wrong tokens, a cache that is not reused or not invalidated, or a bad record reported unclearly."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from posttrain.data import IGNORE_INDEX, encode_record, load_tokenized, record_format
from posttrain.data.tasks import chat_task_records, reverse_answer


@pytest.fixture(scope="module")
def tok(chat_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_tokenizer_dir)


def _trained_text(tok, enc) -> str:
    return tok.decode([t for t in enc.labels if t != IGNORE_INDEX])


def test_chat_trains_exactly_the_assistant_turns(tok):
    msgs = [{"role": "system", "content": "You reverse digits."}, {"role": "user", "content": "reverse 1 2 3"},
            {"role": "assistant", "content": "3 2 1"}, {"role": "user", "content": "reverse 4 5"},
            {"role": "assistant", "content": "5 4"}]
    enc = encode_record({"messages": msgs}, tok)
    assert len(enc.input_ids) == len(enc.labels)
    assert tok.decode(enc.input_ids) == tok.apply_chat_template(msgs, tokenize=False)
    assert _trained_text(tok, enc) == "3 2 1<|im_end|>\n5 4<|im_end|>\n"
    # trained tokens are the input ids at those positions; the prompt is masked
    assert all(lab in (IGNORE_INDEX, t) for t, lab in zip(enc.input_ids, enc.labels))
    everything = encode_record({"messages": msgs}, tok, train_on_prompt=True)
    assert everything.labels == everything.input_ids and everything.trained == len(enc.input_ids) - 1


def test_prompt_completion_text_and_token_ids(tok):
    pc = encode_record({"prompt": "reverse 1 2", "completion": "2 1"}, tok)
    assert _trained_text(tok, pc) == "2 1<|im_end|>" and pc.input_ids[-1] == tok.eos_token_id
    assert tok.decode(pc.input_ids) == "reverse 1 2" + "2 1<|im_end|>"
    text = encode_record({"text": "reverse 1 2"}, tok)
    assert text.labels == text.input_ids and text.input_ids[-1] == tok.eos_token_id
    ids = encode_record({"input_ids": [5, 6, 7], "labels": [-100, -100, 7]})
    assert ids.labels == [-100, -100, 7] and ids.trained == 1
    assert encode_record({"input_ids": [5, 6, 7]}).labels == [5, 6, 7]
    assert encode_record({"input_ids": [5, 6, 7], "labels": [-100, -100, 7]}, train_on_prompt=True).labels == [5, 6, 7]
    assert [record_format(r) for r in ({"messages": []}, {"prompt": "", "completion": ""}, {"text": ""},
                                       {"input_ids": []})] == ["messages", "prompt_completion", "text", "input_ids"]


@pytest.mark.parametrize("record, message", [
    ({"ids": [1]}, "expected one of 'messages'"),
    ({"input_ids": [1, "x"]}, r"'input_ids'\[1\] is \"x\", not a token id"),
    ({"input_ids": [1, 10**29]}, r"'input_ids'\[1\] is 100000000000000000000000000000, not a token id"),
    ({"input_ids": [1, -100]}, r"'input_ids'\[1\] is -100, not a token id"),
    ({"input_ids": [1, 2], "labels": [1, 2.5]}, r"'labels'\[1\] is 2.5, not a token id \(-100 where not trained"),
    ({"input_ids": [1, 2], "labels": [1]}, "must be a list of 2"),
    ({"input_ids": [1]}, "at least 2 tokens"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ({"messages": [{"role": "user"}]}, "string 'role' and 'content'"),
    ({"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "ok"}]},
     r"message 0 has role 'wizard', which the chat template does not know \(roles: system, user, assistant, tool\)"),
    ({"text": "hi"}, None),
])
def test_bad_records_are_refused_clearly(tok, record, message):
    if message is None:  # a text record without a tokenizer
        with pytest.raises(ValueError, match="needs a tokenizer"):
            encode_record(record)
        return
    with pytest.raises(ValueError, match=message):
        encode_record(record, tok)


def test_the_roles_a_template_knows_are_those_it_names():
    from posttrain.data.formats import STANDARD_ROLES, template_roles

    assert template_roles("{% for m in messages %}<|im_start|>{{ m['role'] }}{% endfor %}") == STANDARD_ROLES
    named = "{% if message['role'] == 'ipython' %}I{% elif message.role == \"system\" %}S{% endif %}"
    assert template_roles(named) == (*STANDARD_ROLES, "ipython")


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok.name_or_path)
    # renders the last message differently from the same message followed by others
    t.chat_template = ("{% for m in messages %}{% if loop.last %}[{{ m['content'] }}]{% else %}"
                       "{{ m['content'] }};{% endif %}{% endfor %}")
    msgs = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "3"}]
    with pytest.raises(ValueError, match="prefix by prefix"):
        encode_record({"messages": msgs}, t)


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_tokenized_cache_is_made_once_reused_and_invalidated(tmp_path, tok, chat_tokenizer_dir):
    data = _write_jsonl(tmp_path / "chat.jsonl", chat_task_records(40, seed=1))
    said = []
    a = load_tokenized(data, tok, tokenizer_path=chat_tokenizer_dir, progress=False, log=said.append)
    assert len(a) == 40 and len(said) == 1 and os.path.isdir(a.cache)
    assert a.cache.startswith(str(tmp_path / ".posttrain-cache"))
    ids, labels = a.example(3)
    ref = encode_record(chat_task_records(40, seed=1)[3], tok)
    assert ids.tolist() == ref.input_ids and labels.tolist() == ref.labels
    assert a.lengths.tolist() == [len(encode_record(r, tok).input_ids) for r in chat_task_records(40, seed=1)]
    batch = a.examples([5, 3, 5, 39], max_len=6)  # one batched lookup: the same records, in order, repeats kept
    for (ids, labels), i in zip(batch, [5, 3, 5, 39]):
        one = a.example(i, max_len=6)
        assert torch.equal(ids, one[0]) and torch.equal(labels, one[1]) and len(ids) <= 6
    b = load_tokenized(data, tok, tokenizer_path=chat_tokenizer_dir, progress=False, log=said.append)
    assert len(said) == 1 and b.cache == a.cache  # a second run opens the cache
    c = load_tokenized(data, tok, tokenizer_path=chat_tokenizer_dir, train_on_prompt=True, progress=False,
                       log=said.append)
    assert len(said) == 2 and c.cache != a.cache  # another masking: another cache
    _write_jsonl(data, chat_task_records(41, seed=1))
    d = load_tokenized(data, tok, tokenizer_path=chat_tokenizer_dir, progress=False, log=said.append)
    assert len(said) == 3 and len(d) == 41  # the file changed: tokenized again


def test_the_tokenizing_bar_shows_on_a_terminal_only(tmp_path, tok, chat_tokenizer_dir, capfd, monkeypatch):
    """A log file or pipe gets no progress-bar lines (a bar redraws itself with \\r: dozens of
    lines in a file); a terminal gets the one bar."""
    import sys

    data = _write_jsonl(tmp_path / "chat.jsonl", chat_task_records(40, seed=1))
    load_tokenized(data, tok, tokenizer_path=chat_tokenizer_dir, progress=True, log=lambda *a: None)
    assert "examples" not in capfd.readouterr().err  # stderr is not a terminal here
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    _write_jsonl(data, chat_task_records(41, seed=1))
    load_tokenized(data, tok, tokenizer_path=chat_tokenizer_dir, progress=True, log=lambda *a: None)
    assert "Generating train split" in capfd.readouterr().err


def test_tokenizing_over_two_processes_equals_one(tmp_path, tok, chat_tokenizer_dir):
    records = chat_task_records(60, seed=2)
    one = load_tokenized(_write_jsonl(tmp_path / "a.jsonl", records), tok, tokenizer_path=chat_tokenizer_dir,
                         num_proc=1, progress=False, log=lambda *_: None)
    two = load_tokenized(_write_jsonl(tmp_path / "b.jsonl", records), tok, tokenizer_path=chat_tokenizer_dir,
                         num_proc=2, progress=False, log=lambda *_: None)
    assert one.table["input_ids"] == two.table["input_ids"] and one.table["labels"] == two.table["labels"]
    assert [w.split(":")[-1] for w in two.table["where"]] == [str(i) for i in range(1, 61)]


def test_json_arrays_and_datasets_folders(tmp_path, tok):
    import datasets

    records = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4, 5]}]
    (tmp_path / "a.json").write_text(json.dumps(records))
    a = load_tokenized(tmp_path / "a.json", progress=False, log=lambda *_: None)
    assert a.example(0)[1].tolist() == [-100, 2, 3] and a.where(1) == f"{tmp_path / 'a.json'}[1]"
    folder = tmp_path / "saved"
    datasets.Dataset.from_list([{"prompt": "reverse 1 2", "completion": "2 1"}] * 3).save_to_disk(str(folder))
    b = load_tokenized(folder, tok, progress=False, log=lambda *_: None)
    assert len(b) == 3 and b.trained().tolist() == [len(tok("2 1")["input_ids"]) + 1] * 3


@pytest.mark.parametrize("content, message", [
    ('{"input_ids": [1, 2]}\n{oops\n', r"bad.jsonl:2: not valid JSON"),
    ('{"input_ids": [1, 2]}\n\n{"input_ids": [3]}\n', r"bad.jsonl:3: a sequence needs at least 2 tokens"),
    ('{"text": 5}\n', r"bad.jsonl:1: 'text' must be a string"),
    ('{"input_ids": [1, 2]}\n{"input_ids": [3, 100000000000000000000000000000]}\n',
     r"bad.jsonl:2: 'input_ids'\[1\] is 100000000000000000000000000000, not a token id"),
    ("", r"^`data` \S+bad.jsonl: the file is empty$"),
    ("\n  \n", r"^`data` \S+bad.jsonl: the file is empty \(blank lines only\)$"),
    ("[]", r"^`data` \S+bad.jsonl: the file holds an empty list, no records$"),
])
def test_a_bad_line_is_named_by_file_and_line(tmp_path, tok, content, message):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(ValueError, match=message):
        load_tokenized(tmp_path / "bad.jsonl", tok, progress=False, log=lambda *_: None)


def test_missing_or_wrong_sources_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_tokenized(tmp_path / "nope.jsonl", progress=False)
    with pytest.raises(ValueError, match="not a `datasets` save_to_disk folder"):
        load_tokenized(tmp_path, progress=False)


def test_the_chat_task_answers_are_exact():
    for r in chat_task_records(20, seed=5):
        user, assistant = r["messages"][-2]["content"], r["messages"][-1]["content"]
        assert assistant == reverse_answer(user) and user.split()[1:][::-1] == assistant.split()
