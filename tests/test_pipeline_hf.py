"""Pipeline training on Hugging Face models and chat data: a local transformers model split into
stages by cost, the chat task's records packed into the schedule's microbatches with loss masks,
the loss normalized over the step's trained tokens. A failure names the family and schedule whose
gradients or exported weights differ from one process training the unsplit model."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from conftest import make_tiny_model
from posttrain.dp import EngineConfig
from posttrain.models import load_pretrained
from posttrain.pipeline.stages import balanced_block_ranges, split_model
from posttrain.train.core import OptimConfig
from posttrain.train.sft.pipeline import PipelineConfig, predicted_peaks, run_pipeline
from posttrain.train.sft.pipeline.data import PipelineData, packed_loss
from posttrain.train.sft.pipeline.loop import check_model_and_data


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    from posttrain.data.tasks import chat_task_records

    path = tmp_path_factory.mktemp("pipechat") / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chat_task_records(64, seed=5)))
    return str(path)


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory, chat_tokenizer_dir):
    made = {}

    def get(family: str) -> str:
        if family not in made:
            made[family] = make_tiny_model(family, tmp_path_factory.mktemp(f"deep-{family}"), chat_tokenizer_dir,
                                           layers=4)
        return made[family]

    return get


def _reference(cfg: PipelineConfig, steps: int):
    """The unsplit model trained on the same packed microbatches in one process: the first
    step's gradients and the weights after ``steps`` AdamW steps."""
    model = load_pretrained(cfg.model_path)
    data = PipelineData(cfg, model.config)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    first = None
    for k in range(steps):
        batch = data.step(k)
        opt.zero_grad(set_to_none=True)
        for x, t, e in zip(batch.inputs, batch.targets, batch.extras):
            (packed_loss(model(x, **e), t) / batch.loss_divisor).backward()
        if first is None:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return first, model


@pytest.mark.parametrize("family, schedule, chunks, loss_agg", [
    ("llama", "1f1b", 1, "token-mean"),
    ("qwen2", "interleaved_1f1b", 2, "seq-mean-token-mean"),  # tied embeddings on ranks 0 and 1
    ("qwen2", "zbv", 2, "token-mean"),                  # tied embeddings on one rank (V shape)
])
def test_pipeline_on_a_transformers_model_equals_the_unsplit_model(deep_model, chat_data, tmp_path, family,
                                                                  schedule, chunks, loss_agg):
    cfg = PipelineConfig(schedule=schedule, num_ranks=2, chunks=chunks, num_microbatches=4, model_path=deep_model(family),
                         data=chat_data, sequences=12, max_tokens=128, steps=2, optim=OptimConfig(lr=1e-3), loss_agg=loss_agg,
                         output_dir=str(tmp_path / "out"))
    results = run_pipeline(cfg, return_grads=True)
    want, trained = _reference(cfg, cfg.steps)
    # the step's global gradient norm (the recipe's, over every stage, a tied copy counted once)
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in want.values()])))
    assert all(r["grad_norms"][0] == pytest.approx(norm, rel=1e-4) for r in results), (norm, results[0]["grad_norms"])
    seen = set()
    for r in results:
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, want[name], atol=2e-5, rtol=1e-4, msg=f"{family} {schedule}: {name}")
            seen.add(name)
    assert seen == set(want)  # every parameter lives on some stage
    ref_loss = None
    for r in results:
        if r["losses"][0] is not None:
            ref_loss = r["losses"][0]
    assert ref_loss is not None and ref_loss > 0
    # The exported directory loads to the reference's weights after two steps.
    got = load_pretrained(str(tmp_path / "out")).state_dict()
    for name, value in trained.state_dict().items():
        torch.testing.assert_close(got[name], value, atol=2e-5, rtol=1e-4, msg=f"{family} {schedule}: exported {name}")
    if family == "qwen2":
        hf = load_pretrained(str(tmp_path / "out")).hf
        assert hf.lm_head.weight is hf.model.embed_tokens.weight  # still tied after export


