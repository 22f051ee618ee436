"""Live event stream: a sink on every rank that batches events to a receiver thread in the notebook kernel."""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Callable

from .events import Event, _default

__all__ = ["StreamSink", "StreamReceiver", "EventLog", "FLUSH_INTERVAL"]

FLUSH_INTERVAL = 0.01  # seconds between two batches from one rank; a lone event goes out at once


def _encode(events: list[Event], control: list[dict]) -> bytes:
    msg = {"events": [e.__dict__ for e in events]}
    if control:
        msg["control"] = control
    return json.dumps(msg, default=_default, separators=(",", ":")).encode()


class StreamSink:
    """Trace sink that pushes events, batched, over a ZeroMQ PUSH socket to a :class:`StreamReceiver`.

    Calling the sink only appends to a queue; a background thread encodes and sends. The first event after a
    quiet spell is sent at once; events that follow within ``interval`` seconds go out together. Sending never
    blocks the caller: if the receiver is gone, events are dropped (``dropped`` counts them).
    """

    def __init__(self, address: str, interval: float = FLUSH_INTERVAL, hwm: int = 10000):
        import zmq

        self.address = address
        self.interval = interval
        self.sent = 0
        self.controls_sent = 0
        self.dropped = 0
        self._buf: collections.deque = collections.deque()
        self._control: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._busy = False
        self._closed = False
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 500)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.connect(address)
        self._thread = threading.Thread(target=self._run, name="meshviz-stream", daemon=True)
        self._thread.start()

    def __call__(self, event: Event) -> None:
        self._buf.append(event)
        if not self._wake.is_set():
            self._wake.set()

    def send_control(self, message: dict) -> None:
        """Send a small control message (not an event) on the same channel, after the events queued so far."""
        self._control.append(message)
        self._wake.set()

    def _run(self) -> None:
        import zmq

        while True:
            self._wake.wait()
            self._wake.clear()
            self._busy = True
            batch = []
            while self._buf:
                batch.append(self._buf.popleft())
            control = []
            while self._control:
                control.append(self._control.popleft())
            if batch or control:
                try:
                    self._sock.send(_encode(batch, control), zmq.NOBLOCK)
                    self.sent += len(batch)
                    self.controls_sent += len(control)
                except zmq.Again:
                    self.dropped += len(batch)
                except Exception:  # an unencodable event must not stop the stream
                    self.dropped += len(batch)
            self._busy = False
            if self._closed:
                if not self._buf and not self._control:
                    break
                continue
            time.sleep(self.interval)

    def flush(self, timeout: float = 2.0) -> int:
        """Wait until every queued event has been handed to the socket; returns the number sent so far."""
        deadline = time.monotonic() + timeout
        self._wake.set()
        while (self._buf or self._control or self._busy) and time.monotonic() < deadline:
            if not self._thread.is_alive():
                break
            time.sleep(0.0005)
        return self.sent

    def close(self) -> None:
        if self._closed:
            return
        self.flush(1.0)
        self._closed = True
        self._wake.set()
        self._thread.join(1.0)
        self._sock.close()
        self._ctx.term()

    def __repr__(self) -> str:
        return f"StreamSink({self.address}, sent={self.sent})"


