"""posttrain's SFT against TRL's ``SFTTrainer`` on one GPU: the same model, records, order and update.

    python -m posttrain.lab.bench.trl_sft compare --dir /tmp/trl_sft        # ~1.1B Llama on CUDA
    python -m posttrain.lab.bench.trl_sft compare --dir /tmp/t --preset tiny --device cpu --steps 4 --rounds 1
                                                                            # the plumbing, on the CPU

``compare`` prepares, once, under ``--dir``: a randomly initialized Llama-architecture model
(``1b``: TinyLlama-1.1B's shape, 22 blocks of hidden 2048, 32 query and 4 key-value heads,
vocabulary 32000, untied head: 1.10B parameters; ``tiny`` for the CPU) saved with
``save_pretrained`` in fp32, a word-level tokenizer over the same ids (TRL needs one for its pad
token), and ``--records`` pre-tokenized records (``input_ids`` and ``labels``, ``-100`` on the
prompt: the first 30% of each record, as a chat's user turn) whose lengths follow posttrain's
``long_tail`` profile up to ``--max-len`` (4096). Both trainers read that file and train the same
records in the same order: posttrain's own seeded order (:meth:`TrainData.record_ids`), which TRL
is given through a sequential sampler.

Each variant runs as its own process for ``--steps`` optimizer steps of ``--sequences`` records:

- ``trl``: ``SFTTrainer`` on the pre-tokenized records (``skip_prepare_dataset``), bf16 autocast
  over fp32 weights, AdamW (transformers' default, fused), a constant learning rate, the loss over
  the step's trained tokens (transformers' ``num_items_in_batch``), and what TRL adds by itself:
  its log-probabilities through a chunked LM head that also yields the entropy and token accuracy
  it logs each step. It runs ``--trl-batch`` records a forward (1: no padding; more: padded to the
  batch's longest) and accumulates ``sequences / trl-batch`` of them; a variant ``trl:N`` runs N
  records a forward, padded, beside it.
- ``trl-pf:N``: TRL's padding-free mode (``padding_free=True``), N records a forward concatenated
  into one row with position ids restarting at each record, as TRL's docs advise to avoid
  padding. Its docs pair it with flash attention's varlen kernels, which the GPU image lacks;
  with ``sdpa`` transformers builds a block-diagonal mask from the position ids (no attention
  across records: the losses show it), so the attention runs as a masked kernel over the whole
  row. TRL's packing (``packing=True``) is not run: it regroups records into fixed-length rows, so
  a step would no longer hold the same records as posttrain's.
- ``odc`` / ``fsdp``: ``posttrain train`` at world size 1, bf16 (fp32 master weights and
  gradients), the records packed into microbatches of at most ``--max-tokens`` tokens (4096) with
  varlen attention between packed sequences (no padding).

``--checkpointing on|off`` (default off) sets activation checkpointing in both: TRL's ``SFTConfig``
turns it on unless told otherwise, posttrain leaves it off unless asked. ``--profile FILE`` writes
torch's profile of one TRL step (operators by self time), to find where its step goes: the last
warm-up step of the first round, so that the profiler's own cost stays out of the timed steps.

Times are by stopwatch: a step lasts from the end of the one before (data, logging, everything) to
its own end after a device synchronization; tokens/s count the records' tokens (no padding) over
the steps after ``--warmup``, per round; the variants alternate over ``--rounds`` rounds (order
rotated each round) and the medians with their ranges are reported; a variant against TRL is the
median of its per-round ratios, with their range. MFU is the model's FLOPs
(posttrain's FLOPs model: 6 x parameters x tokens plus causal attention) over the time and a
stated peak (``--peak-tflops``, default 989: an H100 SXM's dense bf16) and over an 8192^3 bf16
matrix product measured on the same device. Peak memory: the largest ``max_memory_allocated`` of a
step. The first ``--steps`` losses of both go side by side (the same records and update).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

__all__ = ["PRESETS", "compare", "prepare"]

#: Model shapes (``transformers.LlamaConfig`` fields).
PRESETS = {
    "1b": {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
           "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 4096,
           "tie_word_embeddings": False},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
             "tie_word_embeddings": False},
}
PROMPT_SHARE = 0.3
VARIANTS = ("trl", "odc", "fsdp")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prepare(directory: str, preset: str, records: int, max_len: int, seed: int = 0, device: str = "cpu") -> None:
    """The model (initialized on ``device``), tokenizer and records under ``directory`` (kept if
    already there)."""
    import random

    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from posttrain.data.synthetic import profile_lengths

    model_dir = os.path.join(directory, "model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        _log(f"preparing a random {preset} Llama in {model_dir}")
        torch.manual_seed(seed)
        config = LlamaConfig(**PRESETS[preset])
        with torch.device(device):
            model = LlamaForCausalLM(config)
        model.save_pretrained(model_dir)
        vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, config.vocab_size)}}
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                      pad_token="<pad>", eos_token="<eos>")
        tok.save_pretrained(model_dir)
        del model
    data = os.path.join(directory, "train.jsonl")
    if not os.path.exists(data):
        vocab_size = PRESETS[preset]["vocab_size"]
        rng = random.Random(seed)
        with open(data + ".tmp", "w") as f:
            for n in profile_lengths("long_tail", records, max_len=max_len, seed=seed):
                ids = [rng.randrange(2, vocab_size) for _ in range(n)]
                prompt = max(1, int(PROMPT_SHARE * n))
                f.write(json.dumps({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]}) + "\n")
        os.replace(data + ".tmp", data)


def _order(directory: str, sequences: int, steps: int, max_tokens: int) -> list[list[int]]:
    """posttrain's records of each step (its seeded order), read off its own data loader."""
    from posttrain.train.sft import TrainConfig, TrainData

    cfg = TrainConfig(data=os.path.join(directory, "train.jsonl"), model_path=os.path.join(directory, "model"),
                      sequences=sequences, max_tokens=max_tokens, max_len=max_tokens, steps=steps)
    data = TrainData(cfg, 1)
    return [data.record_ids(s) for s in range(steps)]


