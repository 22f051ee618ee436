"""The global mesh that ``dist.parallelize`` and its plans work on: set_mesh, get_mesh, create_mesh."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import rank_context
from ...core.mesh import ProcessMesh

__all__ = ["set_mesh", "get_mesh", "create_mesh"]

@dataclass
class AutoParallelState:
    mesh: ProcessMesh | None = None  # the global mesh
    model_done: bool = False  # parallelize_model ran on this rank
    parallelized: tuple | None = None  # (the model parallelize made last, whether it has no pipeline stages)


AUTO_PARALLEL = rank_context.slot("auto_parallel", AutoParallelState)


def _state() -> AutoParallelState:
    return AUTO_PARALLEL.get()


def set_mesh(mesh: ProcessMesh | None) -> None:
    """Set the global mesh (``None`` clears it)."""
    if mesh is not None and not isinstance(mesh, ProcessMesh):
        raise ValueError(f"set_mesh expects a ProcessMesh, got {type(mesh).__name__}: {mesh!r}")
    _state().mesh = mesh


def get_mesh() -> ProcessMesh | None:
    """The global mesh, or None when none was set."""
    return _state().mesh


def create_mesh(mesh_dims) -> ProcessMesh:
    """Set and return a global mesh from ``[(name, degree), ...]``, ids in row-major order."""
    names = [name for name, _ in mesh_dims]
    shape = [int(degree) for _, degree in mesh_dims]
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"create_mesh needs positive degrees, got {list(mesh_dims)}")
    mesh = ProcessMesh(np.arange(int(np.prod(shape))).reshape(shape).tolist(), names)
    set_mesh(mesh)
    return mesh
