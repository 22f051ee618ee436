"""torch DTensor's rule for an op call read as a decision: local after meshviz's moves, Paddle's default, or DTensor."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .. import compat
from ..core.layout import local_shape
from ..core.mesh import ProcessMesh
from ..core.partial import summed
from ..core.placements import Replicate
from . import groups
from .dtensor import (
    PLAIN_PLACEMENTS,
    DistTensor,
    contiguous_stride,
    from_torch_placements,
    make_dtensor,
    representable,
    to_torch_placements,
)
from .op_plan import Decision, nests_tensors, tree_map

__all__ = ["ask_torch", "as_replicate"]


def ask_torch(d: Decision, func, args, kwargs, dists) -> None:
    """Complete ``d`` (how ``torch``) with torch DTensor's rule for the inputs as ``d.moves`` would lay them out
    (asked of stand-ins: nothing moves, so the deciding call moves as every later one does): ``local`` where the
    rule names plain placements (after meshviz's planner makes the moves it asks for, :attr:`Decision.torch_moves`),
    ``default`` where torch has no rule, else DTensor runs it."""
    if func in compat.dtensor_special_ops() or any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        return
    dm = dists[0]._dtensor.device_mesh
    tensors: list = []
    current: list = []  # per tensor argument: its placements as laid out for the op (None: a dense tensor)
    targets = iter(d.moves or ())

    def unwrap(x):
        if isinstance(x, DistTensor):
            tensors.append(x)
            dt = _laid_out(x, next(targets, None))
            current.append(dt.placements)
            return dt
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            tensors.append(x)
            current.append(None)
            return as_replicate(x, dists[0], dm)
        return x

    uargs, ukwargs = tree_map(unwrap, (args, kwargs))
    try:
        got = compat.dtensor_decision(func, uargs, ukwargs)
    except compat.NoDTensorRule as e:
        if e.decomposes:
            d.how, d.torch_rule = "decompose", True
        else:
            d.how, d.note = "default", ("default", "torch DTensor has no sharding rule for it")
            d.moves = None
        return
    if len(got.wanted) != len(tensors):
        return
    moves_self = d.inplace and got.wanted[0] is not None and current[0] is not None \
        and tuple(got.wanted[0]) != tuple(current[0])
    moves: list = []  # per dist input: the placements torch's rule lays it out in first, None where it stays
    for t, want, now in zip(tensors, got.wanted, current):
        if want is None or now is None:
            if want is not None and isinstance(t, torch.Tensor) and any(not p.is_replicate() for p in want):
                return _dtensor_runs(d, moves_self)  # a dense input torch would lay out otherwise
            if now is not None:
                moves.append(None)
            continue
        if tuple(want) != tuple(now):
            if not compat.dtensor_converts_partial_kinds() and _converts_partial_kind(now, want):
                # torch 2.11's DTensor cannot turn one Partial reduction into another inside an op (P(avg) + P(sum)):
                # the Partial inputs are reduced first
                d.summed_first = True
                return
            target = _plain_target(want, now, t)
            if target is None:
                return _dtensor_runs(d, moves_self)  # DTensor moves data: it runs the op (its collectives observed)
            # an in-place op's self too: DTensor would write into a re-laid-out copy of it and drop the write
            moves.append(target)
        else:
            moves.append(None)
    outputs = []
    for o in got.outputs:
        if o is None:
            outputs.append(None)
            continue
        tpl, shape, stride, dtype, layout = o
        own = None if all(type(p) in PLAIN_PLACEMENTS for p in tpl) else layout  # _StridedShard: only torch names it
        outputs.append((tuple(from_torch_placements(tpl)), shape, stride, dtype, own))
    d.how, d.op, d.local_args, d.outputs, d.single = "local", got.op, got.local_args, outputs, got.single
    d.nested = nests_tensors(args, kwargs)
    # torch's rule moves data: meshviz's planner makes those moves (its events, Paddle's collectives), then each
    # rank runs the op on its blocks; every call, the deciding one too, moves each input from its own layout
    # straight there
    if any(m is not None for m in moves):
        d.torch_moves = tuple(moves)
        before = d.moves or (None,) * len(moves)
        d.moves = tuple(m if m is not None else b for m, b in zip(moves, before))


def _laid_out(x: DistTensor, target):
    """The DTensor ``x`` would be after meshviz's planner moved it to ``target`` (None: not moved), without data:
    a block of the moved one's shape that holds no values (torch's rule reads placements, shapes and strides)."""
    if target is None or tuple(target) == x._mpl and x._tpl is None:
        return x._dtensor
    target = tuple(target)
    stride = x.stride() if target == x._mpl else contiguous_stride(x.shape)  # a reshard's result is contiguous
    local = x._local
    coord = x._pmesh.coordinate(groups.rank())
    if coord is None:
        block = compat.empty_block(local.dtype, local.device)
    else:
        block = local.new_empty(()).expand(local_shape(tuple(x.shape), x._pmesh, target, coord))
    tpl = to_torch_placements(target if representable(target) else summed(target))
    return compat.dtensor_from_local(block, x._dtensor.device_mesh, tpl, x.shape, stride)


def _dtensor_runs(d: Decision, moves_self: bool) -> None:
    """DTensor runs the op, but for an in-place op whose self its rule lays out anew: DTensor would write into that
    copy and drop the write (self keeps its old block under the new placements), so Paddle's default rule runs it."""
    if moves_self:
        d.how, d.note, d.moves = "default", ("default", "torch DTensor's rule lays out self anew in place"), None


def _plain_target(want, now, t):
    """meshviz's placements for the layout torch's rule wants ``t`` in, where meshviz's planner makes the same
    move: plain placements, no tensor dim split by several mesh axes, no Partial turned into another kind; else
    None."""
    if not all(type(p) in PLAIN_PLACEMENTS for p in want):
        return None
    dims = [p.dim for p in want if p.is_shard()]
    if len(dims) != len(set(dims)):
        return None
    if _converts_partial_kind(now, want):
        return None
    return tuple(from_torch_placements(want))


def _converts_partial_kind(now, want) -> bool:
    return any(a.is_partial() and b.is_partial() and a != b for a, b in zip(now, want))


def as_replicate(x: torch.Tensor, ref: DistTensor, dm):
    """A dense tensor meeting a dist one is replicated on its mesh, as in Paddle."""
    if x.dim() > 0 and x.numel() > 1:
        return make_dtensor(_local_for_replicate(x, ref._pmesh), ref._pmesh, [Replicate()] * ref._pmesh.ndim,
                            x.shape, dm.device_type)
    return x


def _local_for_replicate(x: torch.Tensor, mesh: ProcessMesh) -> torch.Tensor:
    return x.detach() if mesh.contains(groups.rank()) else compat.empty_block(x.dtype, x.device)
