"""The base of every view: matplotlib rendering, static PNG/HTML, a widget, and a throttled live source."""

from __future__ import annotations

import base64
import html
import io
import os
import threading
import time

from matplotlib.figure import Figure

from .sheet import DPI, Block, new_figure

__all__ = ["View", "Live", "Replayer", "as_events", "new_figure", "fig_png", "png_size", "image_box", "set_image",
           "target_mesh", "plan_ops", "DPI", "STATIC_DPI"]

STATIC_DPI = DPI  # the picture stored in notebooks beside the widget: the same size as the widget's


def fig_png(fig: Figure, dpi: int = DPI) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) in pixels of a PNG."""
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _image_layout(data: bytes) -> dict:
    w, h = png_size(data)
    return dict(width=f"{w}px", height=f"{h}px", max_width="none", min_width=f"{w}px", flex="0 0 auto")


def image_box(data: bytes):
    """(box, image): the picture at its own size, one image pixel per CSS pixel (never stretched, never shrunk),
    in a box as wide as the output area that scrolls when the picture is wider."""
    import ipywidgets as w

    image = w.Image(value=data, format="png", layout=w.Layout(**_image_layout(data)))
    box = w.Box([image], layout=w.Layout(overflow="auto", max_width="100%", flex="0 0 auto"))
    box.add_class("meshviz-picture")
    return box, image


def set_image(image, data: bytes) -> None:
    """Show ``data`` in ``image`` (from image_box) at its own size."""
    for k, v in _image_layout(data).items():
        if getattr(image.layout, k) != v:
            setattr(image.layout, k, v)
    image.value = data


def as_events(source):
    """(events so far, live source or None) for a Cluster-like object, a list of events, or a JSONL path."""
    from ..trace import Event, load_events

    if source is None:
        return [], None
    if isinstance(source, (str, os.PathLike)):
        return load_events(source), None
    if hasattr(source, "subscribe") and hasattr(source, "unsubscribe"):
        return [], source
    if isinstance(source, Event):
        return [source], None
    try:
        events = list(source)
    except TypeError:
        raise ValueError(f"source must be a Cluster, a list of events or a JSONL path, got {source!r}") from None
    return [e if isinstance(e, Event) else Event.from_dict(e) for e in events], None


def target_mesh(e) -> dict | None:
    """The mesh a ``reshard`` event moves its tensor to (None when the event does not say)."""
    from ..trace import ReshardPlan

    return e.payload_as(ReshardPlan).target_mesh


def plan_ops(e) -> list | None:
    """The step ops of a ``reshard`` event's plan (None when the event does not say)."""
    from ..trace import ReshardPlan

    p = e.payload_as(ReshardPlan)
    return list(p.ops) if p.ops is not None else None


