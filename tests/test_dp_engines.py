"""The data-parallel engine interface (``posttrain.dp``), engine by engine: what every trainer
relies on without testing an engine's name. A failure names the engine and the promise it broke."""

from __future__ import annotations

import pytest
import torch

from posttrain.dp import EngineConfig, build_engine, engine_class, engine_names
from posttrain.launch import run_ranks
from posttrain.models import GPT, GPTConfig, token_loss_sum

CFG = GPTConfig(vocab_size=32, dim=16, num_layers=2, num_heads=2, max_seq_len=32)
ENGINES = [("fsdp", "one-sided"), ("odc-fsdp2", "one-sided"), ("odc-fsdp2", "collective"), ("odc", "one-sided"),
           ("odc", "collective")]


def test_every_registered_engine_is_covered_here():
    assert sorted(engine_names()) == sorted({name for name, _ in ENGINES})


@pytest.mark.parametrize("name, mode, equal", [("fsdp", "one-sided", True), ("odc", "one-sided", False),
                                               ("odc", "collective", True), ("odc-fsdp2", "one-sided", False),
                                               ("odc-fsdp2", "collective", True)])
def test_whether_ranks_need_equal_counts_is_known_before_any_process(name, mode, equal):
    assert engine_class(name).needs_equal_microbatches(EngineConfig(mode=mode)) is equal


def _seqs(rank: int, count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randint(0, CFG.vocab_size, (1, 9 + 3 * i), generator=g) for i in range(count)]


def _engine_worker(rank: int, world_size: int, name: str, mode: str, counts: list[int]) -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = build_engine(model, EngineConfig(name, mode=mode))
    mine = _seqs(rank, counts[rank])
    local = sum(s.shape[1] - 1 for s in mine)
    run = engine.pad(mine, max(counts))
    dummies = sum(x is None for x in run)
    # which saved tensors the engine reports as its weights: every forward input it holds
    held, activations = [], []

    def pack(t):
        (held if engine.holds(t) else activations).append(t.numel())
        return t

    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    with engine.minibatch(local) as mb:
        for seq in run:
            if seq is None:
                engine.run_dummy()
                continue
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = token_loss_sum(model(seq[:, :-1]), seq[:, 1:])
            (loss / mb.loss_divisor).backward()
    opt.step()
    embed = [p.to_local() if hasattr(p, "to_local") else p for p in engine.unit_parameters(engine.units[-1])]
    full = engine.full_state_dict()
    engine.close()
    return {"dummies": dummies, "full": full, "held": sum(held), "activations": sum(activations),
            "embed_numel": sum(p.numel() for p in embed), "global": mb.global_tokens}


def _reference(counts: list[int]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(CFG)
    seqs = [s for r, c in enumerate(counts) for s in _seqs(r, c)]
    total = sum(s.shape[1] - 1 for s in seqs)
    for s in seqs:
        (token_loss_sum(model(s[:, :-1]), s[:, 1:]) / total).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name, mode", ENGINES)
def test_padding_dummies_and_held_weights_on_every_engine(name, mode):
    """Ranks with 1 and 3 sequences: engines with a rendezvous per layer get two dummy
    microbatches on the first rank and take the single-process step anyway (a dummy changes no
    gradient); ODC runs the counts as they are. Every engine tells its gathered weights from
    activations, and hands the units' shards over (together the whole root unit)."""
    counts = [1, 3]
    out = run_ranks(_engine_worker, 2, name, mode, counts)
    equal = engine_class(name).needs_equal_microbatches(EngineConfig(mode=mode))
    assert [r["dummies"] for r in out] == ([2, 0] if equal else [0, 0])
    want = _reference(counts)
    for r in out:
        for k, v in want.items():
            torch.testing.assert_close(r["full"][k], v, rtol=1e-5, atol=1e-6, msg=f"{name}/{mode} {k}")
        assert r["held"] > 0 and r["activations"] > 0, (name, mode, r["held"], r["activations"])
        assert r["global"] == sum(s.shape[1] - 1 for rk, c in enumerate(counts) for s in _seqs(rk, c))
    root = sum(p.numel() for n, p in GPT(CFG).named_parameters() if not n.startswith("layers."))
    assert root <= sum(r["embed_numel"] for r in out) <= root + 64, (name, [r["embed_numel"] for r in out], root)
