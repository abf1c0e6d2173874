"""ODC trains exactly like a single process (and like FSDP2) across its configurations.

A failure here pinpoints a wrong gather (parameters), a wrong scatter-accumulate or sync
(gradients), or wrong normalization, for the configuration named in the test id.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from odc_helpers import assert_states_close, tiny_llama, train_fsdp, train_odc, train_reference
from posttrain.launch import run_ranks

FP32 = {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize(
    "counts",
    [[3, 1, 0, 2], [2, 1], [1, 1], [3]],
    ids=["ws4-unequal-3-1-0-2", "ws2-unequal-2-1", "ws2-equal", "ws1"],
)
def test_parity_with_single_process_reference(counts):
    """Unequal microbatch counts (a rank with none included) give the reference's parameters; so
    does one rank (FSDP2 does not reduce-scatter over one rank: its own gradients are taken)."""
    want = train_reference(counts)
    for state, _stats in run_ranks(train_odc, len(counts), counts):
        assert_states_close(state, want, **FP32)


def test_parity_with_plain_fsdp2():
    """ODC with grad_divide_factor=world size reproduces FSDP2's rank-averaged gradients."""
    counts = [2, 2]
    want = run_ranks(train_fsdp, 2, counts)[0]
    for state, _ in run_ranks(train_odc, 2, counts, grad_divide_factor=2.0):
        assert_states_close(state, want, **FP32)
    # and FSDP2 itself is the reference divided by 2 (sanity of the comparison)
    assert not torch.equal(want["head.weight"], train_reference(counts)["head.weight"])


def test_parity_hsdp_2x2():
    """(replicate=2, shard=2) mesh: ODC inside each shard pair, one all-reduce at the sync."""
    counts = [3, 0, 1, 2]
    want = train_reference(counts)
    for state, _ in run_ranks(train_odc, 4, counts, mesh_shape=(2, 2)):
        assert_states_close(state, want, **FP32)


def _hsdp_one_rank_shards(rank: int, world_size: int) -> str:
    try:
        train_odc(rank, world_size, [1, 1], mesh_shape=(2, 1))
    except ValueError as e:
        return str(e)
    return "accepted"


def test_hsdp_with_one_rank_per_shard_group_is_refused():
    """FSDP2 keeps the gradients of a one-rank shard group to itself until its own all-reduce:
    ODC cannot take them, so it says so rather than train without them."""
    for got in run_ranks(_hsdp_one_rank_shards, 2):
        assert got.startswith("ODC on FSDP2 with one rank per shard group and several replicas"), got


def _unused_parameter(rank, world_size, fsdp_reduces_unused):
    import posttrain.odc as odc_mod
    from odc_helpers import make_gpt, shard
    from posttrain import _compat

    if not fsdp_reduces_unused:  # FSDP2 as torch 2.11 and 2.12 have it: no set_reduce_scatter_unused_params
        _compat.reduces_unused_params = lambda module: False
    model = make_gpt()
    model.unused = torch.nn.Linear(4, 4)  # trainable, never used by forward
    shard(model)
    with odc_mod.enable(model) as odc:
        try:
            with odc.minibatch(num_tokens=8):
                model(torch.randint(0, 32, (1, 9)))[0].sum().backward()
        except RuntimeError as e:
            return str(e).splitlines()[0]
    return "trained"


def test_a_parameter_without_a_gradient_on_a_torch_that_leaves_it_out_is_refused_in_one_line():
    """torch 2.11 and 2.12's FSDP2 leaves a trainable parameter that got no gradient out of its
    reduce-scatter (2.13 and later reduce it as zero when asked): ODC's rows then lack it, which
    it refuses in one line naming the fixes instead of adding rows to the wrong owners."""
    from torch.distributed.fsdp import FSDPModule

    if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):  # torch 2.13 and later
        assert run_ranks(_unused_parameter, 2, True) == ["trained"] * 2
    for got in run_ranks(_unused_parameter, 2, False):  # (on 2.11 and 2.12: what FSDP2 itself does)
        assert "got no gradient in this backward" in got and "use flat ODC" in got, got


@pytest.mark.parametrize("reshard", [True, False, 2], ids=["reshard-True", "reshard-False", "reshard-int2"])
def test_parity_reshard_after_forward(reshard):
    """Each reshard_after_forward setting; int re-gathers over the smaller post-forward group."""
    counts = [2, 1, 0, 3]
    want = train_reference(counts)
    results = run_ranks(train_odc, 4, counts, reshard=reshard)
    for rank, (state, stats) in enumerate(results):
        assert_states_close(state, want, **FP32)
        if counts[rank]:
            # int: backward re-gathers come from the post-forward group of 2 ranks
            assert (stats["regrouped_gathers"] > 0) == (reshard == 2), stats


def test_mixed_precision_matches_fsdp2_and_gathers_bf16():
    """bf16 params / fp32 reduce: same result as FSDP2 under the same policy, half the gather bytes."""
    counts = [2, 2]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    want = run_ranks(train_fsdp, 2, counts, mp=mp)[0]
    got = run_ranks(train_odc, 2, counts, mp=mp, grad_divide_factor=2.0)
    fp32 = run_ranks(train_odc, 2, counts, grad_divide_factor=2.0)
    for (state, stats), (_, stats32) in zip(got, fp32):
        assert_states_close(state, want, rtol=2e-2, atol=2e-3)
        assert stats["gathers"] == stats32["gathers"]
        assert stats["gather_bytes"] * 2 == stats32["gather_bytes"], (stats, stats32)
        # gradients are pushed in the fp32 reduce dtype
        assert stats["push_bytes"] == stats32["push_bytes"]


def test_deterministic_mode_is_bitwise_reproducible():
    """deterministic=True: two runs give bitwise identical parameters, matching the reference."""
    counts = [3, 1, 0, 2]
    first = run_ranks(train_odc, 4, counts, deterministic=True)
    second = run_ranks(train_odc, 4, counts, deterministic=True)
    want = train_reference(counts)
    for (a, _), (b, _) in zip(first, second):
        for k in a:
            assert torch.equal(a[k], b[k]), k
        assert_states_close(a, want, **FP32)


def test_collective_mode_matches_reference():
    """mode='collective' (a barrier at every gather/reduce) is numerically the same as ODC."""
    counts = [2, 2]
    want = train_reference(counts)
    for state, _stats in run_ranks(train_odc, 2, counts, mode="collective"):
        assert_states_close(state, want, **FP32)


def test_transformers_llama_parity():
    """A transformers LlamaForCausalLM (tiny random config, no download) under ODC."""
    pytest.importorskip("transformers")
    counts = [2, 1]
    want = train_reference(counts, make_model=tiny_llama)
    for state, _ in run_ranks(train_odc, 2, counts, make_model=tiny_llama):
        assert_states_close(state, want, rtol=1e-4, atol=1e-5)
