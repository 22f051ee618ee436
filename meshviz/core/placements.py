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


@dataclass(frozen=True, repr=False)
class Shard(Placement):
    """Split tensor dim ``dim`` in ceil-sized chunks along the mesh axis."""

    dim: int

    def __post_init__(self):
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise ValueError(f"Shard dim must be an int, got {self.dim!r}")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def get_dim(self) -> int:
        return self.dim

    def __repr__(self) -> str:
        return f"S({self.dim})"


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


_PAT = re.compile(r"^\s*(?:S\((-?\d+)\)|Shard\((?:dim=)?(-?\d+)\)|(R|Replicate\(\))"
                  r"|P\((\w+)\)|Partial\((?:reduce_type=)?([\w.]*)\))\s*$")


def parse_placement(text) -> Placement:
    """Parse ``S(0)``, ``R``, ``P(sum)`` (or the long spellings) into a placement."""
    if isinstance(text, Placement):
        return text
    m = _PAT.match(str(text))
    if not m:
        raise ValueError(f"cannot read placement {text!r}; write S(0), R or P(sum)")
    s1, s2, r, p1, p2 = m.groups()
    if s1 is not None or s2 is not None:
        return Shard(int(s1 if s1 is not None else s2))
    if r:
        return Replicate()
    red = p1 or (p2.split(".")[-1] if p2 else "sum")
    return Partial(ReduceType.parse(red))


def placements_str(placements) -> str:
    return "[" + ", ".join(repr(p) for p in placements) + "]"
