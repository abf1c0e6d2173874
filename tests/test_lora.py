"""LoRA through peft on every engine: the adapters train as a single process's peft model on the
same data does, the base stays frozen (never pushed, no optimizer state), the output directory is
an adapter peft loads or, merged, a whole model; bad LoRA flags are one line before any work."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from posttrain.data.tasks import chat_task_records
from posttrain.dp import EngineConfig
from posttrain.models import HFCausalLM, load_pretrained
from posttrain.models.lora import LoraSpec, add_lora, merged
from posttrain.train.core import OptimConfig
from posttrain.train.sft import TrainConfig, TrainData, loss_units, microbatch_loss, run_training


def _chat_file(tmp_path, n=24, seed=0):
    path = tmp_path / "chat.jsonl"
    records = chat_task_records(n, seed=seed, min_digits=1, max_digits=10)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _reference(cfg: TrainConfig) -> HFCausalLM:
    """One process, no engine: the model with the same adapters (same seed) and AdamW over them,
    each step's whole minibatch as one packed microbatch."""
    data = TrainData(cfg, 1)
    torch.manual_seed(cfg.seed)
    model = load_pretrained(cfg.model_path)
    add_lora(model, cfg.lora, seed=cfg.seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.optim.lr, weight_decay=0.0)
    for step in range(cfg.steps):
        seqs = data.minibatch(step)
        ids = list(range(len(seqs)))
        microbatch_loss(model, seqs, ids, 1.0 / loss_units(seqs, ids, cfg.loss_agg), cfg.loss_agg).backward()
        opt.step()
        opt.zero_grad()
    return model


def _logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("family, dp", [("llama", "odc"), ("qwen2", "fsdp"), ("mistral", "odc-fsdp2")])
def test_lora_adapters_train_as_one_peft_process_and_peft_loads_them(tmp_path, tiny_model, family, dp):
    from peft import PeftModel

    src = tiny_model(family)
    max_tokens = 320 if family == "qwen2" else 160
    cfg = TrainConfig(engine=EngineConfig(dp), model_path=src, data=_chat_file(tmp_path), sequences=8,
                      max_tokens=max_tokens, steps=3, optim=OptimConfig(lr=2e-2), output_dir=str(tmp_path / "out"),
                      lora_rank=4, lora_targets=("q_proj", "v_proj", "down_proj"))
    results = run_training(cfg, world_size=2, quiet=True)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("adapter")) == ["adapter_config.json",
                                                                                    "adapter_model.safetensors"]
    ref = _reference(cfg)
    probe = torch.tensor([list(range(3, 40))])
    base = transformers.AutoModelForCausalLM.from_pretrained(src)
    untrained = _logits(base, probe)
    loaded = PeftModel.from_pretrained(base, str(out))
    got, want = _logits(loaded, probe), _logits(ref, probe)
    assert not torch.allclose(want, untrained, atol=1e-3)  # the adapters moved the output
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    # the frozen base: no optimizer state for it, and (flat ODC) nothing of it pushed
    trainable = sum(p.numel() for p in ref.parameters() if p.requires_grad)
    state = sum(r["optimizer_state_numel"] for r in results)
    assert 2 * trainable <= state <= 2 * trainable + 64  # AdamW's two moments of the adapters (flat ODC pads)
    if dp == "odc":
        pushed = sum(r["engine_stats"]["push_bytes"] for r in results)
        assert 0 < pushed <= 2 * 3 * 4 * trainable  # at most a full fp32 gradient per rank and step


