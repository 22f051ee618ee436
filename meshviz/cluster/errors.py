"""RankError and RankOutcome, as ``meshviz.cluster`` has always exported them (defined in :mod:`meshviz.errors`)."""

from ..errors import RankError, RankOutcome

__all__ = ["RankError", "RankOutcome"]
