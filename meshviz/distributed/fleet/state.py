"""What ``fleet.init`` set up on this rank: the hybrid group, its topology, the strategy."""

from __future__ import annotations

from ... import rank_context

__all__ = ["FleetState", "FLEET", "current", "hybrid_group", "configured"]


class FleetState:
    __slots__ = ("_hcg", "_topology", "_strategy", "_built", "_model")

    def __init__(self):
        self._hcg = self._topology = self._strategy = None
        self._model = None  # a weak reference to the model distributed_model got last (its parameters' names)
        self._built = None  # the HybridCommunicateGroup this rank built last (fleet.init's or not)


FLEET = rank_context.slot("fleet", FleetState)


def current() -> FleetState:
    """This rank's fleet state."""
    return FLEET.get()


def hybrid_group():
    """The hybrid communicate group ``fleet.init`` built on this rank."""
    hcg = current()._hcg
    if hcg is None:
        raise RuntimeError("call fleet.init(is_collective=True, strategy=...) first")
    return hcg


def configured() -> tuple:
    """``(hybrid group, strategy)`` that ``fleet.init`` set on this rank; None for what it has not set."""
    state = current()
    return state._hcg, state._strategy
