"""Ranks as ipyparallel engines: start, bind devices, init the process group, stream events, report failures."""

from ..errors import RankError, RankOutcome
from .cluster import Cluster
from .config import DEFAULT_CPU_RANKS
from .control import ClusterState

__all__ = ["Cluster", "ClusterState", "RankError", "RankOutcome", "DEFAULT_CPU_RANKS"]
