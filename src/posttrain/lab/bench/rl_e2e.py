"""``posttrain bench rl-e2e``: whole GRPO steps, end to end (the end-to-end mode of ``bench rl``).

``posttrain bench rl`` times the update phase alone on replayed rollouts. This one times what a
user waits for: every phase of a GRPO step (loading the policy's weights into the rollout copy,
sampling, rewards, the reference, the update) by stopwatch (the rows' ``wall_s``),
with the phases beside it, for

- ``odc+diff_micro``, every prompt of a step in one batch with posttrain's own decoding loop
  (``generate_batch`` step, ``sampler`` posttrain: the defaults); the same batch through
  ``transformers``' ``generate`` (``sampler`` generate); one ``generate`` call per prompt (as
  posttrain sampled before batching); and ``fsdp+same_micro`` with the defaults: all on 2 CPU
  processes, as the README's RL command runs. The first three split the sampling's gain: the
  decoding loop (batched generate over batched), batching (per prompt over batched generate).
  Where the setting skips groups whose samples all earned the same reward (posttrain's default),
  ``odc+diff_micro`` once more training every group, as TRL does: what skipping gains;
- TRL's ``GRPOTrainer`` (``trl`` installed; ``--no-trl`` leaves it out) on the same model, prompts,
  reward and sampling, matched to the run: 64 completions per optimizer step, one iteration (the
  update on-policy), the same clipping, token-mean loss, no KL term, learning rate and schedule,
  fp32, ``transformers``' ``generate``, no vLLM. It runs as ``accelerate`` launches it on CPUs:
  by default as one process with 2 threads and as 2 data-parallel processes over gloo with 1 thread
  each (32 completions each); the faster of the two counts as TRL's.

Settings: ``readme`` (the README's: the chat task's model post-trained as the README's SFT command
does, 8 prompts x 8 samples, 8 new tokens, temperature 1.5) and ``long`` (the chat task's untrained
model, which often runs to the limit: up to 256 new tokens, where the update and the balance weigh
more; it earns no reward, so posttrain trains the equal-reward groups there, as TRL always does,
instead of skipping them and updating nothing).

How it times: as the demo does (:mod:`.stepwise`). Timing each variant as its own run put the
machine's moods between them: TRL's own step moved by a quarter between two days, and per-round
ratios of whole runs scattered over 0.99-1.71. So every variant lives for the whole setting in
long-lived processes (posttrain's in the same 2 rank processes, each TRL launch in its own,
told by rank 0 through a pipe when to run its next step) and they take turns a step at a time, in
an order drawn afresh at every step (so that no variant always follows the same one), after
``warmup`` steps of each that are not counted; only one variant runs at any moment, and TRL's
start-up and end of training run outside the timed steps. A variant's figure is its mean step
over every counted step; a ratio is the two variants' summed seconds, with the 5th-95th
percentile of the same ratio over the rounds drawn with replacement, and the rounds' own range
beside it. posttrain's stopwatch runs from a step's start to its update's end (its row's
figures after it); TRL's from the message that starts the step to its ``on_step_end``.

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
import random
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass, replace

import torch.distributed as dist

from posttrain.dp import EngineConfig
from posttrain.launch import run_ranks
from posttrain.train.core import OptimConfig
from posttrain.train.rl import RLConfig

from .split import write_result
from .stepwise import bootstrap_rate_ratio

__all__ = ["SETTINGS", "VARIANTS", "RLE2EBench", "TRLTurns", "turns_worker"]

#: name -> (model: "sft" or "random", prompts a step, samples a prompt, new tokens, temperature, skip equal-reward
#: groups). The untrained model earns no reward at all: posttrain would skip every group and update nothing,
#: so the long setting trains them, as TRL does, to time the same work.
SETTINGS = {"readme": ("sft", 8, 8, 8, 1.5, True), "long": ("random", 8, 8, 256, 1.5, False)}
#: (engine, balancing method, generate_batch, sampler, train every group): the last one only where the
#: setting skips equal-reward groups (it splits off what skipping them gains: TRL trains every group)
VARIANTS = (("odc", "diff_micro", "step", "posttrain", False), ("odc", "diff_micro", "step", "generate", False),
            ("odc", "diff_micro", "prompt", "generate", False), ("fsdp", "same_micro", "step", "posttrain", False),
            ("odc", "diff_micro", "step", "posttrain", True))
#: The README's RL recipe.
OPTIM = OptimConfig(lr=1e-3, lr_schedule="cosine", warmup_steps=4, max_grad_norm=1.0)
#: How long rank 0 waits for one TRL step before calling its process stuck.
TRL_STEP_LIMIT_S = 900.0
#: The posttrain side's ends of every TRL process's pipes made in this process (a TRL process forked
#: later closes them too, or the end of a pipe it inherited would never show)
_OURS: list = []


def _name(variant: tuple[str, str, str, str, bool]) -> str:
    dp, balance, batch, sampler, every = variant
    return (f"{dp}+{balance} ({'batched' if batch == 'step' else 'per prompt'}{', generate' * (sampler == 'generate')}"
            f"{', every group' * every})")


def _trl_name(processes: int, threads: int) -> str:
    each = " each" if processes > 1 else ""
    return f"trl ({processes} process{'es' * (processes > 1)}, {threads} thread{'s' * (threads != 1)}{each})"


def parse_launch(text: str) -> tuple[int, int]:
    """``"PxT"`` (TRL's processes and threads per process) as ``(P, T)``."""
    try:
        p, t = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"trl={text}: each launch is PROCESSESxTHREADS, e.g. 2x1") from None
    if p < 1 or t < 1:
        raise ValueError(f"trl={text}: processes and threads must be at least 1")
    return p, t


