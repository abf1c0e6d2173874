"""Activation offload on one Llama-style pipeline stage: what full offload costs in step time and
saves in peak memory, and PipeOffload's ``k`` measured beside the docs' formula.

:func:`measure_offload` builds the decoder layers of a randomly initialized ``transformers`` Llama
(no download) as one stage (hidden states in, hidden states out), and for each sequence length runs
one training step of ``microbatches`` microbatches on one device: every forward, then every
backward in the same order, with the saved tensors going through an
:class:`~posttrain.pipeline.ActivationStore`. The offload variant offloads each microbatch's
saved activations after its forward and reloads them ahead of its backward, in the order
:class:`~posttrain.pipeline.PipelineRunner` issues the copies (:func:`~posttrain.pipeline.add_offload`
with full offload, then :func:`~posttrain.pipeline.execution_order`); the baseline runs the same
actions without the copies (the runner under ``OffloadPolicy(0)``: hooks and accounting, no copy).
Both variants are timed alternately after a warm-up, the median of ``repeats`` is reported, and the
parameter and input gradients of one step of each are compared (offload must not change them).

``k`` (docs/pipeline.md, "When offload is free") is ``(D2H + H2D time) / (F + B time)`` of one
chunk-microbatch: here one microbatch's offload and reload, each timed alone, over one
microbatch's forward and backward timed alone.

Used by ``posttrain doctor`` on a GPU; the CPU runs the same code at small sizes (tests), with
memory figures ``None`` (the CPU keeps no peak count).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from posttrain.balance.cost import ModelShape
from posttrain.device import max_memory_allocated, reset_peak_memory, synchronize
from posttrain.pipeline import Action, ActivationStore, OffloadPolicy, StageLayout, add_offload, execution_order

__all__ = ["build_llama_stage", "docs_k", "format_offload", "format_selective", "measure_offload", "offload_order",
           "predict_offload"]

#: The docs' estimate of half-precision values autograd saves per token and layer, in units of the
#: hidden size (docs/pipeline.md, "When offload is free": "about `10h` half-precision values are
#: saved per token").
DOCS_SAVED_PER_H = 10


def docs_k(hidden: int, seq_len: int, flops_per_s: float, host_bytes_per_s: float) -> float:
    """PipeOffload's ``k`` as docs/pipeline.md (line 31, "When offload is free") predicts it:
    ``k = 10 / (3 (6h + s)) * Bc / Bo`` for hidden size ``h``, sequence length ``s``, achieved
    FLOP rate ``Bc`` (FLOP/s) and host-link bandwidth ``Bo`` (bytes/s): ``10h`` half-precision
    values saved per token and layer go out and back (``40h`` bytes) against ``12h (6h + s)``
    FLOPs of forward and backward per token and layer."""
    return 10.0 / (3.0 * (6 * hidden + seq_len)) * flops_per_s / host_bytes_per_s


class _LlamaStage(nn.Module):
    """Decoder layers of a Llama (with its rotary embedding): ``(1, tokens, hidden)`` hidden states
    in and out, causal attention (``sdpa``, no mask: ``is_causal``), as a middle pipeline stage."""

    def __init__(self, layers: nn.ModuleList, rotary: nn.Module) -> None:
        super().__init__()
        self.layers = layers
        self.rotary_emb = rotary  # a buffer of frequencies, no parameters; kept in float32

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        cos_sin = self.rotary_emb(h, pos)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
        return h


def build_llama_stage(hidden: int, layers: int, max_tokens: int, device: torch.device | str,
                      dtype: torch.dtype) -> tuple[nn.Module, object]:
    """A randomly initialized Llama-style stage of ``layers`` decoder layers and its config:
    SwiGLU width ``2.6875 * hidden`` (11008 at 4096), heads of 128 (at least one head), as many
    key/value heads, ``sdpa`` attention. Nothing is downloaded."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    heads = max(1, hidden // 128)
    config = LlamaConfig(vocab_size=32, hidden_size=hidden, intermediate_size=round(2.6875 * hidden),
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=max(max_tokens, 1), attn_implementation="sdpa")
    with torch.device(device):
        blocks = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(layers)).to(dtype)
        rotary = LlamaRotaryEmbedding(config=config)
    return _LlamaStage(blocks, rotary), config


def offload_order(microbatches: int) -> list[Action]:
    """The actions of one stage on one device, every forward then every backward in order, with
    full offload, in the order :class:`~posttrain.pipeline.PipelineRunner` runs them."""
    plain = [Action(0, "F", j) for j in range(microbatches)] + [Action(0, "B", j) for j in range(microbatches)]
    return execution_order(add_offload({0: plain}, StageLayout(1), microbatches, OffloadPolicy(1))[0])


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.float().square().mean()


