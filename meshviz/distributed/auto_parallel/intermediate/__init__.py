"""Paddle 3's intermediate parallel API: `dist.parallelize` with tensor, sequence, pipeline and data parallel plans."""

from .conv_parallel import ConvParallel
from .parallelize import parallelize, parallelize_model, parallelize_optimizer
from .pipeline_parallel import SplitPoint
from .tensor_parallel import (
    ColWiseParallel,
    PlanBase,
    PrepareLayerInput,
    PrepareLayerOutput,
    RowWiseParallel,
    SequenceParallelBegin,
    SequenceParallelDisable,
    SequenceParallelEnable,
    SequenceParallelEnd,
)

__all__ = [
    "parallelize", "parallelize_model", "parallelize_optimizer", "SplitPoint", "PlanBase", "ConvParallel",
    "ColWiseParallel", "RowWiseParallel", "PrepareLayerInput", "PrepareLayerOutput",
    "SequenceParallelBegin", "SequenceParallelEnd", "SequenceParallelEnable", "SequenceParallelDisable",
]
