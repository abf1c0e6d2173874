"""The training loop over every data-parallel engine. A failure pinpoints an engine or balancing
method that computes a different gradient (the loss curves diverge) or bad config handling."""

from __future__ import annotations

from dataclasses import replace

import pytest

from posttrain._launch import run_ranks
from posttrain.train import TrainConfig, summarize, train_worker

# SGD: a gradient off by a constant factor changes the curve (Adam would normalize it away).
BASE = TrainConfig(steps=3, sequences=6, max_len=48, max_tokens=64, dim=32, num_layers=2, optimizer="sgd", lr=0.5)


def _losses(cfg):
    per_rank = run_ranks(train_worker, 2, cfg)
    return [sum(r["loss"] for r in step) for step in zip(*per_rank)], per_rank


def test_every_engine_and_method_follows_the_same_loss_curve():
    """Same data and global-token normalization: FSDP2 (padded with dummy microbatches), ODC and
    ODC-collective, under different plans, all take the same optimizer steps."""
    want, _ = _losses(replace(BASE, dp="fsdp", balance="same_micro"))
    for dp, balance in [("fsdp", "round_robin"), ("odc-collective", "same_micro"),
                        ("odc", "round_robin"), ("odc", "diff_micro")]:
        got, per_rank = _losses(replace(BASE, dp=dp, balance=balance))
        assert got == pytest.approx(want, rel=1e-4), (dp, balance)
    summary = summarize(per_rank)
    assert summary["tokens_per_s"] > 0 and 0 < summary["utilization"] <= 1.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dp": "ddp"}, "--dp='ddp' is not one of fsdp, odc, odc-collective"),
        ({"balance": "best"}, "--balance='best' is not one of round_robin"),
        ({"profile": "zipf"}, "--profile='zipf'"),
        ({"max_len": 100, "max_tokens": 64}, "--max-tokens=64 is smaller than the longest sequence"),
        ({"steps": 0}, "--steps=0 must be at least 1"),
        ({"optimizer": "lion"}, "--optimizer='lion' is not one of adamw, sgd"),
    ],
)
def test_bad_config_names_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        replace(BASE, **kwargs)