class _Clock:
    """Seconds of device work between :meth:`start` and :meth:`stop`: device events on an
    accelerator (the current stream), ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.events = device.type != "cpu"

    def start(self) -> None:
        synchronize(self.device)
        if self.events:
            self._start = torch.Event(device=self.device, enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self.events:
            end = torch.Event(device=self.device, enable_timing=True)
            end.record()
            end.synchronize()
            return self._start.elapsed_time(end) / 1000.0
        return time.perf_counter() - self._t0


def _wall(device: torch.device, fn: Callable[[], None]) -> float:
    """Seconds from issuing ``fn`` to the device being idle again (for the store's copies, which
    run on a stream of its own)."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def _zero_grads(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        if t.grad is not None:
            t.grad.zero_()


def _step(stage: nn.Module, inputs: Sequence[torch.Tensor], store: ActivationStore, order: Sequence[Action],
          fraction: float) -> None:
    """One step of ``order``, each copy moving ``fraction`` of a microbatch's saved bytes (0: the
    copies skipped); gradients accumulate."""
    losses: dict[int, torch.Tensor] = {}
    for a in order:
        j = a.microbatch
        if a.kind == "F":
            with store.hooks(0, j):
                losses[j] = _loss(stage(inputs[j]))
        elif a.kind == "B":
            losses.pop(j).backward()
            store.release(0, j)
        elif fraction and a.kind == "OFFLOAD":
            store.offload(0, j, fraction)
        elif fraction and a.kind == "RELOAD":
            store.reload(0, j)


def predict_offload(microbatches: int, forward_s: float, backward_s: float, saved_bytes: float,
                    host_bytes_per_s: float, *, max_overhead: float = 0.02, fraction: float | None = None) -> dict:
    """The simulator on the measurement's own order (one stage, every forward then every backward:
    ``gpipe`` at one rank, every microbatch offloaded): the predicted cost of full offload, and the
    share of each microbatch :func:`~posttrain.sim.planner.plan_offload_fraction` picks to stay
    within ``max_overhead`` (or the given ``fraction``), with its predicted cost and resident peak
    (in microbatches).

    Returns ``{"full_overhead", "full_peak_mb", "fraction" (None: even 5% costs more),
    "overhead", "peak_mb", "none_peak_mb"}``."""
    from posttrain.sim.pipeline import PipelineWorkload, simulate_pipeline
    from posttrain.sim.planner import plan_offload_fraction

    w = PipelineWorkload(forward_s=forward_s, input_grad_s=backward_s, weight_grad_s=0.0,
                         activation_bytes=saved_bytes, host_bandwidth=host_bytes_per_s)
    common = {"num_ranks": 1, "num_microbatches": microbatches, "workload": w, "min_lifespan": 0.0}
    full = simulate_pipeline("gpipe", offload_chunks=1, **common)
    none = simulate_pipeline("gpipe", offload_chunks=0, **common)
    pick = (plan_offload_fraction("gpipe", max_overhead=max_overhead, **common) if fraction is None
            else simulate_pipeline("gpipe", offload_chunks=1, offload_fraction=fraction, **common))
    return {"full_overhead": full.overhead, "full_peak_mb": max(full.peaks), "none_peak_mb": max(none.peaks),
            "fraction": None if pick is None else pick.offload_fraction,
            "overhead": None if pick is None else pick.overhead, "peak_mb": None if pick is None else max(pick.peaks)}


def _grads(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.grad.detach().clone() for t in tensors]


def _rel_diff(ref: torch.Tensor, other: torch.Tensor) -> float:
    """Largest elementwise difference over the largest magnitude of ``ref`` (0 when equal)."""
    diff = float((ref.float() - other.float()).abs().max())
    scale = float(ref.float().abs().max())
    return diff / scale if scale > 0 else diff


