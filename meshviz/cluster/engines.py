"""Ranks as ipyparallel engines (the ``"engines"`` Runner): the controller, the engines' set-up, their jobs."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import tempfile
import threading
import time

from ..errors import RankError, RankOutcome
from ..ranks.outcomes import error_of
from ..trace.stream import EventLog, StreamReceiver
from . import engine as _engine
from .config import ClusterConfig, rank_configs
from .control import Control

__all__ = ["Engines", "EngineJob"]

HEARTBEAT_MS = 500  # ipyparallel's 3000 kept every start waiting two beats (5-6 s) for the engines' first heartbeats


def _pid_alive(pid: int) -> bool:
    try:
        import psutil

        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE
    except Exception:
        return False


class EngineJob:
    """Code running on engines (a :class:`~meshviz.ranks.runner.Job`); ``result`` is ipyparallel's AsyncResult,
    what ``Cluster.execute`` returns."""

    def __init__(self, engines: "Engines", ar, ranks: list[int]):
        self._engines = engines
        self.result = ar
        self.ranks = list(ranks)

    def done(self) -> bool:
        return self.result.ready()

    def wait(self, timeout: float | None = None) -> bool:
        self.result.wait(timeout)
        return self.result.ready()

    def pending(self) -> list[int]:
        return self._engines._pending(self.result)

    def outcomes(self) -> list[RankOutcome]:
        return self._engines._outcomes(self.result)

    def error(self) -> RankError | None:
        """The RankError naming the first rank (in rank order) that did not end well; None while running or when
        every rank did (the cluster's own error, ``Control.rank_error``, names the cause from the ranks' reports)."""
        return error_of(self.outcomes()) if self.done() else None


class Engines:
    """One ipyparallel engine per rank, on a controller of their own: the Cluster's ``"engines"`` Runner.

    Rank r is the engine with the r-th smallest id; with a controller of its own, engine ids are 0..n-1 and
    rank == engine id. Events and failure reports come back on a zmq stream (:class:`StreamReceiver`); the
    Cluster's messages to the ranks leave on a zmq PUB socket that every engine subscribes to.
    """

    kind = "engines"

    def __init__(self, config: ClusterConfig, events: EventLog, control: Control):
        self.config = config
        self.events = events
        self.control = control
        self.state_dir: str | None = None
        self.ranks: list[int] = []
        self.engine_ids: list[int] = []
        self.pids: dict[int, int] = {}
        self.devices: list[str] = []
        self.info: list[dict] = []
        self.backend_used: str | None = None
        self.local = False
        self.loopback = True
        self.client = None
        self.view = None
        self._ipp = None
        self._receiver = None
        self._zctx = None
        self._pub = None
        self._pub_lock = threading.Lock()
        self._base: dict[int, int] = {}
        self._cbase: dict[int, int] = {}
        self._log = logging.getLogger("meshviz.cluster")

    @property
    def n(self) -> int:
        return self.config.n

    # -- start and stop -----------------------------------------------------------------------------------------
    def start(self) -> "Engines":
        """Start the controller and the engines, bind devices, init the process group on every rank."""
        import ipyparallel as ipp
        import zmq

        cfg = self.config
        opts = dict(cfg.ipp_options)
        own_dir = "profile_dir" not in opts and "profile" not in opts
        self.state_dir = tempfile.mkdtemp(prefix="meshviz-cluster-") if own_dir else None
        logdir = self.state_dir or tempfile.mkdtemp(prefix="meshviz-cluster-log-")
        self.logdir = logdir
        log = logging.getLogger(f"meshviz.cluster.{os.path.basename(logdir)}")
        log.handlers = [logging.FileHandler(os.path.join(logdir, "cluster.log"))]
        log.setLevel(logging.INFO)
        log.propagate = False
        self._log = log
        if own_dir:
            opts["profile_dir"] = self.state_dir
        opts.setdefault("controller_ip", "127.0.0.1")
        opts.setdefault("delay", 0)
        opts.setdefault("engine_timeout", max(60, int(cfg.timeout)))
        args = list(opts.get("controller_args", ()))
        if not any("HeartMonitor" in a for a in args):  # the same 30 s of missed beats before an engine is dropped
            args += [f"--HeartMonitor.period={HEARTBEAT_MS}",
                     f"--HeartMonitor.max_heartmonitor_misses={30_000 // HEARTBEAT_MS}"]
        opts["controller_args"] = args
        opts["n"] = cfg.n
        opts["log"] = log
        multi = cfg.multi_machine
        self._receiver = StreamReceiver(
            self.events, host="0.0.0.0" if multi else "127.0.0.1",
            connect_host=(opts.get("controller_location") or socket.gethostname()) if multi else None,
            on_control=self.control.on_control)
        self._zctx = zmq.Context()
        self._pub = self._zctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        pport = self._pub.bind_to_random_port("tcp://*" if multi else "tcp://127.0.0.1")
        self.control.attach(self._send)
        control = f"tcp://{self._receiver.address.split('//')[1].rsplit(':', 1)[0]}:{pport}"
        self._ipp = ipp.Cluster(**opts)
        self._ipp.start_cluster_sync()
        self.client = self._ipp.connect_client_sync()
        self.client.wait_for_engines(cfg.n, timeout=opts["engine_timeout"], interactive=False)
        ids = sorted(self.client.ids)[: cfg.n]
        probes = self.client.direct_view(ids).apply_sync(_engine.probe, not multi)
        self._setup(ids, probes, control)
        return self

    def _setup(self, ids, probes, control) -> None:
        cfg = self.config
        hosts = [p["host"] for p in probes]
        local = all(h == socket.gethostname() for h in hosts)
        loopback = local and not cfg.multi_machine
        self.loopback = loopback
        master = "127.0.0.1" if loopback else socket.gethostbyname(hosts[0])
        cfgs = rank_configs(probes, cfg.mode, cfg.gpus, master, loopback, cfg.timeout, cfg.backend)
        for c in cfgs:
            c.update(stream=self._receiver.address, control=control, trace=True, check=cfg.check_collectives)
        ars = [self.client[eid].apply_async(_engine.setup, c) for eid, c in zip(ids, cfgs)]
        deadline = time.monotonic() + cfg.timeout + 60
        infos = []
        for r, ar in enumerate(ars):
            left = max(0.1, deadline - time.monotonic())
            try:
                infos.append(ar.get(timeout=left))
            except Exception as e:
                raise RuntimeError(f"Cluster: rank {r} (engine {ids[r]}) failed to start: {e}") from e
        self.ranks = list(range(cfg.n))
        self.engine_ids = list(ids)
        self.info = infos
        self.devices = [i["device"] for i in infos]
        self.backend_used = infos[0]["backend"]
        self.pids = {r: i["pid"] for r, i in enumerate(infos)}
        self.local = local
        self.view = self.client.direct_view(ids)
        self.view.block = True
        self._base = dict(self.events.received)
        self._cbase = dict(self.events.controls)

    def shutdown(self) -> None:
        """Ask every engine to flush its events and exit."""
        if self.view is not None:
            try:
                self.view.apply_async(_engine.shutdown).get(timeout=5)
            except Exception:
                pass

    def teardown(self) -> None:
        """Close the client, stop the controller and engines, close the sockets."""
        if self.client is not None:
            try:
                self.client.close()
            except Exception:
                pass
            self.client = None
        self.view = None
        if self._ipp is not None:
            try:
                self._ipp.stop_cluster_sync()
            except Exception as e:
                self._log.warning("stop failed: %s", e)
            self._ipp = None
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        self.control.attach(None)
        with self._pub_lock:
            if self._pub is not None:
                self._pub.close()
                self._zctx.term()
                self._pub = None

    def stop(self) -> None:
        """Ask every engine to exit, then stop the controller (the Runner contract's; the Cluster calls
        :meth:`shutdown` and :meth:`teardown` itself)."""
        self.shutdown()
        self.teardown()

    def kill(self) -> None:
        """SIGKILL every engine of this machine, then stop the controller: the kernel is exiting, and no engine
        may outlive it, even one stuck in a collective that ignores SIGTERM."""
        if not self.local:
            return
        for pid in self.pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            if self._ipp is not None:
                self._ipp.stop_cluster_sync()
        except Exception:
            pass

    def reinit(self, timeout: float) -> None:
        """A fresh process group on the running engines, on a new store port held by rank 0's engine."""
        port = self.view.apply_async(_engine.probe, self.loopback).get(timeout=10)[0]["port"]
        self.view.apply_async(_engine.reinit, port, timeout, self.loopback).get(timeout=timeout + 30)

    # -- running code -------------------------------------------------------------------------------------------
    def run_code(self, code: str) -> EngineJob:
        """Start ``code`` on every rank; its job's ``result`` is the AsyncResult."""
        return EngineJob(self, self.view.execute(code, silent=False, block=False), self.ranks)

    def run_call(self, func, *args, **kwargs) -> EngineJob:
        """Start ``func(*args, **kwargs)`` on every rank (failures reported like a cell's)."""
        return EngineJob(self, self.view.apply_async(_engine.guarded_call, func, *args, **kwargs), self.ranks)

    def as_job(self, handle) -> EngineJob:
        """The job of ``handle``: an EngineJob, or an AsyncResult of code started on ``view`` directly."""
        if isinstance(handle, EngineJob):
            return handle
        rank_of = {eid: r for r, eid in enumerate(self.engine_ids)}
        return EngineJob(self, handle, [rank_of.get(eid, eid) for eid in self._targets(handle)])

    def submit(self, fn, ranks=None) -> EngineJob:
        """Start ``fn(rank)`` on ``ranks`` (all by default; failures reported like a cell's)."""
        ranks = list(self.ranks) if ranks is None else [int(r) for r in ranks]
        view = self.client.direct_view([self.engine_ids[r] for r in ranks])
        return EngineJob(self, view.apply_async(_engine.call_on_rank, fn), ranks)

    def _targets(self, ar) -> list[int]:
        from .. import compat  # imports torch: not before the first cell runs

        targets = compat.ar_targets(ar)
        return list(targets) if targets is not None else self.engine_ids

    def _pending(self, ar) -> list[int]:
        """Ranks whose part of ``ar`` has not finished."""
        rank_of = {eid: r for r, eid in enumerate(self.engine_ids)}
        return [rank_of.get(eid, eid) for eid, c in zip(self._targets(ar), _children(ar)) if not c.done()]

    def _outcomes(self, ar) -> list[RankOutcome]:
        """What each rank's part of ``ar`` ended as, in rank order; a rank the controller saw die is marked dead."""
        rank_of = {eid: r for r, eid in enumerate(self.engine_ids)}
        dead = self.control.dead
        out = []
        for eid, child in zip(self._targets(ar), _children(ar)):
            r = rank_of.get(eid, eid)
            if child.done():
                exc = child.exception()
                res = child.result() if exc is None else None
                if isinstance(res, BaseException):  # ipyparallel resolves a remote error as the result
                    exc = res
                if exc is not None and getattr(exc, "ename", type(exc).__name__) == "EngineError":
                    # the controller saw it die, maybe before the monitor did: name the process when it is gone
                    gone = self.local and r in self.pids and not _pid_alive(self.pids[r])
                    self.control.mark_dead(r, f"engine process {self.pids[r]} exited" if gone
                                           else "engine died while running")
                    out.append(RankOutcome(r, eid, "died", dead[r]))
                elif exc is None:
                    val = res if not hasattr(res, "execution_count") else None
                    out.append(RankOutcome(r, eid, "ok", value=val))
                else:
                    ename = getattr(exc, "ename", type(exc).__name__)
                    evalue = getattr(exc, "evalue", str(exc))
                    tb = getattr(exc, "traceback", None)
                    out.append(RankOutcome(r, eid, "error", f"{ename}: {evalue}", tb))
            elif r in dead:
                out.append(RankOutcome(r, eid, "died", dead[r]))
            else:
                out.append(RankOutcome(r, eid, "running", "no result before the deadline"))
        out.sort(key=lambda o: o.rank)
        return out

    def sync_events(self, ranks, timeout: float = 2.0) -> None:
        """Wait until the events the ranks sent during the last execution have arrived here."""
        if not ranks or self.view is None:
            return
        eids = [self.engine_ids[r] for r in ranks]
        try:
            counts = self.client.direct_view(eids).apply_async(_engine.stream_count).get(timeout=timeout)
        except Exception:
            return
        # the control messages too: a rank's failure report (did it tear its process group down?) must be handled
        # before the execution counts as ended, or the next one could start on a group that is gone
        want = {r: self._base.get(r, 0) + c for r, c, _ in counts if r >= 0}
        handled = {r: self._cbase.get(r, 0) + c for r, _, c in counts if r >= 0}
        self.events.wait_for(want, timeout, controls=handled)

    def interrupt(self, ranks=None) -> None:
        """SIGINT to every engine (or to the engines of ``ranks``)."""
        targets = self.engine_ids if ranks is None else [self.engine_ids[r] for r in ranks]
        if self.client is not None:
            try:
                self.client.send_signal("SIGINT", targets=targets, block=True)
                return
            except Exception:
                pass
        if self.local:
            for r in (self.ranks if ranks is None else ranks):
                try:
                    os.kill(self.pids[r], signal.SIGINT)
                except (OSError, KeyError):
                    pass
        elif self._ipp is not None:
            self._ipp.signal_engines_sync(signal.SIGINT)

    def busy(self) -> bool:
        client = self.client
        return client is not None and bool(client.outstanding)

    def set_tracing(self, on: bool) -> None:
        self.view.apply_sync(_engine.set_tracing, bool(on))

    # -- health -------------------------------------------------------------------------------------------------
    def find_dead(self) -> dict[int, str] | None:
        """Ranks whose engine process exited or left the controller (rank -> why); None once stopped."""
        client = self.client
        if client is None:
            return None
        try:
            registered = set(client.ids)
        except Exception:
            registered = set(self.engine_ids)
        found = {}
        for r, eid in enumerate(self.engine_ids):
            if r in self.control.dead:
                continue
            if self.local and not _pid_alive(self.pids[r]):
                found[r] = f"engine process {self.pids[r]} exited"
            elif eid not in registered:
                found[r] = "engine unregistered from the controller"
        return found

    def describe(self, rank: int) -> str:
        dev = self.devices[rank] if rank < len(self.devices) else "?"
        return f"engine {self.engine_ids[rank]}, {dev}, pid {self.pids.get(rank)}"

    def _send(self, msg: dict) -> None:
        with self._pub_lock:
            if self._pub is not None:
                import zmq

                try:
                    self._pub.send(json.dumps(msg).encode(), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass


def _children(ar) -> list:
    from .. import compat

    return compat.ar_children(ar)
