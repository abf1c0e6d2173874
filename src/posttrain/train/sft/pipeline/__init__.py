"""Pipeline-parallel training runs (``posttrain pipeline``) on CPU processes or GPUs."""

from .config import PipelineConfig
from .loop import build_pipeline_model, microbatch_loss, predicted_peaks, reference_gradients, run_pipeline, step_batch
from .report import format_report, measured_weight_keep

__all__ = [
    "PipelineConfig", "build_pipeline_model", "format_report", "measured_weight_keep", "microbatch_loss",
    "predicted_peaks", "reference_gradients", "run_pipeline", "step_batch",
]
