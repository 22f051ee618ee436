"""Data parallel for ``dist.parallelize``: ``dp_config`` (sharding_level 0-3) and the optimizer it shards."""

from __future__ import annotations

import torch

from ....runtime.zero import Zero
from ...shard_api import ShardingStage1, ShardingStage2, ShardingStage3, shard_optimizer

__all__ = ["check_dp_config", "shard_optimizer_with"]

_LEVELS = {None: None, 0: None, "0": None, 1: "1", "1": "1", 2: "2", "2": "2", 3: "3", "3": "3"}
_STAGES = {"1": ShardingStage1, "2": ShardingStage2, "3": ShardingStage3}


def check_dp_config(config: dict, mesh) -> tuple:
    """``(level, sharding_mesh_dim)`` from ``dp_config``: level None (pure data parallel) or '1'/'2'/'3'."""
    if not isinstance(config, dict):
        raise ValueError(f"dp_config should be a dict, got {type(config).__name__}")
    unknown = set(config) - {"sharding_level", "sharding_mesh_dim", "offload", "exclude_layer"}
    if unknown:
        raise ValueError(f"dp_config has unknown keys {sorted(unknown)}; it takes 'sharding_level' and "
                         f"'sharding_mesh_dim'")
    if config.get("offload"):
        raise NotImplementedError("dp_config: offload is not supported")
    if config.get("exclude_layer") is not None:
        raise NotImplementedError("dp_config: exclude_layer is not supported")
    if mesh is None:
        raise ValueError("global mesh must not be None, please call dist.auto_parallel.set_mesh(global_mesh) "
                         "firstly or pass mesh=")
    if "dp" not in mesh.dim_names:
        raise ValueError(f"dp_config needs a mesh axis named 'dp'; the mesh {mesh} has {mesh.dim_names}")
    level = config.get("sharding_level")
    if isinstance(level, bool) or level not in _LEVELS:
        raise ValueError(f"sharding_level must be 0, 1, 2 or 3, got {level!r}")
    dim = config.get("sharding_mesh_dim", "dp")
    mesh.axis(dim)  # raises on an axis the mesh does not have
    return _LEVELS[level], dim


def shard_optimizer_with(optimizer, level, sharding_mesh_dim, mesh):
    """Paddle's ParallelOptimizer: ``shard_optimizer`` with ``ShardingStage{level}(sharding_mesh_dim, mesh)``."""
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, Zero):
        raise ValueError(f"expected a torch.optim.Optimizer (not one sharded already), got {type(optimizer).__name__}")
    if level is None:
        return shard_optimizer(optimizer, None)
    if "pp" in mesh.dim_names:
        mesh = None  # parameters live on the stage sub-meshes: each is sharded along the axis of its own mesh
    return shard_optimizer(optimizer, _STAGES[level](sharding_mesh_dim, mesh))
