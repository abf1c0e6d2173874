"""Flat ODC (no FSDP2) trains exactly like a single process, with every feature of the FSDP2 engine.

A failure pinpoints, for the configuration in the test id: a wrong gather (parameters), a wrong
push or sync (gradients), a wrong re-gather before backward (a unit's freed weights), wrong
mixed-precision casts, a tied or frozen parameter handled as an ordinary one, or a model left
unusable after sharding.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.profiler import ProfilerActivity, profile

import posttrain.odc as odc_mod
from odc_helpers import (
    LR,
    STEPS,
    assert_states_close,
    loss_of,
    make_gpt,
    step_data,
    tiny_llama,
    tiny_qwen2_tied,
    train_fsdp,
    train_reference,
)
from posttrain.launch import run_ranks
from posttrain.models import checkpoint_blocks
from posttrain.pipeline.runtime import graph_leaves

FP32 = {"rtol": 1e-5, "atol": 1e-6}
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def train_flat(rank: int, world_size: int, counts: list[int], *, make_model=make_gpt, units=None, prepare=None,
               mesh_shape=None, steps: int = STEPS, close: bool = False, ac: bool = False, **kw):
    """Train under flat ODC; returns (full state dict, stats, extra) where extra describes the handle."""
    mesh = None
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    model = make_model()
    if prepare is not None:
        prepare(model)
    if ac:
        from posttrain.models import find_blocks

        checkpoint_blocks(find_blocks(model))
    handle = odc_mod.flat_shard(model, units(model) if units else None, mesh=mesh, **kw).odc
    opt = torch.optim.SGD(handle.parameters(), lr=LR, momentum=0.9)
    for step in range(steps):
        data, total = step_data(step, counts)
        mine = data[rank]
        with handle.minibatch(num_tokens=sum(x.shape[1] - 1 for x in mine)) as mb:
            assert mb.global_tokens == total
            for x in mine:
                (loss_of(model, x) / mb.global_tokens).backward()
        opt.step()
        opt.zero_grad()
    extra = {"num_params": len(handle.parameters()), "grads_bytes": handle.buffer_bytes["grads"],
             "params_bytes": handle.buffer_bytes["params"], "prefetch": dict(handle.prefetch_stats)}
    state = handle.full_state_dict()
    stats = dict(handle.stats)
    if close:
        handle.close()
        extra["after_close"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        handle.close(restore=False)
    return state, stats, extra


@pytest.mark.parametrize("counts", [[3, 1, 0, 2], [2, 1], [1, 1]], ids=["ws4-3-1-0-2", "ws2-2-1", "ws2-equal"])
def test_flat_parity_with_single_process_reference(counts):
    """Unequal microbatch counts (a rank with none included) give the reference's parameters."""
    want = train_reference(counts)
    for rank, (state, stats, _) in enumerate(run_ranks(train_flat, len(counts), counts)):
        assert_states_close(state, want, **FP32)
        # every block is gathered for forward and again for backward, the root once
        units = 3
        assert stats["gathers"] == counts[rank] * (2 * (units - 1) + 1) * STEPS, stats
        assert stats["pushes"] == counts[rank] * units * STEPS, stats


def _frozen_llama():
    model = tiny_llama()
    model.model.layers[0].mlp.requires_grad_(False)
    return model


def _sublayer_units(model):
    return [m for layer in model.model.layers for m in (layer.self_attn, layer.mlp)] + [model]


