"""Paddle's ``paddle.distributed.sharding``: group_sharded_parallel and save_group_sharded_model."""

from ...core.sharding import LEVELS, Piece
from .group_sharded import group_sharded_parallel
from .memory import memory_stats
from .optimizer import GroupShardedOptimizer
from .save import save_group_sharded_model
from .scaler import GroupShardedScaler

__all__ = [
    "group_sharded_parallel", "save_group_sharded_model", "LEVELS", "GroupShardedOptimizer",
    "GroupShardedScaler", "Piece", "memory_stats",
]
