"""Run a schedule: :class:`PipelineRunner`, our own executor over ``torch.distributed`` point-to-point.

Why our own executor and not torch's ``_PipelineScheduleRuntime``: torch's runtime has no
``OFFLOAD``/``RELOAD`` actions, and its custom-function hook runs *instead of* a compute action,
so the saved-tensor hooks could not wrap torch's own forward, and reloads could not be issued at
the point the schedule places them (before the compute action ahead of a backward). Our executor
runs the lowered action list exactly: every action kind of :mod:`posttrain.pipeline._ir`, one
rank-local ``{stage: module}`` dict, and gloo (CPU) or NCCL (GPU) ``isend``/``recv`` between ranks.
It uses torch's split-backward functions (``stage_backward_input`` / ``stage_backward_weight``
from ``torch.distributed.pipelining``) for ``I`` and ``W``, so split backward costs what it
costs in torch. :func:`to_torch_actions` converts our compute schedules to torch's action lists
(``_Action``). ``posttrain bench pipeline`` (:mod:`posttrain.lab.bench.pipeline`) times this runner
against torch's own ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` on the same stages.

Execution order (the simulator's semantics, :func:`posttrain.pipeline.deps.simulate`): a copy (``OFFLOAD``/``RELOAD``) is
issued when the compute action in front of it in the list starts, so a ``RELOAD`` runs just
*before* that compute action (a prefetch) and an ``OFFLOAD`` right after its forward. Sends are
asynchronous (waited at the end of the step). The first tensor crossing each stage boundary is
preceded by a small header (shape, dtype); after that, receives are posted two compute actions
early so that the data lands while this rank computes (torch's runtime posts them early too).
Microbatches of different shapes need ``static_shapes=False`` (a header with every message, each
received when needed); a shape change without it is a clear error. Any failure is raised as
:class:`PipelineActionError` naming rank, stage, action and microbatch.

Loss: the last stage computes ``loss_fn(logits, target) / num_microbatches`` per microbatch, so
the gradients equal one backward of the mean microbatch loss on the whole model; or, with
``step(..., loss_divisor=D)``, ``loss_fn(logits, target) / D`` (a summed token loss over the step's
trained tokens: token-weighted like the data-parallel trainer). What a stage needs besides the
activation (``step(..., extras=...)``: e.g. the document lengths of packed sequences) is known to
every rank from the step's plan and given to each stage's forward; it is not sent.
"""

from __future__ import annotations

import functools
import re
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from posttrain._compat import TorchAction, TorchComputationType, stage_backward_input, stage_backward_weight
from posttrain.device import max_memory_allocated, reset_peak_memory, synchronize

from ._ir import Action
from .offload import ActivationStore
from .passes import OffloadPolicy, add_offload, add_send_recv
from .schedules import Schedule

