"""Pipeline schedules as data: the action IR, generators (golden strings), the validator and the
unit-clock simulation. A failure names a generator whose order changed, a peak that no longer
matches the schedule's promise, or a validator that accepts a broken schedule."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.pipeline import (
    GROUPED_SCHEDULES,
    KINDS,
    ONE_CHUNK_SCHEDULES,
    SCHEDULES,
    Action,
    ScheduleError,
    StageLayout,
    build_schedule,
    parse_schedule,
    simulate,
)
from posttrain.pipeline.schedules import _strict_interleaved


def test_action_text_round_trips_for_every_kind():
    for kind in KINDS:
        a = Action(12, kind, 7)
        assert str(a) == f"12{kind}7" and Action.parse(str(a)) == a
    with pytest.raises(ValueError, match="expected <stage><kind><microbatch> with kind one of F, B, I, W"):
        Action.parse("1X0")
    with pytest.raises(ValueError, match="unknown action kind 'Q'"):
        Action(0, "Q", 0)


GOLDEN = {
    ("gpipe", 2, 3, 1): {0: "0F0 0F1 0F2 0B0 0B1 0B2", 1: "1F0 1F1 1F2 1B0 1B1 1B2"},
    ("1f1b", 2, 3, 1): {0: "0F0 0F1 0B0 0F2 0B1 0B2", 1: "1F0 1B0 1F1 1B1 1F2 1B2"},
    # ZB-H1 as published: rank 1 holds its W back one backward; zb_h1_tight runs each W at once
    ("zb_h1", 2, 3, 1): {0: "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2", 1: "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2"},
    ("zb_h1_tight", 2, 3, 1): {0: "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2", 1: "1F0 1I0 1W0 1F1 1I1 1W1 1F2 1I2 1W2"},
    ("interleaved_1f1b", 2, 4, 2): {
        0: "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        1: "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    },
    ("group_interleaved_zb", 2, 4, 2): {
        0: "0F0 0F1 2F0 2F1 2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 0W1 2F3 2I2 2W2 2I3 2W3 0I2 0W2 0I3 0W3",
        1: "1F0 1F1 3F0 3I0 3W0 3F1 3I1 3W1 1F2 1I0 1W0 1F3 1I1 1W1 3F2 3I2 3W2 3F3 3I3 3W3 1I2 1W2 1I3 1W3",
    },
    ("interleaved_zb", 2, 4, 2): {
        0: "0F0 2F0 0F1 2I0 2F1 0I0 2W0 2I1 0W0 0I1 0F2 2W1 2F2 0W1 0F3 2I2 2F3 0I2 2W2 2I3 0W2 0I3 2W3 0W3",
        1: "1F0 3F0 3I0 1F1 1I0 3F1 3I1 3W0 1I1 1W0 3W1 1F2 1W1 3F2 3I2 1F3 1I2 3F3 3I3 3W2 1I3 1W2 3W3 1W3",
    },
    ("zbv", 2, 2, 2): {0: "0F0 0F1 3F0 3I0 3F1 3I1 0I0 3W0 0I1 3W1 0W0 0W1",
                       1: "1F0 2F0 1F1 2F1 2I0 1I0 2I1 1I1 2W0 1W0 2W1 1W1"},
}


@pytest.mark.parametrize("key", list(GOLDEN), ids=[k[0] for k in GOLDEN])
def test_golden_action_strings(key):
    name, p, m, v = key
    s = build_schedule(name, num_ranks=p, num_microbatches=m, num_chunks=v)
    assert s.text() == GOLDEN[key]
    assert parse_schedule(s.text()) == s.actions


def test_stated_peaks_and_the_1f1b_bubble():
    p, m = 4, 8
    assert build_schedule("1f1b", num_ranks=p, num_microbatches=m).predicted_peaks == (4, 3, 2, 1)
    assert build_schedule("zb_h1_tight", num_ranks=p, num_microbatches=m).predicted_peaks == (4, 3, 2, 1)
    assert build_schedule("zb_h1", num_ranks=p, num_microbatches=m).predicted_peaks == (4, 4, 4, 4)
    assert build_schedule("gpipe", num_ranks=p, num_microbatches=m).predicted_peaks == (8,) * 4
    sim = build_schedule("1f1b", num_ranks=p, num_microbatches=m).simulate()
    assert sim.makespan == 3 * (m + p - 1)  # F=1, B=2
    assert sim.bubble_fraction(0) == pytest.approx((p - 1) / (m + p - 1))
    assert build_schedule("zb_h1", num_ranks=p, num_microbatches=m).simulate().makespan < sim.makespan
    # Megatron's interleaved warm-up: 2(p-r-1) + (v-1)p forwards, plus the one in steady state
    inter = build_schedule("interleaved_1f1b", num_ranks=p, num_microbatches=m, num_chunks=2)
    assert inter.predicted_peaks == tuple(2 * (p - r - 1) + p + 1 for r in range(p))


def test_zb_h1_is_the_published_schedule_a_third_of_1f1bs_bubble_and_p_on_every_rank():
    """Qi et al. 2023 (ZB-H1): on the unit clock F = I = W = 1 (B = 2), m >= p, the makespan is
    3m + (p-1) (1F1B: 3m + 3(p-1)), and every rank holds p chunk-microbatches at its peak, 1F1B's
    peak over all ranks. zb_h1_tight keeps 1F1B's per-rank p - r at a bubble of 2(p-1)."""
    for p in range(1, 10):
        for m in (p, p + 1, 2 * p + 3, 4 * p):
            zb = build_schedule("zb_h1", num_ranks=p, num_microbatches=m)
            tight = build_schedule("zb_h1_tight", num_ranks=p, num_microbatches=m)
            one = build_schedule("1f1b", num_ranks=p, num_microbatches=m)
            assert zb.simulate().makespan == 3 * m + (p - 1), (p, m)
            assert one.simulate().makespan == 3 * m + 3 * (p - 1), (p, m)
            assert zb.predicted_peaks == (p,) * p == (max(one.predicted_peaks),) * p
            assert tight.predicted_peaks == one.predicted_peaks == tuple(p - r for r in range(p))
            if p > 1:
                assert tight.simulate().makespan == 3 * m + 2 * (p - 1), (p, m)
    assert build_schedule("zb_h1", num_ranks=8, num_microbatches=32).simulate().makespan == 103  # the figure
    # fewer microbatches than ranks: one microbatch goes down and back up, then its W
    assert build_schedule("zb_h1", num_ranks=4, num_microbatches=1).simulate().makespan == 2 * 4 + 1