@pytest.mark.parametrize("case", ["gpt", "llama-frozen-ac", "llama-units-inside-ac", "hsdp"])
def test_prefetched_gathers_change_nothing_but_when_they_happen(case):
    """``prefetch=True`` on the CPU runs the accelerator's bookkeeping (gather the next unit in
    forward and the previous one in backward, early; here at once, there on a side stream):
    the reference's parameters, the same number of gathers (each early one taken, none wasted),
    with frozen parameters, activation checkpointing and HSDP. With units inside a checkpointed
    block (attention and MLP of each layer), the recomputation in backward calls them again: it
    gathers for itself, keeps those weights for the recomputed graph, and teaches the prefetch
    nothing (a recomputation taken for the forward's order gathers the wrong units ahead)."""
    counts = [3, 1, 0, 2] if case == "hsdp" else [3, 1]
    kw = {"prefetch": True}
    if case == "llama-frozen-ac":
        kw.update(make_model=_frozen_llama, ac=True)
        want = train_reference(counts, make_model=_frozen_llama)
    elif case == "llama-units-inside-ac":
        kw.update(make_model=tiny_llama, units=_sublayer_units, ac=True)
        want = train_reference(counts, make_model=tiny_llama)
    else:
        want = train_reference(counts)
    if case == "hsdp":
        kw.update(mesh_shape=(2, 2))
    plain = run_ranks(train_flat, len(counts), counts, **{**kw, "prefetch": False})
    got = run_ranks(train_flat, len(counts), counts, **kw)
    for (state, stats, extra), (_, plain_stats, _) in zip(got, plain):
        assert_states_close(state, want, rtol=1e-4, atol=1e-5)
        assert stats["gathers"] == plain_stats["gathers"] and stats["pushes"] == plain_stats["pushes"]
        assert extra["prefetch"]["unused"] == 0, extra
        if stats["pushes"]:  # a rank that ran microbatches gathered ahead in both passes
            assert extra["prefetch"]["prefetched"] > 0, extra
    if case == "gpt":  # 2 blocks: both ahead in forward once the order is known, the first in backward
        n = counts[0] * STEPS
        assert got[0][2]["prefetch"]["prefetched"] == 3 * n - 2, got[0][2]
    if case == "llama-units-inside-ac":  # as many ahead as without checkpointing
        no_ac = run_ranks(train_flat, len(counts), counts, **{**kw, "ac": False})
        assert [g[2]["prefetch"] for g in got] == [g[2]["prefetch"] for g in no_ac]


def _drain_worker(rank, world_size):
    handle = odc_mod.flat_shard(make_gpt(), prefetch=True).odc

    class Side:  # the accelerator's side stream, as far as dropping buffers goes
        waits = 0

        def synchronize(self):
            Side.waits += 1

    handle._side = Side()
    handle._ready[0] = (None, None, None)  # a prefetch no forward took, at the minibatch's exit
    handle.release()
    at_exit = Side.waits
    handle.close(restore=False)  # the failure path frees everything (no collective)
    return at_exit, Side.waits


def test_buffers_the_side_stream_writes_are_dropped_only_after_it_has_written_them():
    """Prefetched vectors and refilled storages are written on the side stream: dropped while it
    still writes them (an unused prefetch at minibatch exit, everything when a failure frees the
    handle), their memory could be handed to a new tensor and overwritten. Both wait for the side
    stream first (its synchronize; on a GPU, the event of every copy on it)."""
    assert run_ranks(_drain_worker, 1) == [(1, 2)]


def test_flat_collective_mode_matches_reference():
    counts = [2, 2]
    want = train_reference(counts)
    for state, _, _ in run_ranks(train_flat, 2, counts, mode="collective"):
        assert_states_close(state, want, **FP32)


def test_flat_finds_the_blocks_of_a_transformers_model_and_matches_the_reference():
    """No units given: the decoder layers at model.model.layers are found, one unit each."""
    pytest.importorskip("transformers")
    counts = [2, 1]
    want = train_reference(counts, make_model=tiny_llama)
    for state, _stats, _ in run_ranks(train_flat, 2, counts, make_model=tiny_llama):
        assert_states_close(state, want, rtol=1e-4, atol=1e-5)
    # 2 decoder layers and the root: 3 pushes per microbatch on rank 0
    assert run_ranks(train_flat, 2, counts, make_model=tiny_llama, steps=1)[0][1]["pushes"] == 2 * 3


