"""Recorders and sinks: where emitted events go (memory, a JSONL file, a live stream)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import TextIO

from ..rank_context import getenv
from .events import Event, from_json, to_json
from .state import TraceState, trace_state

__all__ = [
    "active",
    "on_active",
    "set_cell",
    "emit",
    "span",
    "add_sink",
    "remove_sink",
    "clear_sinks",
    "sinks",
    "set_rank",
    "my_rank",
    "MemorySink",
    "JSONLSink",
    "record",
    "replay",
    "load_events",
]

_lock = threading.Lock()
_watchers: list[Callable[[bool], None]] = []
_active_ranks = [0]  # rank contexts with a sink: module hooks stay while any rank traces


def active() -> bool:
    """True when at least one sink listens; callers skip building events otherwise (tracing off costs nil)."""
    return bool(trace_state().sinks)


def set_rank(rank: int | None) -> None:
    trace_state().rank = rank


def set_cell(cell: int | None) -> None:
    """Events emitted from now on carry ``cell`` (a Cluster's engine sets it as each cell starts)."""
    trace_state().cell = cell


def on_active(callback: Callable[[bool], None]) -> Callable[[bool], None]:
    """Call ``callback(True)`` when tracing turns on (a first sink is added) and ``callback(False)`` when it turns
    off; at once with the current state. What tracing alone needs (module hooks) comes and goes with it."""
    _watchers.append(callback)
    callback(_active_ranks[0] > 0)
    return callback


def _changed(was: bool) -> None:
    now = bool(trace_state().sinks)
    if now == was:
        return
    with _lock:
        before = _active_ranks[0]
        _active_ranks[0] += 1 if now else -1
        after = _active_ranks[0]
    if (before > 0) != (after > 0):
        for cb in list(_watchers):
            try:
                cb(after > 0)
            except Exception:
                pass


def my_rank(st: TraceState | None = None) -> int:
    """The rank events are stamped with (``st``: the rank's trace state, where the caller has it already)."""
    r = (trace_state() if st is None else st).rank
    if r is not None:
        return r
    env = getenv("RANK")
    return int(env) if env is not None else 0


def emit(event: Event, state: TraceState | None = None) -> Event:
    """Send ``event`` to the sinks, stamped with this rank and cell; ``state``: the rank's trace state, where the
    caller has it already."""
    st = trace_state() if state is None else state
    if event.rank < 0:
        event.rank = my_rank(st)
    if event.cell is None:
        event.cell = st.cell
    if event.end is None:
        event.end = time.time()
    for sink in list(st.sinks):
        try:
            sink(event)
        except Exception:  # a broken sink must never break training
            pass
    return event


@contextlib.contextmanager
def span(kind: str, **fields):
    """Time a block and emit one event for it; yields the Event (or None when tracing is off) to fill in."""
    if not trace_state().sinks:
        yield None
        return
    ev = Event(kind=kind, **fields)
    ev.start = time.time()
    try:
        yield ev
    finally:
        ev.end = time.time()
        emit(ev)


def add_sink(sink: Callable[[Event], None]) -> Callable[[Event], None]:
    with _lock:
        sinks = trace_state().sinks
        was = bool(sinks)
        if sink not in sinks:
            sinks.append(sink)
    _changed(was)
    return sink


def remove_sink(sink, close: bool = True) -> None:
    """Stop sending events to ``sink``; also close it (a file) unless ``close=False``."""
    with _lock:
        sinks = trace_state().sinks
        was = bool(sinks)
        if sink in sinks:
            sinks.remove(sink)
    _changed(was)
    closer = getattr(sink, "close", None) if close else None
    if closer is not None:
        closer()


def sinks() -> tuple:
    """The sinks listening now."""
    return tuple(trace_state().sinks)


def clear_sinks() -> None:
    for s in list(trace_state().sinks):
        remove_sink(s)


class MemorySink:
    """Keeps events in a list."""

    def __init__(self, limit: int | None = None):
        self.events: list[Event] = []
        self.limit = limit

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if self.limit is not None and len(self.events) > self.limit:
            del self.events[: len(self.events) - self.limit]

    def of_kind(self, *kinds: str) -> list[Event]:
        return [e for e in self.events if e.kind in kinds]

    def __len__(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:
        return f"MemorySink({len(self.events)} events)"


class JSONLSink:
    """Appends one JSON object a line; ``{rank}`` in the path is replaced by the rank."""

    def __init__(self, path: str):
        self.path = path
        self._fh: TextIO | None = None

    def __call__(self, event: Event) -> None:
        fh = self._fh
        if fh is None:
            path = self.path.replace("{rank}", str(event.rank))
            d = os.path.dirname(path)
            if d:
                os.makedirs(d, exist_ok=True)
            fh = self._fh = open(path, "a", encoding="utf-8")
        fh.write(to_json(event) + "\n")
        fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


@contextlib.contextmanager
def record(path: str | None = None):
    """Record events emitted inside the block; yields a MemorySink, and also writes JSONL to ``path``."""
    mem = MemorySink()
    add_sink(mem)
    js = add_sink(JSONLSink(path)) if path else None
    try:
        yield mem
    finally:
        remove_sink(mem)
        if js is not None:
            remove_sink(js)


def load_events(paths: str | Iterable[str]) -> list[Event]:
    """Read events from one or more JSONL files, ordered by (start time, rank, seq)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Event] = []
    for p in paths:
        with open(p, encoding="utf-8") as fh:
            out.extend(from_json(line) for line in fh if line.strip())
    out.sort(key=lambda e: (e.start, e.rank, e.seq))
    return out


def replay(paths, sink: Callable[[Event], None]) -> int:
    """Feed recorded events to ``sink`` in order; returns how many."""
    events = load_events(paths)
    for e in events:
        sink(e)
    return len(events)
