"""Context parallelism in the models and the ODC engines: a sequence split into zigzag shards over a
group of ranks, packed beside whole sequences, gives the single-process loss and gradients.

A failure pinpoints the shard's positions (the loss differs at once), the key/value exchange or its
gradient's return (gradients differ), grouped-query heads (Llama only), the recomputation of a
checkpointed block (checkpointing only), or an engine's handling of a microbatch whose attention is
a collective (engine tests only)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

from posttrain.balance import pack_sequences
from posttrain.launch import run_ranks
from posttrain.models import GPT, GPTConfig, LlamaLM, checkpoint_blocks, token_loss_sum
from posttrain.models.split_attention import SplitShard

CFG = GPTConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, max_seq_len=128)
FP32 = {"rtol": 1e-5, "atol": 1e-6}


def _model(kind: str, checkpointing: bool):
    torch.manual_seed(0)
    model = GPT(CFG) if kind == "gpt" else LlamaLM(CFG)  # Llama: 4 query heads over 2 key/value heads
    if checkpointing:
        checkpoint_blocks(model.layers)
    return model


def _data(groups: list[tuple[int, ...]], world: int):
    """One long sequence per group (split over it) and one whole sequence per rank."""
    g = torch.Generator().manual_seed(1)
    long = [torch.randint(0, CFG.vocab_size, (29 + 8 * i,), generator=g) for i in range(len(groups))]
    whole = [torch.randint(0, CFG.vocab_size, (7 + 3 * r,), generator=g) for r in range(world)]
    labels = [s.clone() for s in long]
    labels[0][:5] = -100  # a prompt: untrained targets inside the split sequence
    return long, labels, whole


def _reference(kind: str, groups, world):
    model = _model(kind, False)
    long, labels, whole = _data(groups, world)
    packed = pack_sequences([*long, *whole], [*labels, *([None] * len(whole))])
    total = packed.num_trained
    loss = token_loss_sum(model(packed.inputs, document_lengths=packed.document_lengths), packed.targets) / total
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}, \
        {n: (p - 0.5 * p.grad).detach() for n, p in model.named_parameters()}


def _mine(rank, groups, world, long, labels, whole, pgs):
    gi = next(i for i, grp in enumerate(groups) if rank in grp)
    index, k = groups[gi].index(rank), len(groups[gi])
    packed = pack_sequences([long[gi], whole[rank]], [labels[gi], None], shard=(index, k))
    return packed, SplitShard(packed.shard_positions, group=pgs[gi])


def _groups(groups):
    return [dist.new_group(list(grp)) for grp in groups]  # (every rank creates every group, in one order)


def _device(device: str, rank: int) -> torch.device:
    """A rank's device: the CPU, or a GPU (ranks sharing one where there are fewer GPUs than ranks,
    the group then gloo over GPU memory)."""
    return torch.device("cuda", rank % torch.cuda.device_count()) if device == "cuda" else torch.device("cpu")


def _model_worker(rank, world, groups, variants, device="cpu"):
    """The plain model on every rank (no engine): its own gradients summed over the ranks."""
    pgs = _groups(groups)
    dev = _device(device, rank)
    out = {}
    for kind, checkpointing in variants:
        model = _model(kind, checkpointing).to(dev)
        long, labels, whole = _data(groups, world)
        packed, split = _mine(rank, groups, world, long, labels, whole, pgs)
        total = torch.tensor(float(packed.num_trained))
        dist.all_reduce(total)
        logits = model(packed.inputs.to(dev), document_lengths=packed.document_lengths, split=split)
        loss = token_loss_sum(logits, packed.targets.to(dev)) / total.to(dev)
        loss.backward()
        summed = loss.detach().cpu()
        dist.all_reduce(summed)
        grads = {n: p.grad.cpu() for n, p in model.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g)
        out[(kind, checkpointing)] = (float(summed), grads, packed.shard_positions)
    return out


@pytest.mark.parametrize("world,groups", [(2, [(0, 1)]), (4, [(0, 1), (2, 3)]), (4, [(0, 1, 2, 3)])],
                         ids=["2ranks-k2", "4ranks-k2-two-groups", "4ranks-k4"])
def test_a_split_sequence_gives_the_single_process_loss_and_gradients(world, groups):
    variants = [("gpt", False), ("llama", False), ("gpt", True), ("llama", True)] if world == 2 else \
        [("gpt", False), ("llama", True)]
    got = run_ranks(_model_worker, world, groups, variants, timeout_s=240)
    for kind, checkpointing in variants:
        want_loss, want_grads, _ = _reference(kind, groups, world)
        for r, res in enumerate(got):
            loss, grads, positions = res[(kind, checkpointing)]
            assert positions is not None and len(positions) < 29  # a shard, not the whole sequence
            assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (kind, checkpointing, r, loss, want_loss)
            for n, g in want_grads.items():
                torch.testing.assert_close(grads[n], g, **FP32, msg=f"{kind} ckpt={checkpointing} rank {r} {n}")


def _engine_worker(rank, world, groups, variants, device="cpu"):
    """The ODC engines: a minibatch of one packed microbatch per rank (the shard first), an SGD
    step, the full parameters after it."""
    from posttrain.dp import EngineConfig, build_engine

    pgs = _groups(groups)
    dev = _device(device, rank)
    out = {}
    for kind, engine_name, checkpointing in variants:
        model = _model(kind, False).to(dev)
        engine = build_engine(model, EngineConfig(engine_name, activation_checkpointing=checkpointing))
        long, labels, whole = _data(groups, world)
        packed, split = _mine(rank, groups, world, long, labels, whole, pgs)
        opt = torch.optim.SGD(engine.parameters(), lr=0.5)
        with engine.minibatch(packed.num_trained) as mb:
            logits = model(packed.inputs.to(dev), document_lengths=packed.document_lengths, split=split)
            (token_loss_sum(logits, packed.targets.to(dev)) / mb.loss_divisor).backward()
        opt.step()
        out[(kind, engine_name, checkpointing)] = {n: t.cpu() for n, t in engine.full_state_dict().items()}
        engine.close()
        # FSDP2 keeps its modules and communication state in reference cycles: collected here, not at
        # whatever allocation of the next variant's collectives (a segfault there was seen once in CI)
        del model, engine, opt, mb
        gc.collect()
    return out


def test_the_odc_engines_train_a_split_sequence_like_one_process():
    variants = [("gpt", "odc", False), ("llama", "odc", True), ("llama", "odc-fsdp2", False),
                ("gpt", "odc-fsdp2", True)]
    got = run_ranks(_engine_worker, 2, [(0, 1)], variants, timeout_s=240)
    for kind, engine_name, checkpointing in variants:
        _, _, want = _reference(kind, [(0, 1)], 2)
        for r, res in enumerate(got):
            state = res[(kind, engine_name, checkpointing)]
            for n, p in want.items():
                torch.testing.assert_close(state[n], p, **FP32, msg=f"{kind} {engine_name} ckpt={checkpointing} rank {r} {n}")


@pytest.mark.cuda
def test_a_split_sequence_on_a_gpu_trains_like_one_cpu_process():
    """On CUDA, 2 ranks sharing the GPU (gloo over GPU memory; NCCL takes one rank per GPU): the
    models' split attention (the masked pieces: no log-sum-exp kernel there), GQA, checkpointing
    and packing beside whole sequences give one CPU process's loss and gradients, and flat ODC
    takes its step, within the GPU kernels' fp32 rounding (TF32 off)."""
    variants = [("gpt", False), ("llama", True)]
    got = run_ranks(_model_worker, 2, [(0, 1)], variants, "cuda", start="spawn", timeout_s=240)
    for kind, checkpointing in variants:
        want_loss, want_grads, _ = _reference(kind, [(0, 1)], 2)
        for r, res in enumerate(got):
            loss, grads, _ = res[(kind, checkpointing)]
            assert abs(loss - want_loss) <= 1e-4 * abs(want_loss), (kind, checkpointing, r, loss, want_loss)
            for n, g in want_grads.items():
                torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-5, msg=f"{kind} ckpt={checkpointing} rank {r} {n}")
    engines = [("llama", "odc", True), ("gpt", "odc", False)]
    got = run_ranks(_engine_worker, 2, [(0, 1)], engines, "cuda", start="spawn", timeout_s=240)
    for kind, engine_name, checkpointing in engines:
        _, _, want = _reference(kind, [(0, 1)], 2)
        for r, res in enumerate(got):
            for n, p in want.items():
                torch.testing.assert_close(res[(kind, engine_name, checkpointing)][n], p, rtol=1e-4, atol=1e-5,
                                           msg=f"{kind} {engine_name} ckpt={checkpointing} rank {r} {n}")


