"""Ranks as threads of the kernel's process: the Cluster's "threads" Runner (engines' cells, less memory)."""

from __future__ import annotations

import ast
import builtins
import collections
import contextlib
import dataclasses
import itertools
import linecache
import threading
import time
import types

from .. import trace
from ..rank_context import bound
from ..ranks.patches import capture, follow_threads, route_streams, unfollow_threads, unroute_streams
from ..trace.status import RankStatus
from ..trace.stream import EventLog
from .config import ClusterConfig
from .control import Control
from .thread_view import RankResult, ThreadView, _follow, _live, _Output, _pull, _RankDisplay, _shell

__all__ = ["Threads", "ThreadView", "RankResult"]

_cells = itertools.count(1)


# -- running a cell on a rank -----------------------------------------------------------------------------------

def _transform(code: str) -> str:
    """IPython syntax (``%magic``, ``!cmd``) made Python, as an engine's shell would."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:
        return code
    return TransformerManager().transform_cell(code)


def _compile(code: str):
    """(body, last expression or None, filename): the cell split as IPython runs it (the last expression's value
    is the cell's result unless the cell ends with ``;``)."""
    source = _transform(code)
    filename = f"<rank cell {next(_cells)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # tracebacks show the lines
    tree = ast.parse(source, filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not code.rstrip().endswith(";"):
        last = compile(ast.Expression(tree.body.pop().value), filename, "eval")
    return compile(tree, filename, "exec"), last, filename


def _format(value) -> dict:
    shell = _shell()
    if shell is not None:
        data, md = shell.display_formatter.format(value)
        return {"data": data, "metadata": md}
    return {"data": {"text/plain": repr(value)}, "metadata": {}}


def _interactive(func, ns: dict):
    """A function defined in the notebook runs in the rank's namespace (as ipyparallel runs it on an engine)."""
    if isinstance(func, types.FunctionType) and func.__module__ == "__main__":
        f = types.FunctionType(func.__code__, ns, func.__name__, func.__defaults__, func.__closure__)
        f.__kwdefaults__ = func.__kwdefaults__
        return f
    return func


_running: dict[int, bool] = {}  # the running thread clusters (by id) and their check_collectives
_kernel: dict[str, bool] = {}  # the process's check setting before the first of them started


@contextlib.contextmanager
def _on_rollcall(op: str, ranks: tuple, tensors):
    """A collective (or receive) of the thread backend that meshviz's comm layer did not issue (``torch.distributed``
    called directly): the rank's roll-call shows it while it waits, and a failure names it, as for meshviz's own.
    It takes no number of the group's (the comm layer counts its own calls; engines do not see these)."""
    from ..runtime import rollcall

    rec = rollcall.current()
    if rec.op is not None:  # inside one of meshviz's collectives: shown already
        yield
        return
    prev = rec.enter(op, ranks, tensors, counted=False)
    try:
        yield
    except BaseException as e:
        rec.fail(e)
        raise
    finally:
        rec.leave(prev)


class UnprintableError(Exception):
    """Raised in place of a rank's exception whose ``__str__`` raises (chained to it, so its traceback shows)."""


def _text(e: BaseException) -> str | None:
    try:
        return str(e)
    except Exception:
        return None


# -- the backend -----------------------------------------------------------------------------------------------

class Threads:
    """The Cluster's ``"threads"`` Runner: every rank a thread of this process (``Cluster(ranks="threads")``), a
    job a :class:`RankResult`.

    Each rank has its own namespace (as an engine has), its own process group (backend ``"threads"``, see
    :mod:`meshviz.ranks.threads`) and its own trace sinks; its events reach ``cluster.events`` on a
    background thread (JSON round trip, as from an engine), its failures the cluster's control.
    """

    kind = "threads"
    local = False

    def __init__(self, config: ClusterConfig, events: EventLog, control: Control):
        self.config = config
        self.events = events
        self.control = control
        self.ranks: list[int] = []
        self.devices: list[str] = []
        self.info: list[dict] = []
        self.backend_used: str | None = None
        self.engine_ids: list[int] = []
        self.state_dir = None
        self.client = None
        self.view: ThreadView | None = None
        self.world = None
        self.namespaces: list[dict] = []
        self._counts: list[int] = []
        self._queue: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._qlock = threading.Lock()
        self._queued = 0  # events handed to the dispatcher
        self._processed = 0  # ... and taken off its queue (delivered, or dropped as unencodable)
        self._processed_cv = threading.Condition()
        self._dispatcher: threading.Thread | None = None
        self._stop_dispatch = False
        self._sinks: dict = {}
        self._display = None
        self._records: dict = {}  # rank -> its roll-call record
        self._checking_was: bool | None = None

    @property
    def n(self) -> int:
        return self.config.n

    # -- start and stop -----------------------------------------------------------------------------------------
    def start(self) -> "Threads":
        from ..ranks.threads import BACKEND, ThreadWorld, internal_frames

        internal_frames(__file__)

        cfg = self.config
        self.world = ThreadWorld(cfg.n, timeout=cfg.timeout, name="meshviz-rank")
        self._stop_dispatch = False
        self._dispatcher = threading.Thread(target=self._dispatch, name="meshviz-thread-events", daemon=True)
        self._dispatcher.start()
        self.world.on_deadlock = self._timed_out
        self.world.start()
        self.ranks = list(range(cfg.n))
        self.namespaces = [{"__name__": "__main__", "__builtins__": builtins} for _ in self.ranks]
        self._counts = [0] * cfg.n
        self.devices = ["cpu"] * cfg.n
        self.backend_used = BACKEND
        self.info = [{"rank": r, "world": cfg.n, "backend": BACKEND, "device": "cpu",
                      "thread": self.world.name + f"-{r}"} for r in self.ranks]
        self.view = ThreadView(self)
        self.client = self.view.client
        self.control.attach(self._on_message)
        self.set_tracing(True)
        from ..runtime import match

        _running[id(self)] = cfg.check_collectives
        follow_threads(_follow)
        was = match.set_checking(any(_running.values()))  # process-wide: every rank thread, or none
        if len(_running) == 1:
            _kernel["checking"] = was
        self._checking_was = was
        return self

    def stop(self) -> None:
        """End the rank threads and take back what they patched (the Runner contract's; the Cluster calls
        :meth:`shutdown` and :meth:`teardown` itself)."""
        self.shutdown()
        self.teardown()

    def shutdown(self) -> None:
        self.sync_events(self.ranks, 2.0)
        if self.world is not None:
            self.world.stop()

    def teardown(self) -> None:
        if self.world is not None and self.world.started:
            self.world.stop()
        self.world = None
        self._stop_dispatch = True
        self._wake.set()
        if self._dispatcher is not None:
            self._dispatcher.join(2.0)
            self._dispatcher = None
        self.control.attach(None)
        self._sinks.clear()
        if self._checking_was is not None:
            from ..runtime import match

            _running.pop(id(self), None)
            # another thread cluster still running keeps its check; the last one puts the kernel's setting back
            match.set_checking(any(_running.values()) if _running else _kernel.get("checking", self._checking_was))
            self._checking_was = None
            if not _running:
                unfollow_threads()
        for key in [k for k in _live if k[0] == id(self)]:
            del _live[key]
        self.view = None
        unroute_streams()
        shell = _shell()
        if shell is not None and isinstance(shell.display_pub, _RankDisplay):
            shell.display_pub = shell.display_pub._pub

    def kill(self) -> None:
        self.teardown()

    def reinit(self, timeout: float) -> None:
        """After an abort: fresh meetings and call numbers on every group (the groups and the ranks' state stay)."""
        self.world.reset()

    # -- running code -------------------------------------------------------------------------------------------
    def _prepare_io(self) -> None:
        route_streams()
        shell = _shell()
        if shell is not None and not isinstance(shell.display_pub, _RankDisplay):
            shell.display_pub = _RankDisplay(shell.display_pub)

    def run_code(self, code: str, ranks=None, single: bool = False) -> RankResult:
        """Start ``code`` on ``ranks`` (all by default), each in its own namespace; returns the RankResult."""
        ranks = list(self.ranks) if ranks is None else ranks
        body, last, _ = _compile(code)  # a syntax error is raised here, once
        outs = {r: _Output((id(self), r)) for r in ranks}

        def cell(r):
            self._counts[r] += 1
            out = outs[r]
            out.count = self._counts[r]
            trace.set_cell(out.count)  # events say which cell emitted them, as on an engine
            ns = self.namespaces[r]
            capture().out = _live[out.key] = out
            try:
                exec(body, ns)
                if last is not None:
                    value = eval(last, ns)
                    if value is not None:
                        out.execute_result = {**_format(value), "count": out.count}
            finally:
                capture().out = None
                if _live.get(out.key) is out:
                    del _live[out.key]

        return self._submit(cell, ranks, outs, single, "%px")

    def run_call(self, func, *args, _ranks=None, _single=False, _namespace=False, _rank_arg=False,
                 **kwargs) -> RankResult:
        """Start ``func(*args, **kwargs)`` on every rank (in its namespace if defined in the notebook; with
        ``_namespace`` the namespace is the first argument, with ``_rank_arg`` the rank)."""
        ranks = list(self.ranks) if _ranks is None else _ranks
        outs = {r: _Output((id(self), r)) for r in ranks}

        def call(r):
            out = capture().out = _live[(id(self), r)] = outs[r]
            try:
                if _namespace:
                    return func(self.namespaces[r], *args, **kwargs)
                if _rank_arg:
                    return _interactive(func, self.namespaces[r])(r, *args, **kwargs)
                return _interactive(func, self.namespaces[r])(*args, **kwargs)
            finally:
                capture().out = None
                if _live.get(out.key) is out:
                    del _live[out.key]

        return self._submit(call, ranks, outs, _single, "apply")

    def as_job(self, handle: RankResult) -> RankResult:
        """The job of ``handle``: a RankResult is one already."""
        return handle

    def submit(self, fn, ranks=None) -> RankResult:
        """Start ``fn(rank)`` on ``ranks`` (all by default); failures are reported like a cell's."""
        return self.run_call(fn, _ranks=None if ranks is None else [int(r) for r in ranks], _rank_arg=True)

    def run_eval(self, names, ranks=None, single: bool = False) -> RankResult:
        """Evaluate ``names`` (an expression, or a sequence of them) on each rank, in its namespace."""
        return self.run_call(_pull, names, _ranks=ranks, _single=single, _namespace=True)

    def _submit(self, fn, ranks, outs, single, kind) -> RankResult:
        from ..runtime import rollcall

        self._prepare_io()

        from ..backends.threads import watch_calls

        def guarded(r):
            watch_calls(_on_rollcall)
            rec = rollcall.current()  # this rank's roll-call record: what status() reads while it waits
            rec.rank, rec.thread = r, threading.get_ident()
            self._records[r] = rec
            rec.start()
            try:
                return fn(r)
            except BaseException as e:
                self._report(r, e)
                if _text(e) is None:  # every runner describes a failure by its str(): this one's raises
                    raise UnprintableError(f"{type(e).__name__}: <exception str() failed>") from e
                raise
            finally:
                trace.flush()  # the cell's deferred events (a traced reshard's) go out with it
                rec.finish()

        job = self.world.submit(guarded, ranks)
        return RankResult(job, ranks, outs, single, kind)

    def _report(self, rank: int, e: BaseException) -> None:
        """Tell the control this rank failed, as an engine does: the error, the collective it came out of (its
        roll-call record), a mismatch, and whether the group's meetings were left torn (re-made before the next
        cell). A rank stopped for a peer says nothing: the peer's report names the cause."""
        from ..ranks.threads import RankStopped
        from .engine import failure_report

        own_wait = isinstance(e, RankStopped) and e.own  # its own collective timed out, or a deadlock
        if isinstance(e, RankStopped) and not own_wait:
            return
        rec = self._records[rank]  # guarded() set it before the rank ran
        self.control.on_control(failure_report(rank, e, rec.cell, rec, own_wait))

    def _timed_out(self) -> None:
        """The baton's hook, called (holding its lock) on the thread of a rank whose wait found a deadlock or timed
        out. A timed-out rank raises only when it next gets the turn: while another rank keeps it (a loop that
        never waits) that would be never, so it reports now, as a rank process whose collective timed out does,
        and the cluster stops the others."""
        world = self.world
        me = next((r for r, rec in self._records.items() if rec.thread == threading.get_ident()), None)
        if world is None or me is None or world.holder is None or world.holder == me:
            return None  # a deadlock (nobody holds the turn), or the rank runs on at once and reports itself
        from ..ranks.threads import RankStopped
        from .engine import failure_report

        rec = self._records[me]
        if rec.op is not None:
            what = f"{rec.op}{'' if rec.seq is None else f' #{rec.seq}'} on group {list(rec.group or ())}"
        else:  # a collective that does not pass meshviz's comm layer: as the process group words it
            what = getattr(world, "_blocked", {}).get(me) or "a collective"
        err = RankStopped(f"rank {me} timed out after {self.config.timeout:g} s in {what}", own=True)
        rec.fail(err)
        self.control.on_control(failure_report(me, err, rec.cell, rec, True))
        return None

    def _on_message(self, msg: dict) -> None:
        """The cluster's messages to the ranks: an abort stops every waiting rank now; a status request is
        answered at once from every rank's roll-call record (readable while the rank waits)."""
        kind = msg.get("type")
        if kind == "abort" and self.world is not None:
            self.world.abort(msg.get("origin"))
        elif kind == "status":
            from ..runtime import rollcall

            turns = self.world.turn_waits() if self.world is not None else {}
            for r in self.ranks:
                rec = self._records.get(r)
                status = rollcall.snapshot(rec, bool(msg.get("stacks"))) if rec is not None else \
                    RankStatus(r, "idle", note="no cell ran yet")
                if r in turns and status.state in ("idle", "running"):  # its cell waits for the turn to go on
                    status = dataclasses.replace(status, state="running", note=None, turn=turns[r][0],
                                                 waiting_s=round(turns[r][1], 3),
                                                 where=status.where if status.state == "running" else None)
                self.control.on_control({"type": "status", "id": msg.get("id"), "rank": r,
                                         "status": status.to_dict()})

    def interrupt(self, ranks=None) -> None:
        """KeyboardInterrupt on every rank with work (all of them: one baton). A rank waiting in a collective
        leaves its meeting half done, as an abort leaves a rank process's group: the cluster re-makes the
        meetings before the next cell, and says so."""
        if self.world is None:
            return
        waiting = self.world.waiting()
        self.world.interrupt()
        if waiting:
            self.control.abort(None)

    def busy(self) -> bool:
        return self.world is not None and self.world.busy()

    # -- events -------------------------------------------------------------------------------------------------
    def set_tracing(self, on: bool) -> None:
        for r in self.ranks:
            with bound(self.world.contexts[r]):
                sink = self._sinks.get(r)
                if on and sink is None:
                    sink = self._sinks[r] = self._sink_for(r)
                    trace.add_sink(sink)
                elif not on and sink is not None:
                    trace.remove_sink(sink, close=False)
                    del self._sinks[r]

    def _sink_for(self, rank: int):
        def sink(event) -> None:
            with self._qlock:
                self._queued += 1
                self._queue.append(event)
            self._wake.set()

        return sink

    def _dispatch(self) -> None:
        """Hand the ranks' events to the log as an engine's stream would: JSON-plain copies, in batches."""
        from ..trace.events import from_json, to_json

        while True:
            self._wake.wait(0.1)
            self._wake.clear()
            taken, good = 0, []
            while self._queue:
                ev = self._queue.popleft()
                taken += 1
                try:
                    good.append(from_json(to_json(ev)))
                except Exception:  # an unencodable event is dropped, as on the stream
                    pass
            if good:
                self.events._extend(good, time.time())  # the log's own delivery (subscribers called here)
            if taken:
                with self._processed_cv:
                    self._processed += taken
                    self._processed_cv.notify_all()
            if self._stop_dispatch and not self._queue:
                return

    def sync_events(self, ranks, timeout: float = 2.0) -> None:
        """Wait until the events the ranks emitted so far are in the log."""
        with self._qlock:
            want = self._queued
        self._wake.set()
        deadline = time.monotonic() + timeout
        with self._processed_cv:
            while self._processed < want:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._processed_cv.wait(min(left, 0.05))

    # -- health -------------------------------------------------------------------------------------------------
    def find_dead(self) -> dict[int, str] | None:
        if self.world is None:
            return None
        return {}

    def describe(self, rank: int) -> str:
        return f"thread {self.world.name if self.world else 'meshviz-rank'}-{rank}, cpu"