def _measure_one(device: torch.device, hidden: int, layers: int, tokens: int, microbatches: int,
                 dtype: torch.dtype, repeats: int, tol: float, fraction: float | None = None) -> dict:
    torch.manual_seed(0)
    stage, config = build_llama_stage(hidden, layers, tokens, device, dtype)
    params = list(stage.parameters())
    inputs = [torch.randn(1, tokens, hidden, device=device, dtype=dtype).requires_grad_() for _ in range(microbatches)]
    leaves = params + inputs  # a middle stage: input gradients too
    store = ActivationStore(params, device)
    order = offload_order(microbatches)
    clock = _Clock(device)

    # one microbatch alone: its forward, its backward, then its offload and its reload (also the
    # warm-up of kernels and the store's pinned buffers); what the planner's prediction is fed
    fwd, bwd, d2h, h2d = [], [], [], []
    for _ in range(repeats + 1):
        _zero_grads(leaves)
        store.reset_stats()
        clock.start()
        with store.hooks(0, 0):
            loss = _loss(stage(inputs[0]))
        fwd.append(clock.stop())
        clock.start()
        loss.backward()
        bwd.append(clock.stop())
        store.release(0, 0)
        with store.hooks(0, 0):
            loss = _loss(stage(inputs[0]))
        d2h.append(_wall(device, lambda: store.offload(0, 0)))
        store.poll()
        h2d.append(_wall(device, lambda: store.reload(0, 0)))
        loss.backward()
        store.release(0, 0)
    saved_bytes = next(iter(store.packed.values()), 0)
    _zero_grads(leaves)
    f_s, b_s = statistics.median(fwd[1:]), statistics.median(bwd[1:])
    fb_s, d2h_s, h2d_s = f_s + b_s, statistics.median(d2h[1:]), statistics.median(h2d[1:])
    # host-link bandwidth: bytes over the mean of the two directions' times
    host_bytes_per_s = 2 * saved_bytes / (d2h_s + h2d_s) if d2h_s + h2d_s > 0 else float("nan")
    plan = (predict_offload(microbatches, f_s, b_s, saved_bytes, host_bytes_per_s, fraction=fraction)
            if host_bytes_per_s > 0 else None)
    pick = fraction if plan is None else plan["fraction"]  # (the given share, or the planner's)
    # the variants: none, full, and (where it is neither) the planner's share
    fractions = [0.0, 1.0] + ([pick] if pick is not None and 0 < pick < 1 else [])

    # one step of each variant from zero gradients: parameter and input gradients compared
    grads = {}
    late_reloads = 0
    for fr in fractions:
        _zero_grads(leaves)
        store.reset_stats()
        _step(stage, inputs, store, order, fr)
        late_reloads += store.late_reloads
        grads[fr] = _grads(leaves)
    diff = max(_rel_diff(a, b) for fr in fractions[1:] for a, b in zip(grads[0.0], grads[fr]))
    del grads

    # the step, the variants taking turns (the order rotating each repeat)
    times: dict[float, list[float]] = {fr: [] for fr in fractions}
    peak: dict[float, int | None] = dict.fromkeys(fractions)
    base: dict[float, int | None] = dict.fromkeys(fractions)
    saved_peak = dict.fromkeys(fractions, 0)
    moved = dict.fromkeys(fractions, 0)
    for r in range(repeats):
        for fr in fractions[r % len(fractions):] + fractions[:r % len(fractions)]:
            _zero_grads(leaves)
            store.reset_stats()
            synchronize(device)
            reset_peak_memory(device)
            # right after a reset the peak is what is allocated now: parameters, gradients, inputs
            before = max_memory_allocated(device)
            clock.start()
            _step(stage, inputs, store, order, fr)
            times[fr].append(clock.stop())
            late_reloads += store.late_reloads
            saved_peak[fr] = max(saved_peak[fr], store.total_peak())
            moved[fr] = store.offloaded_bytes
            top = max_memory_allocated(device)
            if top is not None:
                peak[fr] = max(peak[fr] or 0, top)
                base[fr] = before if base[fr] is None else min(base[fr], before)

    shape = ModelShape.from_config(config)
    # achieved FLOP rate from the package's one FLOPs model (causal attention; input and weight
    # gradients both count: a middle stage computes both)
    flops = layers * (6.0 * shape.layer_params * tokens + 6.0 * hidden * tokens * tokens)
    flops_per_s = flops / fb_s if fb_s > 0 else float("nan")
    step = {fr: statistics.median(times[fr]) for fr in fractions}
    step_none, step_off = step[0.0], step[1.0]
    act = {fr: None if peak[fr] is None else peak[fr] - base[fr] for fr in fractions}
    itemsize = torch.empty((), dtype=dtype).element_size()
    sel = fractions[2] if len(fractions) > 2 else None
    selective = {
        "fraction": pick, "predicted_overhead_full": None if plan is None else plan["full_overhead"],
        "predicted_overhead_selective": None if plan is None else plan["overhead"],
        "predicted_peak_mb": None if plan is None else {"none": plan["none_peak_mb"], "full": plan["full_peak_mb"],
                                                        "selective": plan["peak_mb"]},
        "offloaded_bytes_full": moved[1.0],
        "step_s_selective": None if sel is None else step[sel],
        "overhead_selective": None if sel is None or step_none <= 0 else step[sel] / step_none - 1.0,
        "act_bytes_selective": None if sel is None else act[sel],
        "saved_peak_mb_selective": None if sel is None or not saved_bytes else saved_peak[sel] / saved_bytes,
        "offloaded_bytes_selective": None if sel is None else moved[sel],
    }
    return {**selective,
        "device": str(device), "dtype": str(dtype).removeprefix("torch."), "hidden": hidden, "layers": layers,
        "tokens": tokens, "microbatches": microbatches, "repeats": repeats,
        "step_s_none": step_none, "step_s_offload": step_off,
        "overhead": step_off / step_none - 1.0 if step_none > 0 else float("nan"),
        "base_bytes": base[0.0], "peak_bytes_none": peak[0.0], "peak_bytes_offload": peak[1.0],
        "act_bytes_none": act[0.0], "act_bytes_offload": act[1.0],
        "act_reduction": None if not act[0.0] else 1.0 - act[1.0] / act[0.0],
        "saved_bytes_per_mb": saved_bytes,
        "saved_per_token_layer_h": saved_bytes / (tokens * layers * hidden * itemsize),
        "saved_peak_mb_none": saved_peak[0.0] / saved_bytes if saved_bytes else 0.0,
        "saved_peak_mb_offload": saved_peak[1.0] / saved_bytes if saved_bytes else 0.0,
        "fb_s": fb_s, "f_s": f_s, "b_s": b_s, "d2h_s": d2h_s, "h2d_s": h2d_s,
        "d2h_gbps": saved_bytes / d2h_s / 1e9 if d2h_s > 0 else float("nan"),
        "h2d_gbps": saved_bytes / h2d_s / 1e9 if h2d_s > 0 else float("nan"),
        "tflops": flops_per_s / 1e12,
        "k_measured": (d2h_s + h2d_s) / fb_s if fb_s > 0 else float("nan"),
        "k_docs": docs_k(hidden, tokens, flops_per_s, host_bytes_per_s),
        "late_reloads": late_reloads, "grads_match": diff <= tol, "grad_max_rel_diff": diff,
    }


