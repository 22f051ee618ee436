"""Pipeline parallelism, Paddle's face: PipelineLayer / PipelineParallel over the runtime's pipeline engine."""

from ...core.schedule import bubble_formula
from ...runtime.pipeline import compute_order, measured_bubble, peak_activation_bytes, transfers
from .layers import BASE_SEED, LayerDesc, PipelineLayer, SharedLayerDesc, segment_layers
from .parallel import (
    SCHEDULE_MODES,
    ActivationMeter,
    PipelineParallel,
    check_pipeline_config,
    resolve_schedule,
)


def __getattr__(name):
    if name == "TracedStage":  # imports torch.distributed.pipelining, which is slow: only when asked
        from ...runtime.pipeline.stage import TracedStage

        return TracedStage
    raise AttributeError(name)


__all__ = [
    "LayerDesc", "SharedLayerDesc", "PipelineLayer", "PipelineParallel", "TracedStage", "SCHEDULE_MODES",
    "resolve_schedule", "check_pipeline_config", "segment_layers", "ActivationMeter", "BASE_SEED",
    "bubble_formula", "measured_bubble", "compute_order", "peak_activation_bytes", "transfers",
]
