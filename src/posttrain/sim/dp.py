"""Data-parallel simulation: FSDP (per-layer collectives) vs ODC (one-sided, one barrier).

[Note: what the DP simulation models]

Every rank runs its microbatches of one minibatch. Per microbatch and layer ``l`` (``L`` layers):
forward ``F(l)`` needs the layer's parameters gathered (``AG``); backward ``B(l)`` needs them
gathered again and then hands its gradient to a reduce (``RS``). Communication runs on its own
channel, in issue order, overlapping compute (FSDP2's implicit prefetch): the gather for layer
``l+1`` is issued when ``F(l)`` starts, the backward gather for layer ``l-1`` when ``B(l)``
starts, and ``RS(l)`` when ``B(l)`` ends.

- **FSDP**: each gather and reduce is a collective: it starts when every rank of the shard
  group has issued it and has its channel free (a rendezvous), and takes the ring time of
  :meth:`Cluster.collective_time`. Ranks must run the same number of microbatches: a rank with
  fewer runs dummy microbatches (one token) and still joins every collective, as FSDP2 does.
- **ODC**: a gather reads the ``group - 1`` peer shards straight from the owners and starts as
  soon as it is issued (:meth:`Cluster.one_sided_time`, on the rank's ingress link); a reduce
  is a push of ``group - 1`` slices on the rank's egress link, each added by its owner. The
  owners' adds are where ranks contend: every push puts one slice on every owner, so all
  owners of a group see the same queue, simulated once (a FIFO at ``accumulate_bandwidth``).
  Gathers need no owner-side model: with equal links, all ranks reading at once load each
  owner's egress exactly as much as each reader's ingress, so the reader's link is the
  bottleneck. Ranks meet once, at the minibatch-end barrier after their last push has landed.
- **HSDP** (``hsdp=True``): shard groups are nodes; collectives or one-sided transfers stay
  inside a node, and the gradient shards are all-reduced across nodes once per minibatch
  (a rendezvous of all ranks). Without HSDP a group spanning nodes is limited by the NIC.

Per rank, compute time is the sum of its ``F``/``B``; utilization is compute over the
minibatch's makespan; the bubble fraction is one minus the mean utilization.

**Jitter** (``jitter > 0``): every ``F``/``B`` lasts its cost times an independent random factor
of mean 1 and that coefficient of variation (log-normal, seeded: the same arguments give the same
result). Real ranks never compute a layer in exactly the same time, so a rendezvous at every
layer waits each time for the slower rank of that layer, while ODC's ranks wait once for the
slower sum, where the deviations have partly cancelled; FSDP pays for the variance even when
the work is balanced. ``posttrain.lab.calibrate.fit_jitter`` fits it to what flat ODC's
collective mode loses beyond ODC's copies on equal sequences.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from posttrain.balance import ContextPlan, ExchangeCost, Plan
from posttrain.spans import Span

from ._engine import Engine, Link, Rendezvous
from .cluster import Cluster
from .costs import ModelShape, SimModel

__all__ = ["CP_CALL_S", "STRATEGIES", "DPResult", "exchange_seconds", "plan_lengths", "simulate_dp",
           "simulate_minibatch"]

#: Seconds a key/value collective of a split sequence costs a GPU whatever its size (the
#: exchange's latency term; an estimate: nothing here measured it on a GPU).
CP_CALL_S = 20e-6


def exchange_seconds(shape: ModelShape, cluster: Cluster, *, dtype_bytes: int = 2,
                     call_s: float = CP_CALL_S) -> ExchangeCost:
    """A split sequence's key/value exchange in the simulator's units (seconds, as
    :meth:`SimModel.sequence_cost`): ``shape``'s keys and values (``dtype_bytes`` each) over the
    intra-node link, and ``call_s`` for each of a layer's two collectives. (A group spanning nodes
    would exchange over the slower link; the plans keep groups small, and this is not modelled.)"""
    return ExchangeCost.for_shape(shape, flops_per_byte=1.0 / cluster.intra_bandwidth, dtype_bytes=dtype_bytes,
                                  flops_per_call=call_s)

STRATEGIES = ("fsdp", "odc")
Strategy = Literal["fsdp", "odc"]
_DUMMY = (1,)


@dataclass
class DPResult:
    """Simulated time of one or more minibatches.

    Attributes:
        strategy: ``fsdp`` or ``odc`` (``+hsdp`` when sharded per node).
        time: seconds, all minibatches.
        tokens: real tokens trained (dummy microbatches excluded).
        compute: per rank, seconds of forward/backward.
        spans: the timeline (only when simulated with ``trace=True``).
    """

    strategy: str
    world_size: int
    time: float = 0.0
    tokens: int = 0
    compute: list[float] = field(default_factory=list)
    minibatch_times: list[float] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        """Tokens per second over all ranks."""
        return self.tokens / self.time if self.time > 0 else 0.0

    @property
    def utilization(self) -> list[float]:
        return [c / self.time if self.time > 0 else 0.0 for c in self.compute]

    @property
    def bubble_fraction(self) -> float:
        u = self.utilization
        return 1.0 - sum(u) / len(u) if u else 0.0

    def merge(self, other: DPResult) -> None:
        """Append ``other`` (the next minibatch) to this result."""
        offset = self.time
        self.time += other.time
        self.tokens += other.tokens
        self.compute = [a + b for a, b in zip(self.compute, other.compute)] if self.compute else list(other.compute)
        self.minibatch_times.extend(other.minibatch_times)
        self.spans.extend(Span(s.rank, s.lane, s.name, s.start + offset, s.end + offset) for s in other.spans)


def plan_lengths(plan: Plan | ContextPlan, cost: Callable[[float], float] | None = None) -> list[list[list[float]]]:
    """rank -> microbatches -> sequence lengths of a balancing plan. A plan that splits sequences
    across ranks (:func:`posttrain.balance.plan_context`; needs the plan's ``cost``) gives each
    rank its shards first, each as a microbatch of one sequence of the *effective* length whose
    cost is the shard's (its share of the sequence plus the exchange): the simulated layers then
    charge a shard what the plan charged it. (A shard's per-layer exchanges, which keep its group
    in step, are not simulated as rendezvous: the group starts together and its shards cost the
    same.)"""
    whole = [[[plan.lengths[i] for i in mb.sequence_ids] for mb in mbs] for mbs in plan.ranks]
    if not isinstance(plan, ContextPlan):
        return whole
    if cost is None:
        raise ValueError("a plan with split sequences needs the plan's cost to simulate its shards")
    return [[[_effective_length(cost, sh.cost, plan.lengths[sh.sequence_id])] for sh in shards] + mine
            for shards, mine in zip(plan.shards, whole)]


def _effective_length(cost: Callable[[float], float], target: float, upper: float) -> float:
    """The length whose ``cost`` is ``target`` (costs grow with length; bisection), at most
    about 16 times ``upper`` (a shard costs less than its sequence unless its exchange is dear; a
    measured split cost on a short sequence can be dearer than the sequence: ``bench odc``'s
    prediction)."""
    lo, hi = 0.0, float(upper)
    while cost(hi) < target and hi < 16 * upper:
        hi *= 1.25
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cost(mid) < target else (lo, mid)
    return (lo + hi) / 2


def _ops(num_layers: int, overlap: bool) -> list[tuple[str, int]]:
    """Per microbatch, the communication in issue order (see the module note)."""
    ops = [("AG", l) for l in range(num_layers)]
    if not overlap:
        return ops + [op for l in range(num_layers - 1, -1, -1) for op in (("AGb", l), ("RS", l))]
    ops.append(("AGb", num_layers - 1))
    for l in range(num_layers - 1, -1, -1):
        if l > 0:
            ops.append(("AGb", l - 1))
        ops.append(("RS", l))
    return ops


def simulate_minibatch(microbatches: Sequence[Sequence[Sequence[int]]], *, strategy: Strategy, model: SimModel,
                       cluster: Cluster, hsdp: bool = False, slowdown: Sequence[float] | None = None,
                       trace: bool = False, op_times: Mapping[str, float] | None = None,
                       overlap: bool = True, jitter: float = 0.0, seed: int = 0) -> DPResult:
    """Simulate one minibatch.

    Args:
        microbatches: rank -> microbatches -> sequence lengths (e.g. :func:`plan_lengths`).
        strategy: ``fsdp`` or ``odc``.
        model: layers, their cost and bytes.
        cluster: ranks and links; ``cluster.num_gpus`` must equal the number of ranks given.
        hsdp: shard within a node and all-reduce across nodes once per minibatch.
        slowdown: per rank, a factor on compute time (a straggler: 2.0 runs at half speed).
        trace: keep every interval (for the Chrome trace and PNG).
        op_times: measured seconds per layer that replace the link model: ``gather`` (one
            all-gather or one-sided gather), ``reduce`` (one reduce-scatter or push) and, for
            ODC, ``add`` (one owner adding one pusher's slice). Used by calibration.
        overlap: communication overlaps compute (prefetched gathers, reduces in the background),
            as on GPUs. ``False``: each gather is issued when its layer needs it and compute waits
            for every reduce, as FSDP2 on CPU/gloo and ODC's CPU transport do.
        jitter: coefficient of variation of every forward and backward's duration (see the
            module note); 0 is deterministic.
        seed: the jitter's random seed.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    n = len(microbatches)
    if n != cluster.num_gpus:
        raise ValueError(f"the plan has {n} ranks but the cluster has num_gpus={cluster.num_gpus}")
    slowdown = list(slowdown) if slowdown is not None else [1.0] * n
    if len(slowdown) != n or any(not s > 0 for s in slowdown):
        raise ValueError(f"slowdown needs {n} positive factors, got {slowdown}")
    if not 0 <= jitter < 10:
        raise ValueError(f"jitter={jitter} must be a coefficient of variation in [0, 10)")
    sigma = math.sqrt(math.log1p(jitter * jitter))
    draws = [random.Random(seed * 1_000_003 + r) for r in range(n)]

    def noise(r: int) -> float:  # mean 1, coefficient of variation ``jitter``
        return math.exp(draws[r].gauss(-sigma * sigma / 2, sigma)) if jitter else 1.0
    mbs = [list(m) for m in microbatches]
    tokens = sum(sum(sum(mb) for mb in rank) for rank in mbs)
    if strategy == "fsdp":  # collectives need equal microbatch counts: pad with dummies
        rounds = max(len(m) for m in mbs)
        mbs = [m + [_DUMMY] * (rounds - len(m)) for m in mbs]

    group = cluster.node_size if hsdp else n
    spans_nodes = not hsdp and cluster.num_nodes > 1
    L = model.num_layers
    ops = _ops(L, overlap)
    op_bytes = {"AG": model.layer_param_bytes, "AGb": model.layer_param_bytes, "RS": model.layer_grad_bytes}
    if strategy == "fsdp":
        op_time = {k: cluster.collective_time(b, group, across_nodes=spans_nodes) for k, b in op_bytes.items()}
    else:
        op_time = {k: cluster.one_sided_time(b, group, across_nodes=spans_nodes) for k, b in op_bytes.items()}
    add_time = model.layer_grad_bytes / group / cluster.accumulate_bandwidth if group > 1 else 0.0
    if op_times is not None:
        unknown = set(op_times) - {"gather", "reduce", "add"}
        if unknown:
            raise ValueError(f"unknown op_times keys {sorted(unknown)}; valid: gather, reduce, add")
        if any(not v >= 0 for v in op_times.values()):
            raise ValueError(f"op_times must be non-negative seconds, got {dict(op_times)}")
        op_time = {"AG": op_times.get("gather", op_time["AG"]), "AGb": op_times.get("gather", op_time["AGb"]),
                   "RS": op_times.get("reduce", op_time["RS"])}
        add_time = op_times.get("add", add_time)

    eng = Engine()
    spans: list[Span] = []
    compute = [0.0] * n
    done_at = [0.0] * n
    rendezvous: dict[tuple[int, int], Rendezvous] = {}
    owners = [Link(eng) for _ in range(n // group)]  # one representative owner queue per group
    end_barrier = Rendezvous(eng, n)

    def rank_proc(r: int):
        g = r // group
        issued = [eng.event() for _ in range(len(ops) * len(mbs[r]))]
        done = [eng.event() for _ in range(len(ops) * len(mbs[r]))]
        index = {op: i for i, op in enumerate(ops)}
        channels = {"in": Link(eng), "out": Link(eng)}  # ODC: ingress (gathers), egress (pushes)

        def comm(kinds: tuple[str, ...], channel: str):
            for k in range(len(issued)):
                kind, layer = ops[k % len(ops)]
                if kind not in kinds:
                    continue
                yield issued[k]
                if strategy == "fsdp":
                    rz = rendezvous.get((g, k))
                    if rz is None:
                        rz = rendezvous[(g, k)] = Rendezvous(eng, group)
                    yield rz.arrive()
                    t0 = eng.now
                    yield channels["in"].use(op_time[kind])
                else:
                    t0 = eng.now
                    ev = channels[channel].use(op_time[kind])
                    if kind == "RS" and add_time:
                        yield owners[g].use(add_time)
                    yield ev
                if trace:
                    spans.append(Span(r, "comm", f"{kind}{layer}", max(t0, eng.now - op_time[kind]), eng.now))
                done[k].fire()

        if strategy == "fsdp":
            eng.process(comm(("AG", "AGb", "RS"), "in"))
        else:
            eng.process(comm(("AG", "AGb"), "in"))
            eng.process(comm(("RS",), "out"))

        def wait(ev, what):
            t0 = eng.now
            yield ev
            if trace and eng.now > t0:
                spans.append(Span(r, "wait", what, t0, eng.now))

        def run(name: str, seconds: float):
            t0 = eng.now
            yield seconds
            compute[r] += seconds
            if trace:
                spans.append(Span(r, "compute", name, t0, eng.now))

        def proc():
            for j, lengths in enumerate(mbs[r]):
                base = j * len(ops)
                tf = model.layer_cost.forward(lengths) * slowdown[r]
                tb = model.layer_cost.backward(lengths) * slowdown[r]
                issued[base + index[("AG", 0)]].fire()
                for l in range(L):
                    if l + 1 < L and overlap:
                        issued[base + index[("AG", l + 1)]].fire()
                    if not overlap and l > 0:
                        issued[base + index[("AG", l)]].fire()
                    yield from wait(done[base + index[("AG", l)]], f"AG{l}")
                    yield from run(f"F{l} mb{j}", tf * noise(r))
                issued[base + index[("AGb", L - 1)]].fire()
                for l in range(L - 1, -1, -1):
                    if l > 0 and overlap:
                        issued[base + index[("AGb", l - 1)]].fire()
                    if not overlap and l < L - 1:
                        issued[base + index[("AGb", l)]].fire()
                    yield from wait(done[base + index[("AGb", l)]], f"AGb{l}")
                    yield from run(f"B{l} mb{j}", tb * noise(r))
                    issued[base + index[("RS", l)]].fire()
                    if not overlap:
                        yield from wait(done[base + index[("RS", l)]], f"RS{l}")
            for k in range(len(done)):  # every reduce / push has landed
                if ops[k % len(ops)][0] == "RS":
                    yield from wait(done[k], "reduce")
            if strategy == "odc" or hsdp:
                yield from wait(end_barrier.arrive(), "barrier")
                if strategy == "odc":
                    yield cluster.inter_latency if cluster.num_nodes > 1 else cluster.intra_latency
            if hsdp and cluster.num_nodes > 1:
                t0 = eng.now
                yield cluster.allreduce_time(model.num_layers * model.layer_grad_bytes / group, cluster.num_nodes)
                if trace:
                    spans.append(Span(r, "comm", "all-reduce", t0, eng.now))
            yield model.optimizer_s
            done_at[r] = eng.now

        eng.process(proc())

    for r in range(n):
        rank_proc(r)
    eng.run()
    if any(not rz.done.fired for rz in rendezvous.values()):
        raise AssertionError("a collective never completed: ranks issued different collectives")
    t = max(done_at)
    return DPResult(strategy=strategy + ("+hsdp" if hsdp else ""), world_size=n, time=t, tokens=tokens,
                    compute=compute, minibatch_times=[t], spans=spans)


def simulate_dp(plans: Sequence[Plan | ContextPlan], *, strategy: Strategy, model: SimModel, cluster: Cluster,
                hsdp: bool = False, slowdown: Sequence[float] | None = None, trace: bool = False,
                op_times: Mapping[str, float] | None = None, overlap: bool = True, jitter: float = 0.0,
                seed: int = 0) -> DPResult:
    """Simulate consecutive minibatches, one balancing plan each (minibatches meet at the
    optimizer step, so they are simulated one after another). See :func:`simulate_minibatch`;
    minibatch ``k`` draws its jitter with seed ``seed + k``. Plans with split sequences
    (:func:`posttrain.balance.plan_context`, planned with ``model.sequence_cost``) run their shards
    as :func:`plan_lengths` says; the tokens counted are the real ones."""
    if not plans:
        raise ValueError("no minibatches to simulate")
    total: DPResult | None = None
    for k, plan in enumerate(plans):
        one = simulate_minibatch(plan_lengths(plan, model.sequence_cost), strategy=strategy, model=model,
                                 cluster=cluster, hsdp=hsdp, slowdown=slowdown, trace=trace, op_times=op_times,
                                 overlap=overlap, jitter=jitter, seed=seed + k)
        one.tokens = sum(plan.lengths)
        if total is None:
            total = one
        else:
            total.merge(one)
    return total