def measure_offload(device: torch.device | str, hidden: int = 4096, layers: int = 2,
                    tokens: Sequence[int] = (4096, 16384), microbatches: int = 4,
                    dtype: torch.dtype = torch.bfloat16, repeats: int = 3, *,
                    tol: float | None = None, fraction: float | None = None) -> list[dict]:
    """Full and selective activation offload on one Llama-style stage, one row per sequence length
    in ``tokens``.

    Each row: the step time without and with offload (median of ``repeats``, the variants
    alternating) and ``overhead`` (with / without - 1); peak bytes allocated without and with
    (``None`` on the CPU), ``base_bytes`` allocated before the forwards (parameters, gradients,
    inputs) and the activation part of the peak (peak - base) with its ``act_reduction``; the saved
    bytes of one microbatch (also per token and layer in units of ``hidden``: the docs assume 10)
    and the store's peak of resident saved activations in microbatches; one microbatch's forward
    and backward (``fb_s``), offload (``d2h_s``) and reload (``h2d_s``) seconds timed alone, the
    link bandwidths and achieved TFLOP/s they imply; ``k_measured`` = (D2H + H2D) / (F + B) and
    ``k_docs`` (:func:`docs_k` from those bandwidths and FLOP rate); ``late_reloads`` (0 when every
    reload was issued ahead) and ``grads_match``/``grad_max_rel_diff``: parameter and input
    gradients of one step with offload against one without, the largest difference over the
    largest gradient of each tensor (at most ``tol``: by default 0, bit-equal, on the CPU; on an
    accelerator, whose attention backward need not be deterministic, ``1e-2`` in half precision
    and ``1e-4`` in float32).
    The copies move bits, so a difference is the offload's fault only beyond that noise.

    Selective offload: from the one-microbatch times (``f_s``, ``b_s``, the copies) the simulator
    predicts full offload's cost on this order (``predicted_overhead_full``) and
    :func:`~posttrain.sim.planner.plan_offload_fraction` picks the largest share of each
    microbatch (``fraction``, a multiple of 0.05) predicted to cost at most 2%
    (``predicted_overhead_selective``; ``fraction`` given here overrides the pick). Where that share
    is below 1, a third variant runs at it: ``step_s_selective``, ``overhead_selective``,
    ``act_bytes_selective``, ``saved_peak_mb_selective`` and the bytes a step moves to host memory
    (``offloaded_bytes_selective`` beside ``offloaded_bytes_full``); ``predicted_peak_mb`` holds the
    simulator's resident peaks in microbatches. Otherwise those fields are ``None`` (full offload
    hides, or not even 5% does).
    """
    device = torch.device(device)
    if microbatches < 1 or repeats < 1 or layers < 1:
        raise ValueError(f"microbatches={microbatches}, repeats={repeats}, layers={layers} must be at least 1")
    if fraction is not None and not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction} must be in (0, 1]")
    if tol is None:  # the CPU's kernels are deterministic; a GPU's attention backward need not be
        tol = 0.0 if device.type == "cpu" else 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    rows = []
    for n in tokens:
        rows.append(_measure_one(device, hidden, layers, n, microbatches, dtype, repeats, tol, fraction))
        gc.collect()  # the last length's stage, store and pinned buffers go before the next is built
        synchronize(device)
    return rows


