"""The sharding group: its process group and ranks, traced spans, and the collectives the shards use."""

from __future__ import annotations

import torch
import torch.distributed as tdist

from ... import trace

__all__ = ["ShardingGroup", "resolve_group", "broadcast_module", "all_gather_single", "reduce_scatter_single",
           "gather_object"]

# torch 2.11 spells these all_gather_into_tensor / reduce_scatter_tensor
all_gather_single = getattr(tdist, "all_gather_single", tdist.all_gather_into_tensor)
reduce_scatter_single = getattr(tdist, "reduce_scatter_single", tdist.reduce_scatter_tensor)


class ShardingGroup:
    """The ranks a parameter is sharded over, in group order; ``rank`` is this rank's index among them."""

    def __init__(self, pg, ranks):
        self.pg = pg
        self.ranks = list(ranks)
        self.size = len(self.ranks)
        self.rank = self.ranks.index(tdist.get_rank())

    def span(self, op, nbytes):
        return trace.span("collective", op=op, group=self.ranks, bytes=int(nbytes))

    def __repr__(self) -> str:
        return f"ShardingGroup({self.ranks})"


def resolve_group(group) -> ShardingGroup:
    if group is None:
        pg = tdist.group.WORLD
    else:
        pg = getattr(group, "process_group", group)
    if pg is None or pg == tdist.GroupMember.NON_GROUP_MEMBER:
        ranks = getattr(group, "ranks", "?")
        raise ValueError(f"group_sharded_parallel: rank {tdist.get_rank()} is not in the group {ranks}")
    ranks = tdist.get_process_group_ranks(pg)
    return ShardingGroup(pg, ranks)


def broadcast_module(module, grp: ShardingGroup, tensors="all"):
    """Broadcast a module's parameters and/or buffers from the group's first rank."""
    items = []
    if tensors in ("all", "params"):
        items += [p for p in module.parameters()]
    if tensors in ("all", "buffers"):
        items += [b for b in module.buffers()]
    with torch.no_grad():
        for t in items:
            with grp.span("broadcast", t.numel() * t.element_size()):
                tdist.broadcast(t.data, src=grp.ranks[0], group=grp.pg)


def gather_object(obj, grp: ShardingGroup) -> list:
    """Every group rank's ``obj``, in group order."""
    if grp.size == 1:
        return [obj]
    out = [None] * grp.size
    tdist.all_gather_object(out, obj, group=grp.pg)
    return out
