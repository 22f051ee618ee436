"""Communication groups: Paddle's ``Group``, process groups in mesh order, DeviceMeshes, and the one registry."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch.distributed as tdist

from .. import compat, rank_context
from ..core.mesh import ProcessMesh
from . import rollcall
from .group_type import Group
from .world import get_world_size, global_group, set_up

__all__ = ["rank", "Group", "resolve", "world_group", "register", "lookup", "release", "group_for_ranks", "line_group",
           "mesh_groups", "axis_group", "device_mesh", "has_device_mesh", "check_mesh_in_world", "reset", "clear_cache"]


def rank() -> int:
    """This process's rank in the default group; 0 before there is one."""
    return tdist.get_rank() if tdist.is_initialized() else 0


# -- the registry, one per rank: everything below is cleared by reset() -----------------------------------------

FIRST_ID = 10  # the first id new_group gives, as Paddle's (its ring ids start after nrings' 9)


@dataclass
class GroupsState:
    paddle: dict = field(default_factory=dict)  # id -> the Group new_group made (0: the world)
    ids: itertools.count = field(default_factory=lambda: itertools.count(FIRST_ID))
    by_ranks: dict = field(default_factory=dict)  # ranks in group order -> ProcessGroup | None (not a member)
    lines: dict = field(default_factory=dict)  # ranks in group order -> an unregistered Group over them (id -1)
    by_pg: dict = field(default_factory=dict)  # id(ProcessGroup) -> (ProcessGroup, Group) for torch groups given
    meshes: dict = field(default_factory=dict)  # (shape, ids) -> {axis: {line tuple: ProcessGroup | None}}
    device_meshes: dict = field(default_factory=dict)


GROUPS = rank_context.slot("groups", GroupsState)


def _state() -> GroupsState:
    return GROUPS.get()


def reset() -> None:
    """Forget every group (the process groups behind them are gone, or about to be: a new world starts)."""
    GROUPS.reset()


clear_cache = reset


def world_group() -> Group:
    """Group 0: the whole world, in rank order (the one ``init_parallel_env`` returns)."""
    set_up()
    g = _state().paddle[0] = global_group()
    return g


def register(ranks, pg, missing=()) -> Group:
    """A new Paddle group over ``ranks`` with the next id (every rank registers the same groups in one order);
    ``missing``: its ranks the world lacks (no process group, as Paddle's lazily made one, until it is used)."""
    me = tdist.get_rank()
    gid = next(_state().ids)
    g = Group(ranks.index(me) if me in ranks else -1, gid, ranks, pg, missing=missing)
    _state().paddle[gid] = g
    return g


def lookup(id: int) -> Group | None:
    return world_group() if id == 0 else _state().paddle.get(id)


def release(group: Group) -> None:
    """Unregister a Paddle group; its process group is destroyed unless a mesh or another group still uses it."""
    if _state().paddle.get(group.id) is not group:
        raise ValueError(f"destroy_process_group: {group} is not a live group (destroyed already?)")
    del _state().paddle[group.id]
    pg = group.process_group
    if pg is None or pg is tdist.group.WORLD:
        return
    shared = any(g.process_group is pg for g in _state().paddle.values()) or any(
        p is pg for axes in _state().meshes.values() for lines in axes.values() for p in lines.values())
    if not shared:
        for key in [k for k, p in _state().by_ranks.items() if p is pg]:
            del _state().by_ranks[key]
            _state().lines.pop(key, None)
        _state().by_pg.pop(id(pg), None)
        tdist.destroy_process_group(pg)


def group_for_ranks(ranks) -> "tdist.ProcessGroup | None":
    """A process group over ``ranks`` in the given order (every rank of the world must call this)."""
    set_up()
    ranks = tuple(int(r) for r in ranks)
    if ranks not in _state().by_ranks:
        if len(ranks) == get_world_size() and ranks == tuple(range(len(ranks))):
            pg = tdist.group.WORLD
        else:
            pg = _new_group(ranks)
        _state().by_ranks[ranks] = pg if pg not in (None, tdist.GroupMember.NON_GROUP_MEMBER) else None
    return _state().by_ranks[ranks]


