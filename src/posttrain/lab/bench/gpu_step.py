"""Flat ODC's engine overhead on a GPU: a Llama training step, two ODC ranks on one GPU against
the same model unsharded in one process.

    python -m posttrain.lab.bench.gpu_step        # ~110M-parameter Llama, bf16, 8 x 2048 tokens a step
    (posttrain doctor runs it and puts the result in its report)

Both variants do the same work per step: ``microbatches`` sequences of ``seq_len`` tokens,
forward and backward in bf16 with fp32 gradients summed into fp32 master weights that AdamW
steps. ``single``: one process holds the whole model twice (fp32 master, bf16 working copy that
it refreshes after each step). ``odc``: flat ODC over 2 processes (gloo group, device transport),
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, each rank half the microbatches.
On one GPU the two ranks' kernels time-share the device, so the total compute equals the single
process's and the ratio odc / single is what the engine adds: gathers, pushes, the minibatch
barriers, and the switching between the two processes' work. Step times are medians of
``steps`` timed steps after ``warmup``, the slower rank's for ODC; the variants alternate over
``rounds`` (each a fresh set of processes).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from posttrain.launch import run_ranks

__all__ = ["LLAMA_100M", "bench_gpu_step"]

#: About 110M parameters: 12 blocks of hidden 768, vocabulary 16384, untied head.
LLAMA_100M = {"vocab_size": 16384, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 12, "max_position_embeddings": 4096,
              "tie_word_embeddings": False}


def _model(cfg: dict, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation="sdpa")).to(device)


def _batch(step: int, i: int, seq_len: int, vocab: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + i)
    return torch.randint(0, vocab, (1, seq_len + 1), generator=g).to(device)


def _loss(model, seq: torch.Tensor) -> torch.Tensor:
    logits = model(seq[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), seq[:, 1:].flatten(), reduction="sum")


def _worker(rank: int, world_size: int, cfg: dict, microbatches: int, seq_len: int, steps: int, warmup: int,
            kind: str) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import posttrain.odc as odc_mod
    from posttrain import device

    dev = device.rank_device(kind, 0)  # both ranks on one GPU (the device transport's setting)
    device.use(dev)
    model = _model(cfg, dev)
    total_tokens = microbatches * seq_len
    mine = range(rank, microbatches, world_size)
    if world_size == 1:
        master = [p for p in model.parameters()]
        work = _model(cfg, dev).to(torch.bfloat16)
        for p in work.parameters():
            p.requires_grad_(True)
        opt = torch.optim.AdamW(master, lr=1e-4)
    else:
        model = odc_mod.flat_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                          reduce_dtype=torch.float32))
        opt = torch.optim.AdamW(model.odc.parameters(), lr=1e-4)
    times, losses = [], []
    for step in range(warmup + steps):
        device.synchronize(dev)
        if world_size > 1:
            dist.barrier()
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=dev)
        if world_size == 1:
            with torch.no_grad():
                for w, m in zip(work.parameters(), master):
                    w.copy_(m)
            for i in mine:
                loss = _loss(work, _batch(step, i, seq_len, cfg["vocab_size"], dev)) / total_tokens
                loss.backward()
                loss_sum += loss.detach()
            for w, m in zip(work.parameters(), master):
                m.grad = w.grad.float()
                w.grad = None
        else:
            with model.minibatch():
                for i in mine:
                    loss = _loss(model, _batch(step, i, seq_len, cfg["vocab_size"], dev)) / total_tokens
                    loss.backward()
                    loss_sum += loss.detach()
        opt.step()
        opt.zero_grad()
        device.synchronize(dev)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss_sum))
    med = torch.tensor([statistics.median(times)], dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        part = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(part)
        losses = part.tolist()
        model.odc.close(restore=False)
    params = sum(p.numel() for p in _model(cfg, torch.device("meta")).parameters())
    peak = device.max_memory_allocated(dev)
    return {"step_s": float(med.item()), "losses": losses, "params": params,
            "peak_gib": None if peak is None else peak / 2**30}


def bench_gpu_step(cfg: dict | None = None, *, microbatches: int = 8, seq_len: int = 2048, steps: int = 5,
                   warmup: int = 2, rounds: int = 2, kind: str = "cuda", log=print) -> dict:
    """Alternate ``single`` and ``odc`` over ``rounds``; log and return the step times, the
    ratio's median and range, and both variants' losses (they follow the same curve).
    ``kind="cpu"`` runs the same code on CPU processes (a check of the code, not a measurement)."""
    cfg = cfg or LLAMA_100M
    runs: dict[str, list[dict]] = {"single": [], "odc": []}
    for _ in range(rounds):
        for name, world in (("single", 1), ("odc", 2)):
            runs[name].append(run_ranks(_worker, world, cfg, microbatches, seq_len, steps, warmup, kind,
                                        start="spawn" if kind != "cpu" else None, timeout_s=600)[0])
    ratios = [o["step_s"] / s["step_s"] for s, o in zip(runs["single"], runs["odc"])]
    out = {"params": runs["single"][0]["params"], "microbatches": microbatches, "seq_len": seq_len,
           "single_s": [r["step_s"] for r in runs["single"]], "odc_s": [r["step_s"] for r in runs["odc"]],
           "ratio": statistics.median(ratios), "ratio_range": (min(ratios), max(ratios)),
           "single_losses": runs["single"][0]["losses"], "odc_losses": runs["odc"][0]["losses"],
           "single_peak_gib": runs["single"][0]["peak_gib"], "odc_peak_gib": runs["odc"][0]["peak_gib"]}
    log(f"Llama {out['params'] / 1e6:.0f}M bf16, {microbatches} x {seq_len} tokens a step: single "
        f"{statistics.median(out['single_s']) * 1e3:.1f} ms, flat ODC on 2 processes "
        f"{statistics.median(out['odc_s']) * 1e3:.1f} ms; odc/single {out['ratio']:.2f} "
        f"({out['ratio_range'][0]:.2f}-{out['ratio_range'][1]:.2f} over {rounds} rounds)")
    log(f"losses single {' '.join(f'{x:.4f}' for x in out['single_losses'])}")
    log(f"losses odc    {' '.join(f'{x:.4f}' for x in out['odc_losses'])}")
    return out


if __name__ == "__main__":
    bench_gpu_step()