def test_merge_lora_writes_a_whole_model_equal_to_the_adapted_one_and_export_does_too(tmp_path, tiny_model, cli):
    src = tiny_model("llama")
    cfg = TrainConfig(engine=EngineConfig("odc"), model_path=src, data=_chat_file(tmp_path), sequences=8,
                      max_tokens=160, steps=2, optim=OptimConfig(lr=2e-2), output_dir=str(tmp_path / "out"),
                      lora_rank=8, lora_alpha=4, merge_lora=True, checkpoint_dir=str(tmp_path / "ck"))
    run_training(cfg, world_size=2, quiet=True)
    probe = torch.tensor([list(range(3, 40))])
    want = _logits(_reference(cfg), probe)
    rc, _, err = cli("export", str(tmp_path / "ck"), str(tmp_path / "exported"))
    assert rc == 0, err
    for out in (tmp_path / "out", tmp_path / "exported"):
        assert (out / "model.safetensors.index.json").exists() and not (out / "adapter_config.json").exists()
        names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert "model.layers.0.self_attn.q_proj.weight" in names and not [n for n in names if "lora" in n]
        got = _logits(transformers.AutoModelForCausalLM.from_pretrained(str(out)), probe)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_merged_folds_each_adapter_into_its_weight_across_parts():
    spec = LoraSpec(rank=2, alpha=6)
    w, a, b, bias = torch.randn(3, 4), torch.randn(2, 4), torch.randn(3, 2), torch.randn(3)
    parts = [{"m.q.base_layer.weight": w, "m.q.lora_A.default.weight": a, "other": torch.ones(1)},
             {"m.q.lora_B.default.weight": b, "m.q.base_layer.bias": bias}]
    out = {}
    for part in merged(parts, spec.scale):
        out.update(part)
    assert sorted(out) == ["m.q.bias", "m.q.weight", "other"]
    torch.testing.assert_close(out["m.q.weight"], w + 3.0 * b @ a)
    with pytest.raises(ValueError, match="without all of"):
        list(merged([{"m.q.lora_A.default.weight": a}], 1.0))


@pytest.mark.parametrize("argv, message", [
    (["--lora-rank", "4", "--lora-targets", "q_proj,wq"],
     "--lora-targets=wq: the model has no such linear layer; it has down_proj, gate_proj, k_proj, lm_head, o_proj, "
     "q_proj, up_proj, v_proj"),
    (["--merge-lora"], "--merge-lora needs --lora-rank"),
    (["--lora-alpha", "8"], "--lora-alpha needs --lora-rank"),
    (["--lora-rank", "-1"], "--lora-rank=-1 must be positive"),
    (["--lora-rank", "4", "--lora-dropout", "1"], "--lora-dropout=1.0 must be in [0, 1)"),
])
def test_bad_lora_flags_are_one_line_before_tokenizing(cli, tiny_model, tmp_path, argv, message):
    data = _chat_file(tmp_path)
    rc, out, err = cli("train", "--model-path", tiny_model("llama"), "--data", data, "--steps", "1", *argv)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert "tokenizing" not in out


def test_lora_needs_a_transformers_model(cli):
    rc, _, err = cli("train", "--lora-rank", "4", "--steps", "1")
    assert rc == 2 and "--lora-rank adds peft adapters to a transformers model" in err, err


def test_rl_trains_adapters_and_samples_from_the_merged_policy(tmp_path, tiny_model, monkeypatch, cli):
    """GRPO with LoRA: the rollout model gets the policy with its adapters merged every step (its
    logits at step 1's load equal the merged export of the checkpoint after step 0, and differ
    from the base's), and the output is the merged model."""
    import torch.distributed as dist

    from posttrain.rl import HFRollout
    from posttrain.train.rl import RLConfig, run_rl

    src = tiny_model("llama")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in chat_task_records(4, seed=3)))
    (tmp_path / "length_reward.py").write_text("def reward(prompt, response):\n    return float(len(response))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = torch.tensor([list(range(3, 30))])
    seen = tmp_path / "rollout"
    seen.mkdir()
    original = HFRollout.load_weights

    def load_and_probe(self, parts):
        original(self, parts)
        if dist.get_rank() == 0:
            k = len(list(seen.iterdir()))
            torch.save(_logits(self.model, probe), seen / f"{k}.pt")

    monkeypatch.setattr(HFRollout, "load_weights", load_and_probe)
    cfg = RLConfig(model_path=src, prompts=str(prompts), reward="length_reward:reward", samples_per_prompt=4,
                   prompts_per_step=2, max_new_tokens=8, steps=2, max_tokens=128, optim=OptimConfig(lr=5e-2),
                   checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=1, output_dir=str(tmp_path / "out"),
                   lora_rank=4, merge_lora=True)
    rows = run_rl(cfg, world_size=2, quiet=True)[0]["metrics"]
    assert rows[0]["updates"] > 0
    base = _logits(transformers.AutoModelForCausalLM.from_pretrained(src), probe)
    first, second = (torch.load(seen / f"{k}.pt") for k in (0, 1))
    torch.testing.assert_close(first, base, atol=1e-5, rtol=1e-5)  # zero-initialized B: the base
    rc, _, err = cli("export", str(tmp_path / "ck" / "step-000001"), str(tmp_path / "after-step-0"))
    assert rc == 0, err
    after = _logits(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "after-step-0")), probe)
    assert not torch.allclose(after, base, atol=1e-3)  # the update moved the adapters
    torch.testing.assert_close(second, after, atol=2e-4, rtol=1e-4)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory, chat_tokenizer_dir):
    from conftest import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("deep-llama"), chat_tokenizer_dir, layers=4)


