"""Cluster: ranks 0..n-1 with a process group across them, code run on all of them, and their events here."""

from __future__ import annotations

import atexit
import shutil
import sys
import threading
import time
import warnings
import weakref
from typing import Any, Protocol

from ..core.devices import DeviceNotice
from ..errors import RankOutcome
from ..ranks.runner import Job, Runner
from ..trace.commtable import CommTable, comm_table
from ..trace.status import RollCall
from ..trace.stream import EventLog
from .config import DEFAULT_CPU_RANKS, DEFAULT_HANG_AFTER, OUTPUT_WAIT, ClusterConfig
from .control import ClusterState, Control, blame_rollcall
from .engine import GRACE
from .engines import Engines
from .hangs import HangWatch
from .threads import Threads

__all__ = ["Cluster", "ClusterState", "DEFAULT_CPU_RANKS", "CellJob", "RankBackend", "RUNNERS"]

STUCK_AFTER = 10.0  # seconds past the collective timeout a rank may run on after an abort before it counts as stuck


class CellJob(Job, Protocol):
    """A Job of a Cluster's ranks; ``result`` is what ``Cluster.execute`` returns for it (ipyparallel's
    AsyncResult on engines, the :class:`~meshviz.cluster.thread_view.RankResult` itself on threads)."""

    result: Any


class RankBackend(Runner, Protocol):
    """A Runner a Cluster runs on (:class:`~meshviz.cluster.engines.Engines`: one ipyparallel engine each;
    :class:`~meshviz.cluster.threads.Threads`: one thread of this process each), with what a notebook needs
    besides: cells (``run_code``), calls (``run_call``), their events, a process group re-made after an abort."""

    ranks: list[int]
    devices: list[str]
    info: list[dict]
    backend_used: str | None
    view: Any

    def shutdown(self) -> None: ...
    def teardown(self) -> None: ...
    def kill(self) -> None: ...
    def reinit(self, timeout: float) -> None: ...
    def run_code(self, code: str) -> CellJob: ...
    def run_call(self, func, *args, **kwargs) -> CellJob: ...
    def as_job(self, handle) -> CellJob: ...
    def sync_events(self, ranks, timeout: float = 2.0) -> None: ...
    def busy(self) -> bool: ...
    def set_tracing(self, on: bool) -> None: ...
    def find_dead(self) -> dict[int, str] | None: ...
    def describe(self, rank: int) -> str: ...


RUNNERS = {"engines": Engines, "threads": Threads}  # what ``ranks=`` names; ``runner=`` brings any other


def _kill_at_exit(ref) -> None:
    """The kernel is exiting without ``stop()`` (a cell raised under nbconvert, the kernel was shut down): no
    rank may outlive it."""
    cluster = ref()
    if cluster is None or cluster.state == ClusterState.STOPPED:
        return
    cluster._control.stop_monitor()
    cluster._ranks.kill()


