"""Paddle's collectives of picklable objects: all_gather_object, broadcast_object_list, scatter_object_list."""

from __future__ import annotations

import pickle

import numpy as np
import torch
import torch.distributed as tdist

from .. import compat
from ..runtime import groups
from ..runtime.comm import Call, CollectiveOp, run
from ..runtime.devices import device
from ..runtime.groups import Group
from .group_api import needs_init

__all__ = ["all_gather_object", "broadcast_object_list", "scatter_object_list"]


# -- collectives: each member first all-gathers a row of sizes, so that an object one rank cannot pickle, or lists
# of other lengths, raise on every member before the bytes move (the bytes' collective would hang or abort gloo)

_SIMULATED = "simulated"  # what_if's ranks keep objects as objects, in torch's object collectives (backends.simulated)


def _dumps(objs):
    """(each object's pickle, None), or (None, the error pickling raised)."""
    try:
        return [pickle.dumps(o) for o in objs], None
    except Exception as e:  # PicklingError, AttributeError (a local object), TypeError (a lock), ...
        return None, e


def _dev(g: Group):
    return device() if g.backend == "nccl" else torch.device("cpu")


def _rows(g: Group, mine: list) -> list:
    out = torch.empty(g.nranks * len(mine), dtype=torch.int64, device=_dev(g))
    compat.all_gather_single(out, torch.tensor(mine, dtype=torch.int64, device=_dev(g)), group=g.process_group)
    return out.view(g.nranks, len(mine)).tolist()


def _unpicklable(what: str, g: Group, bad: list, err) -> ValueError:
    ranks = [g.ranks[i] for i in bad]
    if err is not None:
        e = ValueError(f"{what}: the object of rank {tdist.get_rank()} (this rank) cannot be pickled "
                       f"({type(err).__name__}: {err}); nothing was sent")
        e.__cause__ = err
        return e
    return ValueError(f"{what}: the object of rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))} cannot be "
                      f"pickled (named there); nothing was sent")


def _bytes(parts: list, n: int, dev) -> torch.Tensor:
    """The pickles ``parts`` one after another, zero-padded to ``n`` bytes."""
    buf = torch.zeros(n, dtype=torch.uint8)
    raw = b"".join(parts)
    if raw:
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf.to(dev)


def _loads(raw: bytes, sizes) -> list:
    ends = np.cumsum([0, *sizes]).tolist()
    return [pickle.loads(raw[a:b]) for a, b in zip(ends[:-1], ends[1:])]


def _run(op: CollectiveOp, g: Group, start, **kw) -> None:
    """Run ``start(g)`` as ``op``; an error it returns (every member returns one) is raised once the call is over."""
    err: list = []
    run(Call(op, g, lambda g: err.append(start(g)), nbytes=0, **kw))
    if err and err[0] is not None:
        raise err[0]


@needs_init
def all_gather_object(object_list, obj, group=None):
    """Append every member's picklable ``obj`` to ``object_list``, in group order."""
    g = groups.resolve(group)
    if not isinstance(object_list, list):
        raise TypeError("all_gather_object: object_list must be a list")

    def start(g):
        if g.backend == _SIMULATED:
            got = [None] * g.nranks
            tdist.all_gather_object(got, obj, group=g.process_group)
            object_list.extend(got)
            return None
        data, err = _dumps([obj])
        sizes = [r[0] for r in _rows(g, [-1 if data is None else len(data[0])])]
        if min(sizes) < 0:
            return _unpicklable("all_gather_object", g, [i for i, s in enumerate(sizes) if s < 0], err)
        m = max(sizes)
        out = torch.empty(g.nranks * m, dtype=torch.uint8, device=_dev(g))
        compat.all_gather_single(out, _bytes(data, m, _dev(g)), group=g.process_group)
        raw = out.cpu().numpy().tobytes()
        object_list.extend(pickle.loads(raw[i * m : i * m + s]) for i, s in enumerate(sizes))

    _run(CollectiveOp.ALL_GATHER_OBJECT, g, start)


@needs_init
def broadcast_object_list(object_list, src=0, group=None):
    """Replace ``object_list``'s items with global rank ``src``'s (every member's list as long as src's)."""
    if not isinstance(object_list, list):
        raise TypeError(f"broadcast_object_list: object_list must be a list, got {type(object_list).__name__}")
    g = groups.resolve(group)

    def start(g):
        if g.backend == _SIMULATED:
            tdist.broadcast_object_list(object_list, src=src, group=g.process_group)
            return None
        mine = tdist.get_rank() == src
        data, err = _dumps(object_list) if mine else ([], None)
        rows = _rows(g, [len(object_list), -1 if data is None else sum(map(len, data))])
        count, total = rows[g.ranks.index(src)]
        if total < 0:
            return _unpicklable("broadcast_object_list", g, [g.ranks.index(src)], err)
        other = [g.ranks[i] for i, row in enumerate(rows) if row[0] != count]
        if other:
            return ValueError(f"broadcast_object_list: src rank {src} sends {count} objects, but rank"
                              f"{'s' * (len(other) > 1)} {', '.join(map(str, other))} pass"
                              f"{'es' * (len(other) == 1)} a list of another length; give every rank a list as "
                              f"long as src's")
        head = np.array([len(d) for d in data], dtype=np.int64).tobytes() if mine else b""
        buf = _bytes([head, *data], 8 * count + total, _dev(g))
        tdist.broadcast(buf, src, group=g.process_group)
        if not mine:
            raw = buf.cpu().numpy().tobytes()
            object_list[:] = _loads(raw[8 * count :], np.frombuffer(raw[: 8 * count], dtype=np.int64).tolist())

    _run(CollectiveOp.BROADCAST_OBJECT_LIST, g, start, peers={"src": src}, src=src)


@needs_init
def scatter_object_list(out_object_list, in_object_list=None, src=0, group=None):
    """Global rank ``src`` sends ``in_object_list[i]`` (picklable) to the group's i-th member; every member's
    ``out_object_list`` then holds just its object, as in Paddle."""
    if not isinstance(out_object_list, list):
        raise TypeError("scatter_object_list: out_object_list must be a list")
    g = groups.resolve(group)

    def start(g):
        mine = tdist.get_rank() == src
        if g.backend == _SIMULATED:
            got = [None]
            tdist.scatter_object_list(got, list(in_object_list) if mine else None, src=src, group=g.process_group)
            out_object_list[:] = got
            return None
        count = (-1 if in_object_list is None else len(in_object_list)) if mine else g.nranks
        data, err = _dumps(in_object_list) if mine and count == g.nranks else ([], None)
        count, m = _rows(g, [count, -1 if data is None else max(map(len, data), default=0)])[g.ranks.index(src)]
        if count != g.nranks:
            return ValueError(f"scatter_object_list: src rank {src} needs an in_object_list of {g.nranks} objects, "
                              f"got {None if count < 0 else count}")
        if m < 0:
            return _unpicklable("scatter_object_list", g, [g.ranks.index(src)], err)
        pieces = [_bytes([np.array([len(d)], dtype=np.int64).tobytes(), d], 8 + m, _dev(g)) for d in data]
        out = torch.empty(8 + m, dtype=torch.uint8, device=_dev(g))
        tdist.scatter(out, pieces if mine else None, src=src, group=g.process_group)
        raw = out.cpu().numpy().tobytes()
        out_object_list.clear()
        out_object_list.extend(_loads(raw[8:], np.frombuffer(raw[:8], dtype=np.int64).tolist()))

    _run(CollectiveOp.SCATTER_OBJECT_LIST, g, start, peers={"src": src}, src=src)
