"""``meshviz.show(obj)``: the right view for a mesh, a layout, a tensor, a plan, events, a cluster, a roll-call
(``cluster.status()``), a comm table or a what-if report."""

from __future__ import annotations

import os

from ..core import Layout, Plan, ProcessMesh
from ..trace.commtable import CommTable
from ..trace.status import RankStatus, RollCall
from .base import View, as_events
from .comm_view import CommView
from .mesh_view import MeshView
from .pipeline_view import PipelineView
from .reshard_view import ReshardView
from .rollcall_view import RollCallView
from .tensor_view import TensorView

__all__ = ["show", "view_for_events"]


def view_for_events(events) -> View:
    """PipelineView for compute/send/recv events, ReshardView for reshards, TensorView for placed tensors."""
    kinds = {e.kind for e in events}
    if "compute" in kinds or (kinds & {"send", "recv"} and "reshard" not in kinds):
        return PipelineView(events)
    if "reshard" in kinds:
        return ReshardView(source=events)
    if "placed" in kinds:
        return TensorView(source=events)
    return PipelineView(events)


def show(obj, **kw) -> View:
    """A view of ``obj``; in a notebook, the returned view draws itself when it is a cell's last expression."""
    if isinstance(obj, View):
        return obj
    if hasattr(obj, "per_rank") and hasattr(obj, "like"):  # a what-if report (meshviz.what_if)
        return obj.view(**kw)
    if isinstance(obj, RollCall) or (isinstance(obj, (list, tuple)) and obj
                                     and all(isinstance(s, RankStatus) for s in obj)):
        return RollCallView(obj, **kw)
    if isinstance(obj, CommTable):
        return CommView(obj, **kw)
    if isinstance(obj, ProcessMesh):
        return MeshView(obj, **kw)
    if isinstance(obj, Layout):
        return TensorView(obj.shape, obj.mesh, obj.placements, **kw)
    if isinstance(obj, Plan):
        return ReshardView(obj, **kw)
    if hasattr(obj, "process_mesh") and hasattr(obj, "placements"):
        return TensorView(obj, **kw)
    if hasattr(obj, "subscribe") and hasattr(obj, "unsubscribe"):  # a Cluster: its world, devices per rank
        n = getattr(obj, "n", None) or len(getattr(obj, "devices", []) or [])
        if not n:
            raise ValueError("show(cluster) needs a started cluster")
        return MeshView(list(range(n)), devices=getattr(obj, "devices", None), source=obj,
                        title=f"cluster: {n} ranks", **kw)
    if isinstance(obj, (str, os.PathLike, list, tuple)):
        events, _ = as_events(obj)
        if events and all(hasattr(e, "kind") for e in events):
            return view_for_events(events)
        return MeshView(obj, **kw)
    raise TypeError(f"meshviz.show does not know how to draw {type(obj).__name__}")
