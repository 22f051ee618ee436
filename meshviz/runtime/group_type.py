"""Paddle's ``Group``: a communication group's ranks, this rank's place in them, and its process group."""

from __future__ import annotations

import torch.distributed as tdist

__all__ = ["Group"]


class Group:
    """A communication group: ``ranks`` (global), ``rank`` (this process's index in them, -1 if absent).

    ``new_group`` sorts ``ranks`` as Paddle does; a mesh line keeps the mesh's order.
    """

    def __init__(self, rank: int, id: int, ranks, pg=None, name: str | None = None, missing=()):
        self.rank = rank
        self.id = id
        self.ranks = list(ranks)
        self.key = tuple(self.ranks)  # the roll-call's name for the group: its ranks in group order
        self.nranks = len(self.ranks)
        self.process_group = pg
        self.name = name or f"_default_pg{id}"
        self._backend: str | None = None
        self.missing = tuple(missing)  # ranks the world lacks: the group exists, communicating on it fails

    @property
    def world_size(self) -> int:
        """The group's size; -1 on a rank that is not a member (as Paddle's ``Group.world_size``)."""
        return self.nranks if self.rank >= 0 else -1

    @property
    def backend(self) -> str:
        if self._backend is None:  # asked by every collective (comm.run's device check): once per group
            self._backend = tdist.get_backend(self.process_group) if self.process_group is not None else "undefined"
        return self._backend

    def is_member(self) -> bool:
        return self.rank >= 0

    def get_group_rank(self, rank: int) -> int:
        """Index of global ``rank`` in this group, -1 when it is not a member."""
        return self.ranks.index(rank) if rank in self.ranks else -1

    def get_global_rank(self, group_rank: int) -> int:
        if not 0 <= group_rank < self.nranks:
            raise ValueError(f"group rank {group_rank} outside 0..{self.nranks - 1} of {self}")
        return self.ranks[group_rank]

    def __repr__(self) -> str:
        return f"Group(id={self.id}, ranks={self.ranks}, rank={self.rank})"
