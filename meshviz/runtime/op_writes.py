"""What an op writes besides its own block: other arguments (batch norm's statistics), its ``out=`` tensors."""

from __future__ import annotations

import contextvars

import torch

from .dtensor import DistTensor

__all__ = ["written_args", "writing", "moved", "write_back", "out_variant", "into_out"]

_WRITTEN: dict = {}
# per thread (ranks as threads included): id of the caller's tensor, or of a copy laid out anew for the op ->
# [the caller's tensor, the copy the op writes]
_PENDING: contextvars.ContextVar[dict | None] = contextvars.ContextVar("meshviz_written", default=None)


_STATS = ((3, "running_mean"), (4, "running_var"))
# ops that write arguments their schema does not mark: native_batch_norm updates its running statistics in training
_UNMARKED = {torch.ops.aten.native_batch_norm.default: _STATS}


def written_args(func) -> tuple:
    """``(position, name)`` of the arguments after the first that ``func`` writes (its schema says so), cached."""
    hit = _WRITTEN.get(func)
    if hit is None:
        schema = getattr(func, "_schema", None)
        params = schema.arguments if schema is not None else []
        hit = _WRITTEN[func] = _UNMARKED.get(func) or tuple(
            (i, a.name) for i, a in enumerate(params) if i and a.alias_info is not None and a.alias_info.is_write)
    return hit


def writing(func, args, kwargs, is_dist) -> tuple[dict, contextvars.Token]:
    """Start watching the dist tensors ``func`` writes besides its first argument (see :func:`moved`)."""
    watched: dict = {}
    if func in _UNMARKED and not (args[5] if len(args) > 5 else kwargs.get("training", False)):
        return watched, _PENDING.set(watched)  # native_batch_norm in eval writes nothing
    for i, name in written_args(func):
        x = args[i] if i < len(args) else kwargs.get(name)
        if is_dist(x):
            watched[id(x)] = [x, x]
    return watched, _PENDING.set(watched)


def moved(x, y) -> None:
    """The op layer laid ``x`` out anew as ``y`` for the op: if the op writes ``x``, it writes ``y``."""
    watched = _PENDING.get()
    if watched is not None and y is not x:
        entry = watched.get(id(x))
        if entry is not None:
            entry[1] = y
            watched[id(y)] = entry


def write_back(watched: dict, token: contextvars.Token, redistribute) -> None:
    """Stop watching; what the op wrote into a copy goes back into the caller's tensor, in its own placements."""
    _PENDING.reset(token)
    done: set = set()
    for orig, copy in watched.values():
        if copy is orig or id(orig) in done:
            continue
        done.add(id(orig))
        back = redistribute(copy, orig._mpl, f"{orig.name or 'argument'} written back")
        with torch.no_grad():
            orig._local.copy_(back._local)


# -- out= arguments: the op run as its functional overload, the result held by the caller's tensors -------------------

_OUTS: dict = {}  # op -> (names of its out arguments, its functional overload) or None


def out_variant(func):
    """``(out names, functional overload)`` for an op with ``out=`` arguments (``aten.add.out`` -> ``add.Tensor``:
    the same other arguments, nothing written), cached; None for any other op."""
    hit = _OUTS.get(func, False)
    if hit is not False:
        return hit
    schema = getattr(func, "_schema", None)
    outs = tuple(a.name for a in schema.arguments if a.is_out) if schema is not None else ()
    hit = None
    if outs:
        want = [(a.name, str(a.type)) for a in schema.arguments if not a.is_out]
        packet = func._overloadpacket
        for name in packet.overloads():
            op = getattr(packet, name)
            s = op._schema
            if [(a.name, str(a.type)) for a in s.arguments] == want and not any(
                    a.alias_info is not None for a in s.arguments):
                hit = (outs, op)
                break
    _OUTS[func] = hit
    return hit


def into_out(func, args, kwargs, run, probe):
    """Run an ``out=`` op whose outputs are all dist tensors as its functional overload (``run``: the op layer),
    then each out tensor holds its result (its layout too, as DTensor's out= gives). NotImplemented where an out
    is not a dist tensor. A shape other than the result's raises on every rank before anything runs."""
    names, functional = out_variant(func)
    outs = [kwargs.get(n) for n in names]
    if not all(_is_dist(o) for o in outs):
        return NotImplemented
    rest = {k: v for k, v in kwargs.items() if k not in names}
    shapes = probe(functional, args, rest)
    shapes = [shapes] if isinstance(shapes, torch.Tensor) else list(shapes)
    for n, o, s in zip(names, outs, shapes):
        if tuple(o.shape) != tuple(s.shape):
            raise ValueError(f"{func}: out= tensor {n!r} has shape {list(o.shape)}, the result {list(s.shape)}; a "
                             f"dist tensor cannot be resized in place: pass one of the result's shape")
    res = run(functional, args, rest)
    results = [res] if len(names) == 1 else list(res)
    for o, r in zip(outs, results):
        if r.dtype != o.dtype:
            r = run(torch.ops.aten._to_copy.default, (r,), {"dtype": o.dtype})
        o._hold(r)
    return outs[0] if len(names) == 1 else tuple(outs)


def _is_dist(x) -> bool:
    return type(x) is DistTensor