def test_pipeline_epochs_set_the_steps_from_the_data(cli, deep_model, chat_data, tmp_path):
    """--epochs: the steps follow from the usable records (said first), each row has its epoch,
    and --epochs excludes --steps and needs --data."""
    metrics = tmp_path / "m.jsonl"
    args = ["pipeline", "--model-path", deep_model("llama"), "--pp-size", "2", "--microbatches", "4",
            "--sequences", "16", "--max-tokens", "256", "--plot", ""]
    rc, stdout, err = cli(*args, "--data", chat_data, "--epochs", "0.75", "--metrics", str(metrics))
    assert rc == 0, err
    assert "epochs 0.75 of 64 records, 16 a step: 3 steps" in stdout
    assert "1f1b: 2 ranks x 1 chunk, 4 microbatches, offload none; 3 steps" in stdout
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert sorted({(r["step"], r["epoch"]) for r in rows}) == [(0, 0.25), (1, 0.5), (2, 0.75)]
    rc, _, err = cli(*args, "--data", chat_data, "--epochs", "1", "--steps", "3")
    assert rc == 2 and "--epochs" in err and "--steps" in err, err
    rc, _, err = cli(*args, "--epochs", "1")
    assert rc == 2 and "--epochs needs --data" in err, err


def test_stages_are_balanced_by_cost_and_refuse_other_models(deep_model):
    assert balanced_block_ranges(4, 2, last_extra=1.0) == [(0, 3), (3, 4)]  # the head weighs one block
    assert balanced_block_ranges(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    model = load_pretrained(deep_model("llama"))
    stages = split_model(model.hf, 2)  # a bare transformers model is accepted too
    x = torch.randint(0, model.config.vocab_size, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(stages[1](stages[0](x, document_lengths=[4, 5]), document_lengths=[4, 5]),
                                   model(x, document_lengths=[4, 5]))
    with pytest.raises(ValueError, match="supports posttrain's GPT and transformers"):
        split_model(torch.nn.Linear(2, 2), 2)


def test_bad_pipeline_data_flags_are_named(deep_model, chat_data):
    with pytest.raises(ValueError, match="`data` needs `model_path`"):
        PipelineConfig(data=chat_data)
    with pytest.raises(ValueError, match="sequences=2 is fewer than num_microbatches=4"):
        PipelineConfig(model_path=deep_model("llama"), data=chat_data, sequences=2, num_microbatches=4)
    cfg = PipelineConfig(model_path=deep_model("llama"), data=chat_data, sequences=16, num_microbatches=2, max_tokens=40)
    with pytest.raises(ValueError, match="do not fit in num_microbatches=2 microbatches of at most max_tokens=40"):
        PipelineData(replace(cfg), load_pretrained(cfg.model_path).config).step(0)
    with pytest.raises(ValueError, match=r"engine\.name='fsdp' does not write the pipeline's checkpoints yet"):
        PipelineConfig(model_path=deep_model("llama"), data=chat_data, dp_size=2, engine=EngineConfig("fsdp"),
                       balance="same_micro", checkpoint_dir="ckpt")
    with pytest.raises(ValueError, match="`schedule` zbv, which puts the first and the last stage on one rank"):
        check_model_and_data(PipelineConfig(model_path=deep_model("qwen2"), data=chat_data, dp_size=2, schedule="zbv",
                                            chunks=2))
    with pytest.raises(ValueError, match="with one pipeline rank does not support yet; use posttrain train"):
        check_model_and_data(PipelineConfig(model_path=deep_model("qwen2"), data=chat_data, dp_size=2, num_ranks=1))


def test_the_pipeline_command_trains_a_model_directory_on_chat_data(cli, deep_model, chat_data, tmp_path):
    out = tmp_path / "trained"
    rc, stdout, err = cli("pipeline", "--model-path", deep_model("llama"), "--data", chat_data, "--pp-size", "2",
                          "--microbatches", "4", "--sequences", "8", "--max-tokens", "128", "--steps", "1",
                          "--offload", "full", "--output-dir", str(out), "--plot", "")
    assert rc == 0, err
    assert f"wrote {out}" in stdout and (out / "config.json").exists()
    rc, _, err = cli("pipeline", "--model-path", deep_model("llama"), "--data", chat_data, "--pp-size", "2",
                     "--chunks", "4", "--schedule", "interleaved_1f1b", "--microbatches", "4")
    assert rc == 2 and "has 4 decoder layers, fewer than the 8 stages" in err


def test_a_pipeline_checkpoint_resumes_on_another_split_to_the_same_run(deep_model, chat_data, tmp_path):
    base = PipelineConfig(schedule="1f1b", num_ranks=2, chunks=1, num_microbatches=4, model_path=deep_model("qwen2"),
                          data=chat_data, sequences=12, max_tokens=128, steps=3,
                          optim=OptimConfig(lr=1e-3))
    whole = run_pipeline(replace(base, output_dir=str(tmp_path / "whole")))
    cut = replace(base, checkpoint_dir=str(tmp_path / "ckpt"), output_dir=str(tmp_path / "resumed"))
    first = run_pipeline(replace(cut, steps=2, output_dir=None))
    # The rest on another split: 4 stages of interleaved 1F1B (the tied embedding now on ranks 0 and 1).
    rest = run_pipeline(replace(cut, schedule="interleaved_1f1b", chunks=2))
    assert rest[0]["resumed_from"] == 2 and len(rest[0]["losses"]) == 1
    last = lambda rs: [x for r in rs for x in r["losses"] if x is not None]  # noqa: E731 - the last stage's losses
    assert last(first) == pytest.approx(last(whole)[:2], rel=1e-6)
    assert last(rest) == pytest.approx(last(whole)[2:], rel=1e-5)
    a, b = load_pretrained(str(tmp_path / "whole")).state_dict(), load_pretrained(str(tmp_path / "resumed")).state_dict()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=2e-5, rtol=1e-4, msg=name)
    assert run_pipeline(cut) == []  # nothing left to do
    with pytest.raises(ValueError, match="written with sequences=12, this run has 8"):
        run_pipeline(replace(cut, sequences=8, steps=5))


@pytest.fixture(scope="module")
def long_tail_data(tmp_path_factory):
    """Prompt/completion records from 8 to about 110 tokens: replicas balanced by cost get
    different numbers of microbatches."""
    import random

    rng = random.Random(3)
    path = tmp_path_factory.mktemp("longtail") / "lt.jsonl"
    lines = []
    for _ in range(64):
        digits = " ".join(str(rng.randrange(10)) for _ in range(3))
        k = rng.choice([1, 1, 1, 2, 2, 3, 5, 8, 13])
        lines.append(json.dumps({"prompt": f"reverse {digits}", "completion": (" " + digits[::-1]) * k}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("family, schedule, chunks, offload, dp, mode, balance", [
    ("llama", "1f1b", 1, "none", "odc", "one-sided", "diff_micro"),
    ("llama", "interleaved_1f1b", 2, "1", "odc", "one-sided", "diff_micro"),
    ("qwen2", "1f1b", 1, "full", "odc", "one-sided", "diff_micro"),  # tied: copies on each pipeline's first and last rank
    ("llama", "1f1b", 1, "full", "odc", "collective", "same_micro"),
    ("qwen2", "1f1b", 1, "full", "fsdp", "one-sided", "same_micro"),
    ("llama", "1f1b", 1, "1", "odc-fsdp2", "one-sided", "diff_micro"),  # every registered engine runs a column
    # split backward: W's gradients are pushed after W (stage_backward_weight bypasses the push hook)
    ("llama", "zbv", 2, "full", "odc", "one-sided", "diff_micro"),
    ("qwen2", "zb_h1", 1, "none", "odc", "collective", "same_micro"),
])
def test_pipeline_x_data_parallel_equals_one_process(deep_model, long_tail_data, tmp_path, family, schedule, chunks,
                                                     offload, dp, mode, balance):
    from posttrain.models import load_pretrained as load
    from posttrain.models import tied_names
    from posttrain.train.sft.loop import loss_units
    from posttrain.train.sft.pipeline.dp import SPLIT_BACKWARD, pipeline_plans, runnable

    cfg = PipelineConfig(schedule=schedule, num_ranks=2, chunks=chunks, dp_size=2, model_path=deep_model(family),
                         data=long_tail_data, sequences=16, max_tokens=64, steps=1, optim=OptimConfig("sgd", lr=0.5),
                         balance=balance, engine=EngineConfig(dp, mode=mode), offload=offload, skip_long=True,
                         output_dir=str(tmp_path / "out"))
    results = run_pipeline(cfg, return_grads=True)
    micro = {r["dp_rank"]: r["microbatches"][0] for r in results}
    if family == "llama" and balance == "diff_micro":  # (qwen2's tokenizer makes lengths that split evenly)
        assert micro[0] != micro[1], micro  # the replicas ran different numbers of microbatches in the step
    if balance == "same_micro":
        assert micro[0] == micro[1], micro
    # The first split of a split backward is checked (what it drops stays resident until W): as unsplit.
    bound = replace(cfg, no_weight_split=True) if schedule in SPLIT_BACKWARD else cfg
    for r in results:  # resident saved activations within each pipeline's predicted peak (in units of a stage's
        # largest microbatch, so smaller microbatches count less than one)
        predicted = predicted_peaks(bound, r["microbatches"][0])[r["pp_rank"]]
        assert 0 < r["result"]["peak_units"] <= predicted + 1e-9, (r["rank"], predicted)
        if schedule in SPLIT_BACKWARD:  # W kept only its part: each parameter its own group (ODC's views)
            assert all(k < 0.5 for k in r["result"]["weight_keep"].values()), r["result"]["weight_keep"]
            if 0 not in r["stages"]:  # weights gathered for F, again for I, freed, again for W: 3 per unit
                assert r["engine"]["gathers"] == 3 * r["engine"]["units"] * r["microbatches"][0], (r["engine"], r["microbatches"])
    # One process: the unsplit model on every pipeline's microbatches, the loss over all trained tokens.
    model = load(cfg.model_path)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = PipelineData(cfg, model.config)
    samples = data.data.minibatch(0)
    plans = pipeline_plans([len(x) - 1 for x in samples], pipelines=2, max_tokens=64, method=balance,
                          model_config=model.config, runnable=runnable(cfg))
    total = loss_units(samples, range(len(samples)), "token-mean")
    for sets in plans:
        batch = data.pack(samples, sets, float(total))
        for x, t, e in zip(batch.inputs, batch.targets, batch.extras):
            (packed_loss(model(x, **e), t) / total).backward()
    # the step's global gradient norm over stages and columns (a tied copy counted once)
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()])))
    assert all(r["grad_norms"][0] == pytest.approx(norm, rel=1e-4) for r in results), (norm, results[0]["grad_norms"])
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    want = dict(model.named_parameters())
    alias = {f"hf.{k}": f"hf.{v}" for k, v in tied_names(model).items()}
    seen = set()
    for r in results:
        for name, value in r["params"].items():
            name = alias.get(name, name)  # a tied copy is the embedding
            torch.testing.assert_close(value, want[name].detach(), atol=2e-5, rtol=1e-4, msg=f"rank {r['rank']}: {name}")
            seen.add(name)
    assert seen == set(want) and any(not torch.equal(want[n].detach(), start[n]) for n in want)
    got = load(str(tmp_path / "out"))  # the export: one pipeline's stages, tied weights written once
    from safetensors import safe_open

    written = [k for f in sorted((tmp_path / "out").glob("*.safetensors")) for k in safe_open(str(f), "pt").keys()]
    assert len(written) == len(set(written)), sorted(written)  # every tensor in exactly one file
    for name, value in got.state_dict().items():
        torch.testing.assert_close(value, model.state_dict()[name], atol=2e-5, rtol=1e-4, msg=f"exported {name}")
    if alias:
        assert got.hf.lm_head.weight is got.hf.model.embed_tokens.weight