def test_a_llama_switched_to_split_attention_still_attends_like_transformers_unpacked():
    """After a split forward the model keeps posttrain's attention: an unpacked call with a padding
    mask (generation's) still goes through transformers' own SDPA, and a packed one attends per
    sequence as transformers' block-diagonal mask did."""
    model = _model("llama", False).eval()
    tokens = torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(tokens)
    mask[0, :4] = 0  # left padding
    packed = pack_sequences([tokens[0], tokens[1, :7]])
    with torch.no_grad():
        before = model.hf(input_ids=tokens, attention_mask=mask).logits
        before_packed = model(packed.inputs, document_lengths=packed.document_lengths)
        from posttrain.models.split_attention import HF_ATTENTION, use_split_attention

        use_split_attention(model.hf)
        assert model.hf.config._attn_implementation == HF_ATTENTION
        after = model.hf(input_ids=tokens, attention_mask=mask).logits
        after_packed = model(packed.inputs, document_lengths=packed.document_lengths)
    torch.testing.assert_close(after[0, 4:], before[0, 4:], **FP32)
    torch.testing.assert_close(after[1], before[1], **FP32)
    torch.testing.assert_close(after_packed, before_packed, **FP32)


def test_a_split_shard_must_lead_a_packed_microbatch():
    model = GPT(CFG)
    split = SplitShard(torch.arange(4))
    with pytest.raises(ValueError, match="must be the first packed sequence"):
        model(torch.zeros(1, 9, dtype=torch.long), document_lengths=[5, 4], split=split)
    with pytest.raises(ValueError, match="must be the first packed sequence"):
        model(torch.zeros(1, 4, dtype=torch.long), split=split)
    with pytest.raises(ValueError, match="non-empty 1-D int64"):
        SplitShard(torch.arange(4.0))
    with pytest.raises(ValueError, match="shard 2 of 2 does not exist"):
        pack_sequences([torch.arange(10)], shard=(2, 2))


