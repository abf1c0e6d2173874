"""posttrain: fast LLM post-training (SFT and RL) with ODC and PipeOffload; `posttrain COMMAND --help` lists a command's options.

    posttrain demo                          # FSDP2 and ODC on a tiny GPT, 2 CPU processes: where the speedup comes from
    posttrain train --dp fsdp --balance same_micro --steps 20 --metrics out/fsdp.csv
    posttrain train --dp odc --model llama --precision bf16 --checkpoint-dir out/ckpt
    posttrain train --dp odc --deterministic --activation-checkpointing --world-size 4 --replicas 2
    posttrain chat-task out/chat              # a small model directory and chat data to post-train
    posttrain train --model-path out/chat/model --data out/chat/train.jsonl --output-dir out/model
    posttrain evaluate out/model --data out/chat/eval.jsonl   # exact match of greedy answers
    posttrain rl --model-path out/model --prompts out/chat/eval.jsonl --samples-per-prompt 8   # GRPO
    posttrain export out/ckpt out/model      # a training checkpoint as a transformers model directory
    torchrun --nproc-per-node 2 -m posttrain train --dp odc     # one rank per torchrun process
    posttrain pipeline --schedule group_interleaved --pp-size 2 --chunks 2 --microbatches 8 --offload 1
    posttrain bench odc --profile long_tail --repeats 5
    posttrain bench odc --profile longalign --max-len 4096 --sweep --sequences-per-rank 2,4,8
    posttrain bench balance --world-sizes 2,32,1024     # plan time and imbalance per balancing method
    posttrain bench transport                           # shared-memory transport vs gloo
    posttrain bench overhead                            # one microbatch: FSDP2 and flat ODC vs the plain model
    posttrain bench pipeline --pp-sizes 2,4
    posttrain simulate odc --world-size 32 --profile longalign --cost-model 7b    # FSDP vs ODC at cluster scale
    posttrain simulate pipeline --schedule group_interleaved --pp-size 8 --chunks 2 --offload 1
    posttrain simulate table                # ODC/FSDP speedup, 8-256 GPUs x LongAlign/SWE-smith x 1.5B/7B
    posttrain simulate calibrate            # simulator vs the real 2-rank benchmark and pipeline runner
    posttrain plan odc --world-size 64 --profile swe_smith
    posttrain plan pipeline --pp-size 8 --memory-gib 8
    posttrain results                       # rerun what docs/results.md reports and rewrite it
    posttrain doctor                        # on a GPU machine: check the CUDA paths, write out/gpu-report.md
    python -m posttrain demo                # the same without the console script

Every command's options come from the configuration dataclasses of the code it runs
(posttrain.cli.options), which is also the one place that maps a parameter to its flag: the
library and the trainers name parameters in their errors (max_tokens=64), this command line
prints the flag (--max-tokens=64).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading

__all__ = ["COMMANDS", "SUMMARIES", "build_parser", "main"]

#: Each command and the module of this package that adds it, in the order ``--help`` lists them.
COMMANDS = {"demo": "demo", "train": "train", "export": "export", "chat-task": "chat", "evaluate": "chat",
            "rl": "rl", "pipeline": "pipeline", "bench": "bench", "simulate": "simulate", "plan": "plan",
            "results": "results", "doctor": "doctor"}


#: Each command's one-line help, as ``posttrain --help`` lists it without importing the commands
#: (their options come from the code they run: torch, transformers, seconds); a test holds these
#: equal to the help each command's module gives.
SUMMARIES = {
    "demo": "FSDP2 and ODC on a tiny GPT, 2 CPU processes, step by step over rounds: table, factors, "
            "predictions, timeline",
    "train": "data-parallel training with FSDP2 or ODC on CPU processes or GPUs (or under torchrun)",
    "export": "turn a training checkpoint into a transformers model directory",
    "chat-task": "write the embedded chat task: a small model directory and chat data",
    "evaluate": "exact-match accuracy of a model's greedy answers to held-out chats",
    "rl": "GRPO/RLOO: sample, reward, and update the policy on any data-parallel engine",
    "pipeline": "pipeline-parallel training with activation offload, on CPU processes or GPUs",
    "bench": "benchmarks: ratios measured side by side in one run",
    "simulate": "discrete-event simulation at cluster scale (FSDP vs ODC, pipeline)",
    "plan": "recommendations from the simulator",
    "results": "rerun every measurement of docs/results.md and rewrite it (hours)",
    "doctor": "check the GPU paths here (devices, the CUDA tests, copy bandwidth) and write a report",
}


def _listing_parser() -> argparse.ArgumentParser:
    """The ``posttrain`` parser for what names no command (``--help``, nothing, a typo): the
    commands and their help, none of them imported."""
    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        sub.add_parser(name, help=SUMMARIES[name])
    return parser


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``posttrain`` parser: one subcommand per module of this package; with ``command``, only
    the module adding it (a command's options come from the code it runs, so building every
    command imports torch, transformers and the rest: seconds before a typo is reported)."""
    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    names = [COMMANDS[command]] if command in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for name in names:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    return parser


