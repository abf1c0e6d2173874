"""``posttrain pipeline``: pipeline-parallel training with activation offload, on CPU processes or GPUs."""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.train.sft.pipeline import PipelineConfig

from .options import add_command, field_flags, name_flags

__all__ = ["PipelineCommand", "add_parser"]


@dataclass(frozen=True)
class PipelineCommand:
    """``posttrain pipeline``: one run, its chart and its calibration record.

    Attributes:
        run: the pipeline run.
        plot: schedule chart PNG ('' for none; with ``dp_size`` 1).
        calibration_out: write every rank's last step (action times, saved bytes, peaks) as
            JSON, for posttrain plan pipeline --calibrate (with ``dp_size`` 1).
    """

    run: PipelineConfig = field(
        default_factory=lambda: PipelineConfig(num_microbatches=8, dim=128, num_layers=8, seq_len=256, steps=5),
        # the engine options the pipeline refuses so far
        metadata={"exclude": ("engine.precision", "engine.activation_checkpointing", "engine.replicas",
                                   "engine.context_parallel")})
    plot: str = "out/pipeline_chart.png"
    calibration_out: str | None = None

    def __post_init__(self) -> None:
        if self.calibration_out and self.run.dp_size > 1:
            raise ValueError("`calibration_out` (a pipeline run to calibrate the planner from) is for `dp_size` 1")


def _run(c: PipelineCommand) -> int:
    from dataclasses import replace

    from posttrain.lab.plots import plot_pipeline
    from posttrain.text import count
    from posttrain.train.core import check_run, placement
    from posttrain.train.sft.pipeline import format_report, measured_weight_keep, predicted_peaks, run_pipeline
    from posttrain.train.sft.pipeline.loop import resolve_epochs

    cfg = replace(c.run, progress=True)
    if cfg.epochs:  # the steps follow from the tokenized data (outputs and checkpoint checked first)
        check_run(cfg)
        cfg = resolve_epochs(cfg, log=print)
    if cfg.dp_size > 1:
        print(f"{cfg.schedule}: {count(cfg.num_ranks, 'rank')} x {count(cfg.num_chunks, 'chunk')}, "
              f"{count(cfg.dp_size, 'data-parallel pipeline')} ({cfg.engine.label}, {cfg.balance}), offload "
              f"{_offload(cfg)}; {count(cfg.steps, 'step')} on "
              f"{placement(cfg.device_kind, cfg.num_ranks * cfg.dp_size)}", flush=True)
    else:
        print(f"{cfg.schedule}: {count(cfg.num_ranks, 'rank')} x {count(cfg.num_chunks, 'chunk')}, "
              f"{count(cfg.num_microbatches, 'microbatch', 'microbatches')}, offload {_offload(cfg)}; "
              f"{count(cfg.steps, 'step')} on {placement(cfg.device_kind, cfg.num_ranks)}", flush=True)
    results = run_pipeline(cfg)
    if not results:
        print(f"nothing to do: the checkpoint in {cfg.checkpoint_dir} already holds {cfg.steps} steps"
              + (f" (--output-dir not written; posttrain export {cfg.checkpoint_dir} OUT_DIR writes the model)"
                 if cfg.output_dir else ""))
        return 0
    if cfg.dp_size > 1:
        from posttrain.train.sft.pipeline.report import format_dp_report

        predicted = {(r["dp_rank"], r["pp_rank"]): predicted_peaks(
            cfg, r["microbatches"][-1], weight_keep=measured_weight_keep([r]))[r["pp_rank"]] for r in results}
        print(format_dp_report(results, predicted))
    else:
        report = format_report(results, predicted_peaks(cfg, weight_keep=measured_weight_keep(results)))
        print(name_flags(report, field_flags(PipelineCommand)))  # (the report names parameters)
    if cfg.output_dir:
        print(f"wrote {cfg.output_dir}")
    if c.calibration_out:
        from posttrain.lab.calibrate import write_pipeline_metrics

        write_pipeline_metrics(cfg, results, c.calibration_out)
        print(f"wrote {c.calibration_out} (posttrain plan pipeline --calibrate {c.calibration_out} plans from it)")
    if c.plot and cfg.dp_size == 1:
        path = plot_pipeline(results, c.plot, title=f"{cfg.schedule}, {cfg.num_ranks} ranks x {cfg.num_chunks} "
                             f"chunks, {cfg.num_microbatches} microbatches, offload {_offload(cfg)} (last step)")
        print(f"wrote {path}")
    return 0


def add_parser(sub) -> None:
    add_command(sub, "pipeline", PipelineCommand, _run, config_file=True,
                help="pipeline-parallel training with activation offload, on CPU processes or GPUs")


def _offload(cfg) -> str:
    """The run's offload as the banner says it: ``full``, ``1`` (chunks), ``full (0.3 of each)``."""
    share = cfg.offload != "none" and cfg.offload_fraction != 1
    return cfg.offload + (f" ({cfg.offload_fraction:g} of each)" if share else "")
