"""posttrain command line.

    posttrain demo                          # FSDP2 then ODC: tiny GPT, 2 CPU processes, long-tail lengths
    posttrain train --dp fsdp --balance same_micro --steps 20 --metrics out/fsdp.csv
    posttrain train --dp odc --model llama --precision bf16 --checkpoint-dir out/ckpt
    posttrain train --dp odc --deterministic --activation-checkpointing --world-size 4 --replicas 2
    torchrun --nproc-per-node 2 -m posttrain train --dp odc     # one rank per torchrun process
    posttrain bench odc --profile long_tail --repeats 5
    posttrain bench odc --profile longalign --max-len 4096 --sweep --sequences-per-rank 2,4,8
    posttrain bench balance --world-sizes 2,32,1024     # plan time and imbalance per balancing method
    posttrain bench pipeline --stages 2,4
    posttrain pipeline --schedule group_interleaved --stages 2 --chunks 2 --microbatches 8 --offload 1
    posttrain simulate odc --gpus 32 --lengths longalign --model 7b     # FSDP vs ODC at cluster scale
    posttrain simulate pipeline --schedule group_interleaved --stages 8 --chunks 2 --offload-chunks 1
    posttrain simulate table                # ODC/FSDP speedup, 8-256 GPUs x LongAlign/SWE-smith x 1.5B/7B
    posttrain simulate calibrate            # simulator vs the real 2-rank benchmark and pipeline runner
    posttrain plan odc --gpus 64 --lengths swe_smith
    posttrain plan pipeline --stages 8 --memory-gib 8
    python -m posttrain demo                # the same without the console script
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


def _config(args: argparse.Namespace, **extra):
    from posttrain.train import TrainConfig

    return TrainConfig(
        profile=args.profile, data=args.data, model=args.model, precision=args.precision,
        steps=args.steps, sequences=args.sequences, max_len=args.max_len,
        max_tokens=args.max_tokens or args.max_len, dim=args.dim, num_layers=args.layers, lr=args.lr,
        seed=args.seed, **extra,
    )


def _demo(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from posttrain.demo import DEMO, run_demo

    cfg = replace(DEMO, steps=args.steps, sequences=args.sequences, max_len=args.max_len,
                  max_tokens=args.max_len, lr=args.lr, seed=args.seed)
    run_demo(cfg, world_size=args.world_size, timeline_path=args.timeline or None)
    return 0


def _train(args: argparse.Namespace) -> int:
    from posttrain.timeline import plot_timelines
    from posttrain.train import run_training

    cfg = _config(args, dp=args.dp, odc_mode=args.odc_mode, balance=args.balance, optimizer=args.optimizer,
                  deterministic=args.deterministic, activation_checkpointing=args.activation_checkpointing,
                  replicas=args.replicas, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                  progress=True)
    results = run_training(cfg, world_size=args.world_size, metrics_path=args.metrics)
    if results is not None and args.timeline and results[0]["metrics"]:
        last = results[0]["metrics"][-1]["step"]
        plot_timelines({f"{cfg.dp_label}+{cfg.balance}": [r["events"] for r in results]}, args.timeline,
                       title=f"step {last}: per-rank compute, communication and waiting")
        print(f"wrote {args.timeline}")
    return 0


def _pipeline(args: argparse.Namespace) -> int:
    from posttrain.pipeline.chart import format_report, plot_pipeline
    from posttrain.pipeline.train import PipelineConfig, predicted_peaks, run_pipeline

    cfg = PipelineConfig(schedule=args.schedule, stages=args.stages, chunks=args.chunks,
                         microbatches=args.microbatches, group_size=args.group_size, offload=args.offload,
                         model=args.model, dim=args.dim, layers=args.layers, seq_len=args.seq_len,
                         batch=args.batch, steps=args.steps, lr=args.lr, seed=args.seed)
    print(f"{cfg.schedule}: {cfg.stages} ranks x {cfg.num_chunks} chunks, {cfg.microbatches} microbatches, "
          f"offload {cfg.offload}; {cfg.steps} steps on {cfg.stages} CPU processes", flush=True)
    results = run_pipeline(cfg)
    print(format_report(results, predicted_peaks(cfg)))
    if args.chart:
        path = plot_pipeline(results, args.chart, title=f"{cfg.schedule}, {cfg.stages} ranks x {cfg.num_chunks} "
                             f"chunks, {cfg.microbatches} microbatches, offload {cfg.offload} (last step)")
        print(f"wrote {path}")
    return 0


def _bench_pipeline(args: argparse.Namespace) -> int:
    from posttrain.pipeline.bench import bench_pipeline
    from posttrain.pipeline.train import PipelineConfig

    base = PipelineConfig(model=args.model, dim=args.dim, layers=args.layers, seq_len=args.seq_len, batch=args.batch,
                          seed=args.seed)
    try:
        stage_counts = tuple(int(x) for x in args.stages.split(","))
    except ValueError:
        raise ValueError(f"--stages={args.stages!r} is not a comma-separated list of pipeline sizes, e.g. 2,4") from None
    if any(p < 2 for p in stage_counts):
        raise ValueError(f"--stages={args.stages}: a pipeline needs at least 2 stages")
    bench_pipeline(base, stage_counts=stage_counts, repeats=args.repeats, json_path=args.json)
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}={text!r} is not a comma-separated list of integers, e.g. 2,4,8") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag}={text!r} needs positive integers")
    return values


def _bench_balance(args: argparse.Namespace) -> int:
    import json

    from posttrain.bench_balance import bench_balance

    result = bench_balance(world_sizes=_int_list(args.world_sizes, "--world-sizes"),
                           sequences_per_rank=args.sequences_per_rank,
                           profiles=[p.strip() for p in args.profiles.split(",") if p.strip()], seeds=args.seeds)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _bench_odc(args: argparse.Namespace) -> int:
    from posttrain.bench import bench_odc, sweep_odc

    if args.sweep:
        spr = _int_list(args.sequences_per_rank, "--sequences-per-rank")
        mt = _int_list(args.sweep_max_tokens, "--sweep-max-tokens") if args.sweep_max_tokens else \
            [args.max_tokens or args.max_len]
        json_path = args.json if args.json != "out/bench_odc.json" else "out/bench_odc_sweep.json"
        sweep_odc(_config(args), sequences_per_rank=spr, max_tokens=mt, world_size=args.world_size,
                  repeats=args.repeats, predict=not args.no_predict, json_path=json_path)
        return 0
    bench_odc(_config(args), world_size=args.world_size, repeats=args.repeats, json_path=args.json)
    return 0


def _add_pipeline_model_args(p: argparse.ArgumentParser) -> None:
    from posttrain.models import MODELS

    p.add_argument("--model", choices=MODELS, default="gpt", help="(default gpt)")
    p.add_argument("--dim", type=int, default=128, help="hidden size (default 128)")
    p.add_argument("--layers", type=int, default=8, help="transformer blocks (default 8)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--batch", type=int, default=2, help="sequences per microbatch (default 2)")
    p.add_argument("--seed", type=int, default=0, help="data and init seed (default 0)")


def _add_run_args(p: argparse.ArgumentParser, *, steps: int, sequences: int, max_len: int, dim: int) -> None:
    from posttrain.data import PROFILES
    from posttrain.models import MODELS
    from posttrain.train import PRECISIONS

    p.add_argument("--profile", choices=PROFILES, default="long_tail", help="synthetic length profile (default long_tail)")
    p.add_argument("--data", default=None, help="train on this JSONL file of {\"input_ids\": [...]} lines instead")
    p.add_argument("--model", choices=MODELS, default="gpt", help="built-in gpt or transformers llama (default gpt)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="bf16: bf16 params, fp32 gradient reduction")
    p.add_argument("--world-size", type=int, default=2, help="CPU processes (default 2; torchrun sets its own)")
    p.add_argument("--steps", type=int, default=steps, help=f"optimizer steps (default {steps})")
    p.add_argument("--sequences", type=int, default=sequences, help=f"sequences per minibatch (default {sequences})")
    p.add_argument("--max-len", type=int, default=max_len, help=f"longest synthetic sequence (default {max_len})")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per microbatch (default: --max-len)")
    p.add_argument("--dim", type=int, default=dim, help=f"model hidden size (default {dim})")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="data and init seed (default 0)")


def build_parser() -> argparse.ArgumentParser:
    from posttrain.balance import METHODS
    from posttrain.pipeline import SCHEDULES
    from posttrain.train import DP_CHOICES

    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="FSDP2 then ODC on a tiny GPT, 2 CPU processes: table and timeline")
    demo.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default 30)")
    demo.add_argument("--world-size", type=int, default=2, help="CPU processes (default 2)")
    demo.add_argument("--sequences", type=int, default=12, help="sequences per minibatch (default 12)")
    demo.add_argument("--max-len", type=int, default=192, help="longest sequence (default 192)")
    demo.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    demo.add_argument("--seed", type=int, default=0, help="data and init seed (default 0)")
    demo.add_argument("--timeline", default="out/demo_timeline.png", help="timeline PNG ('' for none)")
    demo.set_defaults(func=_demo)

    train = sub.add_parser("train", help="train with FSDP2 or ODC on CPU processes (or under torchrun)")
    train.add_argument("--dp", choices=DP_CHOICES, default="odc",
                       help="data-parallel engine: odc (flat ODC, the fast one), fsdp (FSDP2), odc-fsdp2 (ODC on "
                       "FSDP2); odc-collective and odc-fsdp2-collective: --odc-mode collective; odc-flat and "
                       "odc-flat-collective: older names of odc and odc-collective (default odc)")
    train.add_argument("--odc-mode", choices=("odc", "collective"), default="odc",
                       help="ODC engines: odc, or collective (a barrier at every gather and reduce, equal "
                       "microbatch counts: FSDP's semantics on ODC's transport; for benchmarks) (default odc)")
    train.add_argument("--deterministic", action="store_true",
                       help="ODC engines: bitwise identical runs (gradients summed in rank order; one full "
                       "gradient of extra memory per rank)")
    train.add_argument("--activation-checkpointing", action="store_true",
                       help="recompute each block's forward in backward (saves activation memory)")
    train.add_argument("--replicas", type=int, default=1,
                       help="HSDP: shard within groups of world-size/replicas ranks, replicate across them (default 1)")
    train.add_argument("--balance", choices=METHODS, default="diff_micro", help="balancing method (default diff_micro)")
    _add_run_args(train, steps=20, sequences=16, max_len=512, dim=128)
    train.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="(default adamw)")
    train.add_argument("--checkpoint-dir", default=None, help="save checkpoints here; resume from the newest found")
    train.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (default: at the end)")
    train.add_argument("--metrics", default=None, help="per-rank, per-step metrics: .csv or JSON lines")
    train.add_argument("--timeline", default=None, help="write a per-rank timeline PNG of the last step")
    train.set_defaults(func=_train)

    pipe = sub.add_parser("pipeline", help="pipeline-parallel training with activation offload, CPU processes")
    pipe.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="(default 1f1b)")
    pipe.add_argument("--stages", type=int, default=2, help="pipeline ranks = CPU processes (default 2)")
    pipe.add_argument("--chunks", type=int, default=1, help="model chunks per rank (interleaved schedules; default 1)")
    pipe.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    pipe.add_argument("--group-size", type=int, default=None, help="group size of group_interleaved, group_interleaved_zb and interleaved_zb (default: stages)")
    pipe.add_argument("--offload", default="none", help="none, full, or chunks per rank to offload (default none)")
    _add_pipeline_model_args(pipe)
    pipe.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    pipe.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    pipe.add_argument("--chart", default="out/pipeline_chart.png", help="schedule chart PNG ('' for none)")
    pipe.set_defaults(func=_pipeline)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    odc = bench_sub.add_parser("odc", help="FSDP2 vs ODC vs the bounds, side by side, and where the gain comes from")
    _add_run_args(odc, steps=8, sequences=16, max_len=1024, dim=128)
    odc.add_argument("--repeats", type=int, default=5, help="interleaved rounds; ratios are medians, with the range over rounds (default 5)")
    odc.add_argument("--json", default="out/bench_odc.json",
                     help="results file (default out/bench_odc.json; with --sweep out/bench_odc_sweep.json)")
    odc.add_argument("--sweep", action="store_true",
                     help="measure ODC's mechanism and its headroom over --sequences-per-rank x --sweep-max-tokens, "
                     "beside the calibrated simulator's predictions")
    odc.add_argument("--sequences-per-rank", default="2,4,8,16", help="sweep points (default 2,4,8,16)")
    odc.add_argument("--sweep-max-tokens", default=None, help="sweep points, each at least --max-len "
                     "(default: --max-tokens)")
    odc.add_argument("--no-predict", action="store_true", help="sweep without the simulator's predictions")
    odc.set_defaults(func=_bench_odc)
    bb = bench_sub.add_parser("balance", help="plan time and imbalance of every balancing method, 2-1024 ranks")
    bb.add_argument("--world-sizes", default="2,8,32,128,1024", help="comma-separated ranks (default 2,8,32,128,1024)")
    bb.add_argument("--sequences-per-rank", type=int, default=8, help="sequences per rank (default 8)")
    bb.add_argument("--profiles", default="longalign,swe_smith,long_tail,uniform,bimodal",
                    help="comma-separated length profiles (default longalign,swe_smith,long_tail,uniform,bimodal)")
    bb.add_argument("--seeds", type=int, default=5, help="minibatches per (profile, world size) (default 5)")
    bb.add_argument("--json", default="out/bench_balance.json", help="results file (default out/bench_balance.json)")
    bb.set_defaults(func=_bench_balance)
    bp = bench_sub.add_parser("pipeline", help="saved-activation peaks per schedule and offload; our runner vs torch's")
    bp.add_argument("--stages", default="2,4", help="comma-separated pipeline sizes (default 2,4)")
    _add_pipeline_model_args(bp)
    bp.add_argument("--repeats", type=int, default=7, help="timed steps per runtime, alternating (default 7)")
    bp.add_argument("--json", default="out/bench_pipeline.json", help="results file (default out/bench_pipeline.json)")
    bp.set_defaults(func=_bench_pipeline)

    from posttrain._sim_cli import add_parsers

    add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
    except ValueError as e:
        print(f"posttrain: error: {e}", file=sys.stderr)
        rc = 2
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # Under torchrun, a process that used FSDP2 on gloo sometimes aborts during interpreter
        # teardown ("terminate called without an active exception"; torch 2.13 CPU, reproduced
        # without posttrain in a few of 15 runs). Everything is written and flushed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