def test_a_pipeline_x_odc_checkpoint_resumes_as_one_pipeline_on_another_split_and_back(deep_model, long_tail_data,
                                                                                       tmp_path):
    # Whole parameters and AdamW state under the model's names: pp=2 x dp=2 (1F1B) -> one pipeline
    # (interleaved 1F1B, 2 chunks) -> pp=2 x dp=2 (zbv): the loss curve of the uninterrupted run.
    base = PipelineConfig(schedule="1f1b", num_ranks=2, chunks=1, dp_size=2, model_path=deep_model("llama"),
                          data=long_tail_data, sequences=16, max_tokens=64, steps=4, optim=OptimConfig(lr=1e-2),
                          skip_long=True)

    def curve(results):
        return next(r["losses"] for r in results if r["losses"] and r["losses"][0] is not None)

    whole = curve(run_pipeline(base))
    cut = replace(base, checkpoint_dir=str(tmp_path / "ckpt"))
    first = run_pipeline(replace(cut, steps=1))
    assert curve(first) == pytest.approx(whole[:1], rel=1e-6)
    one = run_pipeline(replace(cut, steps=2, dp_size=1, schedule="interleaved_1f1b", chunks=2, num_microbatches=8))
    assert {r["resumed_from"] for r in one} == {1} and curve(one) == pytest.approx(whole[1:2], rel=1e-5)
    # two steps: the last one's loss follows an update made with the loaded AdamW state
    back = run_pipeline(replace(cut, schedule="zbv", chunks=2))
    assert {r["resumed_from"] for r in back} == {2} and curve(back) == pytest.approx(whole[2:], rel=1e-5)


