"""``posttrain pipeline``: pipeline-parallel training with activation offload on CPU processes."""

from __future__ import annotations

import argparse

from .options import add_config_arguments, config_from_args

__all__ = ["add_parser"]


def _run(args: argparse.Namespace) -> int:
    from posttrain.lab.plots import plot_pipeline
    from posttrain.train.sft.pipeline import PipelineConfig, format_report, measured_weight_keep, predicted_peaks, run_pipeline

    cfg = config_from_args(PipelineConfig, args)
    if cfg.dp_size > 1:
        if args.calibration_out:
            raise ValueError("--calibration-out (a pipeline run to calibrate the planner from) is for --dp-size 1")
        print(f"{cfg.schedule}: {cfg.num_ranks} ranks x {cfg.num_chunks} chunks, {cfg.dp_size} data-parallel replicas "
              f"({cfg.engine.label}, "
              f"{cfg.balance}), offload {cfg.offload}; {cfg.steps} steps on "
              f"{cfg.num_ranks * cfg.dp_size} CPU processes", flush=True)
    else:
        print(f"{cfg.schedule}: {cfg.num_ranks} ranks x {cfg.num_chunks} chunks, {cfg.num_microbatches} microbatches, "
              f"offload {cfg.offload}; {cfg.steps} steps on {cfg.num_ranks} CPU processes", flush=True)
    results = run_pipeline(cfg)
    if not results:
        print(f"nothing to do: the checkpoint in {cfg.checkpoint_dir} already holds {cfg.steps} steps"
              + (f" (--output-dir not written; posttrain export {cfg.checkpoint_dir} OUT_DIR writes the model)"
                 if cfg.output_dir else ""))
        return 0
    if results[0]["resumed_from"]:
        print(f"resumed from {cfg.checkpoint_dir} after step {results[0]['resumed_from']}")
    if cfg.dp_size > 1:
        from posttrain.train.sft.pipeline.report import format_dp_report

        predicted = {(r["dp_rank"], r["pp_rank"]): predicted_peaks(
            cfg, r["microbatches"][-1], weight_keep=measured_weight_keep([r]))[r["pp_rank"]] for r in results}
        print(format_dp_report(results, predicted))
    else:
        print(format_report(results, predicted_peaks(cfg, weight_keep=measured_weight_keep(results))))
    if cfg.output_dir:
        print(f"wrote {cfg.output_dir}")
    if args.calibration_out:
        from posttrain.lab.calibrate import write_pipeline_metrics

        write_pipeline_metrics(cfg, results, args.calibration_out)
        print(f"wrote {args.calibration_out} (posttrain plan pipeline --calibrate {args.calibration_out} plans from it)")
    if args.plot and cfg.dp_size == 1:
        path = plot_pipeline(results, args.plot, title=f"{cfg.schedule}, {cfg.num_ranks} ranks x {cfg.num_chunks} "
                             f"chunks, {cfg.num_microbatches} microbatches, offload {cfg.offload} (last step)")
        print(f"wrote {path}")
    return 0


def add_parser(sub) -> None:
    from posttrain.train.sft.pipeline import PipelineConfig

    p = sub.add_parser("pipeline", help="pipeline-parallel training with activation offload, CPU processes")
    add_config_arguments(p, PipelineConfig, defaults={"num_microbatches": 8, "dim": 128, "num_layers": 8,
                                                      "seq_len": 256, "steps": 5})
    p.add_argument("--plot", default="out/pipeline_chart.png", help="schedule chart PNG ('' for none)")
    p.add_argument("--calibration-out", default=None, metavar="FILE",
                   help="write every rank's last step (action times, saved bytes, peaks) as JSON, for "
                        "posttrain plan pipeline --calibrate")
    p.set_defaults(func=_run)
