"""Ownership records: which part of a parameter, its gradient and its optimizer state one rank holds."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .events import Event
from .payloads import Share

__all__ = ["PARTS", "Ownership"]

PARTS = ("param", "grad", "state")


@dataclass(frozen=True)
class Ownership:
    """One rank's share of one parameter under a sharding level; ``to_event()`` is the ``ownership`` event.

    ``sharded``: the parts (of ``PARTS``) the level splits over ``group``; the others stay whole on every rank.
    Where the split is flat (group sharding) ``held`` is the [lo, hi) range of flat elements this rank holds of
    each sharded part and ``ranges`` that range for every group rank; where it is a dist-tensor layout
    (``shard_optimizer``) ``mesh`` and ``placements`` say which block this rank holds.
    """

    name: str | None
    level: str | None  # "os", "os_g" or "p_g_os" (Paddle's sharding stages 1, 2, 3)
    sharded: tuple
    shape: tuple  # global shape
    group: tuple | None = None  # the ranks that share the parameter, in group order
    held: tuple | None = None
    ranges: tuple | None = None
    mode: str | None = None  # how a flat plan splits the parameter (slice, whole, fsdp, replicated)
    local_shape: tuple | None = None
    nbytes: int = 0
    mesh: dict | None = None  # ProcessMesh.to_dict()
    placements: tuple | None = None  # short strings, e.g. ("S(0)", "R")
    tensor_id: int | None = None

    def __post_init__(self):
        bad = [p for p in self.sharded if p not in PARTS]
        if bad:
            raise ValueError(f"Ownership: sharded parts must be among {PARTS}, got {bad}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def holds(self) -> dict | None:
        """part -> [lo, hi) flat elements this rank holds (the whole parameter for parts not sharded)."""
        if self.held is None:
            return None
        return {p: list(self.held) if p in self.sharded else [0, self.numel] for p in PARTS}

    def to_event(self) -> Event:
        share = Share(sharded=tuple(self.sharded), numel=self.numel, mode=self.mode,
                      ranges=None if self.ranges is None else tuple(tuple(r) for r in self.ranges),
                      holds=self.holds())
        return Event(
            kind="ownership",
            name=self.name,
            tensor_id=self.tensor_id,
            op=self.level,
            mesh=self.mesh,
            group=None if self.group is None else list(self.group),
            bytes=int(self.nbytes),
            placements_after=None if self.placements is None else list(self.placements),
            shape_after=list(self.shape),
            local_shape=None if self.local_shape is None else list(self.local_shape),
            payload=share,
        )

    @classmethod
    def from_event(cls, e: Event) -> "Ownership":
        """The record an ``ownership`` event carries (the inverse of ``to_event``)."""
        if e.kind != "ownership":
            raise ValueError(f"Ownership.from_event: not an ownership event (kind {e.kind!r})")
        x = e.payload_as(Share)
        held = None
        sharded = tuple(x.sharded)
        if sharded and x.holds and sharded[0] in x.holds:
            held = tuple(x.holds[sharded[0]])
        return cls(
            name=e.name,
            level=e.op,
            sharded=sharded,
            shape=tuple(e.shape_after or ()),
            group=None if e.group is None else tuple(e.group),
            held=held,
            ranges=None if x.ranges is None else tuple(tuple(r) for r in x.ranges),
            mode=x.mode,
            local_shape=None if e.local_shape is None else tuple(e.local_shape),
            nbytes=e.bytes,
            mesh=e.mesh,
            placements=None if e.placements_after is None else tuple(e.placements_after),
            tensor_id=e.tensor_id,
        )