def _records(directory: str) -> list[dict]:
    with open(os.path.join(directory, "train.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_trl(directory: str, order: list[list[int]], out: str, *, lr: float, batch: int, device: str,
            checkpointing: bool, profile: str | None = None, profile_step: int = -1,
            padding_free: bool = False) -> None:
    """One TRL run (in its own process): per-step stopwatch times, losses, peak memory; with
    ``profile``, torch's profiler over step ``profile_step`` (-1: the last), its operators by self device time (CPU time
    without a GPU) written there."""
    import torch
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from posttrain.device import max_memory_allocated, reset_peak_memory, synchronize

    sequences = len(order[0])
    if sequences % batch:
        raise ValueError(f"--trl-batch {batch} must divide --sequences {sequences}")
    records = _records(directory)
    flat = [records[i] for step in order for i in step]
    dataset = Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in flat])
    model_dir = os.path.join(directory, "model")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    cuda = device == "cuda"
    dev = torch.device(device, 0) if cuda else torch.device("cpu")
    times, losses, peaks = [], [], []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            synchronize(dev)
            reset_peak_memory(dev)
            self.last = time.perf_counter()

        def on_step_begin(self, args, state, control, **kw):
            if profile and state.global_step == profile_step % len(order):
                self.prof = torch.profiler.profile(record_shapes=False)
                self.prof.__enter__()

        def on_step_end(self, args, state, control, **kw):
            synchronize(dev)
            if getattr(self, "prof", None) is not None:
                self.prof.__exit__(None, None, None)
                key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
                with open(profile, "w") as f:
                    f.write(self.prof.key_averages().table(sort_by=key, row_limit=40))
                self.prof = None
            peak = max_memory_allocated(dev)
            peaks.append(None if peak is None else peak / 2**30)
            reset_peak_memory(dev)
            now = time.perf_counter()
            times.append(now - self.last)
            self.last = now

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    class InOrder(SFTTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    args = SFTConfig(
        output_dir=os.path.join(directory, "trl_out"), per_device_train_batch_size=batch,
        gradient_accumulation_steps=sequences // batch, max_steps=len(order), learning_rate=lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        bf16=cuda, use_cpu=not cuda, logging_steps=1, save_strategy="no", report_to="none", seed=0,
        max_length=None, packing=False, padding_free=padding_free, dataset_kwargs={"skip_prepare_dataset": True},
        disable_tqdm=True, dataloader_drop_last=False, gradient_checkpointing=checkpointing,
    )
    trainer = InOrder(model=model, args=args, train_dataset=dataset,
                      processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Clock()])
    trainer.train()
    with open(out, "w") as f:
        json.dump({"step_s": times, "losses": losses, "peak_memory_gib": peaks}, f)


