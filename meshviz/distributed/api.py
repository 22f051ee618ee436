"""Paddle's auto-parallel tensor API: shard_tensor, reshard, dtensor_from_local, unshard_dtensor, local_map."""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as tdist
import torch.utils._pytree as pytree

from .. import compat, trace
from ..core.layout import Layout, local_block, local_shape, normalize_placements, pad_placements, shard_axes
from ..core.mesh import ProcessMesh
from ..core.placements import Replicate, Shard
from ..runtime import groups, ops  # noqa: F401  (ops: every op on a dist tensor goes through it)
from ..runtime.autograd import from_local, local_block_of, plan_of, run_reshard, to_local
from ..runtime.autograd import place as place_dense
from ..runtime.autograd import reshard as reshard_fn
from ..runtime.devices import device
from ..runtime.dtensor import DistTensor, make_dist
from ..runtime.match import called_as, checking
from ..runtime.rollcall import refusing
from ..runtime.world import init_parallel_env
from ..trace.status import name_ranks

__all__ = [
    "shard_tensor",
    "dtensor_from_fn",
    "dtensor_from_local",
    "dtensor_to_local",
    "unshard_dtensor",
    "reshard",
    "local_map",
    "is_dist_tensor",
    "plan_of",
]


def _rank() -> int:
    return tdist.get_rank()


def _check(mesh, placements, shape) -> tuple:
    """Validate everything a call needs, on every rank, before any communication."""
    if not isinstance(mesh, ProcessMesh):
        raise ValueError(f"expected a ProcessMesh, got {type(mesh).__name__}: {mesh!r}")
    pl = normalize_placements(shape, mesh, placements)
    init_parallel_env()
    groups.check_mesh_in_world(mesh)
    return pl


