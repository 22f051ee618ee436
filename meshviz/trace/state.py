"""The trace's per-rank state: event numbering, sinks and the rank and cell events are stamped with."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import rank_context

if TYPE_CHECKING:
    from .events import Event

__all__ = ["TraceState", "TRACE", "trace_state"]


@dataclass
class TraceState:
    seq: itertools.count[int] = field(default_factory=itertools.count)  # each rank numbers its own events from 0
    sinks: list[Callable[[Event], None]] = field(default_factory=list)
    rank: int | None = None  # events are stamped with it
    cell: int | None = None  # the engine cell events are stamped with


TRACE = rank_context.slot("trace", TraceState)


def trace_state(ctx: rank_context.RankContext | None = None) -> TraceState:
    """The calling rank's trace state (or ``ctx``'s, where the caller has fetched its rank context already)."""
    return TRACE.get(ctx)