class Live:
    """Feeds events from a source's background thread to a view, redrawing at most once per ``interval`` s."""

    def __init__(self, view: "View", source, interval: float = 0.15):
        self.view = view
        self.source = source
        self.interval = interval
        self.received = 0
        self._pending: list = []
        self._cv = threading.Condition()
        self._stopped = False
        self._seen: set = set()
        self._inflight = False
        self.latencies: list = []  # seconds from an event's arrival to the redraw that shows it (last 1000)
        self._thread = threading.Thread(target=self._run, name=f"meshviz-{type(view).__name__}", daemon=True)
        source.subscribe(self._on_event)
        backlog = getattr(source, "events", None)
        if backlog is None and hasattr(source, "__iter__"):  # an EventLog itself
            backlog = source
        if backlog is not None:
            with self._cv:
                self._pending[:0] = list(backlog)
        self._thread.start()

    def _on_event(self, event) -> None:  # called on the source's thread: only queue
        with self._cv:
            if not self._pending:
                self._first_arrival = time.monotonic()
            self._pending.append(event)
            self._cv.notify()

    def _run(self) -> None:
        last = 0.0
        while True:
            with self._cv:
                while not self._pending and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
            wait = last + self.interval - time.monotonic()
            if wait > 0:  # let events pile up: one redraw per interval however fast they come
                time.sleep(wait)
            with self._cv:
                batch, self._pending = self._pending, []
                arrived = getattr(self, "_first_arrival", time.monotonic())
                self._inflight = True
            fresh = []
            for e in batch:
                key = (e.rank, e.seq, e.kind, e.start)
                if key not in self._seen:
                    self._seen.add(key)
                    fresh.append(e)
            self.received += len(fresh)
            try:
                if fresh:
                    self.view._ingest(fresh)
                    self.view._refresh()
            except Exception as exc:  # a drawing bug must not kill the stream
                self.view._error = f"{type(exc).__name__}: {exc}"
            last = time.monotonic()
            if fresh:
                self.latencies.append(last - arrived)
                del self.latencies[:-1000]
            with self._cv:
                self._inflight = False

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every event received so far is drawn."""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            with self._cv:
                idle = not self._pending and not self._inflight
            if idle:
                return True
            time.sleep(0.01)
        return False

    def stop(self) -> None:
        try:
            self.source.unsubscribe(self._on_event)
        except Exception:
            pass
        with self._cv:
            self._stopped = True
            self._cv.notify()


class View:
    """A picture of something meshviz knows about; shows as a widget, a PNG, or one line of text."""

    def __init__(self, source=None, interval: float = 0.15):
        self._lock = threading.RLock()
        self._widget = None
        self._image = None
        self._status = None
        self._live: Live | None = None
        self._error: str | None = None
        self._busy = False
        self.redraws = 0
        self.events: list = []
        if source is not None:
            events, live = as_events(source)
            if events:
                self._ingest(events)
            if live is not None:
                self._live = Live(self, live, interval)

    # -- to override ------------------------------------------------------------------------------
    def _block(self) -> Block:
        """The picture, laid out in inches (sheet.Block): its size is what it needs, never stretched."""
        raise NotImplementedError

    def _ingest(self, events) -> None:
        """Take new events (from a source); subclasses keep what they draw."""
        self.events.extend(events)

    def _controls(self):
        return []

    # -- rendering --------------------------------------------------------------------------------
    def figure(self) -> Figure:
        with self._lock:
            return self._block().figure()

    def png(self, dpi: int = DPI) -> bytes:
        return fig_png(self.figure(), dpi)

    def save(self, path, dpi: int = DPI) -> str:
        """Write the picture to ``path`` (.png, .svg or .pdf by suffix); returns the path."""
        self.figure().savefig(os.fspath(path), dpi=dpi)
        return os.fspath(path)

    def _repr_png_(self) -> bytes:
        return self.png()

    def _repr_html_(self) -> str:
        data = base64.b64encode(self.png()).decode("ascii")
        text = html.escape(repr(self))
        img = f'<img src="data:image/png;base64,{data}" alt="{text}"/>'
        return f"<figure>{img}<figcaption><code>{text}</code></figcaption></figure>"

    # -- widget -----------------------------------------------------------------------------------
    @property
    def widget(self):
        """The ipywidgets form of this view (built on first use)."""
        if self._widget is None:
            import ipywidgets as w

            box, self._image = image_box(self._widget_png())
            self._status = w.HTML(value=self._status_html())
            self._widget = w.VBox(self._controls() + [box, self._status])
            self._widget.add_class("meshviz-view")
        return self._widget

    def _widget_png(self) -> bytes:
        return self.png()

    def _status_html(self) -> str:
        """What the widget says under its picture: only what went wrong (the repr is for the console)."""
        if self._error:
            return f'<span style="color:#b00">{html.escape(self._error)}</span>'
        return ""

    def _refresh(self) -> None:
        """Redraw the widget's picture (any thread); a view without a widget only counts."""
        with self._lock:
            self._busy = True
            try:
                self.redraws += 1
                if self._image is not None:
                    set_image(self._image, self._widget_png())
                    self._status.value = self._status_html()
            finally:
                self._busy = False

    def _ipython_display_(self):
        from IPython.display import display

        bundle = {"text/plain": repr(self)}
        try:
            bundle.update(self.widget._repr_mimebundle_() or {})
            bundle["text/plain"] = repr(self)
        except Exception:  # no widget front end: the static picture still shows
            pass
        bundle["image/png"] = self.png(STATIC_DPI)  # the static picture, for nbconvert and GitHub
        display(bundle, raw=True)

    # -- live -------------------------------------------------------------------------------------
    def feed(self, events) -> "View":
        """Add events (replay, or a source of your own) and redraw."""
        evs, _ = as_events(list(events) if not isinstance(events, (str, os.PathLike)) else events)
        with self._lock:
            self._ingest(evs)
        self._refresh()
        return self

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the live source's events so far are drawn (True when there is nothing pending)."""
        return True if self._live is None else self._live.flush(timeout)

    def close(self) -> None:
        """Stop following the live source."""
        if self._live is not None:
            self._live.stop()
            self._live = None

    @property
    def live(self) -> bool:
        return self._live is not None


class Replayer:
    """A live source that plays recorded events (a list or a JSONL path) on a thread, like a Cluster would.

    ``speed``: recorded seconds per real second (``None``: as fast as possible); gaps are capped at ``max_gap``.
    """

    def __init__(self, events, speed: float | None = 1.0, max_gap: float = 0.25):
        self.recorded, _ = as_events(events)
        self.speed = speed
        self.max_gap = max_gap
        self.events: list = []
        self._subs: list = []
        self._thread: threading.Thread | None = None

    def subscribe(self, callback):
        self._subs.append(callback)
        return callback

    def unsubscribe(self, callback) -> None:
        if callback in self._subs:
            self._subs.remove(callback)

    def start(self) -> "Replayer":
        self._thread = threading.Thread(target=self._run, name="meshviz-replay", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        prev = None
        for e in self.recorded:
            if self.speed and prev is not None:
                time.sleep(min(self.max_gap, max(0.0, (e.start - prev) / self.speed)))
            prev = e.start
            self.events.append(e)
            for cb in list(self._subs):
                cb(e)

    def join(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def __repr__(self) -> str:
        return f"<Replayer {len(self.events)}/{len(self.recorded)} events>"