def _torch_dtype(dtype) -> torch.dtype | None:
    """A torch dtype for what Paddle accepts as one: a torch dtype, a name ('float32') or a numpy dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    except TypeError:
        name = None
    found = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(found, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use a torch dtype or a name such as 'float32' or 'int64'")
    return found


def _as_tensor(data, dtype=None) -> torch.Tensor:
    dtype = _torch_dtype(dtype)
    if isinstance(data, torch.Tensor):
        return data if dtype is None else data.to(dtype)
    if isinstance(data, np.ndarray):
        return torch.from_numpy(data).to(dtype) if dtype else torch.from_numpy(data)
    try:
        return torch.as_tensor(data, dtype=dtype)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"expected a tensor, a numpy array, a number or a (nested) list of numbers, got "
                        f"{type(data).__name__}: {e}") from None


def _emit_placed(t: DistTensor, how: str) -> None:
    if not trace.active():
        return
    local = t._local
    trace.emit(trace.Event(
        kind="placed", name=t.name, tensor_id=t.tensor_id, op=how, mesh=t.process_mesh.to_dict(),
        placements_after=[repr(p) for p in t.placements], shape_after=list(t.shape),
        local_shape=list(local.shape), values=trace.small_values(local),
        payload=trace.Placed(dtype=str(t.dtype).replace("torch.", "")),
    ))


@refusing
def shard_tensor(data, mesh: ProcessMesh, placements: Sequence, dtype=None, place=None, stop_gradient=None,
                 name: str | None = None):
    """Every rank passes the same full tensor; each keeps the block its mesh coordinate holds. No communication.

    A parameter stays a parameter (``nn.Parameter`` of a DistTensor). Ranks outside the mesh hold an empty block.
    """
    if isinstance(data, DistTensor):
        out = reshard(data, mesh, placements)
    else:
        dense = _as_tensor(data, dtype)
        pl = _check(mesh, placements, tuple(dense.shape))
        is_param = isinstance(data, torch.nn.Parameter)
        requires_grad = dense.requires_grad if stop_gradient is None else not stop_gradient
        if dense.requires_grad and not dense.is_leaf:
            out = place_dense(dense, mesh, pl)
        else:
            out = make_dist(local_block_of(dense, mesh, pl), mesh, pl, dense.shape,
                            requires_grad=requires_grad and not is_param)
        if is_param:
            out = torch.nn.Parameter(out, requires_grad=requires_grad)
            lazy = data.__dict__.get("_mv_lazy")
            if lazy is not None:  # a LazyGuard parameter: its block comes with initialize()
                lazy.carry(data, out)
        out.name = name or getattr(data, "name", None)
        _emit_placed(out, "shard_tensor")
        return out
    if name:
        out.name = name
    return out


def dtensor_from_fn(fn, mesh: ProcessMesh, placements: Sequence, *args, **kwargs):
    """``shard_tensor(fn(*args, **kwargs), mesh, placements)``: every rank builds the same full tensor (``torch.ones``,
    ``torch.randn`` after the same seed ...) and keeps its block."""
    if not callable(fn):
        raise ValueError(f"dtensor_from_fn: fn must be callable (torch.ones, torch.zeros ...), got {fn!r}")
    return shard_tensor(fn(*args, **kwargs), mesh, placements)


def _global_shape(local: torch.Tensor, mesh: ProcessMesh, placements) -> list[int]:
    shape = list(local.shape)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            if not -len(shape) <= p.dim < len(shape):
                raise ValueError(f"Shard({p.dim}) is out of range for a {len(shape)}-D local tensor")
            shape[p.dim % len(shape)] *= mesh.shape[axis]
    return shape


@refusing
def dtensor_from_local(local_tensor, mesh: ProcessMesh, placements, shape=None):
    """A dist tensor whose block on this rank is ``local_tensor`` (global shape: local x mesh, unless ``shape``).

    Every rank calls it. Where ``shape`` is given (or collectives are checked, ``MESHVIZ_CHECK_COLLECTIVES=1``), one
    small all-gather of the block shapes checks that every rank of the mesh holds the block the global shape gives it
    and that the ranks agree on that shape; where not, every rank raises the same ValueError naming the ranks and
    their blocks (uneven blocks need ``shape``: each rank's block times the mesh differs between them). Without
    ``shape`` the check is left out of the hot path (a LocalLayer's outputs, a split dataset's batches).
    """
    if isinstance(local_tensor, DistTensor):
        raise ValueError("dtensor_from_local takes this rank's block as a dense tensor, got a dist tensor; use "
                         "dist.reshard to change its layout, or dist.dtensor_to_local(t) for its block")
    local = _as_tensor(local_tensor)
    if not isinstance(mesh, ProcessMesh):
        raise ValueError(f"expected a ProcessMesh, got {mesh!r}")
    placements = pad_placements(placements, mesh)
    given = shape is not None
    if shape is None:
        shape = _global_shape(local, mesh, placements)
    elif not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"dtensor_from_local: shape must be the global shape, non-negative ints, got {shape!r}")
    shape = [int(d) for d in shape]
    pl = _check(mesh, placements, tuple(shape))
    member = mesh.contains(_rank())
    _check_blocks(list(local.shape) if member else None, mesh, pl, shape, given, local.dtype)
    if not member:
        local = compat.empty_block(local.dtype, local.device)
    out = from_local(local, mesh, pl, shape)
    _emit_placed(out, "dtensor_from_local")
    return out


def _shape_code(shape) -> int:
    return zlib.crc32(repr([int(d) for d in shape]).encode())


def _exchange(row: list[int]) -> list[list[int]]:
    """Every rank's ``row`` (of one length on all), by one all-gather over the world (under the world's timeout)."""
    n = tdist.get_world_size()
    mine = torch.tensor(row, dtype=torch.int64, device=device())
    out = torch.empty(n * len(row), dtype=torch.int64, device=mine.device)
    compat.all_gather_single(out, mine)
    return out.view(n, len(row)).tolist()


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode())


def _check_blocks(mine: list[int] | None, mesh: ProcessMesh, pl, shape: list[int], given: bool,
                  dtype: torch.dtype = torch.float32) -> None:
    """ValueError on every rank unless every rank of ``mesh`` holds the block (``mine``: this rank's; None off the
    mesh) that ``pl`` gives it of one global ``shape`` they all agree on, in one ``dtype``. Block shapes travel only
    when that fails."""
    me = _rank()
    fits = mine is None or mine == list(local_shape(shape, mesh, pl, mesh.coordinate(me)))
    if not (given or checking()) or tdist.get_world_size() == 1 or tdist.get_backend() == "simulated":
        # no peer asked: this rank's own block
        if not fits:
            raise ValueError(_misfits(mesh, pl, shape, {me: mine}))
        return
    head = [int(mine is not None), int(fits), int(given), len(mine or ()), len(shape), _shape_code(shape),
            _dtype_code(dtype)]
    rows = _exchange(head)
    members = [r for r, h in enumerate(rows) if h[0]]
    if len({rows[r][6] for r in members}) > 1:
        names = {_dtype_code(d): str(d).removeprefix("torch.") for d in vars(torch).values()
                 if isinstance(d, torch.dtype)}
        by: dict = {}
        for r in members:
            by.setdefault(names.get(rows[r][6], "another dtype"), []).append(r)
        raise ValueError("dtensor_from_local: the ranks of the mesh give blocks of different dtypes: "
                         + "; ".join(f"{name_ranks(rs)}: {d}" for d, rs in by.items())
                         + ". Pass every rank's block in one dtype")
    rows = [h[:6] for h in rows]
    if all(rows[r][1] for r in members) and len({tuple(rows[r][4:]) for r in members}) <= 1:
        return
    k = max(max(h[3], h[4]) for h in rows)
    pad = lambda dims: list(dims) + [-1] * (k - len(dims))
    full = _exchange(pad(mine or ()) + pad(shape))
    blocks = {r: full[r][: rows[r][3]] for r in members}
    shapes = {r: full[r][k: k + rows[r][4]] for r in members}
    if len({tuple(v) for v in shapes.values()}) > 1:
        raise ValueError(_disagree(mesh, pl, blocks, shapes, {r: bool(rows[r][2]) for r in members}))
    raise ValueError(_misfits(mesh, pl, shapes[members[0]], {r: blocks[r] for r in members if not rows[r][1]}))


def _misfits(mesh: ProcessMesh, pl, shape, held: dict) -> str:
    parts = [f"rank {r} holds {b} (its block: {list(local_shape(shape, mesh, pl, mesh.coordinate(r)))})"
             for r, b in sorted(held.items())]
    return (f"dtensor_from_local: the local tensor does not match the block that {list(pl)} on {mesh} gives each "
            f"rank of a global shape {list(shape)}: " + "; ".join(parts))


def _disagree(mesh: ProcessMesh, pl, blocks: dict, shapes: dict, given: dict) -> str:
    kinds: dict = {}
    for r in sorted(shapes):
        kinds.setdefault((tuple(shapes[r]), given[r], tuple(blocks[r])), []).append(r)
    parts = []
    for (s, g, b), rs in kinds.items():
        whose = "its" if len(rs) == 1 else "their"
        parts.append(f"{name_ranks(rs)}: shape={list(s)} ({whose} block {list(b)})" if g else
                     f"{name_ranks(rs)}: {list(s)} ({whose} block {list(b)} times the mesh)")
    text = "dtensor_from_local: the ranks of the mesh give different global shapes: " + "; ".join(parts)
    fit = _fitting_shape(mesh, pl, blocks)
    if fit is not None:
        return text + f". The blocks are those of a global shape {fit}: pass shape={fit} on every rank"
    return text + ". Pass the one global shape (shape=[...]) on every rank, each with its block of it"


def _fitting_shape(mesh: ProcessMesh, pl, blocks: dict) -> list[int] | None:
    """The global shape whose blocks are ``blocks`` (rank -> block shape), if there is one."""
    if len({len(b) for b in blocks.values()}) != 1:
        return None
    ndim = len(next(iter(blocks.values())))
    if any(isinstance(p, Shard) and p.dim >= ndim for p in pl):
        return None
    shape = []
    for d in range(ndim):
        axes = shard_axes(pl, d)
        chunks: dict = {}
        for r, b in blocks.items():
            coord = mesh.coordinate(r)
            chunks.setdefault(tuple(coord[a] for a in axes), b[d])
        shape.append(sum(chunks.values()))
    ok = all(list(local_shape(shape, mesh, pl, mesh.coordinate(r))) == list(b) for r, b in blocks.items())
    return shape if ok else None


@refusing
def dtensor_to_local(dist_tensor, mesh=None, placements=None) -> torch.Tensor:
    """This rank's block of ``dist_tensor`` (differentiable). No communication.

    ``mesh`` and ``placements`` are the layout of the gradient flowing back into ``dist_tensor``, as in Paddle (and
    torch's ``to_local(grad_placements=...)``): the block's gradient on each rank becomes that rank's block of a
    gradient laid out so, e.g. ``[Partial()]`` where each rank's block feeds a different computation. None (Paddle
    requires both): the tensor's own. Where a gradient can flow, the mesh must be the tensor's and the placements
    must give every rank a block shaped as its block of the tensor, or every rank raises ValueError (Paddle makes a
    gradient whose blocks do not fit its layout).
    """
    if not isinstance(dist_tensor, DistTensor):
        raise ValueError(f"dtensor_to_local expects a dist tensor, got {type(dist_tensor).__name__}")
    if mesh is None and placements is None:
        return to_local(dist_tensor)
    own = dist_tensor.process_mesh
    mesh = own if mesh is None else mesh
    if not isinstance(mesh, ProcessMesh):
        raise ValueError(f"dtensor_to_local: mesh must be a ProcessMesh (the gradient's), got {mesh!r}")
    shape = tuple(dist_tensor.shape)
    pl = dist_tensor.placements if placements is None else list(normalize_placements(shape, mesh, placements))
    if not (dist_tensor.requires_grad and torch.is_grad_enabled()):
        return to_local(dist_tensor)  # no gradient flows back: its layout is not used (Paddle's LocalLayer example)
    if mesh != own:
        raise ValueError(f"dtensor_to_local: the gradient's mesh {mesh} is not the tensor's {own}; a gradient lies "
                         "on its tensor's mesh (dist.reshard moves the tensor first)")
    misfit = _grad_misfit(shape, mesh, tuple(dist_tensor.placements), tuple(pl))
    if misfit is not None:
        rank, held, given = misfit
        raise ValueError(f"dtensor_to_local: the gradient's placements {pl} give rank {rank} a block of shape "
                         f"{given} of the global shape {list(shape)}, but its block of the tensor "
                         f"({dist_tensor.placements}) has shape {held}: a rank's gradient is its block's")
    return to_local(dist_tensor, mesh, pl)


@functools.lru_cache(maxsize=1024)
def _grad_misfit(shape: tuple, mesh: ProcessMesh, held: tuple, given: tuple) -> tuple | None:
    """(rank, its block's shape, its gradient block's shape) for the first rank of ``mesh`` where the two layouts'
    blocks differ in shape, or None. The same answer on every rank: no communication."""
    if held == given:
        return None
    a, b = (Layout(shape, mesh, pl).bounds() for pl in (held, given))
    sizes, grad_sizes = a[..., 1] - a[..., 0], b[..., 1] - b[..., 0]
    differ = np.flatnonzero((sizes != grad_sizes).any(axis=1))
    if not len(differ):
        return None
    i = int(differ[0])
    return int(mesh.ids.ravel()[i]), sizes[i].tolist(), grad_sizes[i].tolist()


def is_dist_tensor(t) -> bool:
    return isinstance(t, DistTensor)


@refusing
def reshard(dist_tensor, mesh: ProcessMesh, placements: Sequence):
    """Move ``dist_tensor`` to ``placements`` on ``mesh``, running the planner's steps; differentiable."""
    if not isinstance(dist_tensor, DistTensor):
        raise ValueError(
            f"reshard expects a dist tensor (from shard_tensor or dtensor_from_local), got "
            f"{type(dist_tensor).__name__}")
    pl = _check(mesh, placements, tuple(dist_tensor.shape))
    groups.mesh_groups(dist_tensor.process_mesh)
    groups.mesh_groups(mesh)
    with called_as(lambda: f"reshard to {list(pl)} on {mesh!r} (from {list(dist_tensor.placements)} on "
                           f"{dist_tensor.process_mesh!r})"):
        if dist_tensor.requires_grad and torch.is_grad_enabled():
            out = reshard_fn(dist_tensor, mesh, pl)
        else:
            out = run_reshard(dist_tensor, mesh, pl, dist_tensor.name)
    out.name = dist_tensor.name
    return out


