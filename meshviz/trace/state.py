"""The trace's per-rank state: event numbering, sinks and the rank and cell events are stamped with."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
    # events whose making was deferred, as records laid end to end (recorder.defer_record): made and handed to the
    # sinks, in order, at the next flush
    pending: list = field(default_factory=list)
    reads: list = field(default_factory=list)  # values on their way from a device, each settle()d at the flush
    since: float = 0.0  # when the oldest of them was deferred
    lock: Any = field(default_factory=threading.RLock)  # one flush at a time: sinks see the order


TRACE = rank_context.slot("trace", TraceState)


def trace_state(ctx: rank_context.RankContext | None = None) -> TraceState:
    """The calling rank's trace state (or ``ctx``'s, where the caller has fetched its rank context already)."""
    return TRACE.get(ctx)