@pytest.mark.parametrize("p,v,g", [(8, 2, 8), (8, 2, 1), (4, 2, 2), (3, 3, 1), (8, 4, 2), (2, 1, 1)])
def test_interleaved_zb_repeats_one_block_with_no_bubble_between_blocks(p, v, g):
    def makespan(blocks):
        return build_schedule("interleaved_zb", num_ranks=p, num_microbatches=blocks * g, num_chunks=v,
                              group_size=g).simulate().makespan

    period = 3 * v * g  # a rank's whole share of one block: v chunks x (F, I, W), unit each
    # once the pipeline is full (a block spans up to three periods here), each block adds one period
    assert makespan(5) - makespan(4) == makespan(6) - makespan(5) == period


def test_interleaved_zb_at_group_size_one_spreads_memory_at_interleaved_speed():
    kw = dict(num_ranks=8, num_microbatches=32, num_chunks=2)
    inter = build_schedule("interleaved_1f1b", **kw)
    zb = build_schedule("interleaved_zb", group_size=1, **kw)
    assert max(zb.predicted_peaks) == 10 and max(inter.predicted_peaks) == 23
    assert zb.simulate().makespan == 219 and inter.simulate().makespan == 213
    # the first chunk lives longest: it holds more of rank 0's peak than the second
    sim = zb.simulate()
    t_peak = max(sim.memory_curve(0), key=lambda x: x[1])[0]
    live = [s for t0, t1, s, _ in sim.resident[0] if t0 <= t_peak < t1]
    assert sum(s == 0 for s in live) > sum(s == 8 for s in live)


