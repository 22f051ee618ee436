"""meshviz: run PaddlePaddle-style distributed training on PyTorch, and watch it happen."""

from .core import Partial, ProcessMesh, ReduceType, Replicate, Shard

__version__ = "0.1.0"

__all__ = ["ProcessMesh", "Shard", "Replicate", "Partial", "ReduceType", "__version__"]


def __getattr__(name):
    if name == "Cluster":  # imported on first use: it pulls in ipyparallel
        from .cluster import Cluster

        return Cluster
    raise AttributeError(f"module 'meshviz' has no attribute {name!r}")