class TRLTurns:
    """TRL's ``GRPOTrainer`` in processes of its own (``processes`` of them, data parallel over
    gloo as ``accelerate`` launches it on CPUs, each with ``threads`` threads) that run one step each
    time they are told to.

    Made in the bench's parent before the posttrain ranks are forked: the ranks inherit the ends
    that tell (``go``) and hear (``done``); the TRL processes keep the other two, which the parent
    closes, so a TRL process that dies shows on rank 0 as the end of its pipe or its exit (one
    error naming it). A TRL process says when it is ready to train (:meth:`ready`, before any step
    is timed) and, after its last step, waits to be told to finish (:meth:`finish`, after every
    timed step), so neither its start-up nor its end overlaps a timed step."""

    def __init__(self, processes: int, threads: int, model: str, prompts: str, setting: tuple, steps: int,
                 out_dir: str, warmup_steps: int) -> None:
        import multiprocessing as mp
        import socket

        ctx = mp.get_context("fork")
        self.name = _trl_name(processes, threads)
        with socket.socket() as s:  # (a free port for their process group)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.go, self.done, self.procs = [], [], []
        for rank in range(processes):
            go_r, go = ctx.Pipe(duplex=False)
            done, done_w = ctx.Pipe(duplex=False)
            env = {"RANK": str(rank), "WORLD_SIZE": str(processes), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(processes), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": str(threads)} if processes > 1 else {}
            proc = ctx.Process(target=_trl_turns_main, daemon=True,
                               args=(go_r, done_w, [*_OURS, go, done], env, threads, model, prompts, setting, steps,
                                     out_dir, warmup_steps))
            proc.start()
            go_r.close()
            done_w.close()
            _OURS.extend((go, done))
            self.go.append(go)
            self.done.append(done)
            self.procs.append(proc)

    def _tell(self, message: str) -> None:
        for k, go in enumerate(self.go):
            try:
                go.send(message)
            except (BrokenPipeError, ConnectionResetError):
                raise self._ended(k) from None

    def _hear(self, limit_s: float) -> list:
        """One message from every process; a process that ended without one, or sent a failure, is
        an error naming it (a process that died is named before another's failure, which is often
        the broken group it left)."""
        from multiprocessing.connection import wait

        got: dict[int, object] = {}
        failed: dict[int, str] = {}
        deadline = time.monotonic() + limit_s
        while len(got) + len(failed) < len(self.procs):
            pending = [k for k in range(len(self.procs)) if k not in got and k not in failed]
            waits = {**{self.done[k]: k for k in pending}, **{self.procs[k].sentinel: k for k in pending}}
            ready = wait(list(waits), timeout=max(0.0, deadline - time.monotonic()) if not failed else 2.0)
            if not ready:
                if failed:
                    break
                raise RuntimeError(f"{self.name}: no step ended within {limit_s:.0f} s")
            for obj in ready:
                k = waits[obj]
                if k in got or k in failed:
                    continue
                if self.done[k].poll():
                    try:
                        msg = self.done[k].recv()
                    except (EOFError, ConnectionResetError):
                        raise self._ended(k) from None
                    if isinstance(msg, str) and msg != "ready":
                        failed[k] = msg
                    else:
                        got[k] = msg
                elif obj is self.procs[k].sentinel:
                    raise self._ended(k)
        if failed:
            k = min(failed)
            raise RuntimeError(f"{self.name} failed in its process {k}:\n{failed[k]}")
        return [got[k] for k in range(len(self.procs))]

    def ready(self, limit_s: float = TRL_STEP_LIMIT_S) -> None:
        """Wait until every process has loaded the model and data and is about to train."""
        self._hear(limit_s)

    def step(self) -> float:
        """Tell TRL to run its next step; the step's seconds (the slowest process's; on rank 0 of
        the posttrain job)."""
        self._tell("step")
        return max(self._hear(TRL_STEP_LIMIT_S))

    def finish(self, limit_s: float = 120.0) -> None:
        """After its last step: tell every process to end and check that each ran exactly the steps
        it was told to and ended cleanly."""
        self._tell("finish")
        for k, proc in enumerate(self.procs):
            proc.join(timeout=limit_s)
            if proc.exitcode != 0:
                extra = ""
                if self.done[k].poll():
                    try:
                        extra = f":\n{self.done[k].recv()}"
                    except (EOFError, OSError):
                        pass
                raise RuntimeError(f"{self.name}: its process {k} did not end cleanly after its last step (exit code "
                                   f"{proc.exitcode}){extra}")

    def _ended(self, k: int) -> RuntimeError:
        self.procs[k].join(timeout=1)
        return RuntimeError(f"{self.name}: its process {k} ended (exit code {self.procs[k].exitcode}) before the "
                            "step's end")

    def close(self) -> None:
        """Close this side's ends and end the processes (a process waiting for its next message sees
        the end of its pipe and exits; one still busy is killed after 30 s)."""
        for end in (*self.go, *self.done):
            end.close()
            if end in _OURS:
                _OURS.remove(end)
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _trl_turns_main(go, done, theirs, env: dict, threads: int, model: str, prompts: str, setting: tuple, steps: int,
                    out_dir: str, warmup_steps: int) -> None:
    for end in theirs:  # (the posttrain side's ends, inherited by the fork)
        end.close()
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    os.environ.update(env)  # (accelerate's launch on CPUs: a gloo group of the TRL processes)
    try:
        _trl_turns(go, done, threads, model, prompts, setting, steps, out_dir, warmup_steps)
    except EOFError:  # the posttrain side ended: nothing to report to
        os._exit(1)
    except BaseException:
        try:
            done.send(traceback.format_exc())
        except OSError:
            pass
        os._exit(1)
    os._exit(0)


def _trl_turns(go, done, threads: int, model: str, prompts: str, setting: tuple, steps: int, out_dir: str,
               warmup_steps: int) -> None:
    """TRL's GRPO on the run's model, prompts and reward, one step per message on ``go``; each
    step's seconds (from the message to the step's end: its data, sampling, update) sent on ``done``."""
    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
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

    def told(expected: str) -> None:  # the next message: a step, or (after the last) the end
        msg = go.recv()
        if msg != expected:
            raise RuntimeError(f"told to {msg} after {state_steps[0]} of {steps} steps")

    state_steps = [0]

    class Turns(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            done.send("ready")
            told("step")
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            done.send(time.perf_counter() - self.began)
            state_steps[0] = state.global_step
            # (after the last step: wait for the end, so that TRL's end of training runs after every timed step)
            told("step" if state.global_step < state.max_steps else "finish")
            self.began = time.perf_counter()

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = GRPOConfig(  # (64 completions an optimizer step over all of its processes, as posttrain's)
        output_dir=out_dir, per_device_train_batch_size=prompts_per_step * samples // processes,
        num_generations=samples,
        gradient_accumulation_steps=1, max_completion_length=new_tokens, temperature=temperature, top_p=1.0, top_k=0,
        learning_rate=OPTIM.lr, lr_scheduler_type="cosine", warmup_steps=warmup_steps,
        max_grad_norm=OPTIM.max_grad_norm, beta=0.0, num_iterations=1, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", max_steps=steps, logging_strategy="no", save_strategy="no", report_to="none", use_cpu=True,
        bf16=False, seed=0, disable_tqdm=True, log_completions=False, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reverse_digits, args=cfg, train_dataset=Dataset.from_list(records),
                          callbacks=[Turns()])
    trainer.remove_callback(PrinterCallback)  # (its end-of-training dict of metrics; the table is ours)
    trainer.train()
    if state_steps[0] != steps:
        raise RuntimeError(f"TRL ended after {state_steps[0]} of {steps} steps")


def turns_worker(rank: int, world_size: int, cfgs: dict[str, RLConfig], trl: list[TRLTurns], warmup: int,
                 batches: int, rounds: int, progress: bool = False) -> dict | None:
    """One rank of the stepwise rounds: every posttrain variant of ``cfgs`` built in this process
    and every TRL launch of ``trl`` take turns a step at a time (in an order drawn afresh at every
    step, :func:`turn_order`), after ``warmup`` steps of each that are not counted. Rank 0 returns
    ``{name: [{"round", "wall_s", and posttrain's phases}]}``."""
    from posttrain.train.rl.loop import RLTrainer

    trainers: dict[str, RLTrainer] = {}
    try:
        for name, cfg in cfgs.items():
            trainers[name] = RLTrainer(cfg, rank, world_size)
        turns = {**{name: ("posttrain", t) for name, t in trainers.items()}, **{p.name: ("trl", p) for p in trl}}
        names = list(turns)
        steps: dict[str, list] = {name: [] for name in names}

        def turn(name: str, step: int) -> dict:
            kind, who = turns[name]
            if kind == "trl":
                wall = who.step() if rank == 0 else 0.0
                dist.barrier()  # (every rank waits here while TRL runs: the next step starts together)
                return {"wall_s": wall}
            who._ended = None  # (its stopwatch from this step's start, not from its previous turn)
            row = who.train_step(step)
            return {**{k: row[k] or 0.0 for k in ("wall_s", "rollout_s", "reference_s", "update_s")},
                    "equal_groups": row["zero_advantage_groups"]}

        if rank == 0:
            for p in trl:  # (loaded and about to train: nothing of its start-up overlaps a timed step)
                p.ready()
        dist.barrier()
        for step in range(warmup):
            for name in names:
                turn(name, step)
        for r in range(rounds):
            for b in range(batches):
                step = warmup + r * batches + b
                for name in turn_order(names, step):
                    steps[name].append({"round": r, **turn(name, step)})
            if progress and rank == 0:
                print(f"  round {r + 1}/{rounds}: " + ", ".join(
                    f"{name} {statistics.fmean(s['wall_s'] for s in steps[name] if s['round'] == r):.3f}"
                    for name in names) + " s a step", flush=True)
        return steps if rank == 0 else None
    finally:
        for t in trainers.values():
            t.close()


def turn_order(names: list[str], step: int) -> list[str]:
    """The order the variants take their turns at ``step``: a permutation drawn afresh (seeded by
    the step), so that no variant always follows the same one (a fixed rotation would leave
    whatever one step leaves behind, such as cold caches, on the same variant every time)."""
    return random.Random(1_000_003 * step + len(names)).sample(names, len(names))


def pooled_steps(steps: dict[str, list], num: str, den: str) -> tuple[float, float, float]:
    """``num``'s seconds over ``den``'s, summed over every counted step (the same steps each), with
    the 5th and 95th percentile over rounds drawn with replacement: above 1, ``den`` is faster."""
    per_round = {n: {} for n in (num, den)}
    for n in (num, den):
        for s in steps[n]:
            count, secs = per_round[n].get(s["round"], (0, 0.0))
            per_round[n][s["round"]] = (count + 1, secs + s["wall_s"])
    return bootstrap_rate_ratio(per_round[den], per_round[num])  # (den's steps a second over num's)


@dataclass(frozen=True)
class RLE2EBench:
    """``posttrain bench rl-e2e``: which settings, how many steps and rounds, and against whom.

    Attributes:
        settings: ``readme`` and/or ``long`` (see the module docstring).
        steps: counted steps of each variant a round.
        warmup: steps of each variant before the rounds, not counted.
        rounds: rounds of turns (the interval of a ratio draws rounds with replacement).
        sft_steps: steps of the README's SFT run that makes the ``readme`` setting's model.
        no_trl: leave TRL out.
        trl: the launches of TRL to time, each ``PROCESSESxTHREADS`` (threads per process), each taking turns; the
            fastest counts as TRL's.
        work_dir: where the chat task's model and prompts are made ('' : a temporary folder).
        json: results file ('' for none).
    """

    settings: tuple[str, ...] = ("readme", "long")
    steps: int = 5
    warmup: int = 2
    rounds: int = 10
    sft_steps: int = 400
    no_trl: bool = False
    trl: tuple[str, ...] = ("1x2", "2x1")
    work_dir: str = ""
    json: str = "out/bench_rl_e2e.json"

    def __post_init__(self) -> None:
        bad = [s for s in self.settings if s not in SETTINGS]
        if bad or not self.settings:
            raise ValueError(f"settings={','.join(self.settings)}: choose from {', '.join(SETTINGS)}")
        if self.rounds < 1 or self.steps < 1 or self.sft_steps < 1:
            raise ValueError(f"rounds={self.rounds}, steps={self.steps} and sft_steps={self.sft_steps} must be at "
                             "least 1")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be at least 0")
        launches = [parse_launch(t) for t in self.trl]
        if not launches or len(set(launches)) < len(launches):
            raise ValueError(f"trl={','.join(self.trl)}: one or more different launches, each PROCESSESxTHREADS")
        for p, _ in launches:
            for s in self.settings:
                if SETTINGS[s][1] * SETTINGS[s][2] % p:
                    raise ValueError(f"trl={p}x..: {p} processes cannot share the {SETTINGS[s][1] * SETTINGS[s][2]} "
                                     "completions of a step evenly")
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
        total = self.warmup + self.rounds * self.steps
        optim = replace(OPTIM, warmup_steps=min(OPTIM.warmup_steps, total // 2))
        for setting in self.settings:
            spec = SETTINGS[setting]
            kind, prompts_per_step, samples, new_tokens, temperature, skip = spec
            model = models[kind]
            log(f"\n{setting}: {prompts_per_step} prompts x {samples} samples a step, up to {new_tokens} new tokens, "
                f"temperature {temperature}, the chat task's {'post-trained' if kind == 'sft' else 'untrained'} model; "
                f"every variant in long-lived processes, taking turns a step at a time: {self.warmup} warm-up steps "
                f"each, then {self.rounds} rounds of {self.steps} counted steps each", flush=True)
            cfgs = {_name(v): RLConfig(model_path=model, prompts=models["prompts"], samples_per_prompt=samples,
                                       prompts_per_step=prompts_per_step, max_new_tokens=new_tokens, steps=total,
                                       temperature=temperature, engine=EngineConfig(v[0]), balance=v[1], optim=optim,
                                       generate_batch=v[2], sampler=v[3], skip_equal_reward_groups=skip and not v[4],
                                       progress=False, device="cpu")
                    for v in VARIANTS if skip or not v[4]}
            trl: list[TRLTurns] = []
            try:
                if not self.no_trl:
                    for launch in self.trl:
                        p, t = parse_launch(launch)
                        trl.append(TRLTurns(p, t, model, models["prompts"], spec, total,
                                            os.path.join(root, f"trl{p}x{t}"), optim.warmup_steps))
                steps = run_ranks(turns_worker, 2, cfgs, trl, self.warmup, self.steps, self.rounds, True,
                                  timeout_s=7200)[0]
                for p in trl:  # (each ran exactly the steps it was told to, and ends cleanly)
                    p.finish()
            finally:
                for p in trl:
                    p.close()
            result["settings"][setting] = self._report(setting, steps, log)
        write_result(result, self.json or None, log)
        return result

    def _report(self, setting: str, steps: dict[str, list], log) -> dict:
        names = list(steps)
        ref = names[0]
        mean = {n: statistics.fmean(s["wall_s"] for s in steps[n]) for n in names}
        trls = [n for n in names if n.startswith("trl")]
        fastest = min(trls, key=mean.__getitem__) if trls else None
        rounds = sorted({s["round"] for s in steps[ref]})
        out: dict = {"step_s": mean, "rate_over": {}, "round_range": {}, "phases": {}, "trl": fastest}
        log(f"\n{setting}: seconds a whole GRPO step (mean of every counted step), and {ref}'s step rate over each's "
            f"(5-95% over {len(rounds)} rounds drawn with replacement; and the rounds' own range)")
        log(f"  {'':40} {'step s':>7} {'rollout':>8} {'reference':>10} {'update':>7} {'other':>6} "
            f"{'ratio':>12} {'(5-95%)':>11} {'(rounds)':>11}")
        for n in names:
            ratio = pooled_steps(steps, n, ref)
            per_round = [sum(s["wall_s"] for s in steps[n] if s["round"] == r)
                         / sum(s["wall_s"] for s in steps[ref] if s["round"] == r) for r in rounds]
            out["rate_over"][n] = list(ratio)
            out["round_range"][n] = [min(per_round), max(per_round)]
            if "rollout_s" in steps[n][0]:
                ph = {k: statistics.fmean(s[k] for s in steps[n]) for k in ("rollout_s", "reference_s", "update_s")}
                ph["other_s"] = max(0.0, mean[n] - sum(ph.values()))
                out["phases"][n] = ph
                out.setdefault("equal_groups", {})[n] = statistics.fmean(s["equal_groups"] for s in steps[n])
                phases = (f"{ph['rollout_s']:8.3f} {ph['reference_s']:10.3f} {ph['update_s']:7.3f} "
                          f"{ph['other_s']:6.3f}")
            else:
                phases = f"{'':8} {'':10} {'':7} {'':6}"
            log(f"  {n:40} {mean[n]:7.3f} {phases} {ratio[0]:11.2f}x {ratio[1]:5.2f}-{ratio[2]:<5.2f} "
                f"{min(per_round):5.2f}-{max(per_round):<5.2f}")
        log(f"  (ratio: a variant's seconds over {ref}'s, summed over the same rounds; above 1: {ref} is "
            "faster; phases: means of posttrain's own rows, rollout including loading the weights into the rollout "
            "copy and the rewards)")
        if out.get("equal_groups"):
            log("  groups whose samples all earned the same reward, a step (mean): " + ", ".join(
                f"{n} {v:.1f}" for n, v in out["equal_groups"].items()) + " (skipped: "
                f"{'none' if not SETTINGS[setting][5] else 'by every variant but the every-group one'})")
        if fastest is not None:
            r = out["rate_over"][fastest]
            log(f"  posttrain ({ref}) against TRL's faster launch ({fastest}): {r[0]:.2f}x TRL's step rate "
                f"({r[1]:.2f}-{r[2]:.2f})")
            every = [n for n in names if n.endswith(", every group)")]
            if every:  # (the same, training every group as TRL does: what skipping equal-reward groups leaves out)
                r = out["rate_over_trl_every_group"] = list(pooled_steps(steps, fastest, every[0]))
                log(f"  posttrain training every group as TRL does ({every[0]}): {r[0]:.2f}x TRL's step rate "
                    f"({r[1]:.2f}-{r[2]:.2f})")
        return out