def test_group_interleaved_zb_reproduces_the_papers_unit_clock_figures():
    kw = dict(num_ranks=8, num_microbatches=32)
    # docs/pipeline.md: makespans 206 / 210 / 240 and peaks 16 / 12 / 13 for v=2, g=8 / 4 / 1
    for g, peak, makespan, block in ((8, 16, 206, 237), (4, 12, 210, 225), (1, 13, 215, 240)):
        s = build_schedule("group_interleaved_zb", num_chunks=2, group_size=g, **kw)
        assert max(s.predicted_peaks) == peak
        assert s.simulate().makespan == makespan and s.block_makespan == block
    assert max(build_schedule("group_interleaved_zb", num_chunks=4, group_size=2, **kw).predicted_peaks) == 22
    # g >= p/2: (p-r-1) + (v-1)g + 1 warm-up forwards, then I, W, F in turn
    s = build_schedule("group_interleaved_zb", num_chunks=2, group_size=4, **kw)
    assert s.predicted_peaks == tuple((8 - r - 1) + 4 + 1 for r in range(8))
    assert all(a.kind == "F" for a in s.actions[0][:12]) and [a.kind for a in s.actions[0][12:15]] == ["I", "W", "F"]
    # g = 1: the slots keep the turn; chunk 0 runs ahead of chunk 1 instead of waiting for it
    one = build_schedule("group_interleaved_zb", num_chunks=2, group_size=1, **kw)
    assert one.text()[0].split()[:6] == ["0F0", "0F1", "0F2", "8F0", "0F3", "8F1"]
    # held to its block times, the run starts every action there (they are feasible) and ends at 240
    timed = one.simulate(not_before=one.block_times)
    assert all(timed.start[(one.layout.rank_of(a.stage), a)] == t for a, t in one.block_times.items())
    assert timed.makespan == 240 and max(timed.peaks()) == 13


@pytest.mark.full
def test_group_interleaved_zb_is_megatrons_split_order_where_that_runs():
    for p in range(1, 9):
        for v in (1, 2, 3):
            for g in range(1, p + 1):
                layout = StageLayout(p, v)
                m = 2 * p * g
                strict = _strict_interleaved(layout, m, g, split=True)
                ours = build_schedule("group_interleaved_zb", num_ranks=p, num_microbatches=m, num_chunks=v,
                                      group_size=g)
                if 2 * g >= p:
                    assert ours.actions == strict, (p, v, g)
    for v, g in ((2, 1), (2, 2), (2, 3), (4, 2)):  # the fixed order deadlocks here (the paper's p=8)
        layout = StageLayout(8, v)
        with pytest.raises(ScheduleError, match="deadlock"):
            simulate(_strict_interleaved(layout, 48, g, split=True), layout, 48)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 5), k=st.integers(1, 4), v=st.integers(1, 3), data=st.data())
def test_every_generator_gives_a_valid_schedule(p, k, v, data):
    m = p * k
    for name in SCHEDULES:
        kw = {}
        if name in ("interleaved_1f1b", "group_interleaved", "group_interleaved_zb", "interleaved_zb"):
            kw["num_chunks"] = v
        if name in ("group_interleaved", "group_interleaved_zb", "interleaved_zb"):
            kw["group_size"] = data.draw(st.sampled_from([g for g in range(1, p + 1) if m % g == 0]))
        s = build_schedule(name, num_ranks=p, num_microbatches=m, **kw)
        sim = s.simulate()  # raises on any invalid schedule
        assert tuple(sim.peaks()) == s.predicted_peaks
        per_rank_work = m * s.layout.num_chunks * 3
        assert all(sum(1 for a in acts if a.kind in "FBIW") > 0 for acts in s.actions.values())
        assert sim.makespan >= per_rank_work


def _sched(text):
    return parse_schedule(text)


