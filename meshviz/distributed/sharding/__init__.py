"""Paddle's ``paddle.distributed.sharding``: group_sharded_parallel and save_group_sharded_model."""

from .group_sharded import (
    LEVELS,
    GroupShardedOptimizer,
    GroupShardedScaler,
    Piece,
    group_sharded_parallel,
    memory_stats,
    save_group_sharded_model,
)

__all__ = [
    "group_sharded_parallel", "save_group_sharded_model", "LEVELS", "GroupShardedOptimizer",
    "GroupShardedScaler", "Piece", "memory_stats",
]
