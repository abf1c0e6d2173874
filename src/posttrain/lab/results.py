"""``posttrain results`` (``make results``): rerun every measurement docs/results.md reports and
rewrite it.

Each section is one ``posttrain`` command. Its report (what the command prints, progress lines
dropped) goes into the file verbatim under the command line, the commit it ran on and the date,
so every figure names the command that produced it and can be rerun. Sections are delimited by
``<!-- result: NAME -->`` / ``<!-- end: NAME -->`` markers; ``--only NAME,...`` reruns some and
keeps the others as they are (``--only profiles:longalign,profiles:swe_smith`` reruns some
profiles of the per-profile section and keeps the other profiles' reports). The file is
rewritten after every finished command, so an interrupted or failed run keeps what it measured
(and the old text of the sections it had not reached).
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from posttrain.lab.commands import run_posttrain
from posttrain.lab.readme import run_readme

__all__ = ["SECTIONS", "Section", "run_results"]


@dataclass(frozen=True)
class Section:
    """One measurement: a ``posttrain`` command and what to say about it (no figures: those come
    from the command).

    Attributes:
        name: the marker name (``--only`` selects by it).
        title: the heading.
        argv: the command's arguments after ``posttrain``.
        intro: what the command measures and how to read it.
        minutes: about how long it takes on the CI machine kind (2 cores).
    """

    name: str
    title: str
    argv: tuple[str, ...]
    intro: str
    minutes: float


_LA = ("--profile", "longalign", "--max-len", "4096", "--steps", "6")

SECTIONS: tuple[Section, ...] = (
    Section("demo", "The demo", ("demo",),
            "Four variants training the same tiny GPT on the same long-tail data (up to 4,096 tokens) in 2 CPU "
            "processes, taking turns a step at a time over 8 rounds of the same minibatches (docs/odc.md, "
            "'Measuring on 2 shared cores'): the speedup over FSDP2 and its three factors (transport, engine, "
            "mechanism), pooled over the rounds with a 90% interval, then the simulator calibrated on this "
            "machine predicting the mechanism at 8-64 GPUs (a prediction, not a measurement).",
            6),
    Section("bench-odc-long-tail", "FSDP2 vs ODC, short sequences (long_tail, up to 1,024 tokens)",
            ("bench", "odc"),
            "Seven variants taking turns a step at a time over 5 rounds of the same minibatches, and two bounds "
            "run beside each round: the table's ratios are medians of per-round ratios with the lowest and "
            "highest round; total, transport, engine and mechanism are pooled over the rounds with a 90% "
            "interval (they multiply to the total). `compute/even` is the same microbatches' compute time "
            "(communication excluded) over the even bound's.", 5),
    Section("bench-odc-longalign", "FSDP2 vs ODC, LongAlign-shaped sequences (1/16 scale, up to 4,096 tokens)",
            ("bench", "odc", *_LA, "--max-tokens", "4096"),
            "The same comparison on the `longalign` profile scaled to 4,096 tokens (16 sequences a step, 2 ranks).",
            20),
    Section("bench-odc-cp", "Context parallelism: the longest sequences split across ranks (LongAlign-shaped, 4 a step)",
            ("bench", "odc", "--profile", "longalign", "--max-len", "4096", "--max-tokens", "4096", "--sequences", "4",
             "--steps", "12", "--repeats", "5", "--context-parallel", "auto"),
            "The same variants and `odc+cp` (flat ODC whose plan splits the costliest sequences across the 2 ranks, "
            "docs/odc.md, 'Context parallelism') at 4 sequences a step, where whole sequences leave about a fifth to "
            "the even bound; 5 interleaved rounds of 11 steps. 'Against the even bound' gives what `odc+diff_micro` "
            "and `odc+cp` leave to it, split into work, balance and critical share beside the plans' own figures; "
            "`cp` is `odc+cp` over `odc+diff_micro` (pooled); "
            "the last lines calibrate the simulator on this machine and set its prediction of that gain beside it. "
            "The goal (issue 48): `odc+cp` at 0.90 of the even bound and 1.15x `odc+diff_micro`.", 11),
    Section("sweep-longalign", "ODC's mechanism against its headroom, LongAlign-shaped, over a sweep",
            ("bench", "odc", *_LA, "--sweep", "--sequences-per-rank", "1,2,4,8", "--sweep-max-tokens", "4096,8192"),
            "Flat ODC only: `odc+diff_micro` over `odc-collective+same_micro` (the mechanism) against the "
            "partition bound over the collective run (the headroom: what any schedule of whole sequences could "
            "win), at every point of sequences per rank x max_tokens, beside the simulator calibrated on this "
            "machine; then the calibrated simulator at more ranks.", 60),
    Section("profiles", "Flat ODC against the partition bound on every length profile",
            ("bench", "odc", "--profile", "{profile}", "--max-len", "4096", "--steps", "6", "--sweep",
             "--sequences-per-rank", "8", "--sweep-max-tokens", "4096", "--no-predict"),
            "One sweep point (8 sequences per rank, max_tokens 4,096) per profile: `odc/part` is "
            "`odc+diff_micro` over the partition bound.", 40),
    Section("bench-rl", "The RL update on the same rollouts under three engines", ("bench", "rl"),
            "32 rollouts a step drawn with RL's shape (responses up to 1,024 tokens, a quarter cut at the limit), "
            "replayed through the update under FSDP2+same_micro, collective flat ODC+same_micro and "
            "ODC+diff_micro, 5 interleaved rounds; last line: the simulator, calibrated in the same run, "
            "for the same update plans; see docs/rl.md.", 5),
    Section("rl-e2e", "Whole GRPO steps against TRL", ("bench", "rl-e2e"),
            "Whole GRPO steps by stopwatch (`wall_s`), with the phases of posttrain's own rows, at the README's "
            "setting and at 256-token responses: under flat ODC+diff_micro, posttrain's sampler batched, "
            "transformers' generate batched and one generate call per prompt (the split of the sampling's gain); "
            "FSDP2+same_micro with the defaults; at the README's setting ODC once more training every group (what "
            "skipping equal-reward groups gains); and TRL's GRPOTrainer matched to the run (one process with 2 threads "
            "and 2 processes with 1 each; the faster counts); every variant in long-lived processes, taking turns a step "
            "at a time in an order drawn afresh each step, 10 rounds of 5 counted steps; see docs/rl.md.", 15),
    Section("transport", "The shared-memory transport against gloo", ("bench", "transport"),
            "Bandwidth of ODC's one-sided gather and scatter-accumulate against gloo's all-gather and "
            "reduce-scatter on the same 2 processes; ratios are gloo time over shared-memory time.", 1),
    Section("overhead", "Where an engine's time goes: one microbatch against the plain model", ("bench", "overhead"),
            "One microbatch forward and backward under FSDP2 (with ODC's transport at 2 ranks) and under flat "
            "ODC, each in a minibatch of its own, interleaved iteration by iteration with the same plain model "
            "(medians of 30); each engine's time beyond the plain model split into minibatch entry, forward, "
            "backward and exit, with its median gather and gradient reduction; then the optimizer step on "
            "FSDP2's shards.", 2),
    Section("balance", "The balancer: plan time and imbalance", ("bench", "balance"),
            "Every balancing method at 2-1,024 ranks, 8 sequences per rank, 5 minibatches each: median plan "
            "time and imbalance (max / mean of the ranks' costs); for `same_micro` also FSDP's step cost over "
            "the lower bound.", 1),
    Section("pipeline", "Pipeline memory per schedule and offload; our runner against torch's",
            ("bench", "pipeline"),
            "Largest per-rank peak of saved activations measured by the hooks (MiB and chunk-microbatches, "
            "measured = predicted; under a split backward, with what each stage measured it keeps for W) for each "
            "schedule and offload policy (the last of 2 steps); then step time of our runner against "
            "torch.distributed.pipelining on the same stages (these timings move by up to 20% on this machine).",
            2),
    Section("paper-table", "The PipeOffload unit-cost table", ("simulate", "pipeline", "--paper-table"),
            "Our group-interleaved constructions on the paper's unit clock (p=8, m=32, F=I=W=1) next to the "
            "paper's peaks and makespans; docs/pipeline.md explains the constructions.", 1),
    Section("sim-table", "FSDP vs ODC at 8-256 GPUs (simulated)", ("simulate", "table"),
            "ODC over FSDP per balancing method, 8 sequences per GPU, LongAlign- and SWE-smith-shaped lengths "
            "at their published scale, Qwen2.5 1.5B and 7B cost presets on H100-like GPUs. The diff_micro "
            "columns compare ODC+diff_micro with FSDP+same_micro.", 5),
    Section("calibrate", "The simulator against this machine", ("simulate", "calibrate"),
            "The simulator, fed costs measured here, predicts the 2-rank benchmark's FSDP2+same_micro against "
            "ODC+diff_micro; then the real trainings run. The pipeline runner's measured peaks against the "
            "prediction follow.", 3),
)

#: Lines a report drops: progress, and where files went.
_NOISE = re.compile(r"^\s*(\{'train_runtime'|round \d+/\d+|wrote |posttrain: .* on \d+ CPU processes|step \s*\d+ |"
                    r"loss .* ->|resumed from|measuring |calibrating |running the real|  \S+ on equal lengths|  layer cost fit)")
_PROFILES = ("longalign", "swe_smith", "long_tail", "bimodal", "uniform")


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(__file__)).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, check=True, cwd=os.path.dirname(__file__)).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" with uncommitted changes" if _dirty(status) else "")


def _dirty(status: list[str]) -> bool:
    """Whether ``git status --porcelain`` lines change anything but what this command writes itself
    (README.md's outputs, docs/): a run that rewrote the README's outputs first still measured the commit."""
    paths = [line[3:].split(" -> ")[-1] for line in status if line.strip()]
    return any(not (p == "README.md" or p.startswith("docs/")) for p in paths)


def _run(argv: Sequence[str], log: Callable[[str], None]) -> str:
    lines = run_posttrain(argv, log, ok=(0, 1))  # 1: ran, and reports a target missed
    return "\n".join(line for line in lines if not _NOISE.match(line)).strip()


def _blocks(section_text: str) -> dict[str, str]:
    """The per-command reports of an old section, by command line."""
    return {m.group(1): m.group(0) for m in re.finditer(r"`posttrain ([^`]+)` \(commit [^\n]*\n\n```\n.*?\n```\n",
                                                         section_text, re.S)}


def _render(section: Section, commit: str, log: Callable[[str], None],
            done: Callable[[str], None] = lambda text: None, *, profiles: Sequence[str] | None = None,
            old: str = "") -> str:
    """The section's text; ``done`` gets the text so far (closed by its end marker) after each
    command, so a long section keeps what it measured if a later command fails or is interrupted.
    ``profiles``: of a per-profile section, rerun only these and keep the others' old reports."""
    today = datetime.date.today().isoformat()
    parts = [f"<!-- result: {section.name} -->", f"## {section.title}", "", section.intro, ""]
    argvs = ([tuple(a.replace("{profile}", p) for a in section.argv) for p in _PROFILES]
             if "{profile}" in section.argv else [section.argv])
    kept = _blocks(old)
    end = f"<!-- end: {section.name} -->"
    for argv, profile in zip(argvs, _PROFILES if len(argvs) > 1 else [None]):
        line = " ".join(argv)
        if profiles is not None and profile not in profiles and line in kept:
            parts += [kept[line].rstrip("\n"), ""]
            continue
        report = _run(argv, log)
        parts += [f"`posttrain {line}` (commit {commit}, {today}):", "", "```", report, "```", ""]
        done("\n".join([*parts, end]))
    parts.append(end)
    return "\n".join(parts)


_HEADER = """# Measured results

Every figure here was printed by the command above it, on the commit named beside it, on the CI
machine kind (2 CPU cores, no GPU): `posttrain results` (`make results`) reruns them all and rewrites
this file (about {minutes:.0f} minutes; `posttrain results --only NAME,...` reruns some sections).
Timings on 2 cores move by 10-20% from run to run: only ratios measured side by side in one run mean
anything, and the benchmarks repeat them over interleaved rounds. Sections measured on another
machine (a GPU machine: docs/gpu.md) say so, name their command, and are kept as they are.
"""


#: The ``only`` name of the README's shown outputs (:mod:`posttrain.lab.readme`), rerun first.
README = "readme"


def run_results(path: str = "docs/results.md", *, only: Sequence[str] | None = None,
                log: Callable[[str], None] = print, readme: str = "README.md") -> str:
    """Rerun the sections (all, or those named in ``only``) and rewrite ``path``; returns its
    text. ``readme`` (in ``only``, or with every section): the README's shown outputs, rerun from
    its shown commands and rewritten in ``readme``."""
    names = [s.name for s in SECTIONS] + [README]
    profiles: dict[str, list[str]] = {}  # section -> the profiles to rerun (``profiles:longalign,...``)
    if only:
        sections = []
        for item in only:
            name, _, profile = item.partition(":")
            if name not in profiles or not profile:
                sections.append(name)
            if profile:
                if profile not in _PROFILES:
                    raise ValueError(f"`only`: unknown profile {profile!r} in {item!r}; choose from {', '.join(_PROFILES)}")
                profiles.setdefault(name, []).append(profile)
        only = sections
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise ValueError(f"`only`: unknown section(s) {', '.join(unknown)}; choose from {', '.join(names)}")
    if not only or README in only:
        log(f"the outputs {readme} shows, from its commands (about 3 min)")
        run_readme(readme, log=log)
        if only and set(only) == {README}:
            if not os.path.exists(path):
                return ""
            with open(path) as f:
                return f.read()
    old = {}
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
        for m in re.finditer(r"<!-- result: (\S+) -->.*?<!-- end: \1 -->", text, re.S):
            old[m.group(1)] = m.group(0)
    commit = _commit()
    rendered: dict[str, str] = {}

    known = {s.name for s in SECTIONS}
    kept = [text for name, text in old.items() if name not in known]  # measured elsewhere (a GPU machine)

    def write() -> str:
        body = [rendered.get(s.name) or old.get(s.name) for s in SECTIONS] + kept
        text = _HEADER.format(minutes=sum(s.minutes for s in SECTIONS)) + "\n" + "\n\n".join(
            b for b in body if b) + "\n"
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        return text

    for section in SECTIONS:
        if only and section.name not in only:  # (README: done above)
            continue
        log(f"{section.title} (about {section.minutes:g} min)")

        def done(partial: str, name: str = section.name) -> None:
            rendered[name] = partial
            write()
            log(f"  kept in {path}")

        rendered[section.name] = _render(section, commit, log, done, profiles=profiles.get(section.name),
                                         old=old.get(section.name, ""))
    text = write()
    log(f"wrote {path}")
    return text
