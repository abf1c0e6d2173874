"""``posttrain bench rl-e2e``: whole GRPO steps, end to end (the end-to-end mode of ``bench rl``).

``posttrain bench rl`` times the update phase alone on replayed rollouts. This one times what a
user waits for: every phase of a GRPO step (loading the policy's weights into the rollout copy,
sampling, rewards, the reference, the update, the metrics) by stopwatch (the rows' ``wall_s``),
with the phases beside it, for

- ``odc+diff_micro``, every prompt of a step in one batch with posttrain's own decoding loop
  (``generate_batch`` step, ``sampler`` posttrain: the defaults); the same batch through
  ``transformers``' ``generate`` (``sampler`` generate); one ``generate`` call per prompt (as
  posttrain sampled before batching); and ``fsdp+same_micro`` with the defaults: all on 2 CPU
  processes, as the README's RL command runs. The first three split the sampling's gain: the
  decoding loop (batched generate over batched), batching (per prompt over batched generate);
- TRL's ``GRPOTrainer`` (``trl`` installed; ``--no-trl`` leaves it out) on the same model, prompts,
  reward and sampling, matched to the run: 64 completions per optimizer step, one iteration (the
  update on-policy), the same clipping, token-mean loss, no KL term, learning rate and schedule,
  fp32, ``transformers``' ``generate``, no vLLM. It runs as one process with 2 threads (its
  ``accelerate`` launch across CPU processes is not set up here); the same process with 1 thread is
  timed too and the faster of the two counts as TRL's.

Settings: ``readme`` (the README's: the chat task's model post-trained as the README's SFT command
does, 8 prompts x 8 samples, 8 new tokens, temperature 1.5) and ``long`` (the chat task's untrained
model, which often runs to the limit: up to 256 new tokens, where the update and the balance weigh
more; it earns no reward, so posttrain trains the equal-reward groups there, as TRL always does,
instead of skipping them and updating nothing). Variants run as their own runs, interleaved over
``rounds`` with the order rotated; a run's figure is its median step after ``warmup`` steps; ratios
are medians of per-round ratios with their range.

What differs between the two per step, besides speed: posttrain leaves groups whose rewards are
all equal out of the update (``skip_equal_reward_groups``, on by default); TRL trains them with zero
advantage. TRL's update runs on the prompts and completions padded to the longest of the batch;
posttrain packs them, unpadded, into microbatches balanced over its ranks, and runs the LM head
on the response positions alone (TRL on the last ``max_completion_length`` positions of each
padded row). Both take the ratio's old log-probs from the update's own forward (one iteration:
on-policy) and sample left-padded batches with a KV cache: TRL with ``transformers``'
``generate``, which computes every row until the last one ends; posttrain by default with its own
loop, which drops rows that ended from the batch and its cache and applies no logits processor
but the temperature.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, replace

from posttrain.dp import EngineConfig
from posttrain.launch import run_ranks
from posttrain.train.core import OptimConfig
from posttrain.train.rl import RLConfig, run_rl

from .split import write_result

__all__ = ["SETTINGS", "VARIANTS", "RLE2EBench", "trl_worker"]

#: name -> (model: "sft" or "random", prompts a step, samples a prompt, new tokens, temperature, skip equal-reward
#: groups). The untrained model earns no reward at all: posttrain would skip every group and update nothing,
#: so the long setting trains them, as TRL does, to time the same work.
SETTINGS = {"readme": ("sft", 8, 8, 8, 1.5, True), "long": ("random", 8, 8, 256, 1.5, False)}
#: (engine, balancing method, generate_batch, sampler)
VARIANTS = (("odc", "diff_micro", "step", "posttrain"), ("odc", "diff_micro", "step", "generate"),
            ("odc", "diff_micro", "prompt", "generate"), ("fsdp", "same_micro", "step", "posttrain"))
#: The README's RL recipe.
OPTIM = OptimConfig(lr=1e-3, lr_schedule="cosine", warmup_steps=4, max_grad_norm=1.0)


def _name(variant: tuple[str, str, str, str]) -> str:
    dp, balance, batch, sampler = variant
    return f"{dp}+{balance} ({'batched' if batch == 'step' else 'per prompt'}{', generate' * (sampler == 'generate')})"


def _median_step(rows: list[dict], warmup: int) -> dict[str, float]:
    steady = rows[warmup:]
    med = {k: statistics.median(r[k] or 0.0 for r in steady) for k in ("wall_s", "rollout_s", "update_s", "reference_s")}
    med["other_s"] = max(0.0, med["wall_s"] - med["rollout_s"] - med["update_s"] - med["reference_s"])
    return med


def trl_worker(rank: int, world_size: int, model: str, prompts: str, setting: tuple, steps: int, threads: int,
               out_dir: str, warmup_steps: int = OPTIM.warmup_steps) -> list[float]:
    """TRL's GRPO on the run's model, prompts and reward (one process): each step's wall time (from
    one step's end to the next's, the first step's from the training's start)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():  # (TRL and accelerate run their own single process)
        dist.destroy_process_group()
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.rl import load_reward

    _, prompts_per_step, samples, new_tokens, temperature, _ = setting
    reward = load_reward("reverse_digits")
    records = []
    with open(prompts) as f:
        for line in f:
            msgs = json.loads(line)["messages"]
            records.append({"prompt": msgs[:-1] if msgs[-1]["role"] == "assistant" else msgs})

    def reverse_digits(prompts, completions, **kwargs):
        return [reward(p, c[0]["content"] if isinstance(c, list) else c) for p, c in zip(prompts, completions)]

    times: list[float] = []

    class Stopwatch(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            times.append(now - self.last)
            self.last = now

    cfg = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=prompts_per_step * samples, num_generations=samples,
        gradient_accumulation_steps=1, max_completion_length=new_tokens, temperature=temperature, top_p=1.0, top_k=0,
        learning_rate=OPTIM.lr, lr_scheduler_type="cosine", warmup_steps=warmup_steps,
        max_grad_norm=OPTIM.max_grad_norm, beta=0.0, num_iterations=1, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", max_steps=steps, logging_strategy="no", save_strategy="no", report_to="none", use_cpu=True,
        bf16=False, seed=0, disable_tqdm=True, log_completions=False, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reverse_digits, args=cfg, train_dataset=Dataset.from_list(records),
                          callbacks=[Stopwatch()])
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # (its end-of-training dict of metrics; the table is ours)
    trainer.train()
    return times


