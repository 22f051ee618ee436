"""The reshard planner: (shape, source layout, target layout) -> ordered steps, each one collective on one mesh axis."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .crossmesh import cross_choices, cross_moves, kept_partials, landing, midway, scattered
from .layout import chunk, local_block, normalize_placements, shard_axes, with_nesting
from .mesh import ProcessMesh
from .partial import commutes, nesting, partial_axes, partial_fill, summed
from .placements import Partial, ReduceType, Replicate, Shard
from .traffic import step_most

__all__ = ["OPS", "Step", "Plan", "fmt_bytes", "plan_reshard", "simulate", "apply_step", "initial_locals", "assemble"]

# operation -> what moves
OPS = {
    "all_reduce": "Partial -> Replicate: every rank of a line gets the reduction",
    "all_gather": "Shard -> Replicate: every rank of a line gets all blocks",
    "reduce_scatter": "Partial -> Shard: each rank of a line gets its chunk of the reduction",
    "all_to_all": "Shard(a) -> Shard(b): each rank sends every partner the piece it will own",
    "slice": "Replicate -> Shard: each rank keeps its chunk, nothing moves",
    "zero_fill": "Replicate -> Partial: coordinate 0 keeps the value, the others hold the reduction's identity",
    "send_recv": "across meshes: each target rank receives its block from one source rank",
}


@dataclass(frozen=True)
class Step:
    """One step of a plan: an operation along one mesh axis (or a transfer between meshes)."""

    op: str
    mesh: ProcessMesh
    axis: int | None
    before: tuple
    after: tuple
    shape: tuple
    groups: tuple = ()  # lines of ranks along `axis`, mesh order; for send_recv: (src, dst) pairs
    bytes: int = 0  # bytes a rank receives in this step (the largest over ranks)
    dim: int | None = None  # tensor dim gathered / sliced / scattered (all_to_all: the source dim)
    dst_dim: int | None = None  # all_to_all: the target dim
    reduce: ReduceType | None = None
    target_mesh: ProcessMesh | None = None  # send_recv
    blocks: tuple | None = None  # send_recv between meshes of different shapes: each pair's slice of the source's block

    @property
    def axis_name(self) -> str | None:
        return None if self.axis is None else self.mesh.dim_names[self.axis]

    def describe(self) -> str:
        before = "[" + ", ".join(map(repr, self.before)) + "]"
        after = "[" + ", ".join(map(repr, self.after)) + "]"
        where = f"axis {self.axis_name}" if self.axis is not None else "between meshes"
        extra = ""
        if self.op == "all_to_all":
            extra = f" dim {self.dim}->{self.dst_dim}"
        elif self.dim is not None:
            extra = f" dim {self.dim}"
        if self.reduce is not None:
            extra += f" {self.reduce.short}"
        return f"{self.op:<14} {where}{extra}: {before} -> {after}, {fmt_bytes(self.bytes)}/rank"

    def __repr__(self) -> str:
        return f"Step({self.describe()})"

    def group_of(self, rank: int):
        """The line (or pairs) ``rank`` takes part in for this step; None when it has no part."""
        if self.op == "send_recv":
            mine = tuple(p for p in self.groups if rank in p)
            return mine or None
        return self.mesh.axis_group_of(rank, self.axis) if self.mesh.contains(rank) else None


def fmt_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB; a count that rounds up to 1024 of a unit is given in the next one."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        text = f"{n:.0f}" if unit == "B" else f"{n:.1f}"
        if abs(float(text)) < 1024 or unit == "GiB":  # 1048575 B is 1.0 MiB, not 1024.0 KiB
            return f"{text} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


@dataclass(frozen=True)
class Plan:
    """The ordered steps of one reshard."""

    shape: tuple
    itemsize: int
    src_mesh: ProcessMesh
    src_placements: tuple
    dst_mesh: ProcessMesh
    dst_placements: tuple
    steps: tuple = field(default_factory=tuple)

    def __iter__(self):
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i) -> Step:
        return self.steps[i]

    @property
    def ops(self) -> list[str]:
        return [s.op for s in self.steps]

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.steps)

    @property
    def cross_mesh(self) -> bool:
        return self.src_mesh != self.dst_mesh

    def describe(self) -> str:
        src = "[" + ", ".join(map(repr, self.src_placements)) + "]"
        dst = "[" + ", ".join(map(repr, self.dst_placements)) + "]"
        head = f"reshard {list(self.shape)}: {src} -> {dst}"
        if self.cross_mesh:
            head += f" (mesh {self.src_mesh.shape} -> {self.dst_mesh.shape})"
        lines = [head] + [f"  {i}. {s.describe()}" for i, s in enumerate(self.steps, 1)]  # step 1 of n, as drawn
        if not self.steps:
            lines.append("  (nothing to do)" if self.src_placements == self.dst_placements else
                         "  (no communication: the layouts differ only along mesh axes of one rank)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.describe()


# -- byte model ---------------------------------------------------------------------------------------


def _counted(step: Step, itemsize: int) -> Step:
    """``step`` with its bytes: the most any rank receives in it (:func:`~meshviz.core.traffic.step_most`)."""
    return replace(step, bytes=step_most(step, itemsize))


# -- planning -----------------------------------------------------------------------------------------


class _Builder:
    def __init__(self, shape, mesh, placements, itemsize):
        self.shape = shape
        self.mesh = mesh
        self.cur = list(placements)
        self.itemsize = itemsize
        self.steps: list[Step] = []

    def add(self, op, axis, new, **kw):
        before = tuple(self.cur)
        old = self.cur[axis]
        self.cur[axis] = Replicate() if isinstance(new, Shard) else new
        if isinstance(old, Shard):  # this axis leaves its dim's nesting (it was the innermost there)
            self.cur = with_nesting(self.cur, old.dim, [a for a in shard_axes(before, old.dim) if a != axis])
        if isinstance(new, Shard):  # a new shard is the innermost chunk of its dim
            self.cur = with_nesting(self.cur, new.dim, shard_axes(self.cur, new.dim) + [axis])
        k = self.mesh.shape[axis]
        if k == 1:  # a line of one rank holds the same block before and after: a new label, no step
            return
        self.steps.append(_counted(
            Step(op, self.mesh, axis, before, tuple(self.cur), self.shape,
                 groups=tuple(self.mesh.axis_groups(axis)) if k > 1 or op != "slice" else (), **kw),
            self.itemsize))


def _settle_and_reduce(b: _Builder, i: int, op: str, new, **kw) -> None:
    """Reduce Partial axis ``i`` by ``op``, first settling the pending Partial axes nested inside it whose reduction
    does not commute with its own (``nesting``: a later mesh axis is reduced first)."""
    rt = b.cur[i].reduce_type
    for j in reversed(partial_axes(b.cur)):
        if j > i and not commutes(b.cur[j].reduce_type, rt):
            _settle_and_reduce(b, j, "all_reduce", Replicate(), reduce=b.cur[j].reduce_type)
    b.add(op, i, new, **kw)


def _unit_axes_as(mesh, cur, dst) -> list:
    """``cur`` with every mesh axis of one rank placed as in ``dst`` (the block is the same either way: a chunk of
    one is the whole and a reduction of one summand is that summand), its shards nested where ``dst`` has them."""
    unit = [i for i in range(mesh.ndim) if mesh.shape[i] == 1]
    out = [Replicate() if i in unit and isinstance(dst[i], Shard) else (dst[i] if i in unit else p)
           for i, p in enumerate(cur)]
    for d in sorted({p.dim for p in [*cur, *dst] if isinstance(p, Shard)}):
        real, tgt = shard_axes(out, d), shard_axes(dst, d)
        nest: list[int] = []
        r = 0
        for t in tgt:  # the target's nesting as far as the real axes follow it, then the rest
            if t in unit:
                nest.append(t)
            elif r < len(real) and real[r] == t:
                nest.append(t)
                r += 1
            else:
                break
        nest += real[r:] + [a for a in tgt if a in unit and a not in nest]
        out = with_nesting(out, d, nest)
    return out


def _plan_same_mesh(shape, mesh, src, dst, itemsize) -> list[Step]:
    b = _Builder(shape, mesh, _unit_axes_as(mesh, src, dst), itemsize)
    n = mesh.ndim
    ndim = len(shape)

    # 1. Partial axes that do not stay Partial: all-reduce now, unless the target shards them (reduce-scatter later).
    for i in range(n):
        c, t = b.cur[i], dst[i]
        if isinstance(c, Partial) and c != t and not isinstance(t, Shard):
            _settle_and_reduce(b, i, "all_reduce", Replicate(), reduce=c.reduce_type)

    # 2. Un-shard what the target does not keep, from the last tensor dim down, innermost mesh axis first.
    #    Axes of one rank already sit as in the target (``_unit_axes_as``) and do not count in a nesting.
    for d in reversed(range(ndim)):
        cur_axes = _real(mesh, shard_axes(b.cur, d))
        tgt_axes = _real(mesh, shard_axes(dst, d))
        keep = 0
        while keep < min(len(cur_axes), len(tgt_axes)) and cur_axes[keep] == tgt_axes[keep]:
            keep += 1
        for i in reversed(cur_axes[keep:]):
            t = dst[i]
            if isinstance(t, Shard) and t.dim != d and _a2a_ok(mesh, b.cur, dst, i, t.dim):
                b.add("all_to_all", i, Shard(t.dim), dim=d, dst_dim=t.dim)
            else:
                b.add("all_gather", i, Replicate(), dim=d)

    # 3. Target shards and partials, outer mesh axis first, except that the axes sharding one tensor dim take their
    #    places in that dim's target nesting (each new shard is the innermost chunk). A reduction here may settle an
    #    axis already passed; the next round brings it to its target.
    order = list(range(n))
    for d in range(ndim):
        nest = shard_axes(dst, d)
        for pos, i in zip(sorted(nest), nest):
            order[pos] = i
    for _ in range(n + 1):
        if tuple(b.cur) == tuple(dst):
            break
        for i in order:
            c, t = b.cur[i], dst[i]
            if isinstance(t, Shard):
                if i in shard_axes(b.cur, t.dim):
                    continue
                if isinstance(c, Partial):
                    _settle_and_reduce(b, i, "reduce_scatter", t, dim=t.dim, reduce=c.reduce_type)
                else:
                    b.add("slice", i, t, dim=t.dim)
            elif c == t:
                continue
            elif isinstance(t, Partial):
                if isinstance(c, Partial):  # a different reduction: settle the old one first
                    _settle_and_reduce(b, i, "all_reduce", Replicate(), reduce=c.reduce_type)
                b.add("zero_fill", i, t, reduce=t.reduce_type)
            else:
                raise AssertionError(f"planner left axis {i} as {c}, target {t}")  # pragma: no cover
    if tuple(_unit_axes_as(mesh, b.cur, dst)) != tuple(dst):  # pragma: no cover
        raise ValueError(f"cannot plan {list(src)} -> {list(dst)} on mesh {mesh.shape}: reached {b.cur}")
    return _relabelled(b.steps, mesh, dst)


def _relabelled(steps, mesh, dst) -> list[Step]:
    """``steps`` with every mesh axis of one rank shown as ``dst`` has it: the steps it took there were dropped."""
    if 1 not in mesh.shape:
        return steps
    return [replace(s, before=tuple(_unit_axes_as(mesh, s.before, dst)), after=tuple(_unit_axes_as(mesh, s.after, dst)))
            for s in steps]


def _real(mesh, axes) -> list[int]:
    """``axes`` less those of one rank."""
    return [a for a in axes if mesh.shape[a] > 1]


def _a2a_ok(mesh, cur, dst, axis, b_dim) -> bool:
    """Can axis ``axis`` (innermost shard of its dim) switch to Shard(b_dim) by an all-to-all?"""
    tgt_b = shard_axes(dst, b_dim)
    return axis in tgt_b and _real(mesh, shard_axes(cur, b_dim)) == _real(mesh, tgt_b[:tgt_b.index(axis)])


def plan_reshard(shape: Sequence[int], src_mesh: ProcessMesh, src_placements, dst_mesh: ProcessMesh | None = None,
                 dst_placements=None, itemsize: int = 4) -> Plan:
    """Plan a reshard. Same mesh: per-axis collectives in the order README.md's "How a reshard is planned" gives.
    Other mesh of the same shape: reshard on the source, send/recv between ranks at the same coordinate, reshard on
    the target (:func:`_same_shape`). Other shape: reduce the source's Partial axes that do not travel as they are
    (:func:`~meshviz.core.crossmesh.kept_partials`), send each target rank its block (and summand) from a source
    rank whose block holds it (a local copy where that is the target itself), then gather and fill on the target:
    the cheapest of :func:`_other_shape`'s choices (the source gathering some shards or none; the target receiving
    pieces and gathering them).
    """
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape) or itemsize < 0:
        raise ValueError(f"plan_reshard: sizes are not negative, got shape {list(shape)} and itemsize {itemsize}")
    if dst_mesh is None:
        dst_mesh = src_mesh
    if dst_placements is None:
        raise ValueError("plan_reshard needs target placements")
    src = normalize_placements(shape, src_mesh, src_placements)
    dst = normalize_placements(shape, dst_mesh, dst_placements)
    if src_mesh == dst_mesh or (src_mesh.shape == dst_mesh.shape and src_mesh.process_ids == dst_mesh.process_ids):
        steps = _plan_same_mesh(shape, src_mesh, src, dst, itemsize)
    elif src_mesh.shape == dst_mesh.shape:
        steps = _same_shape(shape, src_mesh, src, dst_mesh, dst, itemsize)
    else:
        steps = _other_shape(shape, src_mesh, src, dst_mesh, dst, itemsize)
    return Plan(shape, itemsize, src_mesh, src, dst_mesh, dst, tuple(steps))


def _other_shape(shape, src_mesh, src, dst_mesh, dst, itemsize) -> list[Step]:
    """Between meshes of other shapes: the cheapest of :func:`~meshviz.core.crossmesh.cross_choices` (ties: the
    first): reshard on the source, send each target rank its block from one source block (or pieces), reshard on
    the target."""
    pairs = kept_partials(src_mesh, src, dst_mesh, dst)
    kept_src, kept_dst = [s for s, _ in pairs], [t for _, t in pairs]
    pre = tuple(Replicate() if isinstance(p, Partial) and i not in kept_src else p for i, p in enumerate(src))
    mid = tuple(Replicate() if isinstance(p, Partial) and i not in kept_dst else p for i, p in enumerate(dst))
    best, least, first = None, 0, {}  # the cheapest so far, its bytes; the source's steps to each layout
    for via, got, pieces in cross_choices(shape, src_mesh, src, pre, dst_mesh, dst, mid):
        if via not in first:
            first[via] = _plan_same_mesh(shape, src_mesh, src, via, itemsize)
        steps = list(first[via])
        if best is not None and sum(s.bytes for s in steps) >= least:  # no step moves fewer than 0 bytes
            continue
        moves = cross_moves(shape, src_mesh, via, dst_mesh, got, pairs, pieces)
        if moves is None:  # a target block no single source block holds
            continue
        steps.append(_counted(Step("send_recv", src_mesh, None, via, got, shape, groups=moves[0],
                                   target_mesh=dst_mesh, blocks=moves[1]), itemsize))
        if got == mid:
            b = _Builder(shape, dst_mesh, mid, itemsize)
            for i, p in enumerate(dst):
                if isinstance(p, Partial) and i not in kept_dst:
                    b.add("zero_fill", i, p, reduce=p.reduce_type)
            steps += _relabelled(b.steps, dst_mesh, dst)
        else:
            steps += _plan_same_mesh(shape, dst_mesh, got, dst, itemsize)
        if best is None or sum(s.bytes for s in steps) < least:
            best, least = steps, sum(s.bytes for s in steps)
    assert best is not None  # the source wholly gathered holds every target block
    return best


def _same_shape(shape, src_mesh, src, dst_mesh, dst, itemsize) -> list[Step]:
    """Between meshes of one shape: reshard on the source to a layout, send/recv between ranks at the same
    coordinate, reshard on the target. The layout is the target's (Paddle's N-D order: all on the source, then
    send) unless :func:`~meshviz.core.crossmesh.midway` (what shrinks on the source, the rest on the target, as
    Paddle's 1-D ``SToRReshardFunctionCrossMesh`` sends the shards and gathers on the target) or a reduce-scatter in
    place of an all-reduce, the shards sent and gathered on the target (:func:`~meshviz.core.crossmesh.scattered`),
    moves fewer bytes."""
    pairs = tuple(zip(src_mesh.process_ids, dst_mesh.process_ids))
    best: list[Step] | None = None
    for via in (dst, midway(shape, src, dst), *scattered(shape, src_mesh, src, dst)):
        via = normalize_placements(shape, src_mesh, via)
        steps = _plan_same_mesh(shape, src_mesh, src, via, itemsize)
        steps.append(_counted(Step("send_recv", src_mesh, None, via, via, shape, groups=pairs, target_mesh=dst_mesh),
                              itemsize))
        steps += _plan_same_mesh(shape, dst_mesh, via, dst, itemsize)
        if best is None or sum(s.bytes for s in steps) < sum(s.bytes for s in best):
            best = steps
    assert best is not None
    return best


# -- simulation on numpy (one process, any mesh size) -------------------------------------------------


def initial_locals(value: np.ndarray, mesh: ProcessMesh, placements) -> dict:
    """rank -> local value that ``shard_tensor(value, mesh, placements)`` gives each rank."""
    from .layout import dense_to_local

    placements = normalize_placements(value.shape, mesh, placements)
    return {mesh.rank_at(c): dense_to_local(value, mesh, placements, c) for c in np.ndindex(*mesh.shape)}


def _reduce(arrs, rt: ReduceType):
    stack = np.stack(arrs)
    if rt == ReduceType.kRedSum:
        return stack.sum(0)
    if rt == ReduceType.kRedAvg:
        return stack.mean(0)
    if rt == ReduceType.kRedMax:
        return stack.max(0)
    if rt == ReduceType.kRedMin:
        return stack.min(0)
    return stack.prod(0)


def _reduction(step: Step) -> ReduceType:
    if step.reduce is None:
        raise ValueError(f"apply_step: a {step.op} step needs its reduction")
    return step.reduce


def _take(arr, dim, k, i):
    a, b = chunk(arr.shape[dim], k, i)
    idx = [slice(None)] * arr.ndim
    idx[dim] = slice(a, b)
    return arr[tuple(idx)]


def apply_step(step: Step, locals_: dict) -> dict:
    """Run one step on simulated ranks: ``locals_`` maps rank -> numpy local value; returns the new map."""
    out = dict(locals_)
    mesh = step.mesh
    if step.op == "send_recv":
        new = {}
        for j, (s, t) in enumerate(step.groups):
            v = locals_[s]
            if step.blocks is None:
                new[t] = np.array(v)  # a copy, and a 0-d array where slicing a scalar gave a numpy scalar
                continue
            if t not in new:  # the target's block, from one source or pieces of several
                d = step.target_mesh or mesh
                new[t] = np.empty([b - a for a, b in local_block(step.shape, d, step.after, d.coordinate(t))], v.dtype)
            if all(b > a for a, b in step.blocks[j]):
                new[t][landing(step, j)] = v[tuple(slice(a, b) for a, b in step.blocks[j])]
        return new
    axis = step.axis
    if axis is None:
        raise ValueError(f"apply_step: a {step.op} step needs a mesh axis")
    k = mesh.shape[axis]
    if step.op == "slice":
        for r in locals_:
            coord = mesh.coordinate(r)
            if coord is None:
                raise ValueError(f"apply_step: rank {r} is not in the step's mesh")
            out[r] = _take(locals_[r], step.dim, k, coord[axis])
        return out
    if step.op == "zero_fill":
        for r in locals_:
            fill = partial_fill(step.after, mesh.coordinate(r), step.axis)
            if fill == "zero":
                out[r] = np.zeros_like(locals_[r])
            elif fill == "one":
                out[r] = np.ones_like(locals_[r])
        return out
    for line in step.groups:
        vals = [locals_[r] for r in line]
        if step.op == "all_gather":
            full = np.concatenate(vals, axis=step.dim)
            for r in line:
                out[r] = full
        elif step.op == "all_reduce":
            red = _reduce(vals, _reduction(step))
            for r in line:
                out[r] = red
        elif step.op == "reduce_scatter":
            red = _reduce(vals, _reduction(step))
            for i, r in enumerate(line):
                out[r] = _take(red, step.dim, k, i)
        elif step.op == "all_to_all":
            full = np.concatenate(vals, axis=step.dim)
            for i, r in enumerate(line):
                out[r] = _take(full, step.dst_dim, k, i)
        else:  # pragma: no cover
            raise ValueError(f"unknown step {step.op}")
    return out


def simulate(plan: Plan, value: np.ndarray) -> dict:
    """Execute a plan on simulated ranks starting from ``shard_tensor(value)``; rank -> final local value."""
    locals_ = initial_locals(value, plan.src_mesh, plan.src_placements)
    for step in plan.steps:
        locals_ = apply_step(step, locals_)
    return locals_


def assemble(locals_: dict, shape, mesh: ProcessMesh, placements) -> np.ndarray:
    """The global value a set of local values stands for (Partial axes reduced in ``nesting`` order)."""
    placements = normalize_placements(shape, mesh, placements)
    dense = summed(placements)
    order = nesting(placements)
    out = None
    for c in np.ndindex(*mesh.shape):
        if any(c[i] != 0 for i in order):
            continue
        value = _reduce_partial(locals_, mesh, placements, c, order)
        if out is None:
            out = np.zeros(shape, dtype=value.dtype)
        blk = local_block(shape, mesh, dense, c)
        out[tuple(slice(a, b) for a, b in blk)] = value
    if out is None:  # unreachable: the mesh's origin always takes part
        raise ValueError("assemble: an empty mesh")
    return out


def _reduce_partial(locals_, mesh, placements, c, order):
    """Reduce over the Partial axes ``order`` (innermost first) around coordinate ``c``."""
    if not order:
        return locals_[mesh.rank_at(c)]
    i, inner = order[-1], order[:-1]
    vals = []
    for j in range(mesh.shape[i]):
        cc = list(c)
        cc[i] = j
        vals.append(_reduce_partial(locals_, mesh, placements, tuple(cc), inner))
    return _reduce(vals, placements[i].reduce_type)