def test_flat_mixed_precision_matches_fsdp2_and_gathers_half_the_bytes():
    """bf16 params / fp32 reduce: the same parameters as FSDP2 under the same policy (both sum
    bf16 gradients in fp32), half the gather bytes of fp32, fp32 pushes and fp32 master shards."""
    counts = [2, 2]
    want = run_ranks(train_fsdp, 2, counts, mp=BF16)[0]
    got = run_ranks(train_flat, 2, counts, mp_policy=BF16, grad_divide_factor=2.0)
    fp32 = run_ranks(train_flat, 2, counts, grad_divide_factor=2.0)
    for (state, stats, _), (_, stats32, _) in zip(got, fp32):
        assert all(v.dtype == torch.float32 for v in state.values())
        assert_states_close(state, want, rtol=1e-3, atol=1e-5)
        assert stats["gathers"] == stats32["gathers"]
        assert stats["gather_bytes"] * 2 == stats32["gather_bytes"], (stats, stats32)
        assert stats["push_bytes"] == stats32["push_bytes"] * 0.5  # bf16 rows added into fp32


def test_flat_bf16_model_trains_in_bf16():
    """A model already in bf16 (no policy): bf16 shards, gathers and accumulators; close to fp32."""
    counts = [2, 1]
    want = train_reference(counts)
    bf16 = run_ranks(train_flat, 2, counts, make_model=lambda: make_gpt().to(torch.bfloat16))
    for state, _, _ in bf16:
        assert all(v.dtype == torch.bfloat16 for v in state.values())
        assert_states_close({k: v.float() for k, v in state.items()}, want, rtol=5e-2, atol=2e-2)


def _tied_check(rank, world_size, counts):
    state, _, extra = train_flat(rank, world_size, counts, make_model=tiny_qwen2_tied, close=True)
    return state, extra["after_close"]


def test_flat_tied_embeddings_train_as_one_parameter_and_stay_tied():
    """Qwen2 with tie_word_embeddings: trained as one parameter (its gradient is the sum of both
    uses), like the reference; after close() the model holds one tied parameter again."""
    pytest.importorskip("transformers")
    counts = [2, 1]
    want = train_reference(counts, make_model=tiny_qwen2_tied)
    assert torch.equal(want["lm_head.weight"], want["model.embed_tokens.weight"])
    for state, after in run_ranks(_tied_check, 2, counts):
        assert_states_close(state, want, rtol=1e-4, atol=1e-5)
        assert_states_close(after, want, rtol=1e-4, atol=1e-5)


def _tied_roundtrip(rank, world_size, tmp):
    from transformers import AutoModelForCausalLM

    model = tiny_qwen2_tied()
    handle = odc_mod.flat_shard(model).odc
    opt = torch.optim.SGD(handle.parameters(), lr=0.5)
    x = step_data(0, [1, 1])[0][rank][0]
    with handle.minibatch(num_tokens=x.shape[1] - 1) as mb:
        (loss_of(model, x) / mb.global_tokens).backward()
    opt.step()
    handle.close()
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    if rank == 0:
        model.save_pretrained(tmp)
    torch.distributed.barrier()
    back = AutoModelForCausalLM.from_pretrained(tmp)
    with torch.no_grad():
        same = torch.equal(back(x).logits, model(x).logits)
    return tied, back.lm_head.weight is back.model.embed_tokens.weight, same


def test_flat_tied_model_saves_and_reloads_tied_with_equal_logits(tmp_path):
    pytest.importorskip("transformers")
    for tied, reloaded_tied, same in run_ranks(_tied_roundtrip, 2, str(tmp_path)):
        assert tied and reloaded_tied and same


def _freeze(model):
    model.tok_emb.weight.requires_grad_(False)
    for p in model.layers[1].parameters():
        p.requires_grad_(False)


