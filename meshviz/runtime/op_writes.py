"""Arguments an op writes besides its first (batch norm's running statistics), kept in the caller's layout."""

from __future__ import annotations

import contextvars

import torch

__all__ = ["written_args", "writing", "moved", "write_back"]

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