@pytest.mark.parametrize("schedule, chunks, dp_size, dp", [
    ("1f1b", 1, 1, "odc"),
    ("zbv", 2, 1, "odc"),       # split backward: W of a frozen base computes nothing
    ("1f1b", 1, 2, "odc"),      # pipeline x flat ODC: each stage's adapters sharded over its column
])
def test_pipeline_lora_trains_as_one_peft_process(deep_llama, tmp_path, schedule, chunks, dp_size, dp, cli):
    from peft import PeftModel

    from posttrain.train.sft.pipeline import PipelineConfig, run_pipeline
    from posttrain.train.sft.pipeline.data import PipelineData, packed_loss

    cfg = PipelineConfig(schedule=schedule, num_ranks=2, chunks=chunks, dp_size=dp_size, engine=EngineConfig(dp),
                         model_path=deep_llama, data=_chat_file(tmp_path, n=48), sequences=8, max_tokens=160,
                         steps=2, optim=OptimConfig(lr=2e-2), output_dir=str(tmp_path / "out"), lora_rank=4,
                         checkpoint_dir=str(tmp_path / "ck"),
                         lora_targets=("q_proj", "v_proj", "up_proj"), **({"num_microbatches": 4} if dp_size == 1 else {}))
    run_pipeline(cfg)
    torch.manual_seed(cfg.seed)
    ref = load_pretrained(deep_llama)
    add_lora(ref, cfg.lora, seed=cfg.seed)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=cfg.optim.lr, weight_decay=0.0)
    if dp_size == 1:
        data = PipelineData(cfg, ref.config)
        for k in range(cfg.steps):
            batch = data.step(k)
            for x, t, e in zip(batch.inputs, batch.targets, batch.extras):
                (packed_loss(ref(x, **e), t) / batch.loss_divisor).backward()
            opt.step()
            opt.zero_grad()
    else:  # the minibatch's loss over all its trained tokens, as pipeline x DP averages it
        data = TrainData(TrainConfig(model_path=deep_llama, data=cfg.data, sequences=8, max_tokens=160), 1)
        for k in range(cfg.steps):
            seqs = data.minibatch(k)
            ids = list(range(len(seqs)))
            microbatch_loss(ref, seqs, ids, 1.0 / loss_units(seqs, ids, "token-mean"), "token-mean").backward()
            opt.step()
            opt.zero_grad()
    probe = torch.tensor([list(range(3, 40))])
    base = transformers.AutoModelForCausalLM.from_pretrained(deep_llama)
    assert not torch.allclose(_logits(base, probe), _logits(ref, probe), atol=1e-3)  # the adapters moved
    want = _logits(ref, probe)
    rc, _, err = cli("export", str(tmp_path / "ck"), str(tmp_path / "exported"))  # the checkpoint: the same adapter
    assert rc == 0, err
    for out in ("out", "exported"):
        fresh = transformers.AutoModelForCausalLM.from_pretrained(deep_llama)
        loaded = PeftModel.from_pretrained(fresh, str(tmp_path / out))
        torch.testing.assert_close(_logits(loaded, probe), want, atol=2e-4, rtol=1e-4, msg=out)


def test_rl_refuses_lora_targets_the_model_lacks(cli, tiny_model, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in chat_task_records(4, seed=3)))
    rc, _, err = cli("rl", "--model-path", tiny_model("llama"), "--prompts", str(prompts), "--lora-rank", "4",
                     "--lora-targets", "wq")
    assert rc == 2 and "--lora-targets=wq: the model has no such linear layer" in err, err