def test_validator_rejects_broken_schedules():
    layout = StageLayout(2)
    good = {0: "0F0 0B0", 1: "1F0 1B0"}
    simulate(_sched(good), layout, 1)
    cases = [
        ({0: "0F0", 1: "1F0 1B0"}, "stage 0 microbatch 0 needs either B or I\\+W, not neither"),
        ({0: "0F0 0F0 0B0", 1: "1F0 1B0"}, "0F0 appears 2 times"),
        ({0: "0F0 0B0 1F0", 1: "1B0"}, "rank 0 runs 1F0, but stage 1 lives on rank 1"),
        ({0: "0F0 0B0", 1: "1F0 1W0 1I0"}, "deadlock: .*1W0 waits for 1I0"),
        ({0: "0F0 0I0 0W0", 1: "1F0 1I0"}, "stage 1 microbatch 0 has only one of I and W"),
        ({0: "0B0 0F0", 1: "1F0 1B0"}, "deadlock"),
        ({0: "0F0 0B0"}, "schedule has ranks \\[0\\], the layout has 2"),
    ]
    for text, message in cases:
        with pytest.raises(ScheduleError, match=message):
            simulate(_sched(text), layout, 1)
    # a cross-rank cycle: rank 0 waits for 1B1 before running 0F1, which rank 1 needs for 1F1
    two = {0: "0F0 0B0 0B1 0F1", 1: "1F0 1B0 1F1 1B1"}
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(_sched(two), layout, 2)


def test_bad_schedule_requests_are_clear_errors():
    with pytest.raises(ValueError, match="unknown schedule 'zb_h9'; valid: gpipe, 1f1b, interleaved_1f1b"):
        build_schedule("zb_h9", num_ranks=2, num_microbatches=4)
    with pytest.raises(ValueError, match="group_interleaved needs at least 4 microbatches"):
        build_schedule("group_interleaved", num_ranks=4, num_microbatches=2, num_chunks=2)
    with pytest.raises(ValueError, match="num_microbatches=6 must be a multiple of group_size=4"):
        build_schedule("group_interleaved", num_ranks=4, num_microbatches=6, num_chunks=2)
    with pytest.raises(ValueError, match=r"interleaved_zb: group_size=5 must be in \[1, num_ranks=4\]"):
        build_schedule("interleaved_zb", num_ranks=4, num_microbatches=10, num_chunks=2, group_size=5)
    with pytest.raises(ValueError, match="interleaved_zb: num_microbatches=6 must be a multiple of group_size=4"):
        build_schedule("interleaved_zb", num_ranks=4, num_microbatches=6, num_chunks=2)
    with pytest.raises(ValueError, match="1f1b runs one chunk per rank, got num_chunks=2"):
        build_schedule("1f1b", num_ranks=2, num_microbatches=4, num_chunks=2)
    with pytest.raises(ValueError, match="num_ranks=0 must be at least 1"):
        build_schedule("1f1b", num_ranks=0, num_microbatches=4)


def test_send_recv_lowering_golden():
    from posttrain.pipeline import add_send_recv, format_schedule

    s = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    lowered = add_send_recv(s.actions, s.layout)
    assert format_schedule(lowered) == {
        0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        1: "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
    }
    simulate(lowered, s.layout, 2)
    # V shape: stages 1 and 2 share the last rank, so nothing is sent between them
    v = build_schedule("zbv", num_ranks=2, num_microbatches=1)
    text = format_schedule(add_send_recv(v.actions, v.layout))
    assert "SEND_F1" not in text[1] and "RECV_F2" not in text[1] and "0SEND_F0" in text[0]


def test_nccl_point_to_point_needs_each_peers_messages_received_in_sending_order():
    """NCCL ignores tags: a peer's sends pair with the receiver's receives in posting order. The
    runner sends over NCCL only where every pair of ranks keeps that order (else through host
    memory, over gloo, which matches tags): true of every schedule here but zbv."""
    from posttrain.pipeline import add_send_recv
    from posttrain.pipeline.runtime import execution_order, p2p_orders_match

    def orders(s):
        lowered = add_send_recv(s.actions, s.layout)
        return [execution_order(lowered[r]) for r in range(s.layout.num_ranks)]

    for name, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2)):
        s = build_schedule(name, num_ranks=2, num_microbatches=4, num_chunks=chunks)
        assert p2p_orders_match(orders(s), s.layout) == (name != "zbv"), name
    s = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    got = orders(s)
    sends = [i for i, a in enumerate(got[0]) if a.kind == "SEND_F"]
    got[0][sends[0]], got[0][sends[1]] = got[0][sends[1]], got[0][sends[0]]  # microbatch 1 sent first
    assert not p2p_orders_match(got, s.layout)


