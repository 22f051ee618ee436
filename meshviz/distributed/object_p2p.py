"""Paddle's ``send_object_list`` / ``recv_object_list``: picklable objects from one rank to another."""

from __future__ import annotations

import pickle

import torch

from ..runtime import groups
from ..runtime.devices import device
from .collective import recv, send
from .group_api import needs_init

__all__ = ["send_object_list", "recv_object_list"]


def _peer(what: str, name: str, rank, in_group, group) -> int:
    if in_group is None:
        return 0 if rank is None else rank
    if rank is not None:
        raise ValueError(f"{what}: give {name} or {name}_in_group, not both")
    return groups.resolve(group).get_global_rank(in_group)


def _check(what: str, object_list) -> None:
    if not isinstance(object_list, list) or not object_list:
        raise ValueError(f"{what}: object_list must be a non-empty list, got {object_list!r}")


@needs_init
def send_object_list(object_list, dst=None, group=None, dst_in_group=None) -> None:
    """Send the picklable objects of ``object_list`` to global rank ``dst`` (0 by default; or ``dst_in_group``, its
    index in ``group``), which receives them with :func:`recv_object_list` into a list of as many items. Their sizes
    go first, then their bytes, as Paddle's. A rank outside ``group`` does nothing."""
    _check("send_object_list", object_list)
    dst = _peer("send_object_list", "dst", dst, dst_in_group, group)
    if not groups.resolve(group).is_member():
        return
    data = [pickle.dumps(o) for o in object_list]
    send(torch.tensor([len(d) for d in data], dtype=torch.int64, device=device()), dst=dst, group=group)
    send(torch.frombuffer(bytearray(b"".join(data)), dtype=torch.uint8).to(device()), dst=dst, group=group)


@needs_init
def recv_object_list(object_list, src=None, group=None, src_in_group=None) -> None:
    """Replace the items of ``object_list`` by the objects global rank ``src`` (0 by default; or ``src_in_group``)
    sends with :func:`send_object_list`: the list must have as many items as the sender's."""
    _check("recv_object_list", object_list)
    src = _peer("recv_object_list", "src", src, src_in_group, group)
    if not groups.resolve(group).is_member():
        return
    sizes = torch.empty(len(object_list), dtype=torch.int64, device=device())
    recv(sizes, src=src, group=group)
    ends = torch.cumsum(sizes, 0).tolist()
    buf = torch.empty(ends[-1], dtype=torch.uint8, device=device())
    recv(buf, src=src, group=group)
    raw = buf.cpu().numpy().tobytes()
    for i, (a, b) in enumerate(zip([0] + ends[:-1], ends)):
        object_list[i] = pickle.loads(raw[a:b])
