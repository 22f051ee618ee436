"""ProcessMesh.get_group on the runtime: one communication group per line of a mesh axis."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import rank_context
from ..core.mesh import ProcessMesh, set_group_getter
from ..runtime import groups
from ..runtime.world import get_rank, get_world_size, init_parallel_env
from .collective import Group, new_group

__all__ = ["axis_group"]

@dataclass
class ProcessMeshState:
    lines: dict = field(default_factory=dict)  # (shape, ids, axis) -> {line: Group}


PROCESS_MESH = rank_context.slot("process_mesh", ProcessMeshState)


def _state() -> ProcessMeshState:
    return PROCESS_MESH.get()


def axis_group(mesh: ProcessMesh, axis: int) -> Group | None:
    """The group of the calling rank's line along ``axis`` (Paddle's ``mesh.get_group(dim_name)``).

    Every line of the axis gets its group the first time, on every rank in the same order, so that ranks on
    different lines do not wait for each other: a live group over the same ranks (the world's, one new_group made)
    where there is one, as in Paddle, else a new one. A rank outside the mesh gets None; on a 1-D mesh it gets the
    mesh's group, of which it is not a member (as Paddle's ``new_group`` gives it). A line naming ranks the world
    lacks (a mesh larger than the world) still gets its group, as in Paddle; a collective on it raises.
    """
    init_parallel_env()
    key = (tuple(mesh.shape), tuple(mesh.process_ids), axis)
    lines = _state().lines
    if key not in lines:
        world = get_world_size()
        lines[key] = {
            line: _made(line, world) or (
                new_group(list(line)) if max(line) < world
                else groups.register(sorted(line), None, missing=[r for r in line if r >= world]))
            for line in mesh.axis_groups(axis)}
    line = mesh.axis_group_of(get_rank(), axis)
    if line is None:
        return next(iter(lines[key].values())) if mesh.ndim == 1 else None
    return lines[key][line]


def _made(line, world: int) -> Group | None:
    """The live group over the ranks of ``line`` made first (the world's, then new_group's in the order they were
    made), which the line takes rather than a new one, as Paddle's ``get_group`` finds one by its ranks."""
    want = sorted(line)
    if want == list(range(world)):
        return groups.lookup(0)
    return next((g for gid, g in groups.GROUPS.get().paddle.items() if gid and sorted(g.ranks) == want), None)


set_group_getter(axis_group)