def test_nccl_carries_a_schedule_only_where_its_batches_complete_one_after_another():
    """NCCL runs a rank's batches in order on one stream and completes a (large) send only when the
    peer's receive is in the batch the peer's stream is at. Where two ranks would each wait in their
    current batch for a message the other posts in a later one, `plan_receives` posts the receive
    earlier; a schedule it cannot plan goes through host memory. Pinpoints a change in the batching
    rule (`message_runs`), the planner or a schedule's message order."""
    from posttrain.pipeline import OffloadPolicy, add_offload, add_send_recv
    from posttrain.pipeline.runtime import (
        _message,
        execution_order,
        message_runs,
        nccl_batches_complete,
        p2p_orders_match,
        plan_receives,
    )

    def orders(s, offload="none"):
        m = s.num_microbatches
        lowered = add_send_recv(add_offload(s.actions, s.layout, m, OffloadPolicy.parse(offload, s.layout.num_chunks)),
                                s.layout)
        return [execution_order(lowered[r]) for r in range(s.layout.num_ranks)]

    def hoisted(os_, plan):  # receives the plan posts before their own run
        return sum(1 for r, o in enumerate(os_) for start, idx in plan[r].items() for i in idx
                   if i != start and any(o[k].kind in ("F", "B", "I", "W") for k in range(start, i)))

    unplanned = set()
    for ranks in (2, 4, 8):
        for name, chunks in (("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("zb_h1_tight", 1), ("interleaved_1f1b", 2),
                             ("group_interleaved", 2), ("group_interleaved_zb", 2), ("interleaved_zb", 2), ("zbv", 2)):
            for m in (ranks, 2 * ranks, 4 * ranks):
                s = build_schedule(name, num_ranks=ranks, num_microbatches=m, num_chunks=chunks)
                for offload in ("none", "full"):  # copies between two messages do not split their batch
                    os_ = orders(s, offload)
                    plan = plan_receives(os_, s.layout)
                    # planned wherever each pair receives in sending order (NCCL ignores tags)
                    assert (plan is None) == (not p2p_orders_match(os_, s.layout)), (ranks, name, m, offload)
                    if plan is None:
                        unplanned.add(name)
                        continue
                    batches = []
                    for r, o in enumerate(os_):
                        runs = message_runs(o)
                        groups = {start: [_message(o[i], s.layout) for i in idx if o[i].kind.startswith("SEND")]
                                  for start, idx in runs}
                        for start, idx in plan[r].items():
                            groups[start] += [_message(o[i], s.layout) for i in idx]
                        batches.append([[x for x in g if x[1] != r] for g in groups.values()])
                    assert nccl_batches_complete(batches)[0], (ranks, name, m, offload)
                    if name in ("1f1b", "gpipe"):  # every receive in its own run
                        assert hoisted(os_, plan) == 0, (ranks, name, m)
    assert unplanned == {"zbv", "group_interleaved_zb"}, unplanned
    # 1F1B at 2 ranks: rank 0 sends microbatch 1's activation and receives microbatch 0's gradient in one batch
    s = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    o = orders(s)[0]
    [(start, idx)] = [(start, idx) for start, idx in message_runs(o) if len(idx) == 2]
    assert [str(o[i]) for i in idx] == ["0SEND_F1", "0RECV_B0"]
    # interleaved 1F1B's steady state needs receives posted a batch early
    s = build_schedule("interleaved_1f1b", num_ranks=4, num_microbatches=8, num_chunks=2)
    assert hoisted(orders(s), plan_receives(orders(s), s.layout)) > 0
    # the same two messages in separate batches on both ranks, each sending first: a hang
    crossed = [[[("send", 1, "x")], [("recv", 1, "y")]], [[("send", 0, "y")], [("recv", 0, "x")]]]
    assert not nccl_batches_complete(crossed)[0]
    assert nccl_batches_complete([[[("send", 1, "x"), ("recv", 1, "y")]], [[("send", 0, "y"), ("recv", 0, "x")]]])[0]


def test_offload_lowering_golden_and_memory():
    from posttrain.pipeline import OffloadPolicy, add_offload, add_send_recv, format_schedule

    s = build_schedule("1f1b", num_ranks=2, num_microbatches=3)
    lowered = add_offload(s.actions, s.layout, 3, OffloadPolicy(1))
    # rank 1's backwards follow their forwards at once (lifespan 0): never worth a round trip
    assert format_schedule(lowered) == {
        0: "0F0 0OFFLOAD0 0RELOAD0 0F1 0OFFLOAD1 0B0 0RELOAD1 0F2 0OFFLOAD2 0RELOAD2 0B1 0B2",
        1: "1F0 1B0 1F1 1B1 1F2 1B2",
    }
    for name, kw in [("1f1b", {}), ("interleaved_1f1b", {"num_chunks": 2}), ("interleaved_1f1b", {"num_chunks": 4}),
                     ("group_interleaved", {"num_chunks": 2, "group_size": 2})]:
        sched = build_schedule(name, num_ranks=4, num_microbatches=8, **kw)
        peaks = []
        for k in range(sched.layout.num_chunks + 1):
            lo = add_send_recv(add_offload(sched.actions, sched.layout, 8, OffloadPolicy(k)), sched.layout)
            sim = simulate(lo, sched.layout, 8)
            assert sim.makespan == sched.simulate().makespan  # free copies cost no time
            peaks.append(sim.peaks())
        assert peaks[0] == list(sched.predicted_peaks)
        for fewer, more in itertools.pairwise(peaks):  # each chunk offloaded lowers or keeps every rank's peak
            assert all(b <= a for a, b in zip(fewer, more)), (name, peaks)
        assert max(peaks[-1]) <= 3  # full offload: a constant few, not growing with stages


def test_offload_skips_short_lifespans_and_checks_policy():
    from posttrain.pipeline import OffloadPolicy, add_offload

    s = build_schedule("1f1b", num_ranks=4, num_microbatches=8)
    assert add_offload(s.actions, s.layout, 8, OffloadPolicy(1, min_lifespan=1e9)) == s.actions
    with pytest.raises(ValueError, match="offload chunks=2 exceeds the 1 chunks per rank"):
        add_offload(s.actions, s.layout, 8, OffloadPolicy(2))
    with pytest.raises(ValueError, match="offload='half' is not none, full or a number of chunks"):
        OffloadPolicy.parse("half", 2)
    assert OffloadPolicy.parse("full", 4).chunks == 4 and OffloadPolicy.parse("none", 4).chunks == 0


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 8, 2), (4, 8, 2), (4, 16, 3), (3, 9, 2)])
def test_interleaved_1f1b_is_torchs_action_order(p, m, v):
    """Same order as torch's ScheduleInterleaved1F1B, built here on stand-in stages (no processes)."""
    from types import SimpleNamespace

    import torch
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    ours = build_schedule("interleaved_1f1b", num_ranks=p, num_microbatches=m, num_chunks=v).text()
    for r in range(p):
        stages = [SimpleNamespace(stage_index=r + c * p, num_stages=p * v, group_size=p, group_rank=r,
                                  is_first=r + c * p == 0, is_last=r + c * p == p * v - 1,
                                  submod=torch.nn.Linear(1, 1), scale_grads=True) for c in range(v)]
        theirs = ScheduleInterleaved1F1B(stages, m).pipeline_order[r]
        assert ours[r] == " ".join(str(a) for a in theirs if a is not None)