def test_flat_frozen_parameters_are_gathered_but_never_pushed_stepped_or_accumulated():
    """Frozen embeddings and a frozen block: the reference's parameters (frozen ones unchanged);
    the all-frozen block has no shard to step and pushes nothing; accumulators hold only the
    trainable elements."""
    counts = [2, 1]
    want = train_reference(counts, make_model=lambda: _frozen_gpt())
    init = make_gpt().state_dict()
    got = run_ranks(train_flat, 2, counts, prepare=_freeze)
    plain = run_ranks(train_flat, 2, counts)
    for rank, ((state, stats, extra), (_, _, plain_extra)) in enumerate(zip(got, plain)):
        assert_states_close(state, want, **FP32)
        assert torch.equal(state["tok_emb.weight"], init["tok_emb.weight"])
        assert torch.equal(state["layers.1.fc.weight"], init["layers.1.fc.weight"])
        assert extra["num_params"] == 2  # block 0 and the root; block 1 is all frozen
        assert stats["pushes"] == counts[rank] * 2 * STEPS, stats
        frozen_numel = sum(p.numel() for p in make_gpt().layers[1].parameters()) + init["tok_emb.weight"].numel()
        assert plain_extra["grads_bytes"] - extra["grads_bytes"] >= frozen_numel * 4 // 2 - 64 * 3
        assert extra["params_bytes"] == plain_extra["params_bytes"]  # frozen ones are still exposed


def _frozen_gpt():
    model = make_gpt()
    _freeze(model)
    return model


def test_flat_hsdp_2x2_matches_the_reference():
    """(replicate=2, shard=2) mesh: ODC inside each shard pair, one all-reduce at the sync."""
    counts = [3, 0, 1, 2]
    want = train_reference(counts)
    for state, _, _ in run_ranks(train_flat, 4, counts, mesh_shape=(2, 2)):
        assert_states_close(state, want, **FP32)


def test_flat_deterministic_mode_is_bitwise_reproducible():
    """deterministic=True: two runs give bitwise identical parameters, matching the reference."""
    counts = [3, 1, 0, 2]
    first = run_ranks(train_flat, 4, counts, deterministic=True)
    second = run_ranks(train_flat, 4, counts, deterministic=True)
    want = train_reference(counts)
    for (a, _, _), (b, _, _) in zip(first, second):
        for k in a:
            assert torch.equal(a[k], b[k]), k
        assert_states_close(a, want, **FP32)


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_flat_activation_checkpointing_matches_the_reference(model):
    """Checkpointed blocks recompute their forward after the re-gather: same parameters."""
    if model == "llama":
        pytest.importorskip("transformers")
    make = make_gpt if model == "gpt" else tiny_llama
    counts = [2, 1]
    want = train_reference(counts, make_model=make)
    for state, _stats, _ in run_ranks(train_flat, 2, counts, make_model=make, ac=True):
        assert_states_close(state, want, rtol=1e-4, atol=1e-5)


def _peak_bytes(rank, world_size, ac):
    from posttrain.models import GPT, GPTConfig, token_loss_sum

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, dim=64, num_layers=4, num_heads=2, max_seq_len=2048))
    if ac:
        checkpoint_blocks(model.layers)
    handle = odc_mod.flat_shard(model).odc
    x = torch.randint(0, 64, (1, 2049), generator=torch.Generator().manual_seed(rank))
    with handle.minibatch(num_tokens=2048):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            token_loss_sum(model(x[:, :-1]), x[:, 1:]).backward()
    handle.close(restore=False)
    deltas = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    current = peak = 0
    for _, d in deltas:
        current += d
        peak = max(peak, current)
    return peak


def test_flat_activation_checkpointing_lowers_peak_memory_on_a_long_sequence():
    """One 2048-token microbatch through 4 blocks: the peak of CPU memory allocated during forward
    and backward (torch profiler) falls to well under half with per-block checkpointing."""
    without = run_ranks(_peak_bytes, 2, False)
    with_ac = run_ranks(_peak_bytes, 2, True)
    for a, b in zip(without, with_ac):
        assert b < 0.5 * a, (a, b)


