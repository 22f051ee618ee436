"""Paddle's ``fleet.meta_parallel``: tensor-parallel layers and their collectives."""

from .mp_layers import ColumnParallelLinear, ParallelCrossEntropy, RowParallelLinear, VocabParallelEmbedding

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelCrossEntropy"]
from ...pipeline import LayerDesc, PipelineLayer, PipelineParallel, SharedLayerDesc  # noqa: E402,F401
