"""The pure core: meshes, placements, block layout and the reshard planner (no torch.distributed)."""

from .layout import Layout, chunk, layout, local_block, local_shape, normalize_placements
from .mesh import ProcessMesh
from .placements import Partial, Placement, ReduceType, Replicate, Shard, parse_placement

__all__ = [
    "ProcessMesh", "Placement", "Shard", "Replicate", "Partial", "ReduceType", "parse_placement",
    "Layout", "layout", "local_block", "local_shape", "chunk", "normalize_placements",
]

from .planner import Plan, Step, plan_reshard, simulate  # noqa: E402

__all__ += ["Plan", "Step", "plan_reshard", "simulate"]