def _variants():
    """Every generator at 2-4 ranks, 1-2 chunks, every group size, 1 and 2 microbatches per rank."""
    for p in range(2, 5):
        for k in (1, 2):
            m = p * k
            for name in SCHEDULES:
                if name in ONE_CHUNK_SCHEDULES or name == "zbv":
                    yield name, p, m, None, None
                    continue
                for v in (1, 2):
                    groups = [g for g in range(1, p + 1) if m % g == 0] if name in GROUPED_SCHEDULES else [None]
                    for g in groups:
                        yield name, p, m, v, g


@pytest.mark.full
def test_lowering_send_recv_changes_no_time_and_no_peak_on_any_generated_schedule():
    """One memory accounting: a schedule with OFFLOAD/RELOAD has the same per-rank peaks, start
    times and makespan once SEND/RECV are added (what the runtime runs and measures), under free
    and costly copies. A failure names the schedule whose copies moved (e.g. a reload issued at a
    send instead of at the compute action in front of it, which once gave interleaved_1f1b p=2 m=8
    full offload a peak of 2 where the runtime measures 3)."""
    from posttrain.pipeline import COMPUTE_KINDS, COPY_KINDS, Durations, OffloadPolicy, add_offload, add_send_recv

    clocks = (Durations(), Durations(F=1, B=2.5, I=2, W=0.5, OFFLOAD=1.5, RELOAD=1.5))
    checked = 0
    for name, p, m, v, g in _variants():
        s = build_schedule(name, num_ranks=p, num_microbatches=m, num_chunks=v, group_size=g)
        for k in range(s.layout.num_chunks + 1):
            for d in clocks:
                off = add_offload(s.actions, s.layout, m, OffloadPolicy(k), durations=d)
                plain, lowered = simulate(off, s.layout, m, durations=d), simulate(add_send_recv(off, s.layout),
                                                                                   s.layout, m, durations=d)
                key = (name, p, m, v, g, k, d)
                assert lowered.peaks() == plain.peaks() and lowered.makespan == plain.makespan, key
                assert {a: t for a, t in lowered.start.items() if a[1].kind in (*COMPUTE_KINDS, *COPY_KINDS)} == plain.start, key
                checked += 1
    assert checked > 500
    s = build_schedule("interleaved_1f1b", num_ranks=2, num_microbatches=8, num_chunks=2)
    off = add_offload(s.actions, s.layout, 8, OffloadPolicy(2))
    assert simulate(add_send_recv(off, s.layout), s.layout, 8).peaks() == [3, 3]


