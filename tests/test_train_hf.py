"""Post-training a Hugging Face checkpoint: loaded with its weights, trained under every engine with
loss masks and either loss normalization, exported as a directory ``transformers`` loads as it is.
A failure names an engine or family whose trained weights differ from a single-process reference,
an export that does not reload to the same logits or loses a tie, or masks that are ignored."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from posttrain.data.tasks import chat_task_records  # noqa: E402
from posttrain.dp import EngineConfig  # noqa: E402
from posttrain.models import HFCausalLM, load_pretrained, save_pretrained, tied_names  # noqa: E402
from posttrain.train.core import OptimConfig  # noqa: E402
from posttrain.train.sft import (  # noqa: E402
    TrainConfig,
    TrainData,
    loss_units,
    microbatch_loss,
    run_training,
)


def _chat_file(tmp_path, n=24, seed=0, name="chat.jsonl"):
    path = tmp_path / name  # 22-40 tokens a record, every eighth 120-140: at --max-tokens 160
    records = chat_task_records(n, seed=seed, min_digits=1, max_digits=10)  # the ranks of step 1 run 1 and 2 microbatches
    records[::8] = chat_task_records(len(records[::8]), seed=seed + 1, min_digits=50, max_digits=60)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _reference(cfg: TrainConfig) -> HFCausalLM:
    """The same run in one process without any engine: each step the whole minibatch as one
    packed microbatch, its loss divided by the minibatch's loss units."""
    data = TrainData(cfg, 1)
    model = load_pretrained(cfg.model_path)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, fused=True)
    for step in range(cfg.steps):
        seqs = data.minibatch(step)
        ids = list(range(len(seqs)))
        microbatch_loss(model, seqs, ids, 1.0 / loss_units(seqs, ids, cfg.loss_agg), cfg.loss_agg).backward()
        opt.step()
        opt.zero_grad()
    return model


def _probe(model_dir_or_model, tokens):
    model = model_dir_or_model
    if isinstance(model, str):
        model = HFCausalLM(transformers.AutoModelForCausalLM.from_pretrained(model))
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("family, dp, loss_agg", [
    ("llama", "odc", "token-mean"),
    ("qwen2", "odc", "seq-mean-token-mean"),
    ("qwen2", "fsdp", "token-mean"),
    ("mistral", "odc-fsdp2", "seq-mean-token-mean"),
])
def test_a_pretrained_model_trains_on_chat_and_exports_what_it_trained(tmp_path, tiny_model, family, dp, loss_agg):
    src = tiny_model(family)
    out = tmp_path / "out"
    # transformers gives a qwen2 directory its own tokenizer class, which splits digits: twice the tokens
    max_tokens = 320 if family == "qwen2" else 160
    cfg = TrainConfig(engine=EngineConfig(dp), balance="diff_micro", model_path=src, data=_chat_file(tmp_path),
                      sequences=8, max_tokens=max_tokens, steps=3, optim=OptimConfig(lr=1e-2), loss_agg=loss_agg,
                      output_dir=str(out),
                      eval_data=_chat_file(tmp_path, n=5, seed=7, name="eval.jsonl"), eval_every=2)
    results = run_training(cfg, world_size=2, quiet=True)
    counts = [[m["microbatches"] for m in r["metrics"]] for r in results]
    if family != "qwen2":
        assert counts[0] != counts[1]  # the ranks ran different numbers of microbatches in step 1
    ref = _reference(cfg)
    probe = torch.tensor([list(range(3, 40))])
    got, want = _probe(str(out), probe), _probe(ref, probe)
    assert not torch.allclose(want, _probe(src, probe), atol=1e-3)  # training moved the weights
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    # the reloaded directory is complete: tokenizer, config, generation config
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    assert (out / "generation_config.json").exists() and (out / "model.safetensors.index.json").exists()
    if family == "qwen2":  # tied embeddings: one tensor on disk, tied again on load
        index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert "lm_head.weight" not in index and "model.embed_tokens.weight" in index
        m = transformers.AutoModelForCausalLM.from_pretrained(str(out))
        assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    # held-out loss after steps 2 and 3, the last the reference model's on the same records
    assert [m["eval_loss"] is not None for m in results[0]["metrics"]] == [False, True, True]
    held_out = TrainData(cfg, 1).eval_samples()
    ids = list(range(len(held_out)))
    with torch.no_grad():
        want_eval = microbatch_loss(ref, held_out, ids, 1.0 / loss_units(held_out, ids, loss_agg), loss_agg)
    assert results[1]["metrics"][-1]["eval_loss"] == pytest.approx(float(want_eval), rel=1e-4)
    # the first step's loss is the reference's first loss (masks and normalization agree)
    first = TrainData(cfg, 1).minibatch(0)
    ids = list(range(len(first)))
    with torch.no_grad():
        ref_loss = microbatch_loss(load_pretrained(src), first, ids, 1.0 / loss_units(first, ids, loss_agg), loss_agg)
    assert results[0]["metrics"][0]["loss"] == pytest.approx(float(ref_loss), rel=1e-5)