class Cluster:
    """Ranks 0..n-1 with a process group across them (ipyparallel engines, or threads of this process); returns
    when every rank is ready.

    ``ranks="threads"`` (the default when ``MESHVIZ_RANKS=threads``, as on Binder) runs every rank as a thread of
    this kernel: the same ``%%px`` cells, outputs, events, views and errors, in a fraction of the memory (one
    Python with torch instead of one per rank); CPU only. One rank runs at a time, handing over only while it
    waits (a collective, a receive, ``time.sleep``), so the ranks' code and RNGs behave as in processes
    (:mod:`meshviz.ranks.threads`). Otherwise engines:

    Ranks: rank r is the engine with the r-th smallest engine id. A Cluster always starts its own controller,
    so engine ids are 0..n-1 and rank == engine id (the ``[stdout:r]`` labels of ``%%px`` are ranks); after
    ``restart()`` the same holds.

    Devices, counted before any engine starts: ``devices='auto'`` binds rank r to GPU r (NCCL) when the machine
    has a GPU for every rank, else every rank runs on the CPU with one torch thread (gloo) — with GPUs present but
    too few, a :class:`DeviceNotice` warning and the repr say so. ``devices='cpu'`` forces the CPU;
    ``devices='cuda'`` insists on one GPU per rank (ValueError at once when there are too few; with
    ``backend='gloo'`` the ranks share the GPUs round robin); a list of GPU ids binds rank r to GPU
    ``devices[r]`` (one visible id per rank; an id twice only with ``backend='gloo'``). ``CUDA_VISIBLE_DEVICES``
    is set on each engine before torch is imported, so a rank sees its GPU as ``cuda:0``. ``n=None``: one rank
    per GPU, or 4 without GPUs. A world never mixes NCCL and gloo ranks.

    ``timeout``: collective timeout in seconds (every rank stops within it when one fails; usually much
    sooner, see ``%%px`` below). ``ipp_options`` go to ``ipyparallel.Cluster`` (``engines='mpi'``,
    ``controller_ip=...``, ...); the controller's heartbeat is 0.5 s, not 3 s, unless ``controller_args`` set
    ``HeartMonitor``: an engine counts as started at its first answered beat. The controller, the process-group
    store and the event stream listen on loopback unless you pass ``controller_ip``; connection files live in a
    private state dir (``state_dir``, mode 0700) with the engines' and controller's logs.

    ``%%px`` is activated: a failing cell raises :class:`RankError` naming the rank that failed first, with
    its traceback (every rank that raised the same error, said once: "every rank (0-3) raised NameError: ...");
    the other ranks are stopped at once (their process group is torn down and re-created
    before the next cell). ``events`` fill while cells run; ``subscribe(callback)`` sees each one.

    ``state`` is a :class:`ClusterState`, equal to its name: ``"stopped"``, ``"starting"``, ``"ready"``,
    ``"aborted"`` (a failure tore the process group down; it is re-created before the next cell), ``"broken"``
    (an engine died: ``restart()``) or ``"failed"`` (``start()`` did not finish).

    Hangs: once a rank has waited ``hang_after`` seconds in a collective (None: never), the running cell shows
    the roll-call (:meth:`status`: each rank's state drawn on the ranks, one line per situation, "rank 0 waits in
    all_reduce #1 on group [0, 1] for 6.2 s; rank 1 is idle: its cell finished without entering all_reduce #1"),
    updated until the cell ends; ranks inside different collectives at one sequence number of a group are a
    mismatch, and the cell fails at once naming them; so does a blocking cell whose ranks wait for ranks that
    finished it without entering the collective (or died): nothing else can reach those while it runs. A collective
    timeout's error names the ranks that never entered the collective. Raw ``torch.distributed`` collectives are in
    the roll-call too, without a number. ``check_collectives``: before each collective on a gloo group, the members
    compare op, sequence number, shapes and dtypes (gloo would end the process on a size mismatch); one small
    all-gather each.

    ``runner``: the ranks' :class:`RankBackend` made some other way, called as ``runner(config, events, control)``
    (default: ``RUNNERS[ranks]``); the Cluster talks to it only through that contract.
    """

    def __init__(self, n: int | None = None, devices="auto", backend: str | None = None, timeout: float = 60,
                 ranks: str | None = None, hang_after: float | None = DEFAULT_HANG_AFTER,
                 check_collectives: bool = True, runner=None, **ipp_options):
        self.config = ClusterConfig.from_args(n, devices, backend, timeout, ipp_options, ranks, hang_after,
                                              check_collectives)
        if self.config.notice:  # fewer GPUs than ranks: said once here, and in the repr
            warnings.warn(self.config.notice, DeviceNotice, stacklevel=2)
        self.n = self.config.n
        self.timeout = self.config.timeout
        self.hang_after = self.config.hang_after
        self.rollcalls: list[RollCall] = []  # the roll-calls the last execution showed
        self.last_error = None  # the RankError of the last execution that failed
        self._executions = 0
        self._interrupted = -1  # the execution interrupt() last reached
        self.backend = backend
        self.events = EventLog()
        self._control = Control()
        make = runner or RUNNERS[self.config.ranks]
        self._ranks: RankBackend = make(self.config, self.events, self._control)
        self._magics_suffix = None
        self._atexit = False
        self.start()

    # -- what the ranks are ---------------------------------------------------------------------------------------
    @property
    def state(self) -> ClusterState:
        return self._control.state

    @property
    def failures(self) -> list[dict]:
        """Failure reports from the ranks, in arrival order."""
        return self._control.failures

    @property
    def ranks(self) -> list[int]:
        return self._ranks.ranks

    @property
    def devices(self) -> list[str]:
        return self._ranks.devices

    @property
    def info(self) -> list[dict]:
        return self._ranks.info

    @property
    def backend_used(self) -> str | None:
        return self._ranks.backend_used

    @property
    def ranks_kind(self) -> str:
        """``"engines"`` or ``"threads"``: where the ranks run."""
        return self.config.ranks

    @property
    def view(self):
        """The ranks' view, in rank order: ipyparallel's DirectView over the engines (a ThreadView with the same
        ``execute``/``apply``/``pull``/``push`` over threads)."""
        return self._ranks.view

    @property
    def client(self):
        return self._ranks.client

    @property
    def engine_ids(self) -> list[int]:
        return self._ranks.engine_ids

    @property
    def state_dir(self) -> str | None:
        return self._ranks.state_dir

    # -- life cycle ---------------------------------------------------------------------------------------------
    def start(self) -> "Cluster":
        """Start the ranks, bind devices, init the process group; returns when ready."""
        self._control.begin_start()
        t0 = time.perf_counter()
        try:
            self._ranks.start()
        except BaseException:
            self._control.start_failed()
            self._teardown()
            raise
        if getattr(self._ranks, "local", False) and not self._atexit:
            atexit.register(_kill_at_exit, weakref.ref(self))
            self._atexit = True
        self.started_in = time.perf_counter() - t0
        self._control.started()
        self._control.start_monitor(self._ranks.find_dead)
        self.activate()
        return self

    def stop(self) -> None:
        """Stop the ranks quietly (their output goes to log files in ``state_dir``)."""
        state = self.state
        if state == ClusterState.STOPPED:
            return
        self._control.stop_monitor()
        dead = bool(self._control.dead)
        if not dead and state in (ClusterState.READY, ClusterState.ABORTED):
            self._ranks.shutdown()
        self._teardown()
        self._control.stopped()
        if self.state_dir and not dead:  # the logs are kept when an engine died
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def _teardown(self) -> None:
        self._control.stop_monitor()
        self._ranks.teardown()

    def restart(self) -> "Cluster":
        """Stop and start again (fresh engines, fresh process group, same settings); events are kept."""
        self.stop()
        return self.start()

    def reset(self, quiet: bool = False) -> None:
        """Re-create the process group on the running engines (after a failure tore it down); keeps their state."""
        self._check_alive()
        self._ranks.reinit(self.timeout)
        self._control.reset_done()
        if not quiet:
            print(f"meshviz: the last failure tore the process group down; re-created it on ranks 0-{self.n - 1}",
                  file=sys.stderr, flush=True)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self):
        try:
            if self.state != ClusterState.STOPPED:
                self.stop()
        except Exception:
            pass

    # -- %px ----------------------------------------------------------------------------------------------------
    def activate(self, suffix: str = "") -> None:
        """Register ``%px``, ``%%px``, ``%autopx``, ``%pxresult`` (with ``suffix``) for this cluster's ranks."""
        try:
            from IPython import get_ipython
        except ImportError:
            return
        ip = get_ipython()
        if ip is None:
            return
        from .magics import RankMagics

        ip.magics_manager.register(RankMagics(ip, self.view, suffix, cluster=self))
        self._magics_suffix = suffix

    # -- running code -------------------------------------------------------------------------------------------
    def _prepare(self) -> tuple[int, float]:
        """Ready the ranks for an execution; returns its :meth:`_mark`, for ``_finish``."""
        self._check_alive()
        if self._control.needs_reset:
            self.reset()
        self.rollcalls = []
        self._executions += 1
        return self._mark()

    def _check_alive(self) -> None:
        if self.state == ClusterState.STOPPED or self.view is None:
            raise RuntimeError("Cluster is stopped; call cluster.start() or cluster.restart()")
        broken = {**self._control.dead, **self._control.stuck}
        if broken:
            which = ", ".join(f"rank {r} ({why})" for r, why in sorted(broken.items()))
            raise RuntimeError(f"Cluster: {which}; call cluster.restart() for a working cluster")

    def execute(self, code: str, timeout: float | None = None):
        """Run ``code`` on every rank (like a ``%%px`` cell); returns the AsyncResult (``.stdout`` in rank order).

        Raises :class:`RankError` naming the failing rank(s).
        """
        mark = self._prepare()
        job = self._ranks.run_code(code)
        self._finish(job, timeout, mark=mark)
        job.result.wait_for_output(OUTPUT_WAIT)
        return job.result

    def apply(self, func, *args, timeout: float | None = None, **kwargs) -> list:
        """Call ``func(*args, **kwargs)`` on every rank; returns the results in rank order."""
        mark = self._prepare()
        job = self._ranks.run_call(func, *args, **kwargs)
        outcomes = self._finish(job, timeout, mark=mark)
        return [o.value for o in outcomes]

    def _mark(self) -> tuple[int, float]:
        """Where an execution starts in the failure reports, and when: taken before its code is sent, because a
        rank that fails at once may report before the sender gets to wait for it (a busy machine)."""
        return len(self.failures), time.time()

    def _finish(self, job, timeout, tick=None, mark: tuple[int, float] | None = None) -> list[RankOutcome]:
        """Wait for ``job`` (stopping the other ranks when one fails), then its outcomes; RankError if any failed.
        ``job`` may be what ``view`` returned for code started on it directly; ``tick()`` is called while waiting
        (about every 50 ms: %px shows the ranks' output so far); ``mark``: :meth:`_mark` taken before ``job``
        was started (else now)."""
        job = self._ranks.as_job(job)
        since, t0 = mark or self._mark()
        watch = HangWatch(self, self.hang_after)
        self.rollcalls = watch.shown
        try:
            self._wait(job, timeout, since, watch, tick)
        finally:
            outcomes = job.outcomes()
            watch.close(all(o.status == "ok" for o in outcomes))
        failed = any(o.status != "ok" for o in outcomes)  # its reports decide whether the next execution resets
        self._sync_events([o.rank for o in outcomes if o.status in ("ok", "error")], 5.0 if failed else 2.0)
        if failed:
            rollcall = self._blame(watch, since, t0, [o.rank for o in outcomes if o.status == "ok"])
            self.last_error = self._control.rank_error(outcomes, since, t0, rollcall,
                                                       interrupted=self._interrupted == self._executions)
            raise self.last_error
        return outcomes

    def _blame(self, watch: HangWatch, since: int, t0: float, done=()) -> RollCall | None:
        """The roll-call that explains a failed execution: the last one shown while the ranks hung (else one taken
        now), with the failing ranks inside the collectives they failed in, and the ranks of ``done`` (those that
        ended well) it showed running as they are now: they finished without entering the collective."""
        reports = self._control.reports(since, t0)
        base = watch.mismatch or watch.stuck or watch.last
        if base is not None and base is not watch.mismatch:
            base = self._finished(base, done)
        if not any(f.get("collective") for f in reports) and not self._control.dead:
            return base
        if base is None:
            try:
                base = self.status(timeout=1.0)
            except Exception:
                base = None
        return blame_rollcall(base, reports, self.ranks, self._control.dead)

    def _finished(self, base: RollCall, done) -> RollCall:
        by = base.by_rank()
        late = {r for r in done if r in by and by[r].state == "running"}
        if not late:
            return base
        try:
            now = self.status(timeout=1.0)
        except Exception:
            return base
        return base.merged([s for s in now if s.rank in late and s.state == "idle"])

    def _wait(self, job: Job, timeout, since: int = 0, watch: HangWatch | None = None, tick=None) -> None:
        control, ranks = self._control, self._ranks
        deadline = None if timeout is None else time.monotonic() + timeout
        interrupted_at = None
        aborted_at = None  # when this loop saw the abort go out
        stragglers_told = False
        while True:
            new = control.failures[since:]
            if new and not control.abort_sent and time.time() - new[0]["received"] > GRACE:
                # a rank failed and others, which did not, are still running: they would wait for it forever
                failed = {f.get("rank") for f in new}
                if any(r not in failed for r in job.pending()):
                    control.abort(new[0]["rank"])
            if control.abort_sent and not stragglers_told:
                aborted_at = aborted_at or time.monotonic()
                if time.monotonic() - aborted_at > 1.0:
                    # the abort unblocks collectives, not a rank busy in Python: interrupt what still runs
                    pending = [r for r in job.pending() if r not in control.dead]
                    if pending:
                        ranks.interrupt(pending)
                    stragglers_told = True
            if aborted_at is not None and time.monotonic() - aborted_at > self.timeout + STUCK_AFTER:
                # past the collective timeout, interrupted, still running (it caught the KeyboardInterrupt, or C
                # code never returns): waiting longer could be forever
                for r in job.pending():
                    if r not in control.dead:
                        control.mark_stuck(r, f"still running {self.timeout + STUCK_AFTER:.0f} s after the abort "
                                              "and the interrupt")
                return
            if tick is not None:
                tick()
            if watch is not None and watch.tick(job.pending) is not None:
                # ranks sit in different collectives at one sequence number, or wait for ranks done with this
                # execution (nothing else reaches them while it runs): they will never meet
                control.abort(None)
            try:
                if job.wait(0.05):
                    return
            except KeyboardInterrupt:
                if interrupted_at is not None:
                    raise
                self.interrupt()
                interrupted_at = time.monotonic()
                deadline = interrupted_at + self.timeout + 5
                continue
            dead = control.dead
            if dead:
                pending = job.pending()
                if pending and set(pending) <= set(dead):
                    return
            if deadline is not None and time.monotonic() > deadline:
                return

    def _sync_events(self, ranks, timeout: float = 2.0) -> None:
        """Wait until the events the ranks sent during the last execution have arrived here."""
        self._ranks.sync_events(ranks, timeout)

    # -- the roll-call -------------------------------------------------------------------------------------------
    def status(self, stacks: bool = False, timeout: float = 2.0) -> RollCall:
        """The roll-call: one :class:`~meshviz.trace.RankStatus` per rank (``rank``, ``state`` — ``"idle"``,
        ``"running"``, ``"in_collective"``, ``"dead"``, or ``"unknown"`` when it did not answer within
        ``timeout`` s — ``op``, ``group``, ``seq``, ``waiting_s``, ``where``, ...), answered by a thread on each
        engine even while the rank is blocked; ``stacks`` adds each rank's Python stack.
        ``meshviz.show(cluster.status())`` draws it; ``.lines()`` says what it means."""
        if self.state == ClusterState.STOPPED or self.view is None:
            raise RuntimeError("Cluster is stopped; call cluster.start() or cluster.restart()")
        taken = time.time()
        rid = self._control.request_status(stacks)
        return self._control.collect_status(rid, self.ranks, timeout, taken)

    def comm_table(self, cell=None) -> CommTable:
        """Where the bytes went: per cell, collective, mesh axis (or group) and issuing nn.Module, the count, the
        bytes per rank and the time, read from the events received so far (``cell``: only that engine cell,
        ``-1``: the last one). ``meshviz.show(...)`` draws it."""
        return comm_table(self.events, cell=cell)

    def interrupt(self, abort_after: float | None = 1.0) -> None:
        """Send SIGINT to every engine (what Ctrl-C / the kernel's interrupt button does during ``%%px``).

        A rank blocked inside a collective does not see the signal until the collective returns; if ranks are
        still busy ``abort_after`` seconds later, their process group is torn down (and re-created before the
        next cell) so that the blocked collectives fail at once.
        """
        self._interrupted = self._executions
        if abort_after is not None:
            t = threading.Timer(abort_after, self._abort_if_busy, args=(self._executions,))
            t.daemon = True
            t.start()
        self._ranks.interrupt()

    def _abort_if_busy(self, execution: int) -> None:
        if self._executions == execution and self._ranks.busy():  # still the execution that was interrupted
            self._control.abort(None)

    # -- events -------------------------------------------------------------------------------------------------
    def subscribe(self, callback):
        """Call ``callback(event)`` for every event that arrives (on a background thread)."""
        return self.events.subscribe(callback)

    def unsubscribe(self, callback) -> None:
        self.events.unsubscribe(callback)

    def record(self, path: str) -> int:
        """Save the events received so far to ``path`` as JSONL; ``meshviz.trace.load_events`` reads it back."""
        return self.events.save(path)

    def set_tracing(self, on: bool = True) -> None:
        """Turn event emission on the ranks on or off (on by default)."""
        self._check_alive()
        self._ranks.set_tracing(bool(on))

    # -- display ------------------------------------------------------------------------------------------------
    def __repr__(self) -> str:
        backend = self.backend_used or self.backend or "auto"
        lines = [f"Cluster({self.n} ranks, {backend}, {self.state}, {len(self.events)} events)"]
        if self.config.notice:
            lines.append(f"  {self.config.notice}")
        dead = self._control.dead
        for r in self.ranks:
            extra = f"  DEAD: {dead[r]}" if r in dead else ""
            lines.append(f"  rank {r}: {self._ranks.describe(r)}{extra}")
        return "\n".join(lines)
