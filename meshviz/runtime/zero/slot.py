"""This rank's view of one managed parameter: its piece of the plan, its shard and its gradient buffer."""

from __future__ import annotations

__all__ = ["Slot", "local_tensor"]


class Slot:
    """One parameter as this rank manages it: ``shard`` is what the inner optimizer updates."""

    __slots__ = ("name", "param", "piece", "lo", "hi", "shard", "grad_buf", "group_index")

    def __init__(self, name, param, piece, rank, group_index=0):
        self.name, self.param, self.piece, self.group_index = name, param, piece, group_index
        self.lo, self.hi = piece.ranges[rank]
        self.shard = None
        self.grad_buf = None

    @property
    def owned(self) -> bool:
        return self.hi > self.lo

    def __repr__(self) -> str:
        return f"Slot({self.name}, {self.piece.mode}, [{self.lo}, {self.hi}))"


def local_tensor(t):
    """The local block of a torch DTensor (an FSDP2 parameter or gradient), else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t
