"""ZeRO ownership plan: which rank of a sharding group owns which flat elements of each parameter."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LEVELS", "SHARDED", "STAGES", "Piece", "plan_pieces", "owners_by_size"]

LEVELS = ("os", "os_g", "p_g_os")
# level -> the parts of a parameter's training state that it splits over the group
SHARDED = {"os": ("state",), "os_g": ("grad", "state"), "p_g_os": ("param", "grad", "state")}
# Paddle's sharding stage number (ShardingStage1/2/3, strategy.sharding.stage) -> level
STAGES = {1: "os", 2: "os_g", 3: "p_g_os"}


@dataclass(frozen=True)
class Piece:
    """How one parameter is split over the group: ``ranges[i]`` = flat elements [lo, hi) group rank i owns.

    mode: ``slice`` (elementwise chunks, os/os_g), ``whole`` (kept whole, owned by one rank), ``fsdp`` (FSDP2
    dim-0 chunks, p_g_os), ``replicated`` (kept whole on every rank, p_g_os small parameters).
    """

    name: str
    shape: tuple
    mode: str
    ranges: tuple

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def owners(self) -> list:
        return [i for i, (lo, hi) in enumerate(self.ranges) if hi > lo]

    def __repr__(self) -> str:
        return f"Piece({self.name}, {list(self.shape)}, {self.mode}, {list(self.ranges)})"


def _chunks(n: int, k: int) -> list:
    c = -(-n // k) if n else 0
    return [(min(i * c, n), min((i + 1) * c, n)) for i in range(k)]


def plan_pieces(named_shapes, level: str, nranks: int, segment_size: int) -> list:
    """Who owns what, computed identically on every rank. ``named_shapes``: [(name, shape), ...]."""
    pieces, load = {}, [0] * nranks
    small = []
    for name, shape in named_shapes:
        n = math.prod(shape)
        if level == "p_g_os":
            if n >= segment_size and len(shape) >= 1:
                rows = _chunks(shape[0], nranks)
                row = n // shape[0] if shape[0] else 0
                pieces[name] = Piece(name, tuple(shape), "fsdp", tuple((a * row, b * row) for a, b in rows))
            else:
                pieces[name] = Piece(name, tuple(shape), "replicated", tuple((0, n) for _ in range(nranks)))
        elif n >= segment_size and n >= nranks:
            rs = tuple(_chunks(n, nranks))
            pieces[name] = Piece(name, tuple(shape), "slice", rs)
            for i, (lo, hi) in enumerate(rs):
                load[i] += hi - lo
        else:
            small.append((name, tuple(shape), n))
    # whole parameters: largest first, each to the least-loaded rank (Paddle's greedy partition)
    for name, shape, n in sorted(small, key=lambda s: -s[2]):
        owner = min(range(nranks), key=lambda i: (load[i], i))
        load[owner] += n
        pieces[name] = Piece(name, shape, "whole", tuple((0, n) if i == owner else (0, 0) for i in range(nranks)))
    return [pieces[name] for name, _ in named_shapes]


def owners_by_size(numels, nranks: int) -> list:
    """Fleet's stage-1 owner of each whole parameter (Paddle's ``DygraphShardingOptimizer``): the largest first
    (ties in their given order), each to the group rank holding the fewest elements so far (ties: the lower)."""
    if nranks < 1:
        raise ValueError(f"owners_by_size: nranks must be >= 1, got {nranks}")
    owners, sizes = [0] * len(numels), [0] * nranks
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        rank = sizes.index(min(sizes))
        owners[i] = rank
        sizes[rank] += numels[i]
    return owners
