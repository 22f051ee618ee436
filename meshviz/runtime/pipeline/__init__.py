"""The pipeline engine: stages, schedules, gradient accumulation over micro-batches, the timeline they emit."""

from .engine import SCHEDULE_MODES, PipelineEngine, check_pipeline_config, resolve_schedule
from .meter import ActivationMeter, MicroLoss
from .timeline import compute_order, measured_bubble, peak_activation_bytes, transfers


def __getattr__(name):
    if name == "TracedStage":  # imports torch.distributed.pipelining, which is slow: only when asked
        from .stage import TracedStage

        return TracedStage
    raise AttributeError(name)


__all__ = [
    "PipelineEngine", "TracedStage", "SCHEDULE_MODES", "resolve_schedule", "check_pipeline_config",
    "ActivationMeter", "MicroLoss", "measured_bubble", "compute_order", "peak_activation_bytes", "transfers",
]