class EventLog:
    """Events in arrival order (a read-only sequence), with subscribers called for each new event."""

    def __init__(self, limit: int | None = 200_000):
        self.limit = limit
        self._events: list[Event] = []
        self._arrivals: list[float] = []
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._subscribers: list[Callable[[Event], None]] = []
        self.received: collections.Counter = collections.Counter()  # events received per rank
        self.controls: collections.Counter = collections.Counter()  # control messages handled per rank

    def _extend(self, events: list[Event], arrival: float) -> None:
        with self._cond:
            self._events.extend(events)
            self._arrivals.extend([arrival] * len(events))
            for e in events:
                self.received[e.rank] += 1
            if self.limit is not None and len(self._events) > self.limit:
                cut = len(self._events) - self.limit
                del self._events[:cut]
                del self._arrivals[:cut]
            self._cond.notify_all()
            subs = list(self._subscribers)
        for cb in subs:
            for e in events:
                try:
                    cb(e)
                except Exception:  # a broken widget must not stop the stream
                    pass

    def subscribe(self, callback: Callable[[Event], None]) -> Callable[[Event], None]:
        """Call ``callback(event)`` for every event that arrives from now on (on the receiver thread)."""
        with self._lock:
            if callback not in self._subscribers:
                self._subscribers.append(callback)
        return callback

    def unsubscribe(self, callback) -> None:
        with self._lock:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

    def _handled(self, rank) -> None:
        """A control message from ``rank`` was handled (after its ``on_control`` returned)."""
        with self._cond:
            self.controls[rank] += 1
            self._cond.notify_all()

    def wait_for(self, counts: dict[int, int] | int, timeout: float = 5.0,
                 controls: dict[int, int] | None = None) -> bool:
        """Wait until ``counts`` events arrived (a total, or a per-rank dict of totals), and ``controls`` control
        messages per rank were handled; True if they were."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if isinstance(counts, int):
                    ok = sum(self.received.values()) >= counts
                else:
                    ok = all(self.received[r] >= c for r, c in counts.items())
                ok = ok and all(self.controls[r] >= c for r, c in (controls or {}).items())
                left = deadline - time.monotonic()
                if ok or left <= 0:
                    return ok
                self._cond.wait(left)

    @property
    def arrivals(self) -> list[float]:
        """Arrival time (``time.time()`` in the client) of each event, aligned with the log."""
        with self._lock:
            return list(self._arrivals)

    def of_kind(self, *kinds: str) -> list[Event]:
        return [e for e in self if e.kind in kinds]

    def by_rank(self) -> dict[int, list[Event]]:
        out: dict[int, list[Event]] = {}
        for e in self:
            out.setdefault(e.rank, []).append(e)
        return dict(sorted(out.items()))

    def clear(self) -> None:
        with self._lock:
            self._events.clear()
            self._arrivals.clear()

    def save(self, path: str) -> int:
        """Write the events to ``path`` as JSONL (``meshviz.trace.load_events`` reads it back); returns how many."""
        from .events import to_json

        events = list(self)
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            for e in events:
                fh.write(to_json(e) + "\n")
        return len(events)

    def __len__(self) -> int:
        return len(self._events)

    def __getitem__(self, i):
        with self._lock:
            return self._events[i]

    def __iter__(self):
        with self._lock:
            snap = list(self._events)
        return iter(snap)

    def __repr__(self) -> str:
        ranks = ", ".join(f"{r}: {c}" for r, c in sorted(self.received.items()))
        return f"EventLog({len(self)} events; per rank {{{ranks}}})"


class StreamReceiver:
    """A ZeroMQ PULL socket and a thread in the client that fills an :class:`EventLog` as batches arrive.

    Binds to ``host`` (loopback by default) on a free port; ``address`` is what the ranks connect to.
    ``on_control(message)`` is called for control messages (rank failures), in arrival order with the events.
    """

    def __init__(self, log: EventLog | None = None, host: str = "127.0.0.1", connect_host: str | None = None,
                 on_control: Callable[[dict], None] | None = None):
        import zmq

        self.log = log if log is not None else EventLog()
        self.on_control = on_control
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        bind = "*" if host in ("0.0.0.0", "*", "") else host
        port = self._sock.bind_to_random_port(f"tcp://{bind}")
        self.address = f"tcp://{connect_host or host}:{port}"
        # close() wakes the receiver through this pair at once, rather than after its next poll interval
        wake = f"inproc://meshviz-receiver-wake-{id(self)}"
        self._wake_rx, self._wake_tx = self._ctx.socket(zmq.PAIR), self._ctx.socket(zmq.PAIR)
        for sock in (self._wake_rx, self._wake_tx):
            sock.setsockopt(zmq.LINGER, 0)
        self._wake_rx.bind(wake)
        self._wake_tx.connect(wake)
        self.batches = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="meshviz-receiver", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        while not self._stop:
            if self._sock not in dict(poller.poll(100)):
                continue
            while True:
                try:
                    raw = self._sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    return
                arrival = time.time()
                try:
                    msg = json.loads(raw)
                    events = [Event.from_dict(d) for d in msg.get("events", ())]
                except Exception:  # never execute or trust anything in a message; bad ones are dropped
                    continue
                self.batches += 1
                if events:
                    self.log._extend(events, arrival)
                for c in msg.get("control", ()):
                    if self.on_control is not None:
                        try:
                            self.on_control(c)
                        except Exception:
                            pass
                    self.log._handled(c.get("rank") if isinstance(c, dict) else None)

    def close(self) -> None:
        import zmq

        self._stop = True
        try:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self._thread.join(1.0)
        for sock in (self._sock, self._wake_rx, self._wake_tx):
            sock.close()
        self._ctx.term()
