"""Paddle's auto-parallel entry points: to_static / DistModel, Strategy, the global mesh, parallelize, LocalLayer."""

from . import intermediate
from .dist_model import DistModel, to_static
from .high_level_api import to_distributed
from .interface import create_mesh, get_mesh, set_mesh
from .local_layer import LocalLayer
from .program import Program
from .strategy import Strategy

__all__ = ["to_static", "DistModel", "Program", "Strategy", "set_mesh", "get_mesh", "create_mesh", "LocalLayer",
           "intermediate", "to_distributed"]