def test_the_pipeline_command_runs_data_parallel_pipelines(cli, deep_model, long_tail_data, tmp_path):
    """Besides the report: the trainer core's metrics file (every rank's row of every step, the
    step's loss on each) and an export after step 1 (--save-every) as well as after the last."""
    from transformers import AutoModelForCausalLM

    metrics, out = tmp_path / "m.csv", tmp_path / "out"
    rc, stdout, err = cli("pipeline", "--model-path", deep_model("llama"), "--data", long_tail_data, "--pp-size", "2",
                          "--dp-size", "2", "--sequences", "16", "--max-tokens", "64", "--steps", "2", "--plot", "",
                          "--metrics", str(metrics), "--output-dir", str(out), "--save-every", "1")
    assert rc == 0, err
    assert "2 data-parallel pipelines (odc, diff_micro)" in stdout and "microbatches per pipeline and step" in stdout
    assert len([line for line in stdout.splitlines() if line.strip().startswith(("0 ", "1 ", "2 ", "3 "))]) == 4
    import csv

    rows = list(csv.DictReader(open(metrics)))
    assert [(r["step"], r["rank"]) for r in rows] == [(str(s), str(r)) for s in range(2) for r in range(4)]
    assert len({r["loss"] for r in rows if r["step"] == "1"}) == 1  # the step's loss, the same on every rank
    assert AutoModelForCausalLM.from_pretrained(out) is not None
    rc, _, err = cli("pipeline", "--model-path", deep_model("llama"), "--data", long_tail_data, "--dp-size", "2",
                     "--schedule", "zbv", "--dp", "fsdp", "--balance", "same_micro")
    assert rc == 2 and "--dp='fsdp' with --schedule='zbv'" in err


