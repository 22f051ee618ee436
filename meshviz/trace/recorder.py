"""Recorders and sinks: where emitted events go (memory, a JSONL file, a live stream)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
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
    "defer_record",
    "lazy_reader",
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
FLUSH_EVERY = 4096  # deferred events held at most, about
FLUSH_FIELDS = FLUSH_EVERY * 16  # fields of deferred records held at most
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
    :func:`flush`. ``args`` holds what the event says, read at ``now``."""
    defer_entry(st, (_call, make, args), now)


def _call(entry: tuple) -> Event:
    return entry[1](*entry[2])


def defer_entry(st: TraceState, entry: tuple, now: float) -> None:
    """:func:`defer` of ``entry[0](entry)``: one tuple per deferred event (what the event says after its maker)."""
    defer_record(st, (_entry, entry), now)


def _entry(p: list, i: int) -> Event:
    entry = p[i + 1]
    return entry[0](entry)


_LAZY: dict = {}  # reader -> the length of its records


def lazy_reader(size: int) -> Callable:
    """Make a function ``reader(p, i)`` the reader of records of ``size`` fields (the reader first) for
    :func:`defer_record`: the Event such a record says, when something reads it. A :class:`MemorySink` keeps such
    records as they are and makes their events only when it is read; every other sink gets them made at the
    flush. Their fields must stay as they were when deferred (no tensor a later write could change)."""

    def register(reader: Callable) -> Callable:
        _LAZY[reader] = size
        return reader

    return register


def defer_record(st: TraceState, record: tuple, now: float) -> None:
    """The hot path of a traced reshard: ``record`` laid flat at the end of the rank's deferred records (no object
    kept per event), its event made at the next flush (see :func:`defer`) or, for a :class:`MemorySink`, once
    that is read. ``record[0]``: :func:`_entry` of ``(entry,)`` or a :func:`lazy_reader`'s reader."""
    p = st.pending
    if not p:
        st.since = now
    p += record
    if now - st.since > FLUSH_AFTER or len(p) >= FLUSH_FIELDS:
        flush(st)


def _made_from(p: list, i: int, n: int) -> Iterator[Event]:
    """The events of the lazy records ``p[i:n]`` (one whose making fails is left out, as a broken sink's)."""
    lazy = _LAZY
    while i < n:
        reader = p[i]
        try:
            event = reader(p, i)
        except Exception:
            event = None
        i += lazy[reader]
        if event is not None:
            yield event


def flush(state: TraceState | None = None) -> int:
    """Make the deferred events of this rank (or of ``state``) and hand them to its sinks; returns how many."""
    st = trace_state() if state is None else state
    if not st.pending:
        return 0
    with st.lock:
        p = st.pending
        n = len(p)  # the rank's thread may add records behind these while they are handed on
        batch = p[:n]
        del p[:n]
        reads = st.reads
        if reads:
            k = len(reads)
            for r in reads[:k]:
                try:
                    r.settle()
                except Exception:  # read again when its event is made: never break training here
                    pass
            del reads[:k]
        sinks = list(st.sinks)
        mems = [s for s in sinks if isinstance(s, MemorySink) and type(s) is MemorySink and s.limit is None]
        keep = bool(sinks) and len(mems) == len(sinks)
        lazy = _LAZY
        count = i = run = 0
        while i < n:
            reader = batch[i]
            size = lazy.get(reader)
            if size is not None and keep:  # kept as it is, in a run of such records
                i += size
                count += 1
                continue
            if run < i:
                for mem in mems:
                    mem._take(batch, run, i)
            try:
                event = reader(batch, i)
            except Exception:  # as a broken sink: never break training
                event = None
            i += 2 if size is None else size
            run = i
            if event is None:
                continue
            for sink in sinks:  # as _deliver, inline: a flush makes thousands
                try:
                    sink(event)
                except Exception:
                    pass
            count += 1
        if run < n:
            for mem in mems:
                mem._take(batch, run, n)
    return count


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
    """Keeps events in a list (reading it makes the deferred events of the ranks it listens on first). Without a
    ``limit`` it keeps a traced reshard's records as they are until it is read, and makes their events then."""

    def __init__(self, limit: int | None = None):
        self._events: list[Event] = []
        self._raw: list = []  # in order: (records, start, end) not made yet, and events that came after them
        self._lock = threading.Lock()
        self._states: list[TraceState] = []
        self.limit = limit

    @property
    def events(self) -> list[Event]:
        for st in self._states:
            flush(st)
        if self._raw:
            with self._lock:
                out = self._events
                for item in self._raw:
                    if type(item) is tuple:
                        out.extend(_made_from(*item))
                    else:
                        out.append(item)
                self._raw = []
        return self._events

    @events.setter
    def events(self, events: list[Event]) -> None:
        with self._lock:
            self._events = events
            self._raw = []

    def _take(self, records: list, start: int, end: int) -> None:
        """Lazy records ``records[start:end]`` (see :func:`lazy_reader`), made when the sink is read."""
        with self._lock:
            self._raw.append((records, start, end))

    def __call__(self, event: Event) -> None:
        if self._raw:
            with self._lock:
                if self._raw:  # behind records not made yet
                    self._raw.append(event)
                    return
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