def test_labels_mask_the_loss_and_train_on_prompt_unmasks_it(tmp_path, tiny_model):
    src = tiny_model("llama")
    data = _chat_file(tmp_path, n=8)
    base = TrainConfig(model_path=src, data=data, sequences=4, max_tokens=160, steps=1)
    masked = run_training(base, world_size=2, quiet=True)[0]["metrics"][0]
    everything = run_training(replace(base, train_on_prompt=True), world_size=2, quiet=True)[0]["metrics"][0]
    assert masked["loss"] != pytest.approx(everything["loss"], rel=1e-3)
    # pre-tokenized with labels: the same as the chat records they came from
    tok = transformers.AutoTokenizer.from_pretrained(src)
    from posttrain.data import encode_record

    rows = [encode_record(json.loads(line), tok) for line in open(data)]
    ids_file = tmp_path / "ids.jsonl"
    ids_file.write_text("".join(json.dumps({"input_ids": e.input_ids, "labels": e.labels}) + "\n" for e in rows))
    pre = run_training(replace(base, data=str(ids_file)), world_size=2, quiet=True)[0]["metrics"][0]
    assert pre["loss"] == pytest.approx(masked["loss"], rel=1e-6)


def test_loss_aggalizations_do_not_depend_on_the_placement_of_sequences(tiny_model, tmp_path):
    """Gradients of one minibatch split into microbatches in different ways (as ranks and
    microbatches split it) equal the whole minibatch's, for both normalizations."""
    src = tiny_model("llama")
    cfg = TrainConfig(model_path=src, data=_chat_file(tmp_path, n=6), sequences=6, max_tokens=160)
    seqs = TrainData(cfg, 1).minibatch(0)
    for norm in ("token-mean", "seq-mean-token-mean"):
        grads = []
        for split in ([[0, 1, 2, 3, 4, 5]], [[0], [1, 2], [3, 4, 5]], [[5, 0], [4], [3], [2, 1]]):
            model = load_pretrained(src)
            units = loss_units(seqs, range(6), norm)
            for part in split:
                microbatch_loss(model, seqs, part, 1.0 / units, norm).backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        for g in grads[1:]:
            torch.testing.assert_close(g, grads[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_packed_logits_equal_each_sequence_alone(tiny_model, family):
    model = load_pretrained(tiny_model(family))
    a, b = torch.randint(0, 200, (1, 7)), torch.randint(0, 200, (1, 11))
    packed = model(torch.cat([a, b], dim=1), document_lengths=[7, 11])
    torch.testing.assert_close(packed[:, :7], model(a), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[:, 7:], model(b), atol=1e-5, rtol=1e-5)


def test_save_pretrained_one_part_at_a_time_reloads_equal(tiny_model, tmp_path):
    model = load_pretrained(tiny_model("qwen2"))
    state = model.state_dict()
    parts = [{k: v for k, v in state.items() if ".layers.0." in k}, {k: v for k, v in state.items() if ".layers.0." not in k}]
    out = tmp_path / "m"
    save_pretrained(parts, out, config=model.config, skip=tied_names(model))
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model-00001-of-00002.safetensors",
                                                                 "model-00002-of-00002.safetensors"]
    probe = torch.tensor([[1, 5, 9, 2]])
    torch.testing.assert_close(_probe(str(out), probe), _probe(model, probe))
    assert not list(tmp_path.glob(".m.*"))  # no temporary folder left behind


def test_export_command_turns_a_checkpoint_into_the_same_model(tmp_path, tiny_model, cli):
    src = tiny_model("qwen2")
    data = _chat_file(tmp_path, n=8)
    ckpt, direct, exported = tmp_path / "ckpt", tmp_path / "direct", tmp_path / "exported"
    rc, _, err = cli("train", "--model-path", src, "--data", data, "--sequences", "4", "--max-tokens", "320", "--steps",
                     "2", "--checkpoint-dir", str(ckpt), "--output-dir", str(direct))
    assert rc == 0, err
    rc, _, err = cli("export", str(ckpt), str(exported))
    assert rc == 0, err
    probe = torch.tensor([list(range(3, 30))])
    torch.testing.assert_close(_probe(str(exported), probe), _probe(str(direct), probe))
    rc, _, err = cli("export", str(tmp_path), str(tmp_path / "x"))
    assert rc == 2 and "not a posttrain checkpoint" in err


@pytest.mark.parametrize("args, message", [
    (["--model-path", "/nonexistent"], "--model-path /nonexistent: no such directory"),
    (["--data", "/nonexistent.jsonl"], "--data /nonexistent.jsonl: no such file"),
    (["--output-dir", "FILE/sub", "--model", "llama"], "is a file, so nothing can be created under it"),
    (["--checkpoint-dir", "FILE"], "--checkpoint-dir FILE is a file"),
    (["--metrics", "FILE/m.csv"], "is a file, so nothing can be created under it"),
    (["--truncate", "--skip-long"], "exclude each other"),
    (["--output-dir", "x", "--model", "gpt"], "--output-dir writes a transformers model"),
])
def test_bad_model_data_and_output_paths_fail_before_training(cli, tmp_path, args, message):
    (tmp_path / "FILE").write_text("")
    args = [a.replace("FILE", str(tmp_path / "FILE")) for a in args]
    rc, out, err = cli("train", "--steps", "1", *args)
    assert rc == 2, out + err
    assert message.replace("FILE", str(tmp_path / "FILE")) in err
    assert len(err.strip().splitlines()) == 1 and "step" not in out


@pytest.mark.parametrize("command", [["rl", "--prompts", "p.jsonl"], ["pipeline"], ["train"]])
def test_every_trainer_says_a_missing_model_directory_does_not_exist(cli, tmp_path, command):
    rc, _, err = cli(*command, "--model-path", str(tmp_path / "nope"), "--steps", "1")
    assert rc == 2 and err.strip() == f"posttrain: error: --model-path {tmp_path / 'nope'}: no such directory", err
    (tmp_path / "file").write_text("")
    rc, _, err = cli(*command, "--model-path", str(tmp_path / "file"), "--steps", "1")
    assert rc == 2 and err.strip().endswith(f"--model-path {tmp_path / 'file'}: not a directory"), err


def test_long_sequences_error_truncate_or_skip(tmp_path, tiny_model, cli):
    src = tiny_model("llama")
    data = tmp_path / "ids.jsonl"
    rows = [list(range(2, 12))] * 6 + [list(range(2, 80))]
    data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    common = ["--model-path", src, "--data", str(data), "--sequences", "4", "--max-tokens", "32", "--steps", "1"]
    rc, _, err = cli("train", *common)
    assert rc == 2 and f"{data}:7: a sequence of 78 tokens" in err and "--truncate" in err
    rc, out, _ = cli("train", *common, "--skip-long")
    assert rc == 0 and "left out 1 of 7 sequences" in out
    rc, out, _ = cli("train", *common, "--truncate")
    assert rc == 0 and "cut 1 of 7 sequences to 33 tokens" in out


def test_token_ids_outside_the_vocabulary_are_named(tmp_path, tiny_model, cli):
    data = tmp_path / "ids.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n" + json.dumps({"input_ids": [1, 10**12]}) + "\n")
    rc, _, err = cli("train", "--data", str(data), "--sequences", "2", "--steps", "1")
    assert rc == 2 and f"{data}:2: token id 1000000000000 is outside" in err
    rc, _, err = cli("train", "--data", str(data), "--sequences", "2", "--steps", "1", "--vocab-size", "50")
    assert rc == 2 and "outside --vocab-size=50 (50 ids)" in err
    rc, _, err = cli("train", "--model-path", tiny_model("llama"), "--data", str(data), "--sequences", "2", "--steps", "1")
    assert rc == 2 and f"{data}:2: token id 1000000000000 is outside --model-path's vocabulary" in err
