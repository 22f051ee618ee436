"""ipyparallel engines as ranks: start, bind devices, init the process group, stream events, report failures."""

from .cluster import DEFAULT_CPU_RANKS, Cluster
from .errors import RankError, RankOutcome

__all__ = ["Cluster", "RankError", "RankOutcome", "DEFAULT_CPU_RANKS"]