def _state_dict_before_and_after_close(rank, world_size):
    model = make_gpt()
    plain = type(model)
    block = model.layers[0]
    sharded = odc_mod.flat_shard(model)
    assert sharded is model and isinstance(model, plain) and isinstance(model, odc_mod.FlatODCModule)
    keys = sorted(model.state_dict())  # the sharded state (DTensors per unit)
    try:
        block.state_dict()
        inner = "no error"
    except RuntimeError as e:
        inner = str(e)
    full = model.full_state_dict()
    model.odc.close()
    after = model.state_dict()
    same = after.keys() == full.keys() and all(torch.equal(after[k], full[k]) for k in full)
    trainable = all(isinstance(p, torch.nn.Parameter) for p in model.parameters())
    return keys, inner, same, trainable, len(list(model.parameters())), type(model) is plain, hasattr(model, "odc")


def test_flat_model_state_dict_is_sharded_until_close_puts_the_parameters_back():
    for keys, inner, same, trainable, count, plain, handle in run_ranks(_state_dict_before_and_after_close, 2):
        assert keys and all(k.endswith((".flat", ".flat_frozen")) for k in keys), keys
        assert "sharded by flat ODC" in inner and "close()" in inner  # a unit inside holds no parameters
        assert same and trainable and count == len(list(make_gpt().parameters()))
        assert plain and not handle  # its own class again


MAX_NORM = 0.05
# The key bias's gradient is zero up to rounding (softmax ignores a shift shared by every key),
# and Adam with a tiny eps turns rounding into whole steps; a larger eps keeps the comparison exact.
ADAM = {"lr": LR, "eps": 1e-3}