def _gib(b: int | None) -> str:
    return "n/a" if b is None else f"{b / 2**30:.2f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def format_offload(rows: Sequence[dict]) -> list[str]:
    """Markdown table lines of :func:`measure_offload`'s rows."""
    head = ["tokens", "step ms (none)", "step ms (offload)", "overhead", "k measured", "k docs",
            "F+B ms", "D2H / H2D ms", "D2H / H2D GB/s", "TFLOP/s", "saved GiB/mb (x h per token-layer)",
            "act. peak GiB (none / offload)", "act. reduction", "resident mb (none / offload)", "grads"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            str(r["tokens"]), f"{1e3 * r['step_s_none']:.1f}", f"{1e3 * r['step_s_offload']:.1f}", _pct(r["overhead"]),
            f"{r['k_measured']:.2f}", f"{r['k_docs']:.2f}", f"{1e3 * r['fb_s']:.1f}",
            f"{1e3 * r['d2h_s']:.1f} / {1e3 * r['h2d_s']:.1f}", f"{r['d2h_gbps']:.1f} / {r['h2d_gbps']:.1f}",
            f"{r['tflops']:.1f}",
            f"{_gib(r['saved_bytes_per_mb'])} ({r['saved_per_token_layer_h']:.1f}; docs {DOCS_SAVED_PER_H})",
            f"{_gib(r['act_bytes_none'])} / {_gib(r['act_bytes_offload'])}", _pct(r["act_reduction"]),
            f"{r['saved_peak_mb_none']:.2f} / {r['saved_peak_mb_offload']:.2f}",
            "equal" if r["grads_match"] else f"DIFFER ({r['grad_max_rel_diff']:.3g})",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def format_selective(rows: Sequence[dict]) -> list[str]:
    """Markdown table lines of :func:`measure_offload`'s selective-offload fields: the planner's
    share for the measured ``k``, predicted against measured cost, bytes moved a step and the
    resident peaks (the store's count, in microbatches, and the allocator's activation peak)."""
    head = ["tokens", "k measured", "planner's share", "cost full (predicted / measured)",
            "cost selective (predicted / measured)", "GiB to host a step (full / selective)",
            "resident mb peak none / full / selective (predicted)", "resident mb peak full / selective (store)",
            "act. peak GiB none / full / selective"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        sel = r["step_s_selective"] is not None
        pm = r["predicted_peak_mb"]
        cells = [
            str(r["tokens"]), f"{r['k_measured']:.2f}",
            "none hides" if r["fraction"] is None else f"{r['fraction']:.2f}",
            f"{_pct(r['predicted_overhead_full'])} / {_pct(r['overhead'])}",
            f"{_pct(r['predicted_overhead_selective'])} / {_pct(r['overhead_selective']) if sel else 'not run'}",
            f"{_gib(r['offloaded_bytes_full'])} / {_gib(r['offloaded_bytes_selective']) if sel else '-'}",
            "n/a" if pm is None else " / ".join("-" if pm[k] is None else f"{pm[k]:.2f}" for k in ("none", "full", "selective")),
            f"{r['saved_peak_mb_offload']:.2f} / " + (f"{r['saved_peak_mb_selective']:.2f}" if sel else "-"),
            f"{_gib(r['act_bytes_none'])} / {_gib(r['act_bytes_offload'])} / " + (_gib(r["act_bytes_selective"]) if sel else "-"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
