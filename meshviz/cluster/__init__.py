"""Ranks as ipyparallel engines or threads of this process: start, process group, events, failures."""

from ..errors import RankError, RankOutcome
from .cluster import Cluster
from .config import DEFAULT_CPU_RANKS
from .control import ClusterState

__all__ = ["Cluster", "ClusterState", "RankError", "RankOutcome", "DEFAULT_CPU_RANKS"]