def _run(cmd: list[str], timeout: float) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def _variant(name: str, a, order_file: str, out: str) -> dict:
    d = a.dir
    if name == "trl" or name.startswith(("trl:", "trl-pf:")):  # N records a forward: padded / padding-free
        batch = int(name.split(":")[1]) if ":" in name else a.trl_batch
        _run([sys.executable, "-m", "posttrain.lab.bench.trl_sft", "trl", "--dir", d, "--order", order_file,
              "--out", out, "--lr", str(a.lr), "--trl-batch", str(batch), "--device", a.device,
              "--checkpointing", a.checkpointing] + (["--padding-free"] if name.startswith("trl-pf:") else [])
             + (["--profile", a.profile, "--profile-step", str(a.warmup - 1 if a.warmup else -1)]
                if a.profile and name == "trl" and out.endswith("_r0.json") else []), a.timeout)
        with open(out) as f:
            return json.load(f)
    metrics = out + ".jsonl"
    if os.path.exists(metrics):
        os.remove(metrics)
    _run([sys.executable, "-m", "posttrain", "train", "--data", os.path.join(d, "train.jsonl"),
          "--model-path", os.path.join(d, "model"), "--dp", name, "--world-size", "1", "--device", a.device,
          "--precision", "bf16" if a.device == "cuda" else "fp32", "--sequences", str(a.sequences),
          "--max-tokens", str(a.max_tokens), "--steps", str(a.steps), "--lr", str(a.lr), "--max-grad-norm", "1.0",
          "--balance", "diff_micro", "--metrics", metrics, "--seed", "0"]
         + (["--activation-checkpointing"] if a.checkpointing == "on" else []), a.timeout)
    with open(metrics) as f:
        rows = [r for r in map(json.loads, f) if "step" in r and r.get("rank", 0) == 0]
    return {"step_s": [r["wall_s"] for r in rows], "losses": [r["loss"] for r in rows],
            "peak_memory_gib": [r.get("peak_memory_gib") for r in rows]}


def _matmul_tflops(device: str) -> float | None:
    if device != "cuda":
        return None
    import torch

    from posttrain.device import matmul_tflops

    return matmul_tflops(torch.device("cuda", 0), torch.bfloat16, n=8192, repeats=10)


def compare(a) -> dict:
    from transformers import AutoConfig

    from posttrain.balance.cost import FlopsCost

    prepare(a.dir, a.preset, a.records, a.max_len, device=a.device)
    order = _order(a.dir, a.sequences, a.steps, a.max_tokens)
    order_file = os.path.join(a.dir, "order.json")
    with open(order_file, "w") as f:
        json.dump(order, f)
    records = _records(a.dir)
    tokens = [sum(len(records[i]["input_ids"]) for i in step) for step in order]
    cost = FlopsCost.from_config(AutoConfig.from_pretrained(os.path.join(a.dir, "model")))
    flops = [sum(cost(len(records[i]["input_ids"]) - 1) for i in step) for step in order]
    variants = [v for v in a.variants.split(",") if v]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    failed: dict[str, str] = {}
    for r in range(a.rounds):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            if v in failed:
                continue
            t0 = time.perf_counter()
            try:
                runs[v].append(_variant(v, a, order_file, os.path.join(a.dir, f"{v}_r{r}.json")))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the others go on; reported below
                failed[v] = str(exc)
                _log(f"round {r + 1}/{a.rounds}  {v:5s}  FAILED:\n{exc}")
                continue
            run = runs[v][-1]  # (logged as it comes: a run cut short keeps what it measured)
            _log(f"round {r + 1}/{a.rounds}  {v:5s}  {time.perf_counter() - t0:6.1f} s  step_s "
                 + " ".join(f"{x:.3f}" for x in run["step_s"]) + "  losses "
                 + " ".join(f"{x:.4f}" for x in run["losses"]) + "  peak GiB "
                 + " ".join("-" if x is None else f"{x:.1f}" for x in run["peak_memory_gib"]))
    variants = [v for v in variants if v not in failed]
    measured = _matmul_tflops(a.device)
    timed = range(a.warmup, a.steps)
    result = {"preset": a.preset, "checkpointing": a.checkpointing,
              "sequences": a.sequences, "steps": a.steps, "warmup": a.warmup, "rounds": a.rounds,
              "tokens_per_step": statistics.mean(tokens[s] for s in timed), "peak_tflops": a.peak_tflops,
              "matmul_tflops": measured, "variants": {}, "failed": failed}
    secs = {v: [sum(run["step_s"][s] for s in timed) for run in runs[v]] for v in variants}
    base = baseline(variants)
    result["baseline"] = base
    for v in variants:
        rates = [sum(tokens[s] for s in timed) / t for t in secs[v]]
        # against TRL round by round (the rounds interleave the variants): median and range
        vs = [b / t for t, b in zip(secs[v], secs[base])] if base else []
        peaks = [p for run in runs[v] for p in run["peak_memory_gib"][a.warmup:] if p is not None]
        result["variants"][v] = {
            "tokens_per_s": statistics.median(rates), "range": [min(rates), max(rates)],
            "vs_trl": [statistics.median(vs), min(vs), max(vs)] if vs else None,
            "tflops": statistics.median(sum(flops[s] for s in timed) / t / 1e12 for t in secs[v]),
            "peak_memory_gib": max(peaks) if peaks else None, "losses": runs[v][0]["losses"]}
    return result


