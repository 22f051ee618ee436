"""Paddle's auto-parallel entry points: to_static / DistModel and Strategy."""

from .dist_model import DistModel, to_static
from .program import Program
from .strategy import Strategy

__all__ = ["to_static", "DistModel", "Program", "Strategy"]