__all__ = ["PipelineActionError", "PipelineRunner", "ShardedWeights", "StepResult", "execution_order",
           "graph_leaves", "message_runs", "nccl_batches_complete", "plan_receives", "to_torch_actions"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 10  # ndim, up to 8 dims, dtype code
_MESSAGES = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_COMPUTE = ("F", "B", "I", "W")


class PipelineActionError(RuntimeError):
    """An action failed; the message names rank, stage, action and microbatch."""


@dataclass
class StepResult:
    """What one :meth:`PipelineRunner.step` did on this rank.

    Attributes:
        loss: mean microbatch loss (on the rank holding the last stage; ``None`` elsewhere).
        step_time_s: wall time of the step.
        actions: ``(action text, start s, end s)`` from the step start, in execution order.
        chunk_bytes: per stage, saved bytes of one microbatch (the unit "chunk-microbatch").
        peak_bytes: per stage, peak device-resident saved bytes.
        rank_peak_bytes: peak device-resident saved bytes of this rank's stages together (not the
            sum of ``peak_bytes``: a rank's stages peak at different times).
        curve: ``(time s, resident chunk-microbatches summed over this rank's stages)`` at every change.
        peak_units: the peak of ``curve``.
        offloaded_bytes: bytes copied to host memory.
        weight_keep: per stage that ran a split backward, the largest fraction of a
            chunk-microbatch kept for ``W`` after ``I`` (0 on stage 0; 1 without ``weight_split``):
            what :func:`~posttrain.pipeline.deps.simulate` takes as ``weight_keep``.
        late_reloads: backwards that found their activations still on the host (0 when every
            reload was scheduled ahead).
        cuda_max_allocated: on an accelerator, its peak allocated bytes during the step (all
            device memory, not only saved activations); ``None`` on CPU.
    """

    loss: float | None
    step_time_s: float
    actions: list[tuple[str, float, float]] = field(default_factory=list)
    chunk_bytes: dict[int, int] = field(default_factory=dict)
    peak_bytes: dict[int, int] = field(default_factory=dict)
    rank_peak_bytes: int = 0
    curve: list[tuple[float, float]] = field(default_factory=list)
    peak_units: float = 0.0
    offloaded_bytes: int = 0
    weight_keep: dict[int, float] = field(default_factory=dict)
    late_reloads: int = 0
    cuda_max_allocated: int | None = None


#: Autograd node types that list what they saved (``_saved_*`` / ``saved_tensors``): torch's
#: generated nodes (``MmBackward0``) and custom ``autograd.Function`` nodes (``FooBackward``).
_SHOWS_SAVED = re.compile(r"Backward\d*$|^AccumulateGrad$")


@functools.cache
def _saved_names(node_type: type) -> tuple[str, ...]:
    """The attributes through which an autograd node type shows what it saved."""
    return tuple(n for n in dir(node_type) if n.startswith("_saved_") or n == "saved_tensors")


def execution_order(actions: Sequence[Action]) -> list[Action]:
    """The lowered list in the order one thread runs it: each ``RELOAD`` moved ahead of the compute
    action in front of it (the point where the simulator issues it), but never ahead of an earlier
    copy (the copy stream runs in list order, so a reload also waits for its own ``OFFLOAD``)."""
    out: list[Action] = []
    last_compute = None  # index in out of the latest compute action
    after_copy = 0  # index in out just after the latest copy
    for a in actions:
        if a.kind in ("RELOAD", "RELOAD_W") and last_compute is not None:
            at = max(last_compute, after_copy)
            out.insert(at, a)
            after_copy = at + 1
            if at <= last_compute:
                last_compute += 1
            continue
        if a.kind in ("F", "B", "I", "W"):
            last_compute = len(out)
        out.append(a)
        if a.kind in ("OFFLOAD", "OFFLOAD_W"):
            after_copy = len(out)
    return out


def to_torch_actions(actions: dict[int, list[Action]]):
    """``{rank: [torch _Action]}`` for torch's pipelining runtime (compute and send/recv kinds).

    Raises:
        ValueError: the schedule has ``OFFLOAD``/``RELOAD``, which torch's runtime cannot run.
    """
    C = TorchComputationType

    kinds = {"F": C.FORWARD, "B": C.FULL_BACKWARD, "I": C.BACKWARD_INPUT, "W": C.BACKWARD_WEIGHT,
             "SEND_F": C.SEND_F, "RECV_F": C.RECV_F, "SEND_B": C.SEND_B, "RECV_B": C.RECV_B}
    out = {}
    for rank, acts in actions.items():
        bad = [str(a) for a in acts if a.kind not in kinds]
        if bad:
            raise ValueError(f"torch's pipelining runtime has no action for {bad[0]} (rank {rank}); "
                             f"run offload schedules with posttrain's PipelineRunner")
        out[rank] = [TorchAction(a.stage, kinds[a.kind], a.microbatch) for a in acts]
    return out


def p2p_orders_match(orders: Sequence[Sequence[Action]], layout) -> bool:
    """Whether, for every pair of ranks, the messages one sends the other (in its execution order
    ``orders[rank]``) are received in the same order: what NCCL's point-to-point needs, since it
    ignores tags and pairs a peer's sends and receives in posting order."""
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for rank, actions in enumerate(orders):
        for a in actions:
            s, j = a.stage, a.microbatch
            if a.kind == "SEND_F":
                sent.setdefault((rank, layout.rank_of(s + 1)), []).append(("F", s, j))
            elif a.kind == "SEND_B":
                sent.setdefault((rank, layout.rank_of(s - 1)), []).append(("B", s, j))
            elif a.kind == "RECV_F":
                received.setdefault((layout.rank_of(s - 1), rank), []).append(("F", s - 1, j))
            elif a.kind == "RECV_B":
                received.setdefault((layout.rank_of(s + 1), rank), []).append(("B", s + 1, j))
    return sent == received


def _message(a: Action, layout) -> tuple[str, int, tuple]:
    """``(send|recv, peer rank, message)`` of a message action; ``message`` is ``(F|B, sending
    stage, microbatch)``, the same on both ends."""
    s, j = a.stage, a.microbatch
    if a.kind == "SEND_F":
        return "send", layout.rank_of(s + 1), ("F", s, j)
    if a.kind == "SEND_B":
        return "send", layout.rank_of(s - 1), ("B", s, j)
    if a.kind == "RECV_F":
        return "recv", layout.rank_of(s - 1), ("F", s - 1, j)
    return "recv", layout.rank_of(s + 1), ("B", s + 1, j)


def message_runs(order: Sequence[Action]) -> list[tuple[int, list[int]]]:
    """The runs of message actions in one rank's execution ``order``: the messages between two
    compute actions (copies between them aside: an ``OFFLOAD`` or ``RELOAD`` neither needs nor
    feeds a message), as ``(index of the run's first message, indices of its messages)``."""
    runs: list[tuple[int, list[int]]] = []
    current: list[int] = []
    for i, a in enumerate(order):
        if a.kind in _MESSAGES:
            current.append(i)
        elif a.kind in _COMPUTE and current:
            runs.append((current[0], current))
            current = []
    if current:
        runs.append((current[0], current))
    return runs


def nccl_batches_complete(batches: Sequence[Sequence[Sequence[tuple[str, int, object]]]]) -> tuple[bool, list[int], set]:
    """Whether every rank's batches (``batches[rank]``: lists of ``(send|recv, peer, message)``)
    complete when each rank posts them one after another on one stream, as NCCL runs them: an
    operation completes once the peer's operation of the same message is in the batch the peer's
    stream is at, and a stream moves on once its batch has completed. Returns ``(complete, the
    batch each rank's stream stopped at, the messages done)``: where not complete, two or more
    ranks each wait in their current batch for a message another posts only in a later one."""
    heads = [0] * len(batches)
    done: set = set()
    while True:
        progress = False
        for r, bs in enumerate(batches):
            while heads[r] < len(bs) and all(m in done for _, _, m in bs[heads[r]]):
                heads[r] += 1
                progress = True
        current = [set(bs[heads[r]]) if heads[r] < len(bs) else set() for r, bs in enumerate(batches)]
        for r, ops in enumerate(current):
            for op, peer, m in ops:
                if m not in done and ("recv" if op == "send" else "send", r, m) in current[peer]:
                    done.add(m)
                    progress = True
        if not progress:
            return all(h == len(bs) for h, bs in zip(heads, batches)), heads, done


def plan_receives(orders: Sequence[Sequence[Action]], layout) -> list[dict[int, list[int]]] | None:
    """Where each rank posts its receives so that NCCL can carry a schedule: ``plan[rank]`` maps
    the index (in ``orders[rank]``) of a run's first message (:func:`message_runs`) to the indices
    of the receives posted with that run's sends, in order. ``None`` where no such plan was found
    (the runner then sends through host memory).

    NCCL ignores tags and pairs a peer's sends with the receiver's receives in posting order, so
    every pair of ranks must receive in the order the other sent (:func:`p2p_orders_match`), and
    it runs a rank's batches one after another on one stream (:func:`nccl_batches_complete`).
    Each receive starts in its own run; where the batches would stop, a receive the stopped
    sender waits for is posted earlier, with the batch the receiver's stream is at (and so are
    the receives from the same peer before it, which keeps their order): interleaved schedules
    then post a receive with the sends of the compute action before, as torch's own runtime
    does. A receive is waited for where the schedule places it, whenever it was posted."""
    if not p2p_orders_match(orders, layout):
        return None
    num = len(orders)
    runs = [message_runs(o) for o in orders]
    info = [{i: _message(orders[r][i], layout) for _, idx in runs[r] for i in idx} for r in range(num)]
    # (a stage's neighbour on the same rank: no message)
    sends = [[[i for i in idx if info[r][i][0] == "send" and info[r][i][1] != r] for _, idx in runs[r]] for r in range(num)]
    recvs = [[i for _, idx in runs[r] for i in idx if info[r][i][0] == "recv" and info[r][i][1] != r] for r in range(num)]
    at = [{i: k for k, (_, idx) in enumerate(runs[r]) for i in idx} for r in range(num)]  # receive -> its run
    limit = sum(len(x) for x in recvs) + 1
    for _ in range(limit):
        batches = []
        for r in range(num):
            groups = [[info[r][i] for i in sends[r][k]] for k in range(len(runs[r]))]
            for i in recvs[r]:
                groups[at[r][i]].append(info[r][i])
            batches.append([g for g in groups])
        complete, heads, done = nccl_batches_complete(batches)
        if complete:
            plan = []
            for r in range(num):
                rank_plan: dict[int, list[int]] = {}
                for i in recvs[r]:
                    rank_plan.setdefault(runs[r][at[r][i]][0], []).append(i)
                plan.append(rank_plan)
            return plan
        moved = False
        for a in range(num):
            if heads[a] >= len(runs[a]):
                continue
            for i in sends[a][heads[a]]:
                _, p, m = info[a][i]
                if m in done:
                    continue
                j = next(j for j in recvs[p] if info[p][j][2] == m)
                if at[p][j] <= heads[p]:
                    continue
                for k in recvs[p]:  # it and the receives from the same peer before it
                    if k <= j and info[p][k][1] == a and at[p][k] > heads[p]:
                        at[p][k] = heads[p]
                        moved = True
        if not moved:
            return None
    return None


def backend_for(config: str, device_type: str) -> str:
    """The backend a process group's ``config`` (``torch.distributed.get_backend_config``: ``gloo``
    or ``cpu:gloo,cuda:nccl``) uses for tensors on ``device_type``."""
    if ":" not in config:
        return config
    return dict(part.split(":", 1) for part in config.split(",")).get(device_type, "gloo")


def _host_only(group, device: torch.device) -> bool:
    """Whether ``group`` (``None``: the world) sends ``device`` tensors with gloo, which has no
    point-to-point for CUDA tensors (ranks sharing a GPU: the process group is gloo alone)."""
    return dist.is_initialized() and backend_for(dist.get_backend_config(group), device.type) == "gloo"


def _to(target, device: torch.device):
    if target is None:
        return None
    if isinstance(target, tuple | list):
        return type(target)(_to(t, device) for t in target)
    return target.to(device)


class ShardedWeights(Protocol):
    """What a sharding engine that gathers fresh weight tensors every forward does around a split
    backward (a :class:`~posttrain.dp.DataParallelEngine` with ``split_backward``: flat ODC). ``weights`` is what
    :meth:`weights_of` returned for the microbatch."""

    def weights_of(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors ``I`` and ``W`` treat as the stage's weights, given the leaves of its
        forward's graph (flat ODC: one view per parameter, so that ``W`` runs only the
        weight-gradient nodes, not the whole backward again)."""

    def after_input(self, weights: list[torch.Tensor]) -> None:
        """``I`` is done: the gathered weights may be freed until :meth:`before_weight`."""

    def before_weight(self, weights: list[torch.Tensor]) -> None:
        """``W`` comes next: gather what :meth:`after_input` freed."""

    def after_weight(self, weights: list[torch.Tensor]) -> None:
        """``W`` is done. torch's ``stage_backward_weight`` assigns ``.grad`` itself, so hooks
        that run when autograd accumulates a gradient (a gradient push) did not fire: push."""


def graph_leaves(y: torch.Tensor, exclude: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The leaf tensors that require grad reached from ``y``'s autograd graph, except ``exclude``
    (a stage's input), in a fixed (depth-first) order: a stage's weights when a sharding engine
    gathers fresh leaves every forward."""
    out, seen, stack = [], set(), [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad
        if leaf is not None:
            if leaf is not exclude and leaf.requires_grad:
                out.append(leaf)
            continue
        stack.extend(c for c, _ in reversed(node.next_functions))
    return out


class PipelineRunner:
    """Runs one rank's share of a schedule (see the module docstring).

    Args:
        stages: ``{stage index: module}`` for the stages the layout puts on this rank.
        schedule: from :func:`~posttrain.pipeline.build_schedule`.
        loss_fn: ``loss_fn(logits, target) -> scalar`` on the last stage.
        offload: which saved activations go to host memory (default: none; accounting still runs).
        group: process group of the pipeline ranks (default: the world).
        device: compute device.
        static_shapes: every microbatch has the same shapes (the default): shapes cross ranks once,
            in a header with the first message of each stage boundary, and later receives are
            posted two compute actions ahead so the data lands while this rank computes. With
            ``False`` every message carries its header and is received when needed.
        weight_split: under a split backward, free what only ``I`` needs when ``I`` ends (see
            :meth:`ActivationStore.split`); ``False`` keeps a chunk-microbatch whole until ``W``.
            A stage's first split is checked: if ``W`` reads something the graph walk missed,
            the stage stops splitting (with a warning) and nothing is lost.
        split_checked: ``{stage: verdict}`` of the stages whose first split was already checked;
            pass one dict to every runner of the same stages (one per microbatch count, say) so
            that each stage is checked once (default: this runner's own). While checking, the
            dropped storages stay resident: that step's memory is the unsplit one's.
        sharded: for stages whose parameters a sharding engine took off the modules (flat ODC
            gathers fresh leaf tensors every forward), what that engine does around a split
            backward (see :class:`ShardedWeights`): such a stage has no registered parameters,
            so its weights come from the leaves its forward's autograd graph reaches.
    """

    def __init__(self, stages: dict[int, nn.Module], schedule: Schedule, *, loss_fn: Callable,
                 offload: OffloadPolicy | None = None, group=None, device: torch.device | str = "cpu",
                 static_shapes: bool = True, weight_split: bool = True,
                 split_checked: dict[int, bool] | None = None, sharded: ShardedWeights | None = None) -> None:
        self.layout = schedule.layout
        self.schedule = schedule
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        if self.world != self.layout.num_ranks:
            raise ValueError(f"schedule {schedule.name!r} is laid out for {self.layout.num_ranks} pipeline ranks, "
                             f"but the process group has {self.world}")
        mine = sorted(s for s in range(self.layout.num_stages) if self.layout.rank_of(s) == self.rank)
        if sorted(stages) != mine:
            raise ValueError(f"rank {self.rank} must be given stages {mine}, got {sorted(stages)}")
        self.stages = stages
        self.loss_fn = loss_fn
        self.device = torch.device(device)
        self.wire = self.device  # where payloads travel (host memory instead, below, where NCCL cannot carry them)
        self.policy = offload or OffloadPolicy(0)
        self.m = schedule.num_microbatches
        lowered = add_offload(schedule.actions, self.layout, self.m, self.policy)
        self.lowered = add_send_recv(lowered, self.layout)
        self.order = execution_order(self.lowered[self.rank])
        plan = None
        if self.device.type != "cpu" and not _host_only(group, self.device):
            plan = plan_receives([execution_order(self.lowered[r]) for r in range(self.layout.num_ranks)], self.layout)
        if self.device.type != "cpu" and plan is None:
            # gloo has no point-to-point of device tensors (ranks sharing a GPU); or NCCL cannot carry
            # this schedule's messages (plan_receives: its tag-less pairing or its batches' order)
            self.wire = torch.device("cpu")
        self.static_shapes = static_shapes
        self._order_messages(plan)
        if self._nccl_order and self.world > 1:
            # NCCL's first operation on a group starts its communicator, and a batch of point-to-point
            # operations may not be that first one unless every rank takes part: a collective does it
            dist.all_reduce(torch.zeros(1, device=self.wire), group=self.group)
        self._shapes: dict = {}  # (kind, sending stage) -> (shape, dtype) learned from the first header
        self._sent_shapes: dict = {}
        # each receive is posted when the compute action two compute actions before it starts
        self._post_at: dict[int, list[Action]] = {}
        computes = [i for i, a in enumerate(self.order) if a.kind in ("F", "B", "I", "W")]
        for i, a in enumerate(self.order):
            if a.kind in ("RECV_F", "RECV_B"):
                before = [k for k in computes if k < i]
                self._post_at.setdefault(before[-2] if len(before) >= 2 else 0, []).append(a)
        self._params = {s: [p for p in mod.parameters() if p.requires_grad] for s, mod in stages.items()}
        self._last = self.layout.num_stages - 1
        # one store for the runner's life: its pinned host buffers (CUDA) are reused across steps
        self.store = ActivationStore([p for ps in self._params.values() for p in ps], self.device)
        self.weight_split = weight_split
        # the engine of each stage whose parameters it took off the module (none registered)
        self._sharded = {s: sharded if not self._params[s] else None for s in stages}
        # stage -> its first split was checked against W's reads (and held)
        self._split_ok: dict[int, bool] = {} if split_checked is None else split_checked

    def _order_messages(self, plan: list[dict[int, list[int]]] | None) -> None:
        """How this rank posts its messages: the messages between two compute actions as one batch
        (:meth:`_exchange`), and with it the receives ``plan`` (:func:`plan_receives`) puts there:
        NCCL's order (no receive posted ahead on its own; a batch's headers waited for before its
        payloads are posted). ``None``: each run's own receives (gloo, which matches tags)."""
        self._nccl_order = plan is not None
        self._batch_at = {start: [self.order[i] for i in idx] for start, idx in message_runs(self.order)}
        self._recv_plan: dict[int, list[Action]] = (
            {start: [self.order[i] for i in idx] for start, idx in plan[self.rank].items()} if plan is not None else
            {start: [a for a in run if a.kind in ("RECV_F", "RECV_B")] for start, run in self._batch_at.items()})

    # -- communication ----------------------------------------------------------------------

    def _tag(self, kind: str, stage: int, mb: int, part: int) -> int:
        return ((stage * self.m + mb) * 2 + (kind == "B")) * 2 + part

    def _peer(self, stage: int) -> int:
        r = self.layout.rank_of(stage)
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def _send_ops(self, t: torch.Tensor, stage_to: int, kind: str, stage: int, mb: int) -> list:
        """Post the header of ``t`` where one goes (gloo, at once) and return the payload's send to
        post with the batch it belongs to."""
        t = t.detach().contiguous()
        if t.ndim > _HEADER - 2 or t.dtype not in _DTYPES:
            raise ValueError(f"cannot send a {t.ndim}-d {t.dtype} tensor between stages")
        dst = self._peer(stage_to)
        known = self._sent_shapes.get((kind, stage))
        if known is None or not self.static_shapes:
            header = torch.zeros(_HEADER, dtype=torch.int64)
            header[0] = t.ndim
            header[1:1 + t.ndim] = torch.tensor(t.shape)
            header[-1] = _DTYPES.index(t.dtype)
            # (on the CPU: gloo, which matches tags, whatever the payload's wire)
            self._pending.append((dist.isend(header, dst, group=self.group, tag=self._tag(kind, stage, mb, 0)), header))
            self._sent_shapes[(kind, stage)] = (tuple(t.shape), t.dtype)
        elif known != (tuple(t.shape), t.dtype):
            raise ValueError(f"microbatch {mb} sends a {tuple(t.shape)} {t.dtype} tensor where earlier microbatches "
                             f"sent {known[0]} {known[1]}: microbatches of different shapes need "
                             f"PipelineRunner(static_shapes=False)")
        x = t.to(self.wire)  # (a payload copied to the host where messages travel there)
        return [dist.P2POp(dist.isend, x, dst, self.group, self._tag(kind, stage, mb, 1))]

    def _post_recv(self, stage_from: int, kind: str, stage: int, mb: int):
        """Post the receive of a payload whose shape is known (static shapes) ahead of its batch,
        on the CPU only; ``None`` if it is not."""
        known = self._shapes.get((kind, stage)) if self.static_shapes else None
        if known is None or self._nccl_order:  # (NCCL: receives in the action order, none ahead)
            return None
        buf = torch.empty(known[0], dtype=known[1], device=self.wire)
        return dist.irecv(buf, self._peer(stage_from), group=self.group, tag=self._tag(kind, stage, mb, 1)), buf

    def _recv_op(self, stage_from: int, kind: str, stage: int, mb: int):
        """The payload receive to post with its batch: its shape from the first header, or from
        this message's header when shapes vary (waited for here)."""
        src = self._peer(stage_from)
        known = self._shapes.get((kind, stage)) if self.static_shapes else None
        if known is None:
            header = torch.empty(_HEADER, dtype=torch.int64)
            dist.recv(header, src, group=self.group, tag=self._tag(kind, stage, mb, 0))
            h = header.tolist()
            known = self._shapes[(kind, stage)] = (tuple(h[1:1 + h[0]]), _DTYPES[h[-1]])
        buf = torch.empty(known[0], dtype=known[1], device=self.wire)
        return dist.P2POp(dist.irecv, buf, src, self.group, self._tag(kind, stage, mb, 1)), buf

    def _recv_args(self, a: Action) -> tuple[int, str, int, int]:
        if a.kind == "RECV_F":
            return a.stage - 1, "F", a.stage - 1, a.microbatch
        return a.stage + 1, "B", a.stage + 1, a.microbatch

    def _exchange(self, start: int) -> None:
        """One batch: the messages between two compute actions (the run beginning at ``start`` in
        the order), its sends and the receives planned with it posted together with
        ``batch_isend_irecv``, as torch's own schedules do. NCCL completes a lone send only once
        the peer has posted the matching receive (beyond what its buffers hold), so in 1F1B's
        steady state, where both neighbours send before they receive, unbatched sends would wait
        for each other forever; batched, they progress together (:func:`plan_receives` says which
        receives go with which batch over NCCL; here each run's own).

        Headers (shapes, over gloo) are sent first. Where a receive's shape is not known yet this
        rank then waits for its header: on NCCL before posting anything (NCCL payloads never hold
        a rank's host thread, so a peer reaches its own headers without them, and the batch stays
        whole), on the CPU after posting the sends (gloo's receive of a payload does hold the
        peer's thread: it may need this batch's send before it can send its header). Then the
        run's own receives are waited for, wherever they were posted. Gloo takes this same path
        in the CPU suite."""
        run = self._batch_at[start]
        ops: list = []
        posting: list[tuple[tuple[str, int, int], torch.Tensor]] = []  # receives in this batch: (key, buffer)

        def flush() -> None:
            if ops:
                works = dist.batch_isend_irecv(ops)
                recv_works = [w for op, w in zip(ops, works) if op.op is dist.irecv]
                self._pending += [(w, op.tensor) for op, w in zip(ops, works) if op.op is not dist.irecv]
                for (key, buf), work in zip(posting, recv_works):
                    self._posted[key] = (work, buf)
                ops.clear()
                posting.clear()

        for a in run:
            if a.kind == "SEND_F":
                ops += self._send_ops(self._outputs[(a.stage, a.microbatch)], a.stage + 1, "F", a.stage, a.microbatch)
            elif a.kind == "SEND_B":
                ops += self._send_ops(self._dx.pop((a.stage, a.microbatch)), a.stage - 1, "B", a.stage, a.microbatch)
        if not self._nccl_order:
            flush()
        for a in self._recv_plan.get(start, ()):
            args = self._recv_args(a)
            if args[1:] in self._posted:  # posted ahead (the CPU)
                continue
            posted = self._post_recv(*args)  # (alone, where gloo matches tags and the shape is known)
            if posted is not None:
                self._posted[args[1:]] = posted
                continue
            op, buf = self._recv_op(*args)
            ops.append(op)
            posting.append((args[1:], buf))
        flush()
        for a in run:
            if a.kind not in ("RECV_F", "RECV_B"):
                continue
            key = self._recv_args(a)[1:]
            if key not in self._posted:
                raise AssertionError(f"rank {self.rank}: {a} was not posted by its batch or an earlier one")
            work, buf = self._posted.pop(key)
            work.wait()
            x = buf.to(self.device)
            if a.kind == "RECV_F":
                self._inputs[(a.stage, a.microbatch)] = x.requires_grad_()
            else:
                self._grads[(a.stage, a.microbatch)] = x

    # -- the step ---------------------------------------------------------------------------

    def step(self, inputs: Sequence[torch.Tensor] | None = None,
             targets: Sequence | None = None, *, extras: Sequence[dict] | None = None,
             loss_divisor: float | None = None) -> StepResult:
        """One pass over all microbatches; gradients accumulate into the stages' ``.grad``.

        Args:
            inputs: the ``num_microbatches`` token tensors (used by the rank holding stage 0).
            targets: the matching targets (used by the rank holding the last stage): tensors, or
                tuples of tensors that ``loss_fn`` takes apart (e.g. target ids and token weights).
            extras: per microbatch, keyword arguments every stage's forward receives besides the
                activation (e.g. ``document_lengths`` of packed sequences, from which each stage
                rebuilds position ids and the attention mask). Every rank must pass the same; they
                cost no communication.
            loss_divisor: divide each microbatch's loss by this instead of by the number of
                microbatches (e.g. the step's trained tokens, with a summed ``loss_fn``).
        """
        if extras is not None and len(extras) != self.m:
            raise ValueError(f"extras: {len(extras)} entries for {self.m} microbatches")
        self._extras = extras
        self._divisor = float(loss_divisor) if loss_divisor is not None else float(self.m)
        if 0 in self.stages and (inputs is None or len(inputs) != self.m):
            raise ValueError(f"the rank holding stage 0 needs {self.m} microbatch inputs, got "
                             f"{None if inputs is None else len(inputs)}")
        if self._last in self.stages and (targets is None or len(targets) != self.m):
            raise ValueError(f"the rank holding the last stage needs {self.m} targets, got "
                             f"{None if targets is None else len(targets)}")
        self.store.reset_stats()
        self._pending: list = []
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}  # stage input (leaf)
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}  # stage output, or the loss on the last stage
        self._grads: dict[tuple[int, int], torch.Tensor] = {}  # gradient w.r.t. a stage's output
        self._wgroups: dict[tuple[int, int], tuple[list, list]] = {}  # (param groups, weights) from I for W
        self._dx: dict[tuple[int, int], torch.Tensor] = {}  # input gradient waiting for SEND_B
        self._whole: set[int] = set()  # stages with a split backward kept whole this step (walk declined)
        loss = torch.zeros((), device=self.device) if self._last in self.stages else None
        reset_peak_memory(self.device)
        t_start = time.perf_counter()
        record: list[tuple[str, float, float]] = []
        self._posted: dict = {}
        for i, a in enumerate(self.order):
            for r in self._post_at.get(i, ()):  # receives posted ahead, to land while we compute
                args = self._recv_args(r)
                posted = self._post_recv(*args)
                if posted is not None:
                    self._posted[args[1:]] = posted
            if a.kind in _MESSAGES and i not in self._batch_at:
                continue  # exchanged with the batch that begins before it
            t0 = time.perf_counter()
            try:
                if a.kind in _MESSAGES:
                    self._exchange(i)
                    out = None
                else:
                    out = self._run(a, inputs, targets)
            except PipelineActionError:
                raise
            except Exception as e:
                raise PipelineActionError(f"rank {self.rank}, stage {a.stage}, action {a} ({a.kind}), "
                                          f"microbatch {a.microbatch}: {type(e).__name__}: {e}") from e
            if out is not None:
                loss += out.detach()
            if a.kind in _MESSAGES:
                for m in self._batch_at[i]:
                    record.append((str(m), t0 - t_start, time.perf_counter() - t_start))
            else:
                record.append((str(a), t0 - t_start, time.perf_counter() - t_start))
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        if self.store.held():
            raise PipelineActionError(f"rank {self.rank}: saved activations still held after the step: "
                                      f"{self.store.held()} (schedule missing a backward)")
        synchronize(self.device)  # (on a GPU: the step's kernels, not their launch; once a step)
        step_time = time.perf_counter() - t_start
        return self._result(loss, step_time, record, t_start)

    def _run(self, a: Action, inputs, targets) -> torch.Tensor | None:
        s, j, key = a.stage, a.microbatch, (a.stage, a.microbatch)
        if a.kind == "F":
            if s == 0:
                x = inputs[j].to(self.device)
            elif key in self._inputs:
                x = self._inputs[key]
            else:
                raise RuntimeError("input not received (RECV_F missing before this forward)")
            self._inputs[key] = x
            with self.store.hooks(s, j):
                y = self.stages[s](x, **(self._extras[j] if self._extras is not None else {}))
                if s == self._last:
                    y = self.loss_fn(y, _to(targets[j], self.device)) / self._divisor
            self._outputs[key] = y
            if s < self._last and self.layout.rank_of(s + 1) == self.rank:
                self._inputs[(s + 1, j)] = y.detach().requires_grad_()
            return y if s == self._last else None
        if a.kind in ("B", "I"):
            y = self._outputs.pop(key)
            grad = None if s == self._last else self._grads.pop(key, None)
            if s != self._last and grad is None:
                raise RuntimeError("output gradient not received (RECV_B missing before this backward)")
            x = self._inputs[key]
            if a.kind == "B" or not x.requires_grad:
                # stage 0 (token ids in) has no input gradient: its I is the full backward, W only frees
                torch.autograd.backward(y, grad_tensors=grad)
                dx = x.grad if x.requires_grad else None
                if a.kind == "B":
                    self.store.release(s, j)
                elif self.weight_split:  # nothing is left for W
                    self.store.split(s, j, set())
            else:
                weights = self._params[s] or self._graph_weights(s, y, x)
                (dx,), groups = stage_backward_input([y], None if grad is None else [grad], [x], iter(weights))
                self._wgroups[key] = groups, weights
                if self.weight_split and self._split_ok.get(s, True):
                    keep = self._weight_saved(key, groups)
                    if keep is None:
                        self._whole.add(s)
                    else:
                        self.store.split(s, j, keep, verify=s not in self._split_ok)
                if self._sharded[s] is not None:
                    self._sharded[s].after_input(weights)
            self._inputs.pop(key)
            if s > 0 and self.layout.rank_of(s - 1) == self.rank:
                self._grads[(s - 1, j)] = dx
            elif s > 0:
                self._dx[key] = dx
        elif a.kind == "W":
            groups, weights = self._wgroups.pop(key, (None, None))
            if groups is not None:
                engine = self._sharded[s]
                if engine is not None:
                    engine.before_weight(weights)
                with warnings.catch_warnings():  # weights that are views (a sharding engine's): torch reads .grad
                    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
                    stage_backward_weight(iter(weights), groups)
                if engine is not None:
                    engine.after_weight(weights)
            if s not in self._split_ok and key in self.store.kept and groups is not None:
                # the stage's first split kept what it dropped aside: trust the walk only if W read none of it
                self._split_ok[s] = not self.store.missed(s, j)
                if not self._split_ok[s]:
                    warnings.warn(f"pipeline stage {s}: the weight-gradient pass read a saved tensor the graph walk "
                                  f"did not find; this stage keeps all its saved activations until W", stacklevel=2)
            self.store.release(s, j)
        elif a.kind in ("OFFLOAD", "OFFLOAD_W"):
            self.store.offload(s, j, self.policy.fraction)
        elif a.kind in ("RELOAD", "RELOAD_W"):
            self.store.reload(s, j)
        else:  # pragma: no cover - KINDS is closed
            raise AssertionError(a.kind)
        return None

    def _graph_weights(self, s: int, y: torch.Tensor, x: torch.Tensor) -> list[torch.Tensor]:
        leaves = graph_leaves(y, x)
        return leaves if self._sharded[s] is None else self._sharded[s].weights_of(leaves)

    def _weight_saved(self, key: tuple[int, int], groups: list[dict]) -> set[int] | None:
        """The storages of ``key``'s saved activations that ``W`` will read: those saved by the
        autograd nodes ``stage_backward_weight`` runs, i.e. the nodes on a path from a parameter
        group's intermediates (where ``I`` captured the gradients) to that group's parameters.
        ``None`` (keep everything) where one of those nodes cannot list what it saved: only
        torch's generated nodes and custom ``autograd.Function`` nodes (``...Backward``) can.
        (A node inside a non-reentrant ``torch.utils.checkpoint`` region recomputes the region
        when asked: correct, but slow; the pipeline stages do not checkpoint.)"""
        bit_of_param: dict = {}
        bit_of_mid: dict = {}
        for i, g in enumerate(groups):
            for n in g["params"]:
                bit_of_param[n] = bit_of_param.get(n, 0) | 1 << i
            for n in g["intermediates"]:
                bit_of_mid[n] = bit_of_mid.get(n, 0) | 1 << i
        order, seen = [], set()  # post-order: every node after the nodes it leads to
        for root in bit_of_mid:
            if root in seen:
                continue
            seen.add(root)
            stack = [(root, iter(root.next_functions))]
            while stack:
                node, it = stack[-1]
                child = next((c for c, _ in it if c is not None and c not in seen), None)
                if child is None:
                    order.append(node)
                    stack.pop()
                else:
                    seen.add(child)
                    stack.append((child, iter(child.next_functions)))
        up: dict = {}  # groups whose parameters a node leads to
        for node in order:
            mask = bit_of_param.get(node, 0)
            for c, _ in node.next_functions:
                if c is not None:
                    mask |= up.get(c, 0)
            up[node] = mask
        down: dict = {}  # groups whose intermediates lead to a node (or are it)
        for node in reversed(order):
            mask = down.get(node, 0) | bit_of_mid.get(node, 0)
            down[node] = mask
            for c, _ in node.next_functions:
                if c is not None:
                    down[c] = down.get(c, 0) | mask
        runs = [node for node in order if up[node] & down[node]]
        if any(not _SHOWS_SAVED.search(type(node).__name__) for node in runs):
            return None  # e.g. CopySlices (an in-place op on a view) hides the node it wraps: keep everything
        with self.store.recording() as read:
            try:
                for node in runs:
                    for name in _saved_names(type(node)):
                        getattr(node, name)
            except RuntimeError:  # a node that cannot show what it saved: keep everything
                return None
        return {storage for k, storage in read if k == key}

    def _weight_keep(self, chunk: dict[int, int]) -> dict[int, float]:
        split = {a.stage for a in self.order if a.kind == "W"}
        keep = dict.fromkeys(split, 0.0)
        for (s, _), n in self.store.kept.items():
            keep[s] = max(keep[s], n / chunk[s]) if chunk.get(s) else keep[s]
        for s in split:  # a stage that did not split, or stopped, keeps everything
            if self._split_ok.get(s) is False or s in self._whole or not any(k[0] == s for k in self.store.kept):
                keep[s] = 1.0
        return keep

    def _result(self, loss, step_time: float, record, t_start: float) -> StepResult:
        store = self.store
        chunk = {}
        for (s, _), n in store.packed.items():
            chunk[s] = max(chunk.get(s, 0), n)
        level: dict[int, int] = {}
        curve = [(0.0, 0.0)]
        for _, t, s, b in store.history:
            level[s] = b
            units = sum(v / chunk[k] for k, v in level.items() if chunk.get(k))
            curve.append((t - t_start, units))
        return StepResult(
            loss=None if loss is None else float(loss), step_time_s=step_time, actions=record,
            chunk_bytes=chunk, peak_bytes={s: store.peak(s) for s in self.stages},
            rank_peak_bytes=store.total_peak(), curve=curve,
            peak_units=max(u for _, u in curve), offloaded_bytes=store.offloaded_bytes,
            weight_keep=self._weight_keep(chunk),
            late_reloads=store.late_reloads,
            cuda_max_allocated=max_memory_allocated(self.device))
