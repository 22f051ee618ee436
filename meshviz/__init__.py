"""meshviz: run PaddlePaddle-style distributed training on PyTorch, and watch it happen."""

from .core import Partial, ProcessMesh, ReduceType, Replicate, Shard

__version__ = "0.1.0"

__all__ = ["ProcessMesh", "Shard", "Replicate", "Partial", "ReduceType", "__version__"]


# name -> module that defines it; imported on first use (the cluster pulls in ipyparallel, the views matplotlib)
_LAZY = {
    "Cluster": ".cluster",
    "explore": ".widgets",
    "show": ".widgets",
    "MeshView": ".widgets",
    "TensorView": ".widgets",
    "ReshardView": ".widgets",
    "PipelineView": ".widgets",
    "RollCallView": ".widgets",
    "CommView": ".widgets",
    "WhatIfView": ".widgets",
    "what_if": ".whatif",
    "WhatIf": ".whatif",
    "LazyGuard": ".lazy",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'meshviz' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
