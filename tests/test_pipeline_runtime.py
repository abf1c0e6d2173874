"""The pipeline runtime: gradient parity with one process, measured memory = the schedule's, offload store."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from posttrain.launch import RanksFailedError, run_ranks
from posttrain.pipeline import OffloadPolicy, build_schedule
from posttrain.pipeline._ir import parse_schedule
from posttrain.pipeline.offload import ActivationStore, HostPool
from posttrain.pipeline.runtime import PipelineRunner, execution_order, plan_receives, to_torch_actions
from posttrain.pipeline.stages import split_model
from posttrain.train.core import OptimConfig
from posttrain.train.sft.pipeline import (
    PipelineConfig,
    build_pipeline_model,
    measured_weight_keep,
    microbatch_loss,
    predicted_peaks,
    reference_gradients,
    run_pipeline,
    step_batch,
)


def _predicted(cfg, outs):
    """The schedule's peaks with each stage's W part as the run measured it (exact: compared with approx
    only because the units are sums of fractions)."""
    return pytest.approx(predicted_peaks(cfg, weight_keep=measured_weight_keep(outs)), abs=1e-9)

# every schedule x offload policy (none / half / full where half differs from none) at 2 and 4 ranks
_CASES = []
for _ranks in (2, 4):
    for _name, _chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("group_interleaved", 2),
                           ("group_interleaved_zb", 2), ("interleaved_zb", 2), ("zb_h1", 1), ("zb_h1_tight", 1),
                           ("zbv", 2)):
        for _off in sorted({"none", str(_chunks // 2), "full"} - ({"0"} if _chunks // 2 == 0 else set())):
            _CASES.append((_ranks, _name, _chunks, _off))


# the grouped constructions at their smallest group
_GROUP = {"group_interleaved": lambda r: 1, "interleaved_zb": lambda r: 1, "group_interleaved_zb": lambda r: 1}


@pytest.mark.parametrize("ranks,schedule,chunks,offload", _CASES,
                         ids=[f"{r}r-{s}-{o}" for r, s, _, o in _CASES])
def test_gradients_match_one_process_and_memory_matches_schedule(ranks, schedule, chunks, offload):
    cfg = PipelineConfig(schedule=schedule, num_ranks=ranks, chunks=chunks,
                         num_microbatches=2 * ranks, group_size=_GROUP.get(schedule, lambda r: None)(ranks),
                         offload=offload, num_layers=ranks * chunks, dim=32, seq_len=32, steps=2)
    # (gradients of the first step; memory of the last: a split backward's first splits are checked,
    # holding what they drop until W)
    outs = run_pipeline(cfg, return_grads=True, timeout_s=120)
    ref_loss, ref_grads = reference_gradients(cfg)
    grads = {}
    for o in outs:
        assert not set(grads) & set(o["grads"]), "a parameter lives on two ranks"
        grads.update(o["grads"])
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    [loss] = [o["losses"][0] for o in outs if o["losses"][0] is not None]
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    measured = [o["result"]["peak_units"] for o in outs]
    assert measured == _predicted(cfg, outs), "measured saved-activation peak differs from the schedule's"
    assert all(o["result"]["late_reloads"] == 0 for o in outs)
    if offload != "none":
        assert sum(o["result"]["offloaded_bytes"] for o in outs) > 0


@pytest.mark.parametrize("schedule,offload", [("interleaved_1f1b", "1"), ("zbv", "full")])
def test_llama_stages_match_one_process(schedule, offload):
    """transformers' Llama blocks; under zbv's split backward W keeps a quarter of a block's saved
    activations or less (the linear layers' inputs; attention, rotary and SiLU's are freed after I)."""
    cfg = PipelineConfig(schedule=schedule, num_ranks=2, chunks=2, num_microbatches=4, offload=offload,
                         model="llama", num_layers=4, dim=32, seq_len=16, steps=2)
    outs = run_pipeline(cfg, return_grads=True, timeout_s=120)
    _, ref = reference_gradients(cfg)
    got = {k: v for o in outs for k, v in o["grads"].items()}
    assert set(got) == set(ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    assert [o["result"]["peak_units"] for o in outs] == _predicted(cfg, outs)
    if schedule == "zbv":
        keep = measured_weight_keep(outs)
        assert keep[0] == 0 and all(0 < keep[s] <= 0.3 for s in (1, 2, 3)), keep


def test_training_loss_falls():
    outs = run_pipeline(PipelineConfig(schedule="1f1b", num_ranks=2, num_microbatches=4, offload="full", steps=12,
                                       optim=OptimConfig(lr=1e-2), dim=32, seq_len=32), timeout_s=120)
    losses = [x for o in outs for x in o["losses"] if x is not None]
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize("chunks", [2, 4])
def test_interleaved_offload_of_half_the_chunks_cuts_the_peak_about_in_half(chunks):
    """At 8 ranks. At 2-4 ranks the ratio is 0.56-0.64: the forward in progress and the reloads in
    flight (up to 3 chunk-microbatches) stay resident whatever the policy, and weigh more there."""
    base = PipelineConfig(schedule="interleaved_1f1b", num_ranks=8, chunks=chunks, num_microbatches=16, num_layers=8 * chunks)
    none = max(predicted_peaks(base))
    half = max(predicted_peaks(PipelineConfig(**{**base.__dict__, "offload": str(chunks // 2)})))
    assert 0.45 <= half / none <= 0.55, (none, half)


def test_at_8_ranks_group_interleaved_offload_of_half_cuts_more_than_half_interleaved_about_half():
    """Measured by the runtime on 8 processes (tiny model), in chunk-microbatches: group size 4
    goes 16 -> 7 (more than half), interleaved 1F1B 23 -> 11 (about half)."""
    def peaks(g, off):
        cfg = PipelineConfig(schedule="group_interleaved", num_ranks=8, chunks=2, group_size=g, num_microbatches=16,
                             num_layers=16, dim=16, num_heads=2, seq_len=16, steps=1, offload=off)
        res = run_pipeline(cfg, timeout_s=120)
        measured = max(r["result"]["peak_units"] for r in res)
        assert measured == max(predicted_peaks(cfg))
        return measured

    assert peaks(4, "1") / peaks(4, "none") < 0.5
    assert 0.45 <= peaks(8, "1") / peaks(8, "none") <= 0.55


@pytest.mark.parametrize("schedule,chunks,group,microbatches,expected", [
    # the modulo construction at group size 1: interleaved 1F1B holds 23
    ("interleaved_zb", 2, 1, 16, {"none": 10, "1": 5}),
    # the slot construction at the paper's v=2 g=4, v=2 g=1 and v=4 g=2 (docs/pipeline.md:
    # 12, 6 | 13, 5, 2 | 22, 14, 8, 4; full offload 2 where the paper counts 3 at g=4 and v=4)
    ("group_interleaved_zb", 2, 4, 32, {"none": 12, "1": 6}),
    ("group_interleaved_zb", 2, 1, 32, {"none": 13, "1": 5, "full": 2}),
    ("group_interleaved_zb", 4, 2, 32, {"none": 22, "2": 8, "full": 2}),  # (1 and 3 chunks: 14, 4)
])
def test_at_8_ranks_split_backward_group_interleaved_memory_is_measured_as_predicted(schedule, chunks, group,
                                                                                    microbatches, expected):
    """On 8 processes, with 0, 1, ... chunks offloaded, in whole chunk-microbatches (each held
    until its W: the constructions' own figures)."""
    got = {}
    for off in expected:
        cfg = PipelineConfig(schedule=schedule, num_ranks=8, chunks=chunks, group_size=group, num_microbatches=microbatches,
                             num_layers=8 * chunks, dim=16, num_heads=2, seq_len=16, steps=1, offload=off,
                             no_weight_split=True)
        res = run_pipeline(cfg, timeout_s=120)
        measured = [r["result"]["peak_units"] for r in res]
        assert measured == _predicted(cfg, res)
        got[off] = max(measured)
    assert got == expected


# -- errors ----------------------------------------------------------------------------------

def test_runner_rejects_a_schedule_for_another_number_of_ranks():
    sched = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    with pytest.raises(ValueError, match="laid out for 2 pipeline ranks, but the process group has 1"):
        PipelineRunner({0: nn.Linear(2, 2)}, sched, loss_fn=lambda y, t: y.sum())


def test_bad_pipeline_configs_are_clear():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'; valid: gpipe, 1f1b"):
        PipelineConfig(schedule="pipedream")
    with pytest.raises(ValueError, match="cannot be cut into 8 stages"):
        PipelineConfig(schedule="interleaved_1f1b", num_ranks=4, chunks=2, num_layers=4)
    with pytest.raises(ValueError, match="needs at least 4 microbatches"):
        PipelineConfig(schedule="interleaved_1f1b", num_ranks=4, chunks=2, num_layers=8, num_microbatches=2).build()
    with pytest.raises(ValueError, match="between 0 and the 2 chunks"):
        PipelineConfig(schedule="interleaved_1f1b", chunks=2, offload="3")


def _long_worker(rank, world, cfg):
    from posttrain.pipeline.stages import split_model
    from posttrain.train.sft.pipeline import build_pipeline_model, microbatch_loss

    stages = split_model(build_pipeline_model(cfg), cfg.num_stages)
    runner = PipelineRunner({rank: stages[rank]}, cfg.build(), loss_fn=microbatch_loss)
    x = [torch.zeros(1, 40, dtype=torch.long)] * 2  # 40 tokens; positions stop at seq_len=32
    runner.step(x, x)


def test_failure_names_rank_stage_action_and_microbatch():
    cfg = PipelineConfig(schedule="1f1b", num_ranks=2, num_microbatches=2, seq_len=32, steps=1)
    with pytest.raises(RanksFailedError) as e:
        run_ranks(_long_worker, 2, cfg, timeout_s=60)
    assert "rank 0, stage 0, action 0F0 (F), microbatch 0: ValueError: sequence length 40" in e.value.errors[0]


def _ragged_worker(rank, world, cfg, static):
    from posttrain.pipeline.stages import split_model
    from posttrain.train.sft.pipeline import build_pipeline_model, microbatch_loss

    stages = split_model(build_pipeline_model(cfg), cfg.num_stages)
    runner = PipelineRunner({rank: stages[rank]}, cfg.build(), loss_fn=microbatch_loss, static_shapes=static)
    x = [torch.zeros(1, n, dtype=torch.long) for n in (16, 24)]  # two microbatches, two lengths
    return runner.step(x, x).loss


def test_microbatches_of_different_shapes_need_static_shapes_off():
    cfg = PipelineConfig(schedule="1f1b", num_ranks=2, num_microbatches=2, seq_len=32, steps=1)
    assert run_ranks(_ragged_worker, 2, cfg, False, timeout_s=60)[1] > 0
    with pytest.raises(RanksFailedError) as e:
        run_ranks(_ragged_worker, 2, cfg, True, timeout_s=60)
    assert "need PipelineRunner(static_shapes=False)" in e.value.errors[0]


def _batches_worker(rank, world, cfg, nccl_order):
    import torch.distributed as dist

    from posttrain.pipeline.stages import split_model
    from posttrain.train.sft.pipeline import build_pipeline_model, microbatch_loss

    batches = []
    real = dist.batch_isend_irecv

    def recording(ops):
        batches.append(sorted("send" if op.op is dist.isend else "recv" for op in ops))
        return real(ops)

    dist.batch_isend_irecv = recording
    stages = split_model(build_pipeline_model(cfg), cfg.num_stages)
    static = cfg.schedule != "1f1b"
    schedule = cfg.build()
    mine = {s: stages[s] for s in range(cfg.num_stages) if schedule.layout.rank_of(s) == rank}
    runner = PipelineRunner(mine, schedule, loss_fn=microbatch_loss, static_shapes=static)
    if nccl_order:  # how payloads are posted over NCCL, here over gloo
        orders = [execution_order(runner.lowered[r]) for r in range(world)]
        runner._order_messages(plan_receives(orders, runner.layout))
    x = [torch.zeros(1, 16 if static else n, dtype=torch.long) for n in (16, 20, 24, 28)]
    return batches, runner.step(x, x).loss


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_a_steps_sends_and_receives_are_posted_in_batches_as_over_nccl(schedule):
    """NCCL completes a lone send of a large message only once the peer has posted its receive,
    so in 1F1B's steady state (both neighbours send, then receive) unbatched sends would wait for
    each other forever. Every payload must go through ``batch_isend_irecv``, and where a rank
    sends and receives between two compute actions, both in one batch (gloo here, the same code
    path, with NCCL's order of posting: the planned receives, a batch's headers first; 1F1B with
    varying shapes, so every message has its header; interleaved 1F1B with a receive posted a
    batch early, which it needs). On gloo, sends go before a header is waited for (a peer's
    receive of a payload holds its thread); the loss is the same either way."""
    cfg = PipelineConfig(schedule=schedule, num_ranks=2, chunks=2 if schedule != "1f1b" else 1, num_microbatches=4,
                         num_layers=4, seq_len=32, steps=1)
    losses = []
    for nccl_order in (True, False):
        out = run_ranks(_batches_worker, 2, cfg, nccl_order, timeout_s=60)
        # each rank sends and receives a payload per microbatch and stage boundary it is on
        sent = sum(b.count("send") for batches, _ in out for b in batches)
        received = sum(b.count("recv") for batches, _ in out for b in batches)
        assert sent == 2 * 4 * (cfg.num_stages - 1), sent
        if nccl_order or schedule == "1f1b":  # (gloo with static shapes: receives posted ahead, alone)
            assert received == sent, (sent, received)
        if nccl_order:  # a send and a receive together, on both ranks
            assert all(any(b.count("recv") and b.count("send") for b in batches) for batches, _ in out), out
        losses.append(next(loss for _, loss in out if loss is not None))
    assert losses[0] == losses[1]


# -- execution order and torch action lists ---------------------------------------------------

def test_reload_runs_before_the_compute_action_in_front_of_it_but_after_earlier_copies():
    acts = parse_schedule({0: "0F0 0OFFLOAD0 0F1 0OFFLOAD1 0RELOAD0 0F2 0B0"})[0]
    assert " ".join(map(str, execution_order(acts))) == "0F0 0OFFLOAD0 0F1 0OFFLOAD1 0RELOAD0 0F2 0B0"
    acts = parse_schedule({0: "0F0 0OFFLOAD0 0F1 0RELOAD0 0F2 0B0"})[0]
    assert " ".join(map(str, execution_order(acts))) == "0F0 0OFFLOAD0 0RELOAD0 0F1 0F2 0B0"


def test_torch_action_lists():
    sched = build_schedule("zb_h1", num_ranks=2, num_microbatches=2)
    out = to_torch_actions(sched.actions)
    assert [str(a) for a in out[0]][:3] == ["0F0", "0F1", "0I0"]
    with pytest.raises(ValueError, match="no action for 0OFFLOAD0"):
        to_torch_actions(parse_schedule({0: "0F0 0OFFLOAD0 0RELOAD0 0B0"}))


# -- the activation store ---------------------------------------------------------------------

def _forward(store, lin, x, key=(0, 0)):
    with store.hooks(*key):
        h = lin(x)
        q, k = h.split(h.shape[-1] // 2, dim=-1)  # two views of one storage
        return (q.sin() * k.cos()).sum()


def test_store_aliases_views_passes_params_and_small_tensors_and_round_trips():
    torch.manual_seed(0)
    lin = nn.Linear(64, 128)
    x = torch.randn(32, 64)
    ref_loss = _forward(ActivationStore([]), lin, x)  # graph for the reference
    ref_loss.backward()
    ref = lin.weight.grad.clone()
    lin.weight.grad = None

    store = ActivationStore(lin.parameters())
    loss = _forward(store, lin, x)
    # saved: x for the weight gradient, q and k (two views of h: one storage, stored once) for
    # sin/cos, and the sin and cos outputs for the product: x + h + 2 half-size results
    assert store.packed[(0, 0)] == store.resident[0] == 4 * (32 * 64 + 32 * 128 + 2 * 32 * 64)
    store.offload(0, 0)
    assert store.resident[0] == 0
    store.reload(0, 0)
    assert store.resident[0] == store.packed[(0, 0)]
    loss.backward()
    store.release(0, 0)
    assert store.resident[0] == 0 and store.held() == []
    torch.testing.assert_close(lin.weight.grad, ref, rtol=0, atol=0)
    assert store.late_reloads == 0


def test_a_ranks_peak_is_its_stages_together_not_the_sum_of_their_peaks():
    """Two stages on one rank that peak at different times: the rank's peak (what `posttrain
    pipeline` reports as peak MiB) is the larger, not the sum; held together, it is the sum."""
    from posttrain.train.sft.pipeline import format_report

    lin = nn.Linear(64, 64)
    store = ActivationStore(lin.parameters())
    first = _forward(store, lin, torch.randn(40, 64), key=(0, 0))
    store.offload(0, 0)  # stage 0's bytes leave before stage 1's arrive
    second = _forward(store, lin, torch.randn(60, 64), key=(1, 0))
    a, b = store.packed[(0, 0)], store.packed[(1, 0)]
    assert store.peak(0) == a and store.peak(1) == b and store.total_peak() == max(a, b) < a + b
    store.reload(0, 0)  # now both are resident at once
    assert store.total_peak() == a + b
    for key, loss in (((1, 0), second), ((0, 0), first)):
        loss.backward()
        store.release(*key)
    result = {"stages": [0, 1], "losses": [1.0], "step_times": [0.1],
              "result": {"rank_peak_bytes": 3 * 2**20, "peak_bytes": {0: 2 * 2**20, 1: 2 * 2**20}, "peak_units": 1.5,
                         "offloaded_bytes": 0}}
    assert format_report([result], [2]).splitlines()[1].split()[2] == "3.00"  # not 4.00, the sum


def test_the_host_pool_stops_allocating_and_stays_bounded_over_200_steps_of_varying_shapes():
    """Packed variable-length microbatches: the saved tensors change size every step. A pool that
    reuses only buffers of the exact byte size allocates nearly every offload and keeps it all;
    with size classes and a bound, allocations stop and what the pool holds after a step stays
    near the largest step's demand (the bound: what is in use plus the peak in use; measured here
    1.14x the largest step's offloaded bytes, asserted 1.5x)."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 32)
    store = ActivationStore(lin.parameters())
    gen = torch.Generator().manual_seed(1)
    allocations, worst = [], 0
    for _ in range(200):
        lengths = torch.randint(40, 400, (4,), generator=gen).tolist()  # four microbatches a step
        losses = []
        for j, n in enumerate(lengths):
            losses.append(_forward(store, lin, torch.randn(n, 32), key=(0, j)))
            store.offload(0, j)
        demand = store.offloaded_bytes
        for j in reversed(range(len(lengths))):
            store.reload(0, j)
            losses[j].backward()
            store.release(0, j)
        store.reset_stats()
        worst = max(worst, demand)
        pool = store.pool
        assert pool.live_bytes == 0
        assert pool.held_bytes <= pool.peak_live_bytes and pool.held_bytes <= 1.5 * worst, (pool.held_bytes, worst)
        allocations.append(pool.allocations)
    assert allocations[99] > 0
    assert allocations[-1] - allocations[99] <= 2, allocations[::20]  # settled: the last 100 steps reuse


def test_host_pool_size_classes_views_and_explicit_bound():
    pageable, pinned = HostPool(pin=False), HostPool(pin=False, max_cached_bytes=0)
    pinned.steps = 1  # the pinned rounding, without page-locking memory here
    assert [pageable.size_class(n) for n in (1, 4097, 6000, 8192, 8193)] == [4096, 5120, 6144, 8192, 10240]
    assert [pinned.size_class(n) for n in (1, 4097, 6000, 8192, 8193)] == [4096, 8192, 8192, 8192, 16384]
    a = pageable.take(6000)
    assert a.numel() == 6000 and a.dtype == torch.uint8 and pageable.live_bytes == 6144
    pageable.give(a)
    b = pageable.take(5000)  # a smaller class: the free buffer that fits best
    assert b.data_ptr() == a.data_ptr() and pageable.allocations == 1 and pageable.live_bytes == 6144
    c = pageable.take(5000)  # none free: a new buffer of the class
    assert pageable.allocations == 2 and pageable.live_bytes == 6144 + 5120
    pageable.give(b)
    pageable.give(c)
    x = pinned.take(10_000)
    pinned.give(x)  # max_cached_bytes=0: nothing kept
    assert pinned.held_bytes == 0 and pinned.take(10_000) is not None and pinned.allocations == 2
    with pytest.raises(ValueError, match="max_cached_bytes=-1"):
        HostPool(pin=False, max_cached_bytes=-1)


def test_store_reloads_late_when_no_reload_was_scheduled_and_counts_it():
    lin = nn.Linear(64, 64)
    store = ActivationStore(lin.parameters())
    loss = _forward(store, lin, torch.randn(40, 64))
    store.offload(0, 0)
    loss.backward()
    assert store.late_reloads == 1


def test_store_rejects_wrong_transitions():
    lin = nn.Linear(64, 64)
    store = ActivationStore(lin.parameters())
    _forward(store, lin, torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="reload in state device"):
        store.reload(0, 0)
    store.offload(0, 0)
    with pytest.raises(RuntimeError, match="offload in state host"):
        store.offload(0, 0)
    with pytest.raises(RuntimeError, match="stage 0 microbatch 1: offload without saved activations"):
        store.offload(0, 1)
    store.release(0, 0)
    with pytest.raises(RuntimeError, match="release without saved activations"):
        store.release(0, 0)


def test_small_tensors_and_parameters_are_not_stored():
    lin = nn.Linear(8, 8)
    store = ActivationStore(lin.parameters())
    with store.hooks(0, 0):
        lin(torch.randn(4, 8)).sum()  # input 32 elements, weight is a parameter
    assert store.packed[(0, 0)] == 0


def test_offload_policy_parse():
    assert OffloadPolicy.parse("full", 4).chunks == 4
    assert OffloadPolicy.parse("2", 4).chunks == 2
    with pytest.raises(ValueError, match="not none, full or a number"):
        OffloadPolicy.parse("half", 2)


@pytest.mark.cuda
def test_cuda_store_offloads_on_a_side_stream_and_round_trips():
    torch.manual_seed(0)
    lin = nn.Linear(256, 512).cuda()
    x = torch.randn(512, 256, device="cuda")
    _forward(ActivationStore([], "cuda"), lin, x).backward()
    ref = lin.weight.grad.clone()
    lin.weight.grad = None
    store = ActivationStore(lin.parameters(), "cuda")
    loss = _forward(store, lin, x)
    held = store.resident[0]
    store.offload(0, 0)
    torch.cuda.synchronize()
    store.poll()
    assert store.resident[0] == 0
    store.reload(0, 0)
    assert store.resident[0] == held
    loss.backward()
    store.release(0, 0)
    torch.testing.assert_close(lin.weight.grad, ref, rtol=0, atol=0)
    assert store.late_reloads == 0


# -- split backward: what only I needs is freed when I ends --------------------------------------

def _one_process_zbv(monkeypatch=None, *, weight_split=True, walk=None, offload=0, fraction=1.0, schedule="zbv"):
    """zbv (or ``schedule``) on one process (1 rank x 2 chunks: stages 0 and 1; gpipe: 1 chunk),
    4 microbatches, two steps; the runner, its step results and the parameter gradients."""
    cfg = PipelineConfig(schedule=schedule, num_ranks=1, num_microbatches=4, num_layers=4, dim=32, seq_len=16, steps=1,
                         chunks=2 if schedule == "zbv" else 1)
    torch.manual_seed(0)
    stages = split_model(build_pipeline_model(cfg), cfg.num_stages)
    runner = PipelineRunner(dict(enumerate(stages)), cfg.build(), loss_fn=microbatch_loss,
                            offload=OffloadPolicy(offload, fraction=fraction), weight_split=weight_split)
    if walk is not None:
        monkeypatch.setattr(runner, "_weight_saved", walk)
    results = [runner.step(*step_batch(cfg, step)) for step in range(2)]
    grads = {f"{i}.{n}": p.grad.clone() for i, st in enumerate(stages) for n, p in st.named_parameters()}
    return runner, results, grads


def test_split_backward_frees_what_only_i_needs_with_the_same_gradients():
    from posttrain.pipeline import add_offload, add_send_recv, simulate

    _, whole, ref = _one_process_zbv(weight_split=False)
    for offload in (0, 2):
        runner, results, grads = _one_process_zbv(offload=offload)
        for n in ref:
            torch.testing.assert_close(grads[n], ref[n], rtol=0, atol=0, msg=n)
        last = results[-1]
        assert last.weight_keep[0] == 0.0  # stage 0's I computes every gradient: nothing left for W
        assert 0.3 < last.weight_keep[1] < 0.8  # the linear layers' inputs, not what attention and the loss saved
        assert whole[-1].weight_keep == {0: 1.0, 1: 1.0}
        assert last.late_reloads == 0
        sched = runner.schedule
        lowered = add_send_recv(add_offload(sched.actions, sched.layout, 4, OffloadPolicy(offload)), sched.layout)
        predicted = simulate(lowered, sched.layout, 4, weight_keep=last.weight_keep).peak(0)
        assert last.peak_units == pytest.approx(predicted, abs=1e-9)
        assert last.rank_peak_bytes <= whole[-1].rank_peak_bytes
        if offload:  # W's part goes out again between I and W
            assert any(a.kind == "OFFLOAD_W" for a in runner.order)
            assert last.offloaded_bytes > 0


def test_selective_offload_within_a_chunk_moves_a_share_keeps_the_rest_and_the_gradients():
    """OffloadPolicy(fraction=f): each offload moves the tensors saved first, about f of the
    chunk-microbatch (whole storages), and the rest stays on the device: the same gradients bit
    for bit (zbv's split backward: W's part goes out again at the same share), no late reload, the
    bytes moved about f of full offload's, and a resident peak between none's and full's, near the
    simulator's at that share."""
    from posttrain.pipeline import add_offload, add_send_recv, simulate

    for schedule, chunks in (("zbv", 2), ("gpipe", 1)):  # a split backward; every forward before any backward
        _, none, ref = _one_process_zbv(offload=0, schedule=schedule)
        _, full, _ = _one_process_zbv(offload=chunks, schedule=schedule)
        for fraction in (0.3, 0.6):
            runner, results, grads = _one_process_zbv(offload=chunks, fraction=fraction, schedule=schedule)
            for n in ref:
                torch.testing.assert_close(grads[n], ref[n], rtol=0, atol=0, msg=n)
            last = results[-1]
            assert last.late_reloads == 0
            share = last.offloaded_bytes / full[-1].offloaded_bytes
            assert abs(share - fraction) < 0.15, share
            sched = runner.schedule
            lowered = add_send_recv(add_offload(sched.actions, sched.layout, 4, OffloadPolicy(chunks)), sched.layout)
            predicted = simulate(lowered, sched.layout, 4, weight_keep=last.weight_keep, offload_fraction=share).peak(0)
            assert last.peak_units == pytest.approx(predicted, abs=0.2), (schedule, last.peak_units, predicted)
            if schedule == "gpipe":  # 4 microbatches held at once without offload; fewer with it, more at a share
                assert full[-1].peak_units < last.peak_units < none[-1].peak_units, (full[-1].peak_units, none[-1].peak_units)
    with pytest.raises(ValueError, match=r"offload fraction=0 must be in \(0, 1\]"):
        OffloadPolicy(1, fraction=0)
    with pytest.raises(ValueError, match=r"offload_fraction=0\.5 is a share of the offloaded chunks, and offload=none "
                                         r"offloads none"):
        PipelineConfig(offload_fraction=0.5)


def test_a_split_the_graph_walk_gets_wrong_is_caught_on_the_first_microbatch_and_stops(monkeypatch):
    """A walk that claims W needs nothing: the stage's first split keeps the dropped storages
    aside, W reads them (gradients still exact), and the stage stops splitting with a warning."""
    _, _, ref = _one_process_zbv(weight_split=False)
    with pytest.warns(UserWarning, match="stage 1: the weight-gradient pass read a saved tensor"):
        runner, results, grads = _one_process_zbv(monkeypatch, walk=lambda key, groups: set())
    for n in ref:
        torch.testing.assert_close(grads[n], ref[n], rtol=0, atol=0, msg=n)
    assert runner._split_ok == {1: False}
    assert results[-1].weight_keep[1] == 1.0


def test_store_split_frees_the_rest_and_a_read_of_a_freed_storage_is_clear():
    torch.manual_seed(0)
    lin = nn.Linear(64, 128)
    x = torch.randn(32, 64)
    store = ActivationStore(lin.parameters())
    with store.recording() as read:
        loss = _forward(store, lin, x)
        loss.backward(retain_graph=True)
    kept = {storage for key, storage in read if key == (0, 0)}
    x_storage = next(k for k in kept if store._entries[(0, 0)].storages[k].numel() == 4 * 32 * 64)
    store.split(0, 0, {x_storage})
    assert store.resident[0] == store.kept[(0, 0)] == 4 * 32 * 64
    store.offload(0, 0)
    assert store.resident[0] == 0
    store.reload(0, 0)
    with pytest.raises(RuntimeError, match="freed after the input-gradient pass"):
        loss.backward()
    store.release(0, 0)
    assert store.resident[0] == 0 and store.held() == []


def test_a_stage_whose_w_runs_a_node_that_hides_its_saved_tensors_keeps_them():
    """An in-place op on a view (autograd's CopySlices wraps the node that saved the tensor) that
    appears only from the second microbatch on, after the first split was checked: that
    microbatch is kept whole for W, the gradients are exact and the stage reports keeping all."""
    cfg = PipelineConfig(schedule="zbv", num_ranks=1, num_microbatches=4, vocab_size=64, seq_len=16, steps=1)

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.gain, self.out = nn.Linear(32, 32), nn.Parameter(torch.ones(32)), nn.Linear(32, 64)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            h = self.lin(x)
            if self.calls > 1:  # e.g. a data-dependent branch
                h[..., :16].mul_(self.gain[:16])
            return self.out(torch.tanh(h))

    def run(weight_split):
        torch.manual_seed(0)
        stages = {0: nn.Embedding(64, 32), 1: Head()}
        runner = PipelineRunner(stages, cfg.build(), loss_fn=microbatch_loss, weight_split=weight_split)
        result = runner.step(*step_batch(cfg, 0))
        return result, {f"{s}.{n}": p.grad for s, m in stages.items() for n, p in m.named_parameters()}

    (_, ref), (result, grads) = run(False), run(True)
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=0, atol=0, msg=name)
    assert result.weight_keep == {0: 0.0, 1: 1.0}


def test_a_verifying_split_counts_what_it_keeps_aside_until_the_release():
    torch.manual_seed(0)
    lin = nn.Linear(64, 128)
    store = ActivationStore(lin.parameters())
    loss = _forward(store, lin, torch.randn(32, 64))
    whole = store.resident[0]
    store.split(0, 0, set(), verify=True)
    assert store.resident[0] == whole and store.kept[(0, 0)] == 0  # kept aside: still on the device
    loss.backward()  # reads what the split dropped: noted, and still exact
    assert store.missed(0, 0)
    store.release(0, 0)
    assert store.resident[0] == 0 and store.held() == []


def test_store_partial_offload_keeps_the_rest_through_every_transition():
    """``offload(fraction)`` moves a prefix of the save order and keeps the rest on the device, with
    exact resident bytes after every transition: a backward without a reload reads the kept
    tensors in place and reloads the moved part late (gradients exact); a release while on the
    host frees the kept part; a verifying split on the host holds the kept storages it drops aside
    (a read of one is noted, not fatal); a reload restores the save order for the next offload."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 64))
    x = torch.randn(32, 64)

    def forward(store):
        with store.hooks(0, 0):
            return mlp(x).square().mean()

    plain = ActivationStore(mlp.parameters())
    forward(plain).backward()
    plain.release(0, 0)
    ref = [p.grad.clone() for p in mlp.parameters()]

    store = ActivationStore(mlp.parameters())
    mlp.zero_grad()
    loss = forward(store)
    entry = store._entries[(0, 0)]
    order, total = list(entry.storages), entry.nbytes
    store.offload(0, 0, 0.5)
    moved = store.offloaded_bytes
    assert 0 < moved < total and abs(moved / total - 0.5) < 0.3
    assert list(entry.storages) == order[:len(entry.storages)]  # a prefix of the save order went out
    assert store.resident[0] == total - moved
    loss.backward()  # no reload: the kept part read in place, the moved part reloaded late
    assert store.late_reloads == 1
    store.release(0, 0)
    assert store.resident[0] == 0 and store.held() == []
    for p, g in zip(mlp.parameters(), ref):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)

    loss = forward(store)  # released while on the host
    store.offload(0, 0, 0.5)
    store.release(0, 0)
    assert store.resident[0] == 0

    loss = forward(store)  # a verifying split on the host that drops everything: kept storages held aside
    store.offload(0, 0, 0.5)
    store.split(0, 0, set(), verify=True)
    assert store.resident[0] == total - moved  # (held aside: still resident)
    with pytest.raises(RuntimeError, match="freed after the input-gradient pass"):
        loss.backward()  # the moved part was dropped for good (not resident): its read fails...
    assert store.missed(0, 0)  # ...after the kept part's read was noted
    store.release(0, 0)
    assert store.resident[0] == 0

    loss = forward(store)  # offload, reload: the save order back, so a second offload moves the same prefix
    order = list(store._entries[(0, 0)].storages)
    store.offload(0, 0, 0.5)
    first = set(store._entries[(0, 0)].storages)
    store.reload(0, 0)
    assert list(store._entries[(0, 0)].storages) == order
    store.offload(0, 0, 0.5)
    assert set(store._entries[(0, 0)].storages) == first
    store.reload(0, 0)
    loss.backward()
    store.release(0, 0)
    assert store.resident[0] == 0 and store.held() == []
