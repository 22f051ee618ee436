"""Cluster: ipyparallel engines as ranks 0..n-1, a process group across them, and their events in the notebook."""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import weakref

from ..trace.stream import EventLog, StreamReceiver
from . import engine as _engine
from .errors import RankError, RankOutcome

__all__ = ["Cluster", "DEFAULT_CPU_RANKS"]

DEFAULT_CPU_RANKS = 4  # ranks when n=None and there is no GPU
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def _kill_at_exit(ref) -> None:
    """The kernel is exiting without ``stop()`` (a cell raised under nbconvert, the kernel was shut down): no
    engine may outlive it, even one stuck in a collective that ignores SIGTERM."""
    import signal

    cluster = ref()
    if cluster is None or cluster.state == "stopped" or not getattr(cluster, "_local", False):
        return
    for pid in cluster._pids.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        cluster._stopping.set()
        if cluster._ipp is not None:
            cluster._ipp.stop_cluster_sync()
    except Exception:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        import psutil

        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE
    except Exception:
        return False


def rank_configs(probes: list[dict], mode: str, gpus, master: str, loopback: bool, timeout: float,
                 backend: str | None, ncpu: int | None = None) -> list[dict]:
    """What each rank's engine is told at set-up: rank r is ``probes[r]``'s engine (engines sorted by id).

    LOCAL_RANK counts the ranks before r on the same host. A CPU rank hides the GPUs and uses one thread; a GPU
    rank sees only GPU ``gpus[r]`` (a list was given) or GPU LOCAL_RANK, as its ``cuda:0``.
    """
    n = len(probes)
    hosts = [p["host"] for p in probes]
    ncpu = ncpu or os.cpu_count() or 1
    port = probes[0]["port"]
    cfgs = []
    for r, h in enumerate(hosts):
        lr = hosts[:r].count(h)
        env = {
            "RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(lr), "LOCAL_WORLD_SIZE": str(hosts.count(h)),
            "MASTER_ADDR": master, "MASTER_PORT": str(port), "MESHVIZ_TIMEOUT": str(timeout),
        }
        if loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
            env["GLOO_SOCKET_IFNAME"] = "lo0" if sys.platform == "darwin" else "lo"  # gloo's sockets too
        if mode == "cpu":
            env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
            threads = 1
        else:
            env["CUDA_VISIBLE_DEVICES"] = str(gpus[r] if gpus else lr)
            threads = max(1, ncpu // hosts.count(h))
            env["OMP_NUM_THREADS"] = str(threads)
        cfgs.append({
            "rank": r, "world": n, "port": port, "loopback": loopback, "env": env, "threads": threads,
            "peer_pids": [p["pid"] for i, p in enumerate(probes) if i != r and hosts[i] == h],
            "timeout": timeout, "backend": backend or ("gloo" if mode == "cpu" else "nccl"),
        })
    return cfgs


class Cluster:
    """ipyparallel engines as ranks, with a process group across them; returns when every rank is ready.

    Ranks: rank r is the engine with the r-th smallest engine id. A Cluster always starts its own controller,
    so engine ids are 0..n-1 and rank == engine id (the ``[stdout:r]`` labels of ``%%px`` are ranks); after
    ``restart()`` the same holds.

    Devices: ``devices='auto'`` binds rank r to GPU (its local rank) when the machine has GPUs (NCCL), else
    to the CPU with one torch thread each (gloo). ``devices='cpu'`` forces CPU; a list of GPU ids binds
    rank r to GPU ``devices[r]``. ``CUDA_VISIBLE_DEVICES`` is set on each engine before torch is imported, so a
    rank sees its GPU as ``cuda:0``. ``n=None``: one rank per GPU, or 4 without GPUs.

    ``timeout``: collective timeout in seconds (every rank stops within it when one fails; usually much
    sooner, see ``%%px`` below). ``ipp_options`` go to ``ipyparallel.Cluster`` unchanged (``engines='mpi'``,
    ``controller_ip=...``, ...). The controller, the process-group store and the event stream listen on
    loopback unless you pass ``controller_ip``; connection files live in a private state dir (``state_dir``,
    mode 0700) with the engines' and controller's logs.

    ``%%px`` is activated: a failing cell raises :class:`RankError` naming the rank that failed first, with
    its traceback; the other ranks are stopped at once (their process group is torn down and re-created
    before the next cell). ``events`` fill while cells run; ``subscribe(callback)`` sees each one.
    """

    def __init__(self, n: int | None = None, devices="auto", backend: str | None = None, timeout: float = 60,
                 **ipp_options):
        gpus = None
        if devices == "auto":
            gpus = _gpu_count()
            mode = "cuda" if gpus else "cpu"
        elif devices in ("cpu",):
            mode = "cpu"
        elif devices in ("cuda", "gpu"):
            mode = "cuda"
        elif isinstance(devices, (list, tuple)) and all(isinstance(d, int) and d >= 0 for d in devices):
            mode = "list"
        else:
            raise ValueError(f"Cluster: devices must be 'auto', 'cpu', 'cuda' or a list of GPU ids, got {devices!r}")
        if n is None:
            if mode == "list":
                n = len(devices)
            elif mode == "cuda":
                n = gpus if gpus is not None else _gpu_count()
                if not n:
                    raise ValueError("Cluster: devices='cuda' but no GPU is visible")
            else:
                n = DEFAULT_CPU_RANKS
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"Cluster: n must be a positive int or None, got {n!r}")
        if mode == "list" and len(devices) != n:
            raise ValueError(f"Cluster: {len(devices)} devices given for {n} ranks")
        if mode == "cuda" and "engines" not in ipp_options:  # all ranks on this machine: one GPU each
            gpus = gpus if gpus is not None else _gpu_count()
            if n > gpus:
                raise ValueError(f"Cluster: {n} ranks but {gpus} GPUs here; pass devices='cpu' or n <= {gpus}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"Cluster: timeout must be a positive number of seconds, got {timeout!r}")
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"Cluster: backend must be None, 'gloo' or 'nccl', got {backend!r}")
        self.n = n
        self.timeout = float(timeout)
        self.backend = backend
        self._mode = mode
        self._devices_spec = devices
        self._ipp_options = dict(ipp_options)
        self.events = EventLog()
        self.failures: list[dict] = []  # failure reports from ranks, in arrival order
        self.state = "stopped"
        self.state_dir: str | None = None
        self.ranks: list[int] = []
        self.engine_ids: list[int] = []
        self._pids: dict[int, int] = {}
        self.devices: list[str] = []
        self.info: list[dict] = []
        self.client = None
        self.view = None
        self._ipp = None
        self._receiver = None
        self._pub = None
        self._pub_lock = threading.Lock()
        self._dead: dict[int, str] = {}
        self._abort_sent = False
        self._needs_reset = False
        self._monitor = None
        self._stopping = threading.Event()
        self._magics_suffix = None
        self.start()

    # -- life cycle ---------------------------------------------------------------------------------------------
    def _host(self) -> str:
        return self._ipp_options.get("controller_ip") or "127.0.0.1"

    def start(self) -> "Cluster":
        """Start the controller and n engines, bind devices, init the process group; returns when ready."""
        import ipyparallel as ipp
        import zmq

        if self.state not in ("stopped", "failed"):
            raise RuntimeError(f"Cluster.start: already {self.state}")
        self.state = "starting"
        t0 = time.perf_counter()
        opts = dict(self._ipp_options)
        own_dir = "profile_dir" not in opts and "profile" not in opts
        self.state_dir = tempfile.mkdtemp(prefix="meshviz-cluster-") if own_dir else None
        logdir = self.state_dir or tempfile.mkdtemp(prefix="meshviz-cluster-log-")
        self._logdir = logdir
        log = logging.getLogger(f"meshviz.cluster.{os.path.basename(logdir)}")
        log.handlers = [logging.FileHandler(os.path.join(logdir, "cluster.log"))]
        log.setLevel(logging.INFO)
        log.propagate = False
        self._log = log
        if own_dir:
            opts["profile_dir"] = self.state_dir
        opts.setdefault("controller_ip", "127.0.0.1")
        opts.setdefault("delay", 0)
        opts.setdefault("engine_timeout", max(60, int(self.timeout)))
        opts["n"] = self.n
        opts["log"] = log
        try:
            host = self._host()
            multi = host not in _LOOPBACK
            self._receiver = StreamReceiver(
                self.events, host="0.0.0.0" if multi else "127.0.0.1",
                connect_host=(opts.get("controller_location") or socket.gethostname()) if multi else None,
                on_control=self._on_control)
            self._zctx = zmq.Context()
            self._pub = self._zctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            pport = self._pub.bind_to_random_port("tcp://*" if multi else "tcp://127.0.0.1")
            control = f"tcp://{self._receiver.address.split('//')[1].rsplit(':', 1)[0]}:{pport}"
            self._ipp = ipp.Cluster(**opts)
            self._ipp.start_cluster_sync()
            self.client = self._ipp.connect_client_sync()
            self.client.wait_for_engines(self.n, timeout=opts["engine_timeout"], interactive=False)
            ids = sorted(self.client.ids)[: self.n]
            probes = self.client.direct_view(ids).apply_sync(_engine.probe, not multi)
            self._setup(ids, probes, control)
        except BaseException:
            self.state = "failed"
            self._teardown()
            raise
        self.started_in = time.perf_counter() - t0
        self.state = "ready"
        self._stopping.clear()
        self._monitor = threading.Thread(target=self._watch, name="meshviz-monitor", daemon=True)
        self._monitor.start()
        self.activate()
        return self

    def _setup(self, ids, probes, control) -> None:
        n = self.n
        hosts = [p["host"] for p in probes]
        local = all(h == socket.gethostname() for h in hosts)
        loopback = local and self._host() in _LOOPBACK
        self._loopback = loopback
        master = "127.0.0.1" if loopback else socket.gethostbyname(hosts[0])
        cfgs = rank_configs(probes, self._mode, self._devices_spec if self._mode == "list" else None,
                            master, loopback, self.timeout, self.backend)
        for cfg in cfgs:
            cfg.update(stream=self._receiver.address, control=control, trace=True)
        ars = [self.client[eid].apply_async(_engine.setup, cfg) for eid, cfg in zip(ids, cfgs)]
        deadline = time.monotonic() + self.timeout + 60
        infos = []
        for r, ar in enumerate(ars):
            left = max(0.1, deadline - time.monotonic())
            try:
                infos.append(ar.get(timeout=left))
            except Exception as e:
                raise RuntimeError(f"Cluster: rank {r} (engine {ids[r]}) failed to start: {e}") from e
        self.ranks = list(range(n))
        self.engine_ids = list(ids)
        self.info = infos
        self.devices = [i["device"] for i in infos]
        self.backend_used = infos[0]["backend"]
        self._pids = {r: i["pid"] for r, i in enumerate(infos)}
        self._local = local
        if local:
            atexit.register(_kill_at_exit, weakref.ref(self))
        self.view = self.client.direct_view(ids)
        self.view.block = True
        self._base = dict(self.events.received)
        self._dead = {}
        self._abort_sent = False
        self._needs_reset = False

    def stop(self) -> None:
        """Stop engines and controller quietly (their output goes to log files in ``state_dir``)."""
        if self.state == "stopped":
            return
        self._stopping.set()
        if self.view is not None and not self._dead and self.state in ("ready", "aborted"):
            try:
                self.view.apply_async(_engine.shutdown).get(timeout=5)
            except Exception:
                pass
        self._teardown()
        self.state = "stopped"
        if self.state_dir and not self._dead:  # the logs are kept when an engine died
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def _teardown(self) -> None:
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._stopping.set()
            self._monitor.join(2)
        self._monitor = None
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
        if self._pub is not None:
            self._pub.close()
            self._zctx.term()
            self._pub = None

    def restart(self) -> "Cluster":
        """Stop and start again (fresh engines, fresh process group, same settings); events are kept."""
        self.stop()
        return self.start()

    def reset(self) -> None:
        """Re-create the process group on the running engines (after a failure tore it down); keeps their state."""
        self._check_alive()
        port = self.view.apply_async(_engine.probe, self._loopback).get(timeout=10)[0]["port"]
        ar = self.view.apply_async(_engine.reinit, port, self.timeout, self._loopback)
        ar.get(timeout=self.timeout + 30)
        self._abort_sent = False
        self._needs_reset = False
        self.state = "ready"

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self):
        try:
            if self.state != "stopped":
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
    def _prepare(self) -> None:
        self._check_alive()
        if self._needs_reset:
            self.reset()

    def _check_alive(self) -> None:
        if self.state == "stopped" or self.view is None:
            raise RuntimeError("Cluster is stopped; call cluster.start() or cluster.restart()")
        if self._dead:
            which = ", ".join(f"rank {r} ({why})" for r, why in sorted(self._dead.items()))
            raise RuntimeError(f"Cluster: {which}; call cluster.restart() for a working cluster")

    def execute(self, code: str, timeout: float | None = None):
        """Run ``code`` on every rank (like a ``%%px`` cell); returns the AsyncResult (``.stdout`` in rank order).

        Raises :class:`RankError` naming the failing rank(s).
        """
        self._prepare()
        ar = self.view.execute(code, silent=False, block=False)
        self._finish(ar, timeout)
        return ar

    def apply(self, func, *args, timeout: float | None = None, **kwargs) -> list:
        """Call ``func(*args, **kwargs)`` on every rank; returns the results in rank order."""
        self._prepare()
        ar = self.view.apply_async(_engine.guarded_call, func, *args, **kwargs)
        outcomes = self._finish(ar, timeout)
        return [o.value for o in outcomes]

    def _finish(self, ar, timeout) -> list[RankOutcome]:
        start_fail = len(self.failures)
        t0 = time.time()
        self._wait(ar, timeout, start_fail)
        outcomes = self._collect(ar)
        self._sync_events([o.rank for o in outcomes if o.status in ("ok", "error")])
        bad = [o for o in outcomes if o.status != "ok"]
        if bad:
            raise self._rank_error(outcomes, start_fail, t0)
        return outcomes

    def _wait(self, ar, timeout, start_fail: int = 0) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        targets = list(ar._targets) if ar._targets is not None else self.engine_ids
        rank_of = {eid: r for r, eid in enumerate(self.engine_ids)}
        interrupted_at = None
        while not ar.ready():
            new = self.failures[start_fail:]
            if new and not self._abort_sent and time.time() - new[0]["received"] > _engine.GRACE:
                # a rank failed and others, which did not, are still running: they would wait for it forever
                failed = {f.get("rank") for f in new}
                pending = [rank_of.get(eid) for eid, c in zip(targets, ar._children) if not c.done()]
                if any(r not in failed for r in pending):
                    self._abort(new[0]["rank"])
            try:
                ar.wait(0.05)
            except KeyboardInterrupt:
                if interrupted_at is not None:
                    raise
                self.interrupt()
                interrupted_at = time.monotonic()
                deadline = interrupted_at + self.timeout + 5
                continue
            if self._dead:
                dead_eids = {self.engine_ids[r] for r in self._dead}
                pending = [eid for eid, c in zip(targets, ar._children) if not c.done()]
                if pending and set(pending) <= dead_eids:
                    return
            if deadline is not None and time.monotonic() > deadline:
                return

    def _collect(self, ar) -> list[RankOutcome]:
        targets = list(ar._targets) if ar._targets is not None else self.engine_ids
        rank_of = {eid: r for r, eid in enumerate(self.engine_ids)}
        out = []
        for eid, child in zip(targets, ar._children):
            r = rank_of.get(eid, eid)
            if child.done():
                exc = child.exception()
                res = child.result() if exc is None else None
                if isinstance(res, BaseException):  # ipyparallel resolves a remote error as the result
                    exc = res
                if exc is not None and getattr(exc, "ename", type(exc).__name__) == "EngineError":  # the controller saw it die
                    self._dead.setdefault(r, "engine died while running")
                    self.state = "broken"
                    out.append(RankOutcome(r, eid, "died", self._dead[r]))
                elif exc is None:
                    val = res if not hasattr(res, "execution_count") else None
                    out.append(RankOutcome(r, eid, "ok", value=val))
                else:
                    ename = getattr(exc, "ename", type(exc).__name__)
                    evalue = getattr(exc, "evalue", str(exc))
                    tb = getattr(exc, "traceback", None)
                    out.append(RankOutcome(r, eid, "error", f"{ename}: {evalue}", tb))
            elif r in self._dead:
                out.append(RankOutcome(r, eid, "died", self._dead[r]))
            else:
                out.append(RankOutcome(r, eid, "running", "no result before the deadline"))
        out.sort(key=lambda o: o.rank)
        return out

    def _rank_error(self, outcomes, start_fail, t0) -> RankError:
        dead = [o.rank for o in outcomes if o.status == "died"]
        reports = [f for f in self.failures[start_fail:] if f.get("time", 0) >= t0 - 1]
        if dead:
            origin = dead
        elif reports:
            origin = [reports[0]["rank"]]
        else:
            errs = [o for o in outcomes if o.status == "error"] or [o for o in outcomes if o.status != "ok"]
            origin = [errs[0].rank]
        note = ""
        if self._needs_reset:
            note = "The other ranks' process group was torn down to stop them; it is re-created before the next cell."
        if dead:
            note = "Call cluster.restart() for a working cluster."
        return RankError(outcomes, origin, note)

    def _sync_events(self, ranks, timeout: float = 2.0) -> None:
        """Wait until the events the ranks sent during the last execution have arrived here."""
        if not ranks or self.view is None:
            return
        eids = [self.engine_ids[r] for r in ranks]
        try:
            counts = self.client.direct_view(eids).apply_async(_engine.stream_count).get(timeout=timeout)
        except Exception:
            return
        want = {r: self._base.get(r, 0) + c for r, c in counts if r >= 0}
        self.events.wait_for(want, timeout)

    def interrupt(self, abort_after: float | None = 1.0) -> None:
        """Send SIGINT to every engine (what Ctrl-C / the kernel's interrupt button does during ``%%px``).

        A rank blocked inside a collective does not see the signal until the collective returns; if ranks are
        still busy ``abort_after`` seconds later, their process group is torn down (and re-created before the
        next cell) so that the blocked collectives fail at once.
        """
        if abort_after is not None:
            t = threading.Timer(abort_after, self._abort_if_busy)
            t.daemon = True
            t.start()
        if self.client is not None:
            try:
                self.client.send_signal("SIGINT", targets=self.engine_ids, block=True)
            except Exception:
                if self._ipp is not None:
                    import signal

                    self._ipp.signal_engines_sync(signal.SIGINT)

    def _abort_if_busy(self) -> None:
        client = self.client
        if client is not None and client.outstanding:
            self._abort(None)

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
        self.view.apply_sync(_engine.set_tracing, bool(on))

    # -- failure handling ---------------------------------------------------------------------------------------
    def _broadcast(self, msg: dict) -> None:
        with self._pub_lock:
            if self._pub is not None:
                import zmq

                try:
                    self._pub.send(json.dumps(msg).encode(), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    def _on_control(self, msg: dict) -> None:
        kind = msg.get("type")
        if kind == "failed":
            msg["received"] = time.time()
            self.failures.append(msg)
            self._broadcast({"type": "failed", "rank": msg.get("rank")})
        elif kind == "stuck":
            self._abort(msg.get("failed"))

    def _abort(self, origin) -> None:
        if self._abort_sent:
            return
        self._abort_sent = True
        self._needs_reset = True
        self.state = "aborted"
        self._broadcast({"type": "abort", "origin": origin})

    def _watch(self) -> None:
        while not self._stopping.wait(0.25):
            client = self.client
            if client is None:
                return
            try:
                registered = set(client.ids)
            except Exception:
                registered = set(self.engine_ids)
            for r, eid in enumerate(self.engine_ids):
                if r in self._dead:
                    continue
                why = None
                if self._local and not _pid_alive(self._pids[r]):
                    why = f"engine process {self._pids[r]} exited"
                elif eid not in registered:
                    why = "engine unregistered from the controller"
                if why:
                    self._dead[r] = why
                    self.state = "broken"
                    self.failures.append({"type": "failed", "rank": r, "error": why, "time": time.time(),
                                          "received": time.time()})
                    self._broadcast({"type": "failed", "rank": r})
                    self._abort(r)

    # -- display ------------------------------------------------------------------------------------------------
    def __repr__(self) -> str:
        head = f"Cluster({self.n} ranks, {getattr(self, 'backend_used', self.backend or 'auto')}, {self.state}"
        lines = [head + f", {len(self.events)} events)"]
        for r in self.ranks:
            dev = self.devices[r] if r < len(self.devices) else "?"
            extra = f"  DEAD: {self._dead[r]}" if r in self._dead else ""
            lines.append(f"  rank {r}: engine {self.engine_ids[r]}, {dev}, pid {self._pids.get(r)}{extra}")
        return "\n".join(lines)
