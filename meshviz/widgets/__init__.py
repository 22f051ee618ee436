"""Views that draw meshes, blocks, Partial summands, reshard steps and pipeline timelines (ipywidgets + matplotlib)."""

from ..core.schedule import bubble_formula
from .base import Replayer, View
from .comm_view import CommView
from .explorer import Explorer, explore, plan_table
from .mesh_view import MeshView
from .pipeline_view import PipelineView, synthetic_schedule
from .reshard_view import ReshardView
from .rollcall_view import RollCallView
from .show import show
from .tensor_view import TensorState, TensorView, tensor_state
from .what_if_view import WhatIfView

__all__ = [
    "View", "Replayer", "MeshView", "TensorView", "TensorState", "tensor_state", "ReshardView", "PipelineView",
    "synthetic_schedule", "bubble_formula", "Explorer", "explore", "plan_table", "show", "RollCallView", "CommView",
    "WhatIfView",
]
