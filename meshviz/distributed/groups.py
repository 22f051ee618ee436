"""Process groups built in mesh order, and torch DeviceMeshes on top of them."""

from __future__ import annotations

import torch.distributed as tdist

from ..core.mesh import ProcessMesh
from .env import get_world_size, init_parallel_env

__all__ = ["mesh_groups", "axis_group", "device_mesh", "check_mesh_in_world", "clear_cache", "group_for_ranks"]

_groups: dict = {}  # (ids, shape) -> {axis: {line tuple: ProcessGroup | None}}
_ranks_groups: dict = {}  # ranks tuple -> ProcessGroup | None
_device_meshes: dict = {}


def clear_cache() -> None:
    _groups.clear()
    _ranks_groups.clear()
    _device_meshes.clear()


def _key(mesh: ProcessMesh):
    return (tuple(mesh.shape), tuple(mesh.process_ids))


def check_mesh_in_world(mesh: ProcessMesh) -> None:
    """Raise ValueError (before any communication) when the mesh names ranks the world does not have."""
    world = get_world_size()
    bad = [r for r in mesh.process_ids if r >= world]
    if bad:
        raise ValueError(f"{mesh} names ranks {bad}, but the world has only {world} ranks (0..{world - 1})")


def group_for_ranks(ranks) -> "tdist.ProcessGroup | None":
    """A process group over ``ranks`` in the given order (every rank of the world must call this)."""
    init_parallel_env()
    ranks = tuple(int(r) for r in ranks)
    if ranks not in _ranks_groups:
        if len(ranks) == get_world_size() and ranks == tuple(range(len(ranks))):
            pg = tdist.group.WORLD
        else:
            pg = tdist.new_group(list(ranks), sort_ranks=False)
        _ranks_groups[ranks] = pg if pg not in (None, tdist.GroupMember.NON_GROUP_MEMBER) else None
    return _ranks_groups[ranks]


def mesh_groups(mesh: ProcessMesh) -> dict:
    """axis -> {line of ranks (mesh order): group}; built once per mesh, by every rank, in one fixed order."""
    key = _key(mesh)
    if key not in _groups:
        check_mesh_in_world(mesh)
        out = {}
        for axis in range(mesh.ndim):
            out[axis] = {line: group_for_ranks(line) for line in mesh.axis_groups(axis)}
        _groups[key] = out
    return _groups[key]


def axis_group(mesh: ProcessMesh, axis: int, rank: int | None = None):
    """(line, group) for this rank's line along ``axis``; (None, None) when the rank is not in the mesh."""
    rank = tdist.get_rank() if rank is None else rank
    groups = mesh_groups(mesh)
    line = mesh.axis_group_of(rank, axis)
    if line is None:
        return None, None
    return line, groups[axis][line]


def device_mesh(mesh: ProcessMesh, device_type: str | None = None):
    """A torch DeviceMesh whose coordinates are this mesh's (sub-groups in mesh order, not sorted order)."""
    from torch.distributed.device_mesh import DeviceMesh

    from .env import device

    device_type = device_type or device().type
    key = (_key(mesh), device_type)
    if key in _device_meshes:
        return _device_meshes[key]
    groups = mesh_groups(mesh)
    rank = tdist.get_rank()
    names = tuple(mesh.dim_names)
    if not mesh.contains(rank):
        dm = DeviceMesh(device_type, mesh.mesh, mesh_dim_names=names, _init_backend=False)
    else:
        pgs = [groups[a][mesh.axis_group_of(rank, a)] for a in range(mesh.ndim)]
        if mesh.ndim == 1:
            dm = DeviceMesh.from_group(pgs[0], device_type, mesh=mesh.process_ids, mesh_dim_names=names)
        else:
            dm = DeviceMesh.from_group(pgs, device_type, mesh=mesh.mesh, mesh_dim_names=names)
    _device_meshes[key] = dm
    return dm