@dataclass(frozen=True)
class RLE2EBench:
    """``posttrain bench rl-e2e``: which settings, how many steps and rounds, and against whom.

    Attributes:
        settings: ``readme`` and/or ``long`` (see the module docstring).
        steps: GRPO steps a run.
        warmup: the first steps of a run not counted (the figure: the median of the rest).
        rounds: interleaved rounds.
        sft_steps: steps of the README's SFT run that makes the ``readme`` setting's model.
        no_trl: leave TRL out.
        trl_threads: the thread counts TRL's one process is timed with (the faster counts).
        work_dir: where the chat task's model and prompts are made ('' : a temporary folder).
        json: results file ('' for none).
    """

    settings: tuple[str, ...] = ("readme", "long")
    steps: int = 12
    warmup: int = 2
    rounds: int = 5
    sft_steps: int = 400
    no_trl: bool = False
    trl_threads: tuple[int, ...] = (2, 1)
    work_dir: str = ""
    json: str = "out/bench_rl_e2e.json"

    def __post_init__(self) -> None:
        bad = [s for s in self.settings if s not in SETTINGS]
        if bad or not self.settings:
            raise ValueError(f"settings={','.join(self.settings)}: choose from {', '.join(SETTINGS)}")
        if self.rounds < 1 or self.sft_steps < 1:
            raise ValueError(f"rounds={self.rounds} and sft_steps={self.sft_steps} must be at least 1")
        if not self.trl_threads or min(self.trl_threads) < 1:
            raise ValueError(f"trl_threads={self.trl_threads}: one or more thread counts of at least 1")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup={self.warmup} must be at least 0 and below steps={self.steps}")
        if not self.no_trl:
            try:
                import trl  # noqa: F401
            except ImportError:
                raise ValueError("the comparison with TRL needs trl: pip install trl==1.16.0 (or --no-trl)") from None

    def run(self, log=print) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            return self._run(self.work_dir or tmp, log)

    def _models(self, root: str, log) -> dict[str, str]:
        """The chat task's model directories: ``random`` as made, ``sft`` post-trained as the
        README's SFT command does (made once in ``root``)."""
        from posttrain.lab.chat import make_chat_task
        from posttrain.train.sft import TrainConfig, run_training

        paths = make_chat_task(os.path.join(root, "chat")) if not os.path.exists(os.path.join(root, "chat", "model")) \
            else {"model": os.path.join(root, "chat", "model"), "train": os.path.join(root, "chat", "train.jsonl"),
                  "eval": os.path.join(root, "chat", "eval.jsonl")}
        sft = os.path.join(root, "chat", "trained")
        if "readme" in self.settings and not os.path.exists(os.path.join(sft, "config.json")):
            log(f"post-training the chat task's model as the README does ({self.sft_steps} steps) ...", flush=True)
            run_training(TrainConfig(model_path=paths["model"], data=paths["train"], sequences=32, max_tokens=256,
                                     steps=self.sft_steps,
                                     optim=replace(OPTIM, lr=3e-3, warmup_steps=min(40, self.sft_steps // 10)),
                                     engine=EngineConfig(deterministic=True), output_dir=sft), world_size=2, quiet=True)
        return {"random": paths["model"], "sft": sft, "prompts": paths["train"]}

    def _run(self, root: str, log) -> dict:
        models = self._models(root, log)
        result: dict = {"settings": {}}
        for setting in self.settings:
            spec = SETTINGS[setting]
            kind, prompts_per_step, samples, new_tokens, temperature, skip = spec
            model = models[kind]
            log(f"\n{setting}: {prompts_per_step} prompts x {samples} samples a step, up to {new_tokens} new tokens, "
                f"temperature {temperature}, the chat task's {'post-trained' if kind == 'sft' else 'untrained'} model; "
                f"{self.steps} steps a run (median of the last {self.steps - self.warmup}), {self.rounds} rounds",
                flush=True)
            names = [_name(v) for v in VARIANTS] + ([] if self.no_trl else ["trl (1 process)"])
            rounds: list[dict] = []
            for k in range(self.rounds):
                got: dict[str, dict] = {}
                jobs = [*VARIANTS, None] if not self.no_trl else list(VARIANTS)
                for job in jobs[k % len(jobs):] + jobs[:k % len(jobs)]:
                    if job is None:
                        best = None
                        for threads in self.trl_threads:
                            times = run_ranks(trl_worker, 1, model, models["prompts"], spec, self.steps, threads,
                                              os.path.join(root, "trl"), min(OPTIM.warmup_steps, self.steps // 2),
                                              timeout_s=3600)[0]
                            wall = statistics.median(times[self.warmup:])
                            if best is None or wall < best["wall_s"]:
                                best = {"wall_s": wall, "threads": threads}
                        got["trl (1 process)"] = best
                        log(f"  round {k + 1}/{self.rounds}  {'trl (1 process)':36} {best['wall_s']:.3f} s a step "
                            f"({best['threads']} threads)", flush=True)
                        continue
                    dp, balance, batch, sampler = job
                    cfg = RLConfig(model_path=model, prompts=models["prompts"], samples_per_prompt=samples,
                                   prompts_per_step=prompts_per_step, max_new_tokens=new_tokens, steps=self.steps,
                                   temperature=temperature, engine=EngineConfig(dp), balance=balance,
                                   optim=replace(OPTIM, warmup_steps=min(OPTIM.warmup_steps, self.steps // 2)),
                                   generate_batch=batch, sampler=sampler, skip_equal_reward_groups=skip,
                                   progress=False)
                    rows = run_rl(cfg, world_size=2, quiet=True)[0]["metrics"]
                    got[_name(job)] = _median_step(rows, self.warmup)
                    log(f"  round {k + 1}/{self.rounds}  {_name(job):36} {got[_name(job)]['wall_s']:.3f} s a step",
                        flush=True)
                rounds.append(got)
            result["settings"][setting] = self._report(setting, names, rounds, log)
        write_result(result, self.json or None, log)
        return result

    def _report(self, setting: str, names: list[str], rounds: list[dict], log) -> dict:
        ref = names[0]
        med = {n: statistics.median(r[n]["wall_s"] for r in rounds) for n in names}
        vs = {n: [r[ref]["wall_s"] and r[n]["wall_s"] / r[ref]["wall_s"] for r in rounds] for n in names}
        log(f"\n{setting}: seconds a whole GRPO step (median of {len(rounds)} rounds), and {ref}'s step rate over each's")
        log(f"  {'':36} {'step s':>7} {'rollout':>8} {'reference':>10} {'update':>7} {'other':>6} {'rate of ' + ref[:4]:>12} "
            f"{'(rounds)':>11}")
        out: dict = {"step_s": med, "rate_over": {}, "phases": {}}
        for n in names:
            ratio = statistics.median(vs[n])
            out["rate_over"][n] = [ratio, min(vs[n]), max(vs[n])]
            if "rollout_s" in rounds[0][n]:
                ph = {k: statistics.median(r[n][k] for r in rounds) for k in ("rollout_s", "reference_s", "update_s",
                                                                                   "other_s")}
                out["phases"][n] = ph
                phases = (f"{ph['rollout_s']:8.3f} {ph['reference_s']:10.3f} {ph['update_s']:7.3f} "
                          f"{ph['other_s']:6.3f}")
            else:
                phases = f"{'':8} {'':10} {'':7} {'':6}"
            log(f"  {n:36} {med[n]:7.3f} {phases} {ratio:11.2f}x {min(vs[n]):5.2f}-{max(vs[n]):<5.2f}")
        log("  (rate of odc: a step of that variant over odc+diff_micro (batched)'s, per round; above 1: posttrain is "
            "faster; phases are medians of posttrain's own rows: rollout includes loading the weights into the "
            "rollout copy and the rewards)")
        return out
