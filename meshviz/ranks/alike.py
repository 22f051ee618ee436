"""Which ranks behave alike: the rank-dependent facts of one simulated rank's run, evaluated for every other rank."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import lru_cache

from ..core.layout import local_block
from ..core.mesh import ProcessMesh
from ..core.placements import Partial, Replicate, Shard, parse_placement
from ..core.planner import plan_reshard
from ..core.traffic import received, step_received
from ..trace.payloads import Collective, ReshardPlan, Share

__all__ = ["Facts"]

Check = Callable[[int], object]


class Facts:
    """Everything in rank ``rank``'s simulated run that depends on which rank ran it, as checks ``check(r)`` that
    give what the same point of the run would be on rank ``r``. Another rank behaves exactly as ``rank`` did
    (holds and receives the same bytes) when every check gives it what it gave ``rank`` (:meth:`alike`).

    The run is the same code on every rank (SPMD): a rank's identity reaches it through its coordinates on the
    meshes it uses and its place in the groups it talks in, and through nothing else, unless its own code reads
    its rank (``reads``), which makes it a class of its own. The checks, one per distinct point:

    * membership of every mesh the run named (a dist tensor's, a reshard's, a collective's);
    * the block of every layout a dist tensor had when an op met it (``layouts``) and every layout a reshard passed
      through, where it does not split evenly (an even split gives every member the same block);
    * for every reshard step whose blocks do not split evenly, or that moves blocks between meshes, the rank's part
      and the bytes it receives;
    * for every collective, send and receive, the rank's place in the line of the mesh axis the group is (the
      same line through the other rank), whether it is the root, and the bytes it receives; a group that is no
      mesh line makes the rank a class of its own;
    * for every flat sharding range (group sharding), the length of the range the rank holds;
    * for every pipeline step, the rank's place in the pipeline's group, which is its stage (a stage number
      that is no place on a mesh line, or a block's stage with no such step before it: the rank itself).
    """

    def __init__(self, rank: int, nranks: int, events: Iterable, layouts: Iterable = (), reads: Iterable[str] = ()):
        self.rank = rank
        self.nranks = nranks
        self.alone: list[str] = []  # why no other rank can be alike (empty: checks decide)
        self._meshes: dict = {}
        self._checks: dict = {}
        self._staged = False  # a pipeline step tied this rank's stage to its place on a mesh line
        world = ProcessMesh(list(range(nranks)), ["world"])
        self._mesh(world)
        events = list(events)
        for where in reads:
            self.alone.append(f"its function reads its rank ({where})")
        for e in events:
            for m in _event_meshes(e):
                self._mesh(m)
        for mesh, placements, shape in layouts:
            self._mesh(mesh)
            self._layout(mesh, placements, shape)
        self._lines = self._lines_through(rank)
        for e in events:
            if e.kind == "reshard":
                self._reshard(e)
            elif e.kind in ("collective", "send", "recv"):
                self._comm(e)
            elif e.kind == "ownership":
                self._share(e)
            elif e.kind == "mark" and getattr(e.payload, "stage", None) is not None:
                self._stage(e)
            elif e.kind == "compute" and getattr(e.payload, "stage", None) is not None and not self._staged:
                self.alone.append(f"a compute event names pipeline stage {e.payload.stage}")
        self._mine = self.key(rank)

    # -- the checks ------------------------------------------------------------------------------------------
    def key(self, r: int) -> tuple:
        """What ``r`` gives every check (rank ``r`` and this run's rank behave alike when the keys are equal)."""
        member = tuple(m.contains(r) for m in self._meshes.values())
        return (member,) + tuple(check(r) for check in self._checks.values())

    def alike(self, ranks: Iterable[int]) -> list[int]:
        """The ranks of ``ranks`` that behave as this run's rank did (itself included when among them)."""
        if self.alone:
            return [r for r in ranks if r == self.rank]
        return [r for r in ranks if r == self.rank or self.key(r) == self._mine]

    def __len__(self) -> int:
        return len(self._meshes) + len(self._checks)

    def __repr__(self) -> str:
        why = f", alone: {self.alone[0]}" if self.alone else ""
        return f"Facts(rank {self.rank}: {len(self._meshes)} meshes, {len(self._checks)} checks{why})"

    def _mesh(self, mesh: ProcessMesh) -> ProcessMesh:
        return self._meshes.setdefault(mesh.unique_id, mesh)

    def _add(self, key, check: Check) -> None:
        self._checks.setdefault(key, check)

    def _layout(self, mesh: ProcessMesh, placements, shape) -> None:
        pls = _plain(placements)
        if pls is None:
            if not _even_strided(mesh, placements, shape):
                self.alone.append(f"a tensor of shape {list(shape)} splits unevenly as {list(placements)}")
            return
        if _even(mesh, pls, shape):
            return
        self._add(("block", mesh.unique_id, pls, tuple(shape)), lambda r: _block(mesh, pls, tuple(shape), r))

    def _reshard(self, e) -> None:
        plan = _plan(e)
        if plan is None:
            self.alone.append(f"a reshard of {e.name or 'a tensor'} could not be planned again")
            return
        for s in plan.steps:
            if s.op == "send_recv":
                gets = _send_recv_gets(s)
                part = {x for pair in s.groups for x in pair}  # who takes part, without scanning the pairs per rank
                self._add(("send_recv", id(s)), lambda r, gets=gets, part=part: (r in part, gets.get(r, 0)))
                self._layout(s.target_mesh, s.after, s.shape)
                continue
            self._layout(s.mesh, s.before, s.shape)
            self._layout(s.mesh, s.after, s.shape)
            if not (_even(s.mesh, s.before, s.shape) and _even(s.mesh, s.after, s.shape)):
                # step_received lays out each step's lines once (cached), so every rank's check is a lookup
                self._add(("step", id(s)), lambda r, s=s: (s.mesh.contains(r), step_received(s, r, 1)))

    def _line_of(self, group):
        """(mesh, axis, positions of ``group``'s members on this rank's line), or None when no line holds them."""
        members = set(group)
        if self.rank not in members:
            return None
        holding = [(len(line), line != tuple(group), i, mesh, axis, line)
                   for i, ((mesh, axis), line) in enumerate(self._lines.items()) if members <= set(line)]
        if not holding:
            return None
        *_, mesh, axis, line = min(holding, key=lambda h: h[:3])  # the group itself, else the shortest line
        return mesh, axis, tuple(line.index(g) for g in group)

    def _comm(self, e) -> None:
        if not e.group:
            self.alone.append(f"a {e.op or e.kind} without its group")
            return
        group = [int(g) for g in (e.group[0] if isinstance(e.group[0], list) else e.group)]
        found = self._line_of(group)
        if found is None:
            self.alone.append(f"the group {group} of a {e.op or e.kind} is no line of a mesh the run used")
            return
        mesh, axis, pos = found
        p = e.payload
        root = getattr(p, "src", None) if getattr(p, "src", None) is not None else getattr(p, "dst", None)
        root_at = group.index(root) if root in group else None
        sizes = p.sizes if isinstance(p, Collective) else None
        op, kind = e.op or e.kind, e.kind

        def check(r, mesh=mesh, axis=axis, pos=pos, root_at=root_at, sizes=sizes, op=op, kind=kind):
            line = mesh.axis_group_of(r, axis)
            if line is None:
                return None
            me = line.index(r)
            if me not in pos:
                return ("out",)
            at = pos.index(me)
            if sizes is None:  # a send or receive: the bytes are the tensor's wherever it runs
                return (kind, at)
            return received(op, sizes, len(pos), at, root_at)

        self._add(("comm", op, kind, tuple(group), sizes, root_at), check)

    def _stage(self, e) -> None:
        stage, group = e.payload.stage, [int(g) for g in e.group or ()]
        found = self._line_of(group) if group else None
        if found is None or group.index(self.rank) != stage:
            self.alone.append(f"a {e.kind} event names pipeline stage {stage}")
            return
        mesh, axis, pos = found
        self._add(("stage", tuple(group)), lambda r, mesh=mesh, axis=axis, pos=pos: _place(mesh, axis, pos, r))
        self._staged = True

    def _share(self, e) -> None:
        share = e.payload
        if not isinstance(share, Share) or share.ranges is None or not e.group:
            return
        group = [int(g) for g in e.group]
        found = self._line_of(group)
        if found is None:
            self.alone.append(f"the sharding group {group} is no line of a mesh the run used")
            return
        mesh, axis, pos = found
        lengths = tuple(hi - lo for lo, hi in share.ranges)

        def check(r, mesh=mesh, axis=axis, pos=pos, lengths=lengths):
            at = _place(mesh, axis, pos, r)
            return None if at is None else lengths[at]

        self._add(("share", tuple(group), lengths), check)

    def _lines_through(self, rank: int) -> dict:
        out = {}
        for mesh in self._meshes.values():
            if mesh.contains(rank):
                for axis in range(mesh.ndim):
                    out.setdefault((mesh, axis), mesh.axis_group_of(rank, axis))
        return out


def _place(mesh: ProcessMesh, axis: int, pos: tuple, r: int) -> int | None:
    """``r``'s place in a group whose members sit at positions ``pos`` of their line along ``axis`` (the same line
    through ``r``), or None where ``r`` is not one of them."""
    line = mesh.axis_group_of(r, axis)
    if line is None or line.index(r) not in pos:
        return None
    return pos.index(line.index(r))


# -- layouts ---------------------------------------------------------------------------------------------------------

def _plain(placements) -> tuple | None:
    """meshviz placements for block purposes (Partial lies as Replicate), or None for a torch-only one."""
    out = []
    for p in placements:
        if isinstance(p, (Shard, Replicate, Partial)):
            out.append(p if isinstance(p, Shard) else Replicate())
            continue
        name = type(p).__name__
        if name == "Shard":
            out.append(Shard(p.dim))
        elif name in ("Replicate", "Partial") or name.endswith("Partial"):
            out.append(Replicate())
        else:
            return None
    return tuple(out)


def _even(mesh: ProcessMesh, placements, shape) -> bool:
    ways: dict[int, int] = {}
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            ways[p.dim] = ways.get(p.dim, 1) * mesh.shape[axis]
    return all(int(shape[d]) % k == 0 for d, k in ways.items())


def _even_strided(mesh: ProcessMesh, placements, shape) -> bool:
    ways: dict[int, int] = {}
    for axis, p in enumerate(placements):
        dim = getattr(p, "dim", None)
        if dim is not None and type(p).__name__ != "Partial":
            ways[dim] = ways.get(dim, 1) * mesh.shape[axis] * int(getattr(p, "split_factor", 1))
    return all(int(shape[d]) % k == 0 for d, k in ways.items())


def _block(mesh: ProcessMesh, placements, shape, r: int):
    coord = mesh.coordinate(r)
    if coord is None:
        return None
    return tuple(b - a for a, b in local_block(shape, mesh, placements, coord))


# -- reshards --------------------------------------------------------------------------------------------------------

@lru_cache(maxsize=4096)
def _mesh_of(shape: tuple, ids: tuple, names: tuple) -> ProcessMesh:
    return ProcessMesh(shape=list(shape), process_ids=list(ids), dim_names=list(names))


def _from_dict(d: dict) -> ProcessMesh:
    return _mesh_of(tuple(d["shape"]), tuple(d["process_ids"]), tuple(d.get("dim_names") or ()))


def _event_meshes(e):
    if e.mesh:
        yield _from_dict(e.mesh)
    p = e.payload
    if isinstance(p, ReshardPlan) and p.target_mesh:
        yield _from_dict(p.target_mesh)


@lru_cache(maxsize=4096)
def _plan_for(shape, src, before, dst, after):
    try:
        return plan_reshard(shape, src, [parse_placement(x) for x in before], dst, [parse_placement(x) for x in after],
                            itemsize=1)
    except ValueError:
        return None


def _plan(e):
    p = e.payload
    if not isinstance(p, ReshardPlan) or not e.mesh or e.placements_before is None or e.placements_after is None:
        return None
    src = _from_dict(e.mesh)
    dst = _from_dict(p.target_mesh) if p.target_mesh else src
    return _plan_for(tuple(e.shape_before or ()), src, tuple(e.placements_before), dst, tuple(e.placements_after))


def _send_recv_gets(step) -> dict:
    """target rank -> elements it receives in a send/recv step."""
    return {t: step_received(step, t, 1) for s, t in step.groups if s != t}
