"""The sharding group: its ranks, and the collectives the shards use (all through the comm layer)."""

from __future__ import annotations

import torch
import torch.distributed as tdist

from ... import compat
from .. import comm

__all__ = ["ShardingGroup", "broadcast_module", "gather_object"]


class ShardingGroup:
    """The ranks a parameter is sharded over, in group order; ``rank`` is this rank's index among them."""

    def __init__(self, group):
        self.group = group
        self.pg = group.process_group
        self.ranks = list(group.ranks)
        self.size = len(self.ranks)
        self.rank = group.rank

    def run(self, op, start, *tensors, peer=None, src=None, dst=None):
        """Issue one collective over the group (``start(pg)`` starts it) through the comm layer; ``tensors`` are
        the ones this rank passes, ``src``/``dst`` the root (global ranks) of a rooted op."""
        return comm.run(comm.Call(op, self.group, lambda g: start(self.pg), tensors=tensors, peer=peer, src=src,
                                  dst=dst))

    def all_reduce(self, t, op=tdist.ReduceOp.SUM):
        self.run("all_reduce", lambda pg: tdist.all_reduce(t, op=op, group=pg, async_op=True), t)

    def reduce(self, t, dst_index: int):
        dst = self.ranks[dst_index]
        self.run("reduce", lambda pg: tdist.reduce(t, dst=dst, group=pg, async_op=True), t, peer=dst, dst=dst)

    def broadcast(self, t, src_index: int = 0):
        src = self.ranks[src_index]
        self.run("broadcast", lambda pg: tdist.broadcast(t, src=src, group=pg, async_op=True), t, peer=src, src=src)

    def all_gather_into(self, out, mine):
        self.run("all_gather", lambda pg: compat.all_gather_single(out, mine, group=pg, async_op=True), mine)

    def reduce_scatter_into(self, out, flat):
        self.run("reduce_scatter",
                 lambda pg: compat.reduce_scatter_single(out, flat, group=pg, async_op=True), flat)

    def barrier(self):
        self.run("barrier", lambda pg: tdist.barrier(group=pg, async_op=True))

    def __repr__(self) -> str:
        return f"ShardingGroup({self.ranks})"


def broadcast_module(module, grp: ShardingGroup, tensors="all"):
    """Broadcast a module's parameters and/or buffers from the group's first rank."""
    items = []
    if tensors in ("all", "params"):
        items += [p for p in module.parameters()]
    if tensors in ("all", "buffers"):
        items += [b for b in module.buffers()]
    with torch.no_grad():
        for t in items:
            grp.broadcast(t.data, 0)


def gather_object(obj, grp: ShardingGroup) -> list:
    """Every group rank's ``obj``, in group order."""
    if grp.size == 1:
        return [obj]
    out = [None] * grp.size
    grp.run("all_gather_object", lambda pg: tdist.all_gather_object(out, obj, group=pg))
    return out
