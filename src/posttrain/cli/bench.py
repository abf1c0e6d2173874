"""``posttrain bench ...``: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

import argparse
import json
import os

from .options import add_config_arguments, float_list, int_list
from .train import train_config

__all__ = ["add_parser"]

_RUN_FIELDS = ("profile", "data", "model", "engine.precision", "steps", "sequences", "max_len", "max_tokens", "dim",
               "num_layers", "optim.lr", "seed")


def _odc(args: argparse.Namespace) -> int:
    from posttrain.lab.bench.odc import bench_odc, sweep_odc

    base = train_config(args)
    if args.sweep:
        spr = int_list(args.sequences_per_rank, "--sequences-per-rank")
        mt = int_list(args.sweep_max_tokens, "--sweep-max-tokens") if args.sweep_max_tokens else [base.max_tokens]
        json_path = args.json if args.json != "out/bench_odc.json" else "out/bench_odc_sweep.json"
        sweep_odc(base, sequences_per_rank=spr, max_tokens=mt, world_size=args.world_size, repeats=args.repeats,
                  predict=not args.no_predict, json_path=json_path)
        return 0
    bench_odc(base, world_size=args.world_size, repeats=args.repeats, json_path=args.json)
    return 0


def _rl(args: argparse.Namespace) -> int:
    from posttrain.lab.bench.rl import bench_rl, draw_rollouts
    from posttrain.models import GPTConfig

    if args.rollouts:
        steps = []
        try:
            with open(args.rollouts) as f:
                steps = [json.loads(line)["samples"] for line in f if line.strip()]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"--rollouts {args.rollouts}: not a posttrain rl --record file ({e})") from None
        if len(steps) < 2:
            raise ValueError(f"--rollouts {args.rollouts}: needs 2 or more steps (the first warms up)")
    else:
        steps = draw_rollouts(args.steps, args.samples, max_new_tokens=args.max_new_tokens, seed=args.seed)
    longest = max(len(s["ids"]) for step in steps for s in step)
    max_tokens = args.max_tokens or longest
    if longest - 1 > max_tokens:
        raise ValueError(f"--max-tokens={max_tokens} is below the longest rollout ({longest} tokens)")
    vocab = max(max(s["ids"]) for step in steps for s in step) + 1
    model_cfg = GPTConfig(vocab_size=max(vocab, 2), dim=args.dim, num_layers=args.layers, num_heads=max(1, args.dim // 32),
                          max_seq_len=max_tokens)
    bench_rl(steps, model_cfg=model_cfg, max_tokens=max_tokens, world_size=args.world_size, repeats=args.repeats,
             predict=not args.no_predict, json_path=args.json or None)
    return 0


def _pipeline_dp(args: argparse.Namespace) -> int:
    from posttrain.lab.bench.pipeline_dp import bench_pipeline_dp

    for flag, value in (("--ranks", args.ranks), ("--dp-size", args.dp_size), ("--steps", args.steps),
                        ("--repeats", args.repeats), ("--sequences", args.sequences), ("--layers", args.layers)):
        if value < (2 if flag in ("--dp-size", "--steps") else 1):
            raise ValueError(f"{flag}={value} is too small (--dp-size and --steps at least 2, the others at least 1)")
    bench_pipeline_dp(ranks=args.ranks, dp_size=args.dp_size, schedule=args.schedule, dim=args.dim, layers=args.layers,
                      sequences=args.sequences, max_tokens=args.max_tokens, steps=args.steps, repeats=args.repeats,
                      offload=args.offload, json_path=args.json or None)
    return 0


def _balance(args: argparse.Namespace) -> int:
    from posttrain.lab.bench.balance import bench_balance

    result = bench_balance(world_sizes=int_list(args.world_sizes, "--world-sizes"),
                           sequences_per_rank=args.sequences_per_rank,
                           profiles=[p.strip() for p in args.profiles.split(",") if p.strip()], seeds=args.seeds)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _transport(args: argparse.Namespace) -> int:
    from posttrain.lab.bench.transport import bench_transport

    if args.iters < 1:
        raise ValueError(f"--iters={args.iters} must be at least 1")
    bench_transport(sizes_mib=float_list(args.sizes_mib, "--sizes-mib"), iters=args.iters, json_path=args.json or None)
    return 0


def _overhead(args: argparse.Namespace) -> int:
    from posttrain.lab.bench.overhead import bench_overhead

    bench_overhead(dim=args.dim, world_size=args.world_size, repeats=args.repeats)
    return 0


def _pipeline(args: argparse.Namespace) -> int:
    from posttrain.lab.bench.pipeline import bench_pipeline
    from posttrain.train.sft.pipeline import PipelineConfig

    base = PipelineConfig(model=args.model, dim=args.dim, num_layers=args.num_layers, seq_len=args.seq_len,
                          batch=args.batch, seed=args.seed)
    rank_counts = int_list(args.ranks, "--ranks")
    if min(rank_counts) < 2:
        raise ValueError(f"--ranks={args.ranks}: a pipeline needs at least 2 ranks")
    bench_pipeline(base, rank_counts=tuple(rank_counts), repeats=args.repeats, json_path=args.json)
    return 0


def add_parser(sub) -> None:
    from posttrain.train.sft import TrainConfig
    from posttrain.train.sft.pipeline import PipelineConfig

    bench = sub.add_parser("bench", help="benchmarks: ratios measured side by side in one run")
    bs = bench.add_subparsers(dest="bench", required=True)

    odc = bs.add_parser("odc", help="FSDP2 vs ODC vs the bounds, side by side, and where the gain comes from")
    add_config_arguments(odc, TrainConfig, fields=_RUN_FIELDS,
                         defaults={"steps": 8, "sequences": 16, "max_len": 1024, "max_tokens": None})
    odc.add_argument("--world-size", type=int, default=2, help="CPU processes (default 2)")
    odc.add_argument("--repeats", type=int, default=5,
                     help="interleaved rounds; ratios are medians, with the range over rounds (default 5)")
    odc.add_argument("--json", default="out/bench_odc.json",
                     help="results file (default out/bench_odc.json; with --sweep out/bench_odc_sweep.json)")
    odc.add_argument("--sweep", action="store_true",
                     help="measure ODC's mechanism and its headroom over --sequences-per-rank x --sweep-max-tokens, "
                     "beside the calibrated simulator's predictions")
    odc.add_argument("--sequences-per-rank", default="2,4,8,16", help="sweep points (default 2,4,8,16)")
    odc.add_argument("--sweep-max-tokens", default=None,
                     help="sweep points, each at least --max-len (default: --max-tokens)")
    odc.add_argument("--no-predict", action="store_true", help="sweep without the simulator's predictions")
    odc.set_defaults(func=_odc)

    rl = bs.add_parser("rl", help="the RL update on the same rollouts: ODC+diff_micro vs FSDP2 vs ODC collective")
    rl.add_argument("--rollouts", default=None, help="a posttrain rl --record file (default: rollouts drawn with RL's shape)")
    rl.add_argument("--steps", type=int, default=6, help="drawn: update steps, the first warm-up (default 6)")
    rl.add_argument("--samples", type=int, default=32, help="drawn: rollouts a step (default 32)")
    rl.add_argument("--max-new-tokens", type=int, default=1024, help="drawn: the response length limit (default 1024)")
    rl.add_argument("--max-tokens", type=int, default=None, help="microbatch token budget (default: the longest rollout)")
    rl.add_argument("--dim", type=int, default=128, help="built-in GPT width (default 128)")
    rl.add_argument("--layers", type=int, default=4, help="built-in GPT blocks (default 4)")
    rl.add_argument("--seed", type=int, default=0)
    rl.add_argument("--world-size", type=int, default=2, help="CPU processes (default 2)")
    rl.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default 5)")
    rl.add_argument("--no-predict", action="store_true", help="skip the calibrated simulator's prediction")
    rl.add_argument("--json", default="out/bench_rl.json", help="results file (default out/bench_rl.json)")
    rl.set_defaults(func=_rl)

    bal = bs.add_parser("balance", help="plan time and imbalance of every balancing method, 2-1024 ranks")
    bal.add_argument("--world-sizes", default="2,8,32,128,1024", help="comma-separated ranks (default 2,8,32,128,1024)")
    bal.add_argument("--sequences-per-rank", type=int, default=8, help="sequences per rank (default 8)")
    bal.add_argument("--profiles", default="longalign,swe_smith,long_tail,uniform,bimodal",
                     help="comma-separated length profiles (default longalign,swe_smith,long_tail,uniform,bimodal)")
    bal.add_argument("--seeds", type=int, default=5, help="minibatches per (profile, world size) (default 5)")
    bal.add_argument("--json", default="out/bench_balance.json", help="results file (default out/bench_balance.json)")
    bal.set_defaults(func=_balance)

    tr = bs.add_parser("transport", help="ODC's shared-memory gather and scatter-accumulate vs gloo, 2 ranks")
    tr.add_argument("--sizes-mib", default="1,4,16,64", help="comma-separated per-rank shard sizes in MiB (default 1,4,16,64)")
    tr.add_argument("--iters", type=int, default=10, help="timed calls per measurement (default 10)")
    tr.add_argument("--json", default="out/bench_transport.json", help="results file (default out/bench_transport.json)")
    tr.set_defaults(func=_transport)

    ov = bs.add_parser("overhead", help="one microbatch under FSDP2 and flat ODC against the plain model")
    add_config_arguments(ov, TrainConfig, fields=("dim",))
    ov.add_argument("--world-size", type=int, default=2, help="2: FSDP2 with ODC (default); 1: FSDP2 alone")
    ov.add_argument("--repeats", type=int, default=30,
                    help="interleaved iterations of each engine; times are medians (default 30)")
    ov.set_defaults(func=_overhead)

    pp = bs.add_parser("pipeline", help="saved-activation peaks per schedule and offload; our runner vs torch's")
    pp.add_argument("--ranks", default="2,4", help="comma-separated pipeline sizes (default 2,4)")
    add_config_arguments(pp, PipelineConfig, fields=("model", "dim", "num_layers", "seq_len", "batch", "seed"),
                         defaults={"dim": 128, "num_layers": 8, "seq_len": 256})
    pp.add_argument("--repeats", type=int, default=7, help="timed steps per runtime, alternating (default 7)")
    pp.add_argument("--json", default="out/bench_pipeline.json", help="results file (default out/bench_pipeline.json)")
    pp.set_defaults(func=_pipeline)

    pd = bs.add_parser("pipeline-dp", help="pipeline x data parallelism on long-tail data: ODC+diff_micro vs FSDP2")
    pd.add_argument("--ranks", type=int, default=2, help="pipeline ranks (default 2)")
    pd.add_argument("--dp-size", type=int, default=2, help="data-parallel replicas (default 2)")
    pd.add_argument("--schedule", default="1f1b", help="a schedule without split backward (default 1f1b)")
    pd.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    pd.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    pd.add_argument("--sequences", type=int, default=32, help="records a step (default 32)")
    pd.add_argument("--max-tokens", type=int, default=128, help="microbatch token budget (default 128)")
    pd.add_argument("--steps", type=int, default=5, help="steps per run, the first warm-up (default 5)")
    pd.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    pd.add_argument("--offload", default="none", help="none, full or chunks per rank (default none)")
    pd.add_argument("--json", default="out/bench_pipeline_dp.json", help="results file (default out/bench_pipeline_dp.json)")
    pd.set_defaults(func=_pipeline_dp)
