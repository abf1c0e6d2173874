"""Context parallelism's gain on its own: ``odc+diff_micro`` and ``odc+cp`` taking turns a step at a
time in the same processes (posttrain.lab.bench.stepwise), at bench odc's long_tail setting (2 ranks,
2 sequences a step up to 4,096 tokens, 11 counted steps a round, 3 rounds); prints odc+cp over
odc+diff_micro, pooled and per round.

  python scripts/cp_stepwise.py                 # the two variants
  python scripts/cp_stepwise.py --all-variants  # beside bench odc's seven other variants, as the bench runs them
  python scripts/cp_stepwise.py --one-run       # split attention with the middle shard's chunks as one run
                                                # (as before 2026-11-28), to set against a run without it
  python scripts/cp_stepwise.py --per-step      # also each step measured against the calibrated simulator
                                                # (about a minute more: the calibration of bench odc's prediction)
"""

from __future__ import annotations

import argparse
import inspect
import statistics
from dataclasses import replace


def _one_run_attention() -> None:
    """causal_blocks as before 2026-11-28: runs are not cut at half the shard."""
    import posttrain.models.split_attention as sa

    src = inspect.getsource(sa.causal_blocks)
    old = src.replace(" or i - start == half", "")
    if old == src:
        raise SystemExit("causal_blocks no longer cuts runs the way this script undoes")
    ns: dict = {}
    exec(compile(old, "causal_blocks_one_run", "exec"), sa.__dict__, ns)
    sa.causal_blocks = ns["causal_blocks"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--all-variants", action="store_true")
    p.add_argument("--one-run", action="store_true")
    p.add_argument("--per-step", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.one_run:
        _one_run_attention()  # (before the ranks fork: they inherit it)

    from posttrain.lab.bench.odc import ODC_VARIANTS, _variant_cfg
    from posttrain.lab.bench.stepwise import pooled, stepwise_rounds
    from posttrain.lab.calibrate import cp_config
    from posttrain.train.sft import TrainConfig

    base = TrainConfig(profile="long_tail", max_len=4096, max_tokens=4096, sequences=2, steps=12, device="cpu",
                       progress=False, checkpoint_dir=None)
    odc = _variant_cfg(base, "odc", "one-sided", "diff_micro")
    cfgs = ({f"{c.engine.label}+{c.balance}": c for c in (_variant_cfg(base, *v) for v in ODC_VARIANTS)}
            if args.all_variants else {"odc+diff_micro": odc})
    cfgs["odc+cp"] = cp_config(base, "auto")
    _, raw = stepwise_rounds(cfgs, world_size=2, batches=base.steps - 1, rounds=args.rounds)
    ratio = [pooled(raw, [r])["odc+cp"] / pooled(raw, [r])["odc+diff_micro"] for r in range(args.rounds)]
    both = pooled(raw)
    print(f"{len(cfgs)} variants{', one-run attention' if args.one_run else ''}: odc+cp / odc+diff_micro "
          f"{both['odc+cp'] / both['odc+diff_micro']:.3f} pooled; rounds {', '.join(f'{x:.3f}' for x in ratio)}")
    if args.per_step:
        _per_step(base, raw)
    return 0


def _per_step(base, raw) -> None:
    """Each step's median time over the rounds against the calibrated simulator's (bench odc's
    prediction: posttrain.lab.bench.odc.predict_cp's pieces)."""
    from posttrain.balance import ContextPlan
    from posttrain.lab.bench.cp_exchange import measure
    from posttrain.lab.calibrate import MeasuredSplitCost, measure_sweep_machine, step_context_plans, step_plans
    from posttrain.sim import Cluster, SimModel, plan_lengths, simulate_minibatch

    machine = measure_sweep_machine(base, [base], world_size=2, log=lambda *a, **k: None)
    lengths = [256, 512, 1024, 2048, 4096]
    got = measure(lengths, reps=5, cfg=base)["lengths"]
    split = MeasuredSplitCost(lengths, [got[n]["overhead_s (split-shm)"] for n in lengths])
    eng = machine["engine"]["one-sided"]
    model = SimModel(num_layers=base.num_layers, layer_cost=machine["layer_cost"], layer_param_bytes=0,
                     layer_grad_bytes=0, optimizer_s=eng["per_step"])
    ops = {"gather": eng["per_layer_microbatch"] / 3, "reduce": eng["per_layer_microbatch"] / 3, "add": 0.0}
    cluster = Cluster(num_gpus=2, gpus_per_node=2)

    def priced(plan):
        if not isinstance(plan, ContextPlan):
            return plan
        return replace(plan, shards=tuple(tuple(
            replace(sh, cost=model.sequence_cost(plan.lengths[sh.sequence_id]) / sh.num_shards
                    + split(plan.lengths[sh.sequence_id], sh.num_shards)) for sh in shards) for shards in plan.shards))

    plans = {"odc+diff_micro": step_plans(base, 2, "diff_micro"), "odc+cp": step_context_plans(base, 2, "auto")}
    print("step  lengths        | variant: measured ms / simulated ms (split sequences)")
    for k in range(base.steps - 1):
        row = f"{k + 1:4d}  {plans['odc+cp'][k].lengths!s:14}"
        for name, ps in plans.items():
            sim = simulate_minibatch(plan_lengths(priced(ps[k]), model.sequence_cost), strategy="odc", model=model,
                                     cluster=cluster, op_times=ops, overlap=False)
            measured = statistics.median(s["step_time_s"] for s in raw["steps"][name] if s["batch"] == k + 1)
            nsplit = len(getattr(ps[k], "split", {}))
            row += f" | {name}: {measured * 1e3:6.1f} / {sim.time * 1e3:6.1f}" + (f" ({nsplit})" if nsplit else "")
        print(row)


if __name__ == "__main__":
    raise SystemExit(main())