@refusing
def unshard_dtensor(dist_tensor) -> torch.Tensor:
    """The dense global value (a collective: every rank calls it); differentiable. Empty off the mesh.

    A parameter gives a parameter holding the value (a new leaf, as Paddle's); a plain tensor raises ValueError.
    """
    if not isinstance(dist_tensor, DistTensor):
        raise ValueError(f"The input should be a distributed tensor (unshard_dtensor got "
                         f"{type(dist_tensor).__name__}; a plain tensor is its own dense value).")
    mesh = dist_tensor.process_mesh
    full = dtensor_to_local(reshard(dist_tensor, mesh, [Replicate()] * mesh.ndim))
    if isinstance(dist_tensor, torch.nn.Parameter):
        full = torch.nn.Parameter(full.detach(), requires_grad=dist_tensor.requires_grad)
    return full


def _member_block(t: DistTensor) -> torch.Tensor:
    """A meta tensor shaped as the block the first rank of ``t``'s mesh holds."""
    mesh = t.process_mesh
    coord = mesh.coordinate(mesh.process_ids[0])
    shape = [b - a for a, b in local_block(tuple(t.shape), mesh, t.placements, coord)]
    return torch.empty(shape, dtype=t.dtype, device="meta")


def local_map(func, out_placements, in_placements=None, process_mesh=None, reshard_inputs=False):
    """Wrap ``func`` to run on local blocks: dist inputs (nested in lists, tuples and dicts too) become their blocks,
    outputs become dist tensors with ``out_placements`` (one list per output, flattened as the inputs are; None
    for a non-tensor output). ``in_placements``: one per flattened input (None: as it is)."""

    def wrapped(*args, **kwargs):
        mesh = process_mesh
        flat_in, spec = pytree.tree_flatten(args)
        if in_placements is not None and len(in_placements) != len(flat_in):
            raise ValueError(f"local_map: {len(in_placements)} in_placements for {len(flat_in)} inputs "
                             "(nested inputs count one by one)")
        locals_, stand_ins, seen = [], [], False
        known: dict = {}  # the dist inputs on the mesh: an output placed and shaped as one's block is as large
        for i, a in enumerate(flat_in):
            if isinstance(a, DistTensor):
                mesh, seen = mesh or a.process_mesh, True
                want = None if in_placements is None else in_placements[i]
                if want is not None and list(want) != a.placements:
                    if not reshard_inputs:
                        raise ValueError(f"local_map: input {i} is {a.placements}, expected {list(want)}; "
                                         f"pass reshard_inputs=True to reshard it")
                    a = reshard(a, a.process_mesh, want)
                locals_.append(dtensor_to_local(a))
                stand_ins.append(_member_block(a))
                if a.process_mesh == mesh:
                    known[i] = a
            else:
                locals_.append(a)
                stand_ins.append(a)
        if mesh is None:
            if any(p is not None for p in out_placements):
                raise ValueError("local_map needs a process_mesh when no input is a dist tensor and an output is "
                                 "placed (an out_placements entry is not None)")
            return func(*args, **kwargs)  # as Paddle's: nothing to place, the outputs as func gives them
        outside = not mesh.contains(_rank())
        blocks = stand_ins if outside else locals_
        known = {(tuple(blocks[i].shape), tuple(a.placements)): tuple(a.shape) for i, a in reversed(known.items())}
        if outside:
            # a rank outside the mesh holds no blocks: func runs on meta stand-ins of a member's blocks, which give
            # the outputs' shapes (so every rank agrees on them); the rank keeps empty blocks, as for any op
            with torch.device("meta"):
                out = func(*pytree.tree_unflatten(stand_ins, spec), **kwargs)
        else:
            out = func(*pytree.tree_unflatten(locals_, spec), **kwargs)
        outs, out_spec = pytree.tree_flatten(out)
        out_pls = list(out_placements)
        if len(outs) == 1 and out_pls and not isinstance(out_pls[0], (list, tuple)) and out_pls[0] is not None:
            out_pls = [out_pls]  # one output's placements, not in a list of their own
        if seen and len(out_pls) != len(outs):  # as Paddle's: one placement list for each output value
            raise ValueError(f"local_map: {len(out_pls)} out_placements for {len(outs)} output(s) of {_name(func)} "
                             "(one list per output value, None for a non-tensor one)")
        for o, p in zip(outs, out_pls):
            if p is not None and not isinstance(o, torch.Tensor):
                raise ValueError(f"local_map: an output of {_name(func)} is not a tensor ({type(o).__name__}); "
                                 f"its out_placements entry must be None, not {p}")

        def place(o, p, block):
            # an output whose block is shaped and placed as an input's is as large as it (uneven splits included);
            # any other is its block times the mesh
            pl = pad_placements(list(p), mesh)
            shape = known.get((tuple(block.shape), tuple(pl))) or _global_shape(block, mesh, pl)
            return dtensor_from_local(compat.empty_block(o.dtype, device()) if outside else o, mesh, p, shape=shape)

        res = [place(o, p, o) if p is not None else o for o, p in zip(outs, out_pls)] + outs[len(out_pls):]
        return pytree.tree_unflatten(res, out_spec)

    return wrapped


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or type(func).__name__