def test_a_pipeline_resumes_with_sgd_and_another_packing(deep_model, chat_data, tmp_path):
    # SGD keeps no per-parameter state; the resumed part packs into other microbatches.
    base = PipelineConfig(schedule="1f1b", num_ranks=2, chunks=1, num_microbatches=4, model_path=deep_model("llama"),
                          data=chat_data, sequences=12, max_tokens=128, steps=2, optim=OptimConfig("sgd", lr=0.1))
    whole = [x for r in run_pipeline(base) for x in r["losses"] if x is not None]
    cut = replace(base, checkpoint_dir=str(tmp_path / "ckpt"))
    run_pipeline(replace(cut, steps=1))
    rest = run_pipeline(replace(cut, num_microbatches=2, max_tokens=256))
    assert [x for r in rest for x in r["losses"] if x is not None] == pytest.approx(whole[1:], rel=1e-5)


@pytest.fixture(scope="module")
def long_records(tmp_path_factory):
    """Three records of about 50 tokens: at --max-tokens 64 each fills a microbatch alone."""
    path = tmp_path_factory.mktemp("long3") / "long.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"reverse {d}", "completion": (" " + d[::-1]) * 15}) + "\n"
                            for d in ("1 2 3", "4 5 6", "7 8 9")))
    return str(path)


