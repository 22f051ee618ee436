"""Placements: how a tensor lies along one mesh axis (Shard, Replicate, Partial)."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

__all__ = ["ReduceType", "Placement", "Shard", "Replicate", "Partial", "parse_placement", "placements_str"]


class ReduceType(enum.IntEnum):
    """Reduction a Partial placement stands for (Paddle's names and values)."""

    kRedSum = 0
    kRedMax = 1
    kRedMin = 2
    kRedProd = 3
    kRedAvg = 4

    def __call__(self) -> "ReduceType":
        """Itself: ``Partial.reduce_type()`` is a method in Paddle, and the attribute here answers the call."""
        return self

    @property
    def short(self) -> str:
        return _SHORT[self]

    @classmethod
    def parse(cls, value) -> "ReduceType":
        if isinstance(value, ReduceType):
            return value
        if isinstance(value, str):
            key = value.lower().removeprefix("kred")
            for rt, short in _SHORT.items():
                if key in (short, rt.name.lower().removeprefix("kred")):
                    return rt
        elif isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                pass
        raise ValueError(f"unknown reduce type {value!r}; expected one of {[r.name for r in cls]}")


_SHORT = {
    ReduceType.kRedSum: "sum",
    ReduceType.kRedMax: "max",
    ReduceType.kRedMin: "min",
    ReduceType.kRedProd: "prod",
    ReduceType.kRedAvg: "avg",
}


class Placement:
    """Base of the three placements; value types, compared and hashed by value."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicated(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False

    def __str__(self) -> str:
        return self.__repr__()


@dataclass(frozen=True, repr=False, init=False)
class Shard(Placement):
    """Split tensor dim ``dim`` in ceil-sized chunks along the mesh axis.

    ``co_shard_order`` (Paddle 3.3.1 spells the keyword ``shard_order``; both are accepted) orders the mesh axes that
    shard the same tensor dim: the lowest order is the outermost chunk, ties go by mesh axis. All 0 (the default)
    nests mesh axis 0 outermost. ``Shard(0, co_shard_order=0) == Shard(0)``, as in Paddle.
    """

    dim: int
    co_shard_order: int

    def __init__(self, dim: int, co_shard_order: int | None = None, *, shard_order: int | None = None):
        if co_shard_order is not None and shard_order is not None and co_shard_order != shard_order:
            raise ValueError(f"Shard: give co_shard_order or shard_order, not both ({co_shard_order}, {shard_order})")
        order = co_shard_order if co_shard_order is not None else (shard_order if shard_order is not None else 0)
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise ValueError(f"Shard dim must be an int, got {dim!r}")
        if not isinstance(order, int) or isinstance(order, bool) or order < 0:
            raise ValueError(f"Shard co_shard_order must be a non-negative int, got {order!r}")
        object.__setattr__(self, "dim", int(dim))
        object.__setattr__(self, "co_shard_order", int(order))

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def get_dim(self) -> int:
        return self.dim

    def get_co_shard_order(self) -> int:
        return self.co_shard_order

    def __repr__(self) -> str:
        return f"S({self.dim})" if not self.co_shard_order else f"S({self.dim},o={self.co_shard_order})"


@dataclass(frozen=True, repr=False)
class Replicate(Placement):
    """Every rank along the mesh axis holds the whole (sub)tensor."""

    def is_replicated(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "R"


@dataclass(frozen=True, repr=False)
class Partial(Placement):
    """Every rank holds a summand; the tensor is the reduction of them along the mesh axis.

    ``p.reduce_type()`` (Paddle's spelling) and ``p.reduce_type`` both give the ReduceType. Partial on several
    mesh axes nests the reductions with mesh axis 0 outermost (``meshviz.core.partial``).
    """

    reduce_type: ReduceType = ReduceType.kRedSum

    def __post_init__(self):
        object.__setattr__(self, "reduce_type", ReduceType.parse(self.reduce_type))

    def is_partial(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"P({self.reduce_type.short})"


_ORDER = r"(?:\s*,\s*(?:o|co_shard_order|shard_order)\s*=\s*(\d+))?"
_PAT = re.compile(r"^\s*(?:S\((-?\d+)" + _ORDER + r"\)|Shard\((?:dim=)?(-?\d+)" + _ORDER + r"\)"
                  r"|(R|Replicate(?:\(\))?)|P(?:\((\w*)\))?|Partial(?:\((?:reduce_type=)?([\w.]*)\))?)\s*$")


def parse_placement(text) -> Placement:
    """Parse ``S(0)``, ``S(0,o=1)``, ``R``, ``P(sum)`` (or the long spellings) into a placement; ``P``, ``P()``,
    ``Partial`` and ``Partial()`` are ``P(sum)``, as Paddle's ``Partial()`` is."""
    if isinstance(text, Placement):
        return text
    m = _PAT.match(str(text))
    if not m:
        raise ValueError(f"cannot read placement {text!r}; write S(0), R or P(sum)")
    s1, o1, s2, o2, r, p1, p2 = m.groups()
    if s1 is not None or s2 is not None:
        order = o1 if s1 is not None else o2
        return Shard(int(s1 if s1 is not None else s2), int(order) if order is not None else 0)
    if r:
        return Replicate()
    red = p1 or (p2.split(".")[-1] if p2 else "sum")
    try:
        return Partial(ReduceType.parse(red))
    except ValueError as exc:
        raise ValueError(f"cannot read placement {text!r}: {exc}") from None


def placements_str(placements) -> str:
    return "[" + ", ".join(repr(p) for p in placements) + "]"