def _log_failure(e: Exception) -> str:
    """Write a failed job's tracebacks to a log file; its path."""
    import tempfile
    import time

    path = os.path.join(tempfile.gettempdir(), f"posttrain-error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log")
    with open(path, "w") as f:
        f.write(f"posttrain {' '.join(sys.argv[1:])}\n{e}\n")
    return path


def _command_flags(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, str]:
    """Parameter -> flag for every option of the command ``argv`` runs (a section's option also
    under its dotted path's every tail, ``engine.name`` and ``name``, unless two options share it)."""
    actions = list(parser._actions)
    for word in argv:  # descend into the subcommands argv names
        sub = next((a for a in actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or word not in sub.choices:
            continue
        actions = list(sub.choices[word]._actions)
    from .options import FLAGS

    out: dict[str, str] = {}
    shared: set[str] = set()
    for a in actions:
        longs = [o for o in a.option_strings if o.startswith("--")]
        if not longs or a.dest in (None, argparse.SUPPRESS, "help"):
            continue
        parts = a.dest.split(".")
        for k in range(len(parts)):  # run.engine.name, engine.name, name: each names this option
            name = ".".join(parts[k:])
            if name in out and out[name] != longs[0]:
                shared.add(name)
            out.setdefault(name, longs[0])
    taken = set(out.values())  # library parameters the command's options stand for under another name
    out.update({k: v for k, v in FLAGS.items() if "." not in k and v in taken and k not in out})
    return {k: v for k, v in out.items() if k not in shared}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:  # --help, nothing or a typo: answered without importing torch
        _listing_parser().parse_args(argv)  # (exits: the help, or the error listing the commands)
    from posttrain.launch import Interrupted, RanksFailedError, RunError

    from .options import apply_config_file, name_flags

    parser = build_parser(argv[0])
    try:
        apply_config_file(parser, argv)
    except ValueError as e:
        print(f"posttrain: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    args._argv = argv  # what was given on the command line (flags that exclude each other)
    def terminated(signum, frame):  # SIGTERM unwinds like Ctrl-C: temporary files go, children stop
        raise Interrupted(signum)

    old_term = signal.signal(signal.SIGTERM, terminated) if threading.current_thread() is threading.main_thread() else None
    try:
        rc = args.func(args)
    except ValueError as e:  # a parameter the library or a trainer refused: named by its flag
        print(f"posttrain: error: {name_flags(str(e), _command_flags(parser, argv))}", file=sys.stderr)
        rc = 2
    except RunError as e:  # the run stopped for a reason it states
        print(f"posttrain: error: {name_flags(str(e), _command_flags(parser, argv))}", file=sys.stderr)
        rc = 1
    except RanksFailedError as e:
        print(f"posttrain: error: {e.summary()} (tracebacks: {_log_failure(e)})", file=sys.stderr)
        rc = 1
    except (Interrupted, KeyboardInterrupt) as e:
        print((e if isinstance(e, Interrupted) else Interrupted(signal.SIGINT)).line, file=sys.stderr)
        rc = 130 if not isinstance(e, Interrupted) or e.signum == 2 else 143
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # Under torchrun, a process that used FSDP2 on gloo sometimes aborts during interpreter
        # teardown ("terminate called without an active exception"; torch 2.13 CPU, reproduced
        # without posttrain). Everything is written and flushed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
