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
    "defer",
    "defer_entry",
    "flush",
    "FLUSH_AFTER",
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
FLUSH_AFTER = 0.05  # seconds a deferred event waits at most for the next one to flush it
FLUSH_EVERY = 4096  # deferred events held at most
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
    caller has it already. Deferred events go first: while there are any, ``event`` waits behind them for the same
    flush (making them now would read a GPU block's values, which waits for the device)."""
    st = trace_state() if state is None else state
    if event.rank < 0:
        event.rank = my_rank(st)
    if event.cell is None:
        event.cell = st.cell
    if event.end is None:
        event.end = time.time()
    if st.pending:
        defer_entry(st, (_made, event), time.time())
    else:
        _deliver(list(st.sinks), event)
    return event


def _made(entry: tuple) -> Event:
    return entry[1]


def _deliver(sinks: list, event: Event) -> None:
    """Hand ``event`` to each of ``sinks`` (a copy: a sink may add or remove sinks)."""
    for sink in sinks:
        try:
            sink(event)
        except Exception:  # a broken sink must never break training
            pass


def defer(st: TraceState, make: Callable[..., Event], args: tuple, now: float) -> None:
    """An event made later, as ``make(*args)``, and handed to the sinks at the next flush, in order with the events
    this rank emits after it: when a sink is added or removed or a :class:`MemorySink` is read, at the end of an
    engine's cell or a process rank's life, once the oldest deferred event is ``FLUSH_AFTER`` seconds old, or on
    :func:`flush`. The hot path of a traced reshard: ``args`` holds what the event says, read at ``now``."""
    defer_entry(st, (_call, make, args), now)


def _call(entry: tuple) -> Event:
    return entry[1](*entry[2])


def defer_entry(st: TraceState, entry: tuple, now: float) -> None:
    """:func:`defer` of ``entry[0](entry)``: one tuple per deferred event (what the event says after its maker),
    the least a reshard's hot path can keep alive until the flush."""
    p = st.pending
    if not p:
        st.since = now
    p.append(entry)
    if now - st.since > FLUSH_AFTER or len(p) >= FLUSH_EVERY:
        flush(st)


def flush(state: TraceState | None = None) -> int:
    """Make the deferred events of this rank (or of ``state``) and hand them to its sinks; returns how many."""
    st = trace_state() if state is None else state
    if not st.pending:
        return 0
    n = 0
    with st.lock:
        p, sinks = st.pending, list(st.sinks)
        pop = p.popleft
        while p:
            entry = pop()
            try:
                event = entry[0](entry)
            except Exception:  # as a broken sink: never break training
                continue
            for sink in sinks:  # as _deliver, inline: a flush makes thousands
                try:
                    sink(event)
                except Exception:
                    pass
            n += 1
    return n


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
    st = trace_state()
    flush(st)  # deferred events go to the sinks that listened when they happened
    if isinstance(sink, MemorySink) and not any(x is st for x in sink._states):
        sink._states.append(st)
    with _lock:
        sinks = st.sinks
        was = bool(sinks)
        if sink not in sinks:
            sinks.append(sink)
    _changed(was)
    return sink


def remove_sink(sink, close: bool = True) -> None:
    """Stop sending events to ``sink``; also close it (a file) unless ``close=False``."""
    st = trace_state()
    flush(st)
    with _lock:
        sinks = st.sinks
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
    """Keeps events in a list (reading it makes the deferred events of the ranks it listens on first)."""

    def __init__(self, limit: int | None = None):
        self._events: list[Event] = []
        self._states: list[TraceState] = []
        self.limit = limit

    @property
    def events(self) -> list[Event]:
        for st in self._states:
            flush(st)
        return self._events

    @events.setter
    def events(self, events: list[Event]) -> None:
        self._events = events

    def __call__(self, event: Event) -> None:
        self._events.append(event)
        if self.limit is not None and len(self._events) > self.limit:
            del self._events[: len(self._events) - self.limit]

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