def _train(cfg, world=2):
    from posttrain.train.sft import train_worker

    results = run_ranks(train_worker, world, cfg, timeout_s=300)
    rows = results[0]["metrics"]
    return [r["loss"] for r in rows], [r["split_sequences"] for r in rows]


def free_exchange(monkeypatch) -> None:
    """Price the exchange at nothing (the forked ranks inherit it): at these tiny sizes a split
    never pays on this machine, so the planner would split nothing to test."""
    import posttrain.train.core.context as context

    monkeypatch.setattr(context, "FLOPS_PER_EXCHANGED_BYTE", {"cpu": 0.0, "cpu-gloo": 0.0, "cuda": 0.0})
    monkeypatch.setattr(context, "FLOPS_PER_EXCHANGE_CALL", {"cpu": 0.0, "cpu-gloo": 0.0, "cuda": 0.0})


def test_training_with_split_sequences_follows_the_unsplit_loss_curve(monkeypatch):
    """The trainer's path: the plan splits the costliest sequences (context_parallel 2 and auto),
    every rank runs its shards first with its group, and the optimizer takes the same steps as
    without splitting, on both ODC engines, GPT and Llama, under either loss aggregation."""
    free_exchange(monkeypatch)
    from dataclasses import replace

    from posttrain.dp import EngineConfig
    from posttrain.train.core import OptimConfig
    from posttrain.train.sft import TrainConfig

    # few sequences a step with a long tail: a whole-sequence plan leaves one rank far busier
    base = TrainConfig(steps=3, sequences=3, max_len=96, max_tokens=96, dim=32, num_layers=2, seed=3,
                       optim=OptimConfig("sgd", lr=0.5))
    for extra, engines in [({}, [EngineConfig("odc", context_parallel=2), EngineConfig("odc-fsdp2", context_parallel="auto")]),
                           ({"model": "llama", "loss_agg": "seq-mean-token-mean"},
                            [EngineConfig("odc", context_parallel="auto", activation_checkpointing=True)])]:
        cfg = replace(base, **extra)
        want, none = _train(replace(cfg, engine=EngineConfig("odc")))
        assert none == [0] * len(want)
        for engine in engines:
            got, split = _train(replace(cfg, engine=engine))
            assert sum(split) > 0, (extra, engine)  # it did split
            assert got == pytest.approx(want, rel=1e-4), (extra, engine, got, want)


def test_sequences_longer_than_a_microbatch_are_split_and_train_like_whole_ones(tmp_path):
    """With context parallelism a run takes sequences longer than ``max_tokens`` (up to
    ``max_len``): each is split across ranks into shards that fit (the plan's forced splits), and
    the run takes the same steps as one whose microbatches hold them whole; a data file's long
    record is taken too, where without splitting it is refused."""
    import json
    from dataclasses import replace

    from posttrain.dp import EngineConfig
    from posttrain.train.core import OptimConfig
    from posttrain.train.sft import TrainConfig, run_training

    base = TrainConfig(steps=3, sequences=4, max_len=96, dim=32, num_layers=2, seed=3,
                       optim=OptimConfig("sgd", lr=0.5), profile="uniform")
    for extra in ({}, {"model": "llama", "engine": EngineConfig("odc-fsdp2")}):
        cfg = replace(base, **extra)
        want, _ = _train(replace(cfg, max_tokens=96))
        engine = replace(cfg.engine, context_parallel="auto")
        got, split = _train(replace(cfg, max_tokens=48, engine=engine))
        assert all(n > 0 for n in split), (extra, split)  # every step had a sequence over 48 tokens
        assert got == pytest.approx(want, rel=1e-4), (extra, got, want)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [(7 * i + j) % 50 + 1 for j in range(n)]}) + "\n"
                            for i, n in enumerate((10, 12, 90, 11))))
    data = replace(base, data=str(path), vocab_size=64, max_len=96, max_tokens=48, steps=1)
    with pytest.raises(ValueError, match=r"d.jsonl:3: a sequence of 90 tokens .* split longer sequences across ranks"):
        run_training(data, world_size=2, quiet=True)
    rows = run_training(replace(data, engine=EngineConfig("odc", context_parallel=2)), world_size=2, quiet=True)
    assert rows[0]["metrics"][0]["split_sequences"] == 1