def _new_group(ranks: tuple):
    """``compat.new_group_in_order``, shown by the roll-call as a wait on the world; where the others do not come
    (they make other groups, or none), it fails after the collective timeout saying so."""
    rec = rollcall.current()
    prev = rec.enter("new_group", tuple(range(get_world_size())), counted=False)
    try:
        return compat.new_group_in_order(ranks)
    except RuntimeError as e:
        raise RuntimeError(
            f"making the process group over ranks {list(ranks)} failed: every rank of the world makes the same groups "
            f"in the same order (a ProcessMesh or new_group given other ranks, or used, on some ranks only, waits "
            f"for the others until the timeout); torch: {e}") from None
    finally:
        rec.leave(prev)


def line_group(ranks) -> Group:
    """The Group over ``ranks`` in this order (a mesh line), built once; no Paddle id (-1)."""
    key = tuple(ranks)
    g = _state().lines.get(key)
    if g is None:
        world = get_world_size()
        missing = [r for r in key if not 0 <= r < world]  # a collective on it names them (comm.membership)
        pg = group_for_ranks(key) if not missing else None
        me = tdist.get_rank()
        g = Group(key.index(me) if me in key else -1, -1, key, pg, name=f"line{list(key)}", missing=missing)
        _state().lines[key] = g
    return g


def resolve(group) -> Group:
    """The one reading of a ``group`` argument: a Paddle Group, a torch ProcessGroup, a sequence of ranks (in
    order: a mesh line) or None (the world)."""
    if group is None:
        return world_group()
    if isinstance(group, Group):
        return group
    if isinstance(group, tdist.ProcessGroup):
        hit = _state().by_pg.get(id(group))
        if hit is not None and hit[0] is group:
            return hit[1]
        if group is tdist.group.WORLD:
            return world_group()
        ranks = tdist.get_process_group_ranks(group)
        me = tdist.get_rank()
        g = Group(ranks.index(me) if me in ranks else -1, -1, ranks, group, name=getattr(group, "group_name", None))
        _state().by_pg[id(group)] = (group, g)
        return g
    if isinstance(group, (tuple, list)) and all(isinstance(r, int) and not isinstance(r, bool) for r in group):
        return line_group(group)
    raise TypeError("group must be a meshviz Group, a torch ProcessGroup, a sequence of ranks or None, "
                    f"got {type(group).__name__}")


# -- meshes ----------------------------------------------------------------------------------------------------

def _key(mesh: ProcessMesh):
    return mesh.unique_id  # one number per (shape, ids) in this process


def check_mesh_in_world(mesh: ProcessMesh) -> None:
    """Raise ValueError (before any communication) when the mesh names ranks the world does not have."""
    if _key(mesh) in _state().meshes:  # checked when its groups were built (a new world forgets them)
        return
    world = get_world_size()
    bad = [r for r in mesh.process_ids if r >= world]
    if bad:
        raise ValueError(f"{mesh} names ranks {bad}, but the world has only {world} ranks (0..{world - 1})")


def mesh_groups(mesh: ProcessMesh) -> dict:
    """axis -> {line of ranks (mesh order): group}; built once per mesh, by every rank, in one fixed order."""
    meshes = _state().meshes
    out = meshes.get(_key(mesh))
    if out is None:
        check_mesh_in_world(mesh)
        out = {}
        for axis in range(mesh.ndim):
            out[axis] = {line: group_for_ranks(line) for line in mesh.axis_groups(axis)}
        meshes[_key(mesh)] = out
    return out


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
    if device_type is None:
        from .world import device

        device_type = device().type
    key = (_key(mesh), device_type)
    made = _state().device_meshes
    dm = made.get(key)
    if dm is not None:
        return dm
    from torch.distributed.device_mesh import DeviceMesh

    groups = mesh_groups(mesh)
    rank = tdist.get_rank()
    names = tuple(mesh.dim_names)
    if not mesh.contains(rank):
        dm = compat.device_mesh_without_backend(device_type, mesh.mesh, names)
    else:
        pgs = [groups[a][mesh.axis_group_of(rank, a)] for a in range(mesh.ndim)]
        if mesh.ndim == 1:
            dm = DeviceMesh.from_group(pgs[0], device_type, mesh=mesh.process_ids, mesh_dim_names=names)
        else:
            dm = DeviceMesh.from_group(pgs, device_type, mesh=mesh.mesh, mesh_dim_names=names)
    made[key] = dm
    return dm


def has_device_mesh(mesh: ProcessMesh, device_type: str) -> bool:
    """Has this rank made ``mesh``'s DeviceMesh for ``device_type`` (and so its groups)?"""
    return (_key(mesh), device_type) in _state().device_meshes
