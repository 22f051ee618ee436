"""Paddle's auto-parallel entry points: to_static / DistModel and Strategy."""

from .static import DistModel, Program, to_static
from .strategy import Strategy

__all__ = ["to_static", "DistModel", "Program", "Strategy"]