def test_a_run_whose_longest_sequence_no_split_fits_is_refused_before_starting():
    from posttrain.dp import EngineConfig
    from posttrain.train.sft import TrainConfig, run_training

    with pytest.raises(ValueError, match=r"max_tokens=48 is smaller than the longest sequence \(max_len=200\); raise "
                                         r"`max_tokens`, or split the longer sequences across ranks"):
        TrainConfig(steps=1, sequences=4, max_len=200, max_tokens=48)
    for cp in ("auto", 2):
        with pytest.raises(ValueError, match=r"max_len=200 tokens split over 2 ranks leaves shards longer than "
                                             r"max_tokens=48: it needs 5 ranks"):
            run_training(TrainConfig(steps=1, sequences=4, max_len=200, max_tokens=48, dim=32, num_layers=2,
                                     engine=EngineConfig("odc", context_parallel=cp)), world_size=2, quiet=True)
    with pytest.raises(ValueError, match=r"context_parallel=3 shards a sequence over 3 ranks, but the run has 2"):
        run_training(TrainConfig(steps=1, sequences=4, max_len=48, dim=32, num_layers=2,
                                 engine=EngineConfig("odc", context_parallel=3)), world_size=2, quiet=True)


@pytest.mark.parametrize("kwargs,message", [
    ({"engine": {"name": "fsdp", "context_parallel": 2}}, "for the ODC engines in one-sided mode"),
    ({"engine": {"name": "odc", "mode": "collective", "context_parallel": "auto"}}, "for the ODC engines in one-sided mode"),
    ({"engine": {"name": "odc", "context_parallel": 1}}, "use off, auto or a shard count of 2 or more"),
    ({"engine": {"name": "odc", "context_parallel": "auto"}, "balance": "same_micro"}, "use `balance` diff_micro"),
])
def test_context_parallel_refuses_what_it_cannot_run_in_one_line(kwargs, message):
    from posttrain.dp import EngineConfig
    from posttrain.train.sft import TrainConfig

    with pytest.raises(ValueError, match=message):
        engine = EngineConfig(**kwargs.pop("engine"))
        TrainConfig(engine=engine, **kwargs)


def _failing_member(rank, world, cfg):
    import posttrain.train.sft.loop as loop
    from posttrain.train.sft import train_worker

    if rank == 1:
        def broken(*args, **kwargs):
            raise ValueError("bad shard on rank 1")

        loop.shard_loss = broken
    return train_worker(rank, world, cfg)


def test_a_failing_group_member_ends_the_step_on_every_rank_naming_the_peer(monkeypatch):
    """Rank 1 fails before its shard's exchange: rank 0 ends in seconds with ODC's PeerFailedError
    carrying rank 1's message, not a broken connection or a hang; naming the split sequence where
    rank 0 met the failure in the exchange. (Rank 1 may fail before rank 0 has left the minibatch's
    entry barrier, which both passed: rank 0 then meets it there, seen once on a loaded machine.)"""
    free_exchange(monkeypatch)
    import time
    from dataclasses import replace

    from posttrain.dp import EngineConfig
    from posttrain.launch import RanksFailedError
    from posttrain.train.sft import TrainConfig

    cfg = TrainConfig(steps=2, sequences=3, max_len=96, max_tokens=96, dim=32, num_layers=2, seed=3)
    cfg = replace(cfg, engine=EngineConfig("odc", context_parallel=2))
    start = time.monotonic()
    with pytest.raises(RanksFailedError) as info:
        run_ranks(_failing_member, 2, cfg, timeout_s=120)
    assert time.monotonic() - start < 60
    errors = info.value.errors
    assert "bad shard on rank 1" in errors[1]
    assert "PeerFailedError" in errors[0] and "bad shard on rank 1" in errors[0], errors[0]
    at_entry = "in _enter" in errors[0] and "split sequence" not in errors[0]
    assert at_entry or ("split sequence" in errors[0] and "with ranks [0, 1]" in errors[0]), errors[0]