def _clipped_reference(counts, mesh_shape=None):
    """One process: AdamW on the whole model with torch's clip_grad_norm_; the norms before clipping."""
    model = make_gpt()
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    norms = []
    for step in range(STEPS):
        data, total = step_data(step, counts)
        for r in range(len(counts)):
            for x in data[r]:
                (loss_of(model, x) / total).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def _drop_in_loop(rank, world_size, counts, mesh_shape=None):
    """The loop a user writes for FSDP2's fully_shard, on flat ODC: the model's parameters for
    the optimizer, torch's clip_grad_norm_, its state_dict; plus the minibatch block."""
    from torch.distributed.tensor import DTensor

    mesh = None
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    model = odc_mod.flat_shard(make_gpt(), mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    norms = []
    for step in range(STEPS):
        data, _ = step_data(step, counts)
        mine = data[rank]
        with model.minibatch(num_tokens=sum(x.shape[1] - 1 for x in mine)) as mb:
            for x in mine:
                (loss_of(model, x) / mb.global_tokens).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        opt.step()
        opt.zero_grad()
    sd = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    for p in model.parameters():
        p.data.zero_()
    model.load_state_dict({k: DTensor.from_local(sd[k], v.device_mesh, v.placements, shape=v.shape, stride=v.stride())
                           for k, v in model.state_dict().items()})  # the saved values back into the zeroed shards
    full = model.full_state_dict()
    model.odc.close()
    return full, norms


def _module_state_dict_in_a_parent(rank, world_size):
    model = odc_mod.flat_shard(make_gpt())
    parent = torch.nn.Module()
    parent.add_module("inner", model)
    keys = sorted(parent.state_dict())
    sd = model.state_dict()
    try:
        model.load_state_dict({**sd, "extra.flat": next(iter(sd.values()))})
        strict = "no error"
    except ValueError as e:
        strict = str(e)
    loose = model.load_state_dict({**sd, "extra.flat": next(iter(sd.values()))}, strict=False)
    try:
        odc_mod.flat_shard(make_gpt(), config=odc_mod.ODCConfig(), nonsense=1)
        unknown = "no error"
    except TypeError as e:
        unknown = str(e)
    model.odc.close()
    return keys, sorted(sd), strict, list(loose.unexpected_keys), unknown


def test_flat_model_state_dict_goes_under_a_parents_prefix_and_load_is_strict():
    for keys, own, strict, unexpected, unknown in run_ranks(_module_state_dict_in_a_parent, 2):
        assert keys == ["inner." + k for k in own]
        assert "unexpected keys" in strict and "extra.flat" in strict and unexpected == ["extra.flat"]
        assert "unexpected keyword arguments ['nonsense']" in unknown


@pytest.mark.parametrize("counts, mesh_shape", [([3, 1], None), ([2, 1, 0, 2], (2, 2))], ids=["ws2-3-1", "hsdp-2x2"])
def test_flat_shard_drops_into_a_fully_shard_loop_with_clipping_and_state_dict(counts, mesh_shape):
    """Unequal microbatch counts: torch's clip_grad_norm_ on the model's parameters gives the
    global norm of a single process (every rank the same), the clipped AdamW steps give its
    parameters, and the state_dict round trip keeps them."""
    want, want_norms = _clipped_reference(counts)
    assert min(want_norms) > MAX_NORM  # clipping was on at every step
    for full, norms in run_ranks(_drop_in_loop, len(counts), counts, mesh_shape):
        assert norms == pytest.approx(want_norms, rel=1e-5)
        assert_states_close(full, want, **FP32)


def _sharded_roundtrip(rank, world_size):
    model = make_gpt()
    handle = odc_mod.flat_shard(model).odc
    sd = {k: v.clone() for k, v in handle.sharded_state_dict().items()}  # the values are views of the shards
    shapes = {k: (tuple(v.shape), tuple(v.to_local().shape)) for k, v in sd.items()}
    before = [p.detach().clone() for p in handle.parameters()]
    for p in handle.parameters():
        p.data.zero_()
    handle.load_sharded_state_dict(sd)
    restored = all(torch.equal(a, b.detach()) for a, b in zip(before, handle.parameters()))
    handle.close(restore=False)
    return shapes, restored


def test_flat_sharded_state_dict_is_unpadded_dtensors_per_unit():
    results = run_ranks(_sharded_roundtrip, 2)
    for shapes, restored in results:
        assert restored
        assert set(shapes) == {"layers.0.flat", "layers.1.flat", "<root>.flat"}
    for key in results[0][0]:
        (global0, local0), (global1, local1) = results[0][0][key], results[1][0][key]
        assert global0 == global1 and local0[0] + local1[0] == global0[0]


def test_flat_frees_block_weights_after_forward_and_evaluates_outside_a_minibatch():
    for freed, out, nparams in run_ranks(_frees_after_forward, 2):
        assert freed == [True, True, False]
        assert out > 0 and nparams == 3


def _frees_after_forward(rank, world_size):
    model = make_gpt()
    handle = odc_mod.flat_shard(model).odc
    x = step_data(0, [1, 1])[0][rank][0]
    with handle.minibatch():
        loss = loss_of(model, x)
        # blocks freed their gathered weights after forward; the root keeps its own
        freed = [u.full.untyped_storage().nbytes() == 0 for u in handle.layouts]
        loss.backward()
    with torch.no_grad():
        out = loss_of(model, x)  # outside a minibatch: a collective gather, no push
    handle.close(restore=False)
    return freed, float(out), len(handle.parameters())


def test_flat_labels_its_gathers_and_pushes_for_the_torch_profiler():
    """While a torch profiler records, every gather, push, entry and exit is a labelled range
    (the labels are skipped when none records: they cost about 15 us each)."""
    for gathers, pushes, enters, syncs in run_ranks(_profiled_microbatch, 2):
        # 2 blocks gathered for forward and again for backward, the root once; 3 units pushed
        assert (gathers, pushes, enters, syncs) == (5, 3, 1, 1)


def _profiled_microbatch(rank, world_size):
    model = make_gpt()
    handle = odc_mod.flat_shard(model).odc
    x = step_data(0, [1, 1])[0][rank][0]
    with handle.minibatch():  # not recorded: warm-up
        loss_of(model, x).backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with handle.minibatch():
            loss_of(model, x).backward()
    handle.close(restore=False)
    names = [e.name for e in prof.events()]
    return tuple(names.count(f"ODC::{k}") for k in ("gather", "scatter_accumulate", "minibatch_enter",
                                                      "minibatch_sync"))


def _backward_outside(rank, world_size):
    model = make_gpt()
    handle = odc_mod.flat_shard(model).odc
    x = step_data(0, [1, 1])[0][rank][0]
    loss = loss_of(model, x)
    try:
        loss.backward()
    except RuntimeError as e:
        return str(e)
    finally:
        handle.close(restore=False)
    return "no error"


def test_flat_backward_outside_a_minibatch_is_a_clear_error():
    for msg in run_ranks(_backward_outside, 2):
        assert "outside `with odc.minibatch():`" in msg


def _bad_input(rank, world_size, what):
    model = make_gpt()
    try:
        if what == "mixed-dtypes":
            model.layers[0].fc.to(torch.bfloat16)
            odc_mod.flat_shard(model)
        elif what == "foreign":
            odc_mod.flat_shard(model, [torch.nn.Linear(2, 2)])
        elif what == "uncovered":
            odc_mod.flat_shard(model, list(model.layers))
        elif what == "tied-across-units":
            model.layers[1].fc.weight = model.layers[0].fc.weight
            odc_mod.flat_shard(model)
        elif what == "no-blocks":
            odc_mod.flat_shard(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("what,needle", [
    ("mixed-dtypes", "one dtype per unit"), ("foreign", "not a submodule"), ("uncovered", "outside every unit"),
    ("tied-across-units", "must belong to one unit"), ("no-blocks", "cannot find the transformer blocks"),
])
def test_flat_bad_input_is_a_clear_error(what, needle):
    for msg in run_ranks(_bad_input, 2, what):
        assert needle in msg


def _setup_fails(rank, world_size):
    import posttrain.odc._protocol as protocol_mod

    model = make_gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params_before = [id(p) for p in model.parameters()]

    def broken(*a, **k):
        raise OSError("no space left on /dev/shm")

    real, protocol_mod.ShmTransport.create = protocol_mod.ShmTransport.create, broken
    try:
        odc_mod.flat_shard(model)
    except OSError:
        pass
    finally:
        protocol_mod.ShmTransport.create = real
    after = model.state_dict()
    same_objects = [id(p) for p in model.parameters()] == params_before
    return same_objects and after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_flat_setup_failure_gives_the_model_its_parameters_back():
    assert run_ranks(_setup_fails, 2) == [True, True]


def _weight_pass(rank, world_size, push):
    """Gradients of one minibatch by a plain backward, then by a weight pass that assigns .grad
    to the per-parameter views itself (as torch's stage_backward_weight does), after the weights
    were freed and gathered again."""
    from odc_helpers import batches

    model = make_gpt()
    h = odc_mod.flat_shard(model).odc
    seq = batches(0, rank, 1)[0]
    out = {}
    for mode in ("backward", "weight pass"):
        try:
            with h.minibatch():
                loss = loss_of(model, seq)
                if mode == "backward":
                    loss.backward()
                else:
                    views = h.weight_views(graph_leaves(loss))
                    assert len(views) == len([p for u in h.layouts for p in u.params])  # one per parameter
                    torch.autograd.grad(loss, views, retain_graph=True)  # (an input pass: weights gathered back)
                    # freed until the weight pass, then gathered again: what the pipeline does between I and W
                    resharded = sum(u.reshard for u in h.layouts)
                    assert h.release_weights(views) == resharded and h.regather_weights(views) == resharded
                    for v, g in zip(views, torch.autograd.grad(loss, views)):  # reads the regathered weights
                        v.grad = g
                    if push:
                        assert h.push_grads(views) == len(h.layouts)  # each unit's leaf once
        except RuntimeError as e:
            h.close(restore=False)
            return str(e)
        out[mode] = [p.grad.clone() for p in h.parameters()]
    h.close()
    return out


def test_a_weight_pass_that_assigns_grads_itself_is_pushed_or_refused():
    # 2 shards of every unit (vectors padded to a multiple of 2): what a split backward's W relies on
    for got in run_ranks(_weight_pass, 2, True):
        for a, b in zip(got["backward"], got["weight pass"]):
            torch.testing.assert_close(b, a, **FP32)
    refused = run_ranks(_weight_pass, 2, False)  # not pushed: the minibatch refuses to end (a peer learns of it)
    assert all(isinstance(got, str) for got in refused) and any("never pushed" in got for got in refused), refused