@pytest.mark.parametrize("dp, mode", [("fsdp", "one-sided"), ("odc", "collective")])
def test_pipelines_with_a_rendezvous_per_layer_run_equal_counts(deep_model, long_records, dp, mode):
    # same_micro may leave a pipeline an empty bin; it runs a dummy microbatch instead of hanging.
    cfg = PipelineConfig(schedule="1f1b", num_ranks=2, chunks=1, dp_size=2, model_path=deep_model("llama"),
                         data=long_records, sequences=3, max_tokens=64, steps=1, balance="same_micro",
                         engine=EngineConfig(dp, mode=mode))
    results = run_pipeline(cfg, timeout_s=120)
    counts = {r["dp_rank"]: r["microbatches"][0] for r in results}
    assert counts[0] == counts[1] == 2
    assert results[0]["losses"][0] > 0


@pytest.mark.cuda
def test_a_pipeline_on_cuda_takes_the_cpu_runs_steps(deep_model, chat_data):
    """Stages on the GPU (two ranks: one GPU each, or sharing one, their messages then through
    host memory), saved activations offloaded through pinned buffers on a side stream: the
    gradients and losses of the same run on CPU processes."""
    cfg = PipelineConfig(schedule="1f1b", num_ranks=2, num_microbatches=4, model_path=deep_model("llama"),
                         data=chat_data, sequences=12, max_tokens=128, steps=2, optim=OptimConfig(lr=1e-3),
                         offload="full")
    want = run_pipeline(replace(cfg, device="cpu"), return_grads=True)
    got = run_pipeline(replace(cfg, device="cuda"), return_grads=True)
    for w, g in zip(want, got):
        assert g["losses"] == pytest.approx(w["losses"], rel=1e-3)
        for name, grad in g["grads"].items():
            torch.testing.assert_close(grad, w["grads"][name], atol=1e-4, rtol=1e-3, msg=name)
    assert any(r["result"]["offloaded_bytes"] > 0 for r in got)


@pytest.mark.cuda
def test_pipeline_x_flat_odc_on_cuda_takes_the_cpu_runs_steps(deep_model, long_tail_data):
    """2 pipelines of 2 stages, each column sharded by flat ODC in GPU memory (4 ranks: sharing
    the GPUs where there are fewer)."""
    cfg = PipelineConfig(schedule="1f1b", num_ranks=2, dp_size=2, model_path=deep_model("llama"), data=long_tail_data,
                         sequences=16, max_tokens=64, steps=2, optim=OptimConfig("sgd", lr=0.5),
                         engine=EngineConfig("odc"), offload="full", skip_long=True)
    want = run_pipeline(replace(cfg, device="cpu"))
    got = run_pipeline(replace(cfg, device="cuda"))
    for w, g in zip(want, got):
        assert g["losses"] == pytest.approx(w["losses"], rel=1e-3)