def _full_offload_peak(name, p, m, v=None, g=None, *, weight=True, weight_keep=1.0):
    from posttrain.pipeline import OffloadPolicy, add_offload, add_send_recv

    s = build_schedule(name, num_ranks=p, num_microbatches=m, num_chunks=v, group_size=g)
    policy = OffloadPolicy(s.layout.num_chunks, weight=weight)
    lowered = add_send_recv(add_offload(s.actions, s.layout, m, policy), s.layout)
    return max(simulate(lowered, s.layout, m, weight_keep=weight_keep).peaks())


@pytest.mark.full
def test_full_offload_keeps_a_constant_few_resident_on_every_schedule():
    """docs/pipeline.md: with full offload every schedule keeps at most 3 chunk-microbatches
    resident (group_interleaved_zb and zb_h1_tight at most 2), at any number of ranks, once the
    part a split backward keeps for W is offloaded on its own (OFFLOAD_W/RELOAD_W); without that,
    zb_h1, zbv and interleaved_zb keep a reloaded chunk-microbatch until its late W and hold more
    (the figures the docs give); what W keeps (weight_keep < 1) lowers the peak further."""
    bound = {"gpipe": 3, "1f1b": 3, "interleaved_1f1b": 3, "group_interleaved": 3, "group_interleaved_zb": 2,
             "zb_h1_tight": 2, "zb_h1": 3, "zbv": 3, "interleaved_zb": 3}
    for name, most in bound.items():
        for p in (2, 4, 8):
            for v in ((None,) if name in ONE_CHUNK_SCHEDULES or name == "zbv" else (2, 3)):
                for g in ((1, p // 2, p) if name in GROUPED_SCHEDULES else (None,)):
                    assert _full_offload_peak(name, p, 2 * p, v, g) <= most, (name, p, v, g)
    # the published figures at p=8, m=32: whole chunk-microbatches held until W ...
    assert _full_offload_peak("zb_h1", 8, 32, weight=False) == 8  # rank r holds r W back: p on the last rank
    assert _full_offload_peak("zbv", 8, 32, weight=False) == 13
    assert _full_offload_peak("interleaved_zb", 8, 32, 4, 8, weight=False) == 21
    # ... and W's part offloaded on its own
    assert _full_offload_peak("zb_h1", 8, 32) == 3
    assert _full_offload_peak("zbv", 8, 32) == 3
    assert _full_offload_peak("interleaved_zb", 8, 32, 4, 8) == 3
    assert _full_offload_peak("zbv", 8, 32, weight_keep=0.5) == 2.5
    # freeing I's part alone (no W offload) already helps: zbv 13 -> 7.5 when W keeps half
    assert _full_offload_peak("zbv", 8, 32, weight=False, weight_keep=0.5) == 7.5
