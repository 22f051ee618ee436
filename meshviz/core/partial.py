"""What a tensor Partial on several mesh axes stands for, and the one rule for filling a new Partial axis."""

from __future__ import annotations

from collections.abc import Sequence

from .placements import Partial, Placement, ReduceType, Replicate

__all__ = ["partial_axes", "summed", "nesting", "commutes", "partial_fill"]

_LINEAR = (ReduceType.kRedSum, ReduceType.kRedAvg)
_FILLED = {ReduceType.kRedSum: "zero", ReduceType.kRedProd: "one"}  # reductions whose other summands are identities


def partial_axes(placements: Sequence[Placement]) -> list[int]:
    """Mesh axes that are Partial, in mesh order."""
    return [i for i, p in enumerate(placements) if isinstance(p, Partial)]


def summed(placements: Sequence[Placement]) -> list[Placement]:
    """The placements once every Partial axis is reduced: Replicate there, the rest as they are."""
    return [Replicate() if isinstance(p, Partial) else p for p in placements]


def nesting(placements: Sequence[Placement]) -> list[int]:
    """Partial axes in the order their reductions apply: the last mesh axis first, mesh axis 0 last.

    A tensor Partial on axes a < b is ``reduce_a(reduce_b(locals))``: mesh axis 0 is the outermost reduction, as
    it is the outermost chunk of a co-shard. Mixed reductions need this order (a max of sums is not a sum of maxes).
    """
    return partial_axes(placements)[::-1]


def commutes(a: ReduceType, b: ReduceType) -> bool:
    """Can reductions ``a`` and ``b`` along two mesh axes be applied in either order with the same result?"""
    return a == b or (a in _LINEAR and b in _LINEAR)


def partial_fill(placements: Sequence[Placement], coord, axis: int | None = None) -> str:
    """What the rank at ``coord`` holds when a value becomes Partial: 'value', 'zero' or 'one'.

    ``axis=None``: a dense tensor placed with ``placements`` (every Partial axis is new). SUM keeps the value at
    coordinate 0 of its axis and zeros elsewhere, PROD ones elsewhere, AVG / MAX / MIN keep the value everywhere;
    where a SUM axis and a PROD axis both fill, the zero wins. This reduces back to the value in any nesting order.

    ``axis=i``: only axis ``i`` becomes Partial (``placements`` is the layout after the step) while the other Partial
    axes stay pending. Where axis ``i`` keeps the value the rank keeps its summand; elsewhere it holds the identity
    of axis ``i``'s reduction, itself filled across the pending axes nested inside ``i`` (a ``one`` under a pending
    SUM axis is a zero off that axis's coordinate 0), so that every line along ``i`` reduces to what it held.
    """
    if axis is None:
        axes = partial_axes(placements)
    else:
        p = placements[axis]
        if not isinstance(p, Partial):
            raise ValueError(f"axis {axis} is {p!r}, not Partial")
        if coord[axis] == 0 or p.reduce_type not in _FILLED:
            return "value"
        axes = [axis] + [j for j in partial_axes(placements) if j > axis]
    fills = {_FILLED.get(p.reduce_type) for j in axes if coord[j] != 0 and isinstance(p := placements[j], Partial)}
    if "zero" in fills:
        return "zero"
    return "one" if "one" in fills else "value"
