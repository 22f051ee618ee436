"""What ``fleet.init`` set up on this rank: the hybrid group, its topology, the strategy."""

from __future__ import annotations

from ...rank_context import per_rank

__all__ = ["FleetState", "current", "hybrid_group"]


class FleetState:
    __slots__ = ("_hcg", "_topology", "_strategy")

    def __init__(self):
        self._hcg = self._topology = self._strategy = None


_states = per_rank(FleetState)


def current() -> FleetState:
    """This rank's fleet state."""
    return _states.here()


def hybrid_group():
    """The hybrid communicate group ``fleet.init`` built on this rank."""
    hcg = current()._hcg
    if hcg is None:
        raise RuntimeError("call fleet.init(is_collective=True, strategy=...) first")
    return hcg
