"""Paddle's ``fleet.meta_parallel``: tensor-parallel layers and their collectives."""

from .mp_layers import ColumnParallelLinear, ParallelCrossEntropy, RowParallelLinear, VocabParallelEmbedding
from .rng_tracker import RNGStatesTracker, get_rng_state_tracker, model_parallel_random_seed

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelCrossEntropy",
           "RNGStatesTracker", "get_rng_state_tracker", "model_parallel_random_seed"]
from ...pipeline import LayerDesc, PipelineLayer, PipelineParallel, SharedLayerDesc  # noqa: E402,F401