def baseline(variants: list[str]) -> str | None:
    """The TRL variant the others are set against: ``trl`` where it ran, else the first TRL variant
    listed (``trl:N`` or ``trl-pf:N``), else none."""
    trl = [v for v in variants if v == "trl" or v.startswith(("trl:", "trl-pf:"))]
    return "trl" if "trl" in trl else (trl[0] if trl else None)


def report(res: dict) -> str:
    name = baseline(list(res["variants"]))
    base = res["variants"].get(name) if name else None
    lines = [f"{res['preset']} Llama, {res['sequences']} records a step ({res['tokens_per_step']:.0f} tokens), "
             f"{res['steps']} steps ({res['warmup']} warm-up), {res['rounds']} rounds, activation checkpointing "
             f"{res['checkpointing']} in both; bf16 matmul measured "
             + (f"{res['matmul_tflops']:.0f} TFLOP/s" if res["matmul_tflops"] else "n/a"), "",
             f"| variant | tokens/s (median) | range | vs {name or 'TRL'} (rounds) | TFLOP/s | MFU (stated peak) "
             "| MFU (measured matmul) | peak GiB |", "|---|---|---|---|---|---|---|---|"]
    for v, r in res["variants"].items():
        vs = "n/a" if r["vs_trl"] is None else "{:.2f}x ({:.2f}-{:.2f})".format(*r["vs_trl"])
        mm = f"{r['tflops'] / res['matmul_tflops']:.1%}" if res["matmul_tflops"] else "n/a"
        mem = "n/a" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.1f}"
        lines.append(f"| {v} | {r['tokens_per_s']:.0f} | {r['range'][0]:.0f}-{r['range'][1]:.0f} | {vs} | "
                     f"{r['tflops']:.1f} | {r['tflops'] / res['peak_tflops']:.1%} | {mm} | {mem} |")
    names = list(res["variants"])
    lines += ["", "| step | " + " | ".join(f"{v} loss" for v in names) + " |", "|---|" + "---|" * len(names)]
    for s in range(res["steps"]):
        lines.append(f"| {s} | " + " | ".join(
            f"{res['variants'][v]['losses'][s]:.4f}" if s < len(res["variants"][v]["losses"]) else "-"
            for v in names) + " |")
    for v, err in res["failed"].items():
        lines.append(f"{v}: FAILED ({err.splitlines()[0] if err else 'no output'}; the whole error is in the JSON)")
    if base:
        for v in names:
            if v != name:
                d = max(abs(x - y) / abs(y) for x, y in zip(res["variants"][v]["losses"], base["losses"]))
                lines.append(f"{v}: largest relative difference of a loss from {name}'s: {d:.2e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m posttrain.lab.bench.trl_sft", description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("compare", "trl"))
    p.add_argument("--dir", required=True)
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--records", type=int, default=256)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--trl-batch", type=int, default=1)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--checkpointing", choices=("off", "on"), default="off",
                   help="activation checkpointing in both (TRL's SFTConfig defaults to on, posttrain to off)")
    p.add_argument("--profile", help="write a profile of one TRL step (operators by self time) to this file")
    p.add_argument("--profile-step", type=int, default=-1, help="(trl) the step to profile (-1: the last)")
    p.add_argument("--padding-free", action="store_true", help="(trl) TRL's padding-free mode")
    p.add_argument("--order")
    p.add_argument("--out")
    a = p.parse_args(argv)
    if a.what == "trl":
        with open(a.order) as f:
            run_trl(a.dir, json.load(f), a.out, lr=a.lr, batch=a.trl_batch, device=a.device,
                    checkpointing=a.checkpointing == "on", profile=a.profile,
                    profile_step=a.profile_step, padding_free=a.padding_free)
        return 0
    if not 0 <= a.warmup < a.steps:
        p.error(f"--warmup {a.warmup} must be below --steps {a.steps}")
    res = compare(a)
    text = report(res)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
