"""Flat ODC (no FSDP2) trains exactly like a single process, with the ODC protocol's guarantees.

A failure pinpoints a wrong gather (parameters), a wrong push or sync (gradients), or a wrong
re-gather before backward (a unit's freed weights), for the configuration in the test id.
"""

from __future__ import annotations

import pytest
import torch

import posttrain.odc as odc_mod
from posttrain._launch import run_ranks

from odc_helpers import LR, STEPS, assert_states_close, loss_of, make_gpt, step_data, train_reference

FP32 = {"rtol": 1e-5, "atol": 1e-6}


def train_flat(rank: int, world_size: int, counts: list[int], *, make_model=make_gpt, units=None,
               steps: int = STEPS, **kw):
    model = make_model()
    handle = odc_mod.flat_shard(model, units(model) if units else None, **kw)
    opt = torch.optim.SGD(handle.parameters(), lr=LR, momentum=0.9)
    with handle:
        for step in range(steps):
            data, total = step_data(step, counts)
            mine = data[rank]
            with handle.minibatch(num_tokens=sum(x.shape[1] - 1 for x in mine)) as mb:
                assert mb.global_tokens == total
                for x in mine:
                    (loss_of(model, x) / mb.global_tokens).backward()
            opt.step()
            opt.zero_grad()
        state = handle.full_state_dict()
        stats = dict(handle.stats)
    return state, stats


@pytest.mark.parametrize("counts", [[3, 1, 0, 2], [2, 1], [1, 1]], ids=["ws4-3-1-0-2", "ws2-2-1", "ws2-equal"])
def test_flat_parity_with_single_process_reference(counts):
    """Unequal microbatch counts (a rank with none included) give the reference's parameters."""
    want = train_reference(counts)
    for rank, (state, stats) in enumerate(run_ranks(train_flat, len(counts), counts)):
        assert_states_close(state, want, **FP32)
        # every block is gathered for forward and again for backward, the root once
        units = 3
        assert stats["gathers"] == counts[rank] * (2 * (units - 1) + 1) * STEPS, stats
        assert stats["pushes"] == counts[rank] * units * STEPS, stats


def test_flat_collective_mode_matches_reference():
    counts = [2, 2]
    want = train_reference(counts)
    for state, _ in run_ranks(train_flat, 2, counts, mode="collective"):
        assert_states_close(state, want, **FP32)


def test_flat_transformers_llama_parity():
    pytest.importorskip("transformers")
    from test_odc_parity import _tiny_llama

    counts = [2, 1]
    want = train_reference(counts, make_model=_tiny_llama)
    got = run_ranks(train_flat, 2, counts, make_model=_tiny_llama,
                    units=lambda m: [*m.model.layers, m])
    for state, _ in got:
        assert_states_close(state, want, rtol=1e-4, atol=1e-5)


def _frees_after_forward(rank, world_size):
    model = make_gpt()
    handle = odc_mod.flat_shard(model)
    with handle:
        x = step_data(0, [1, 1])[0][rank][0]
        with handle.minibatch():
            loss = loss_of(model, x)
            # blocks freed their gathered weights after forward; the root keeps its own
            freed = [u.full.untyped_storage().nbytes() == 0 for u in handle.layouts]
            loss.backward()
        with torch.no_grad():
            out = loss_of(model, x)  # outside a minibatch: a collective gather, no push
    return freed, float(out), len(handle.parameters())


def test_flat_frees_block_weights_after_forward_and_evaluates_outside_a_minibatch():
    for freed, out, nparams in run_ranks(_frees_after_forward, 2):
        assert freed == [True, True, False]
        assert out > 0 and nparams == 3


def _backward_outside(rank, world_size):
    model = make_gpt()
    with odc_mod.flat_shard(model):
        x = step_data(0, [1, 1])[0][rank][0]
        loss = loss_of(model, x)
        try:
            loss.backward()
        except RuntimeError as e:
            return str(e)
    return "no error"


def test_flat_backward_outside_a_minibatch_is_a_clear_error():
    for msg in run_ranks(_backward_outside, 2):
        assert "outside `with odc.minibatch():`" in msg


def _bad_input(rank, world_size, what):
    model = make_gpt()
    try:
        if what == "bf16":
            model = model.to(torch.bfloat16)
            odc_mod.flat_shard(model)
        elif what == "foreign":
            odc_mod.flat_shard(model, [torch.nn.Linear(2, 2)])
        elif what == "uncovered":
            odc_mod.flat_shard(model, list(model.layers))
        elif what == "deterministic":
            odc_mod.flat_shard(model, deterministic=True)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("what,needle", [
    ("bf16", "fp32 CPU models"), ("foreign", "not a submodule"), ("uncovered", "outside every unit"),
    ("deterministic", "deterministic"),
])
def test_flat_bad_input_is_a_clear_error(what, needle):
    for msg in run_ranks(_bad_input, 2, what):
        assert needle in msg


def _setup_fails(rank, world_size):
    import posttrain.odc._flat as flat_mod

    model = make_gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def broken(*a, **k):
        raise OSError("no space left on /dev/shm")

    real, flat_mod.ShmTransport.create = flat_mod.ShmTransport.create, broken
    try:
        odc_mod.flat_shard(model)
    except OSError:
        pass
    finally:
        flat_mod.ShmTransport.create = real
    after = model.state_dict()
    return after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_flat_setup_failure_gives_the_model_its_parameters_back():
    assert run_ranks(_setup_fails, 2) == [True, True]
