"""Ranks as new local processes around a store this process serves: spawn, and the rank that failed first."""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import signal
import time
from dataclasses import replace
from functools import partial

from ..errors import RankError, RankOutcome
from ..runtime import rendezvous
from ..trace.status import RankStatus
from . import outcomes as _outcomes
from . import patches
from .options import check_spawn_options
from .outcomes import exit_text, read_report
from .returns import Returns, put_return
from .spawn_context import SpawnContext

__all__ = ["spawn", "SpawnContext", "RankProcesses", "DEFAULT_START_METHOD", "stranded"]

DEFAULT_START_METHOD = "forkserver"  # ranks forked from one server that imported torch once (not re-imported per rank)
# what the fork server imports before forking any rank: torch and what meshviz's ranks import from it (most of a
# rank's start-up time); nothing of meshviz, so an edited meshviz is read afresh by every new rank
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor")


def _start_method(method: str) -> str:
    """``method``, with the fork server told (before it first starts) to preload torch when it is ``forkserver``.

    The server is a fresh interpreter started by multiprocessing (not a fork of this process), so it holds no
    process group or CUDA state of this process whenever it starts; one server serves the whole session."""
    if method == "forkserver":
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # no effect once the server runs
    return method


class RankProcesses:
    """The ``"processes"`` Runner: ``n`` local processes, ranks 0..n-1, each calling the one submitted function
    ``fn(rank)`` (one-shot: its job, a :class:`SpawnContext`, is that function).

    ``start()`` holds a loopback port from before the processes start and ``submit`` serves the process-group
    store on it once they have started (a forked child never inherits the store's thread), so the port is never
    free for another process to take, and the store outlives any one rank. The ranks connect to it as clients
    (``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun's agent), so plain ``torch.distributed.init_process_group()``
    works in them too.
    """

    kind = "processes"

    def __init__(self, n: int, timeout: float, start_method: str = DEFAULT_START_METHOD, daemon: bool = False,
                 hang_after: float | None = None):
        self.n = self.nprocs = n
        self.timeout = timeout
        self.start_method = start_method
        self.daemon = daemon
        self.hang_after = hang_after
        self.host = None
        self.port: int | None = None
        self.store = None
        self.processes: list = []
        self.job: SpawnContext | None = None
        self._reservation = None
        self._ctx = None
        self._seen: dict[int, int] = {}  # rank -> when its exit was seen (count of waits that returned)
        self._waits = 0
        self.ended: dict[int, str] = {}  # rank -> how terminate() ended it (its why), not by itself
        self._arrived: list[bool] | None = None  # who reached the rendezvous, kept when the store closes
        self._read_returned = None  # () -> rank -> the RankStatus a rank left as its function returned

    # -- the Runner contract -------------------------------------------------------------------------------------
    def start(self) -> "RankProcesses":
        """Hold the port the store will serve on (``port``); the processes start at :meth:`submit`."""
        if self._reservation is None and self._ctx is None:
            self._reservation = rendezvous.reserve_port().listen(self.n)
            self.port = self._reservation.port
        return self

    def submit(self, fn, ranks=None, *, read_reports=None, read_returned=None,
               stop_on_failure: bool = True) -> "SpawnContext":
        """Start the processes, each calling ``fn(rank)`` (picklable unless the start method is ``"fork"``);
        returns the job. ``read_reports()`` gives (rank -> (summary, traceback, when) for the ranks that raised,
        rank -> value or None) once they ended (default: torch's error files, no values); ``read_returned()``:
        rank -> the :class:`RankStatus` a rank left as its function returned (its collective counts), for ranks
        that exit at once rather than answer the roll-call; ``stop_on_failure``: end the others as soon as one
        exits with an error."""
        if ranks is not None and sorted(int(r) for r in ranks) != list(range(self.n)):
            raise ValueError(f"RankProcesses runs its function on every rank 0..{self.n - 1}, not {list(ranks)}")
        if self._ctx is not None:
            raise RuntimeError("RankProcesses runs one function; make another RankProcesses for the next")
        import torch.multiprocessing as mp

        self.start()
        if _start_method(self.start_method) == "forkserver":
            entry, args = _with_environ, (dict(os.environ), fn, _me())
        else:
            entry, args = _call, (fn, _me())
        reservation, self._reservation = self._reservation, None
        try:
            self._ctx = mp.start_processes(entry, args=args, nprocs=self.n, join=False, daemon=self.daemon,
                                           start_method=self.start_method)
            self.processes = self._ctx.processes
            self.store = rendezvous.serve_store(reservation, self.n, self.timeout)
        except BaseException:
            reservation.close()
            if self._ctx is not None:
                self.ended = {}
                self.terminate()
            raise
        if self.hang_after is not None and self.n > 1:
            from ..runtime.watchdog import RollCallHost

            self.host = RollCallHost(rendezvous.LOOPBACK, self.port, self.n, self.hang_after,
                                     dead=self.exited).start()
        self._read_returned = read_returned
        self.job = SpawnContext(self, read_reports or self.torch_reports, stop_on_failure)
        return self.job

    def interrupt(self, ranks=None) -> None:
        """SIGINT to the processes of ``ranks`` (all by default) that still run."""
        for r in range(self.n) if ranks is None else ranks:
            p = self.processes[r] if r < len(self.processes) else None
            if p is not None and p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGINT)
                except OSError:
                    pass

    def stop(self) -> None:
        """End every process still running (its outcome: ``"stopped"``, by ``stop()``) and stop serving the store."""
        self.terminate("stop")
        self.close()
        if self._reservation is not None:
            self._reservation.close()
            self._reservation = None

    # -- the processes -------------------------------------------------------------------------------------------
    def gone(self) -> dict[int, str]:
        """rank -> how its process ended, for the ranks whose process ended badly (a signal, an exit code)."""
        out = {}
        for i, p in enumerate(self.processes):
            if not p.is_alive() and p.exitcode:
                out[i] = exit_text(p.exitcode)
        return out

    def exited(self) -> dict[int, str]:
        """rank -> how its process ended, for every rank whose process ended (well or not): the roll-call need
        not wait for their answers, which will not come."""
        return {i: exit_text(p.exitcode) for i, p in enumerate(self.processes) if not p.is_alive()}

    def relabel(self, rc):
        """``rc`` with each rank whose process exited with code 0 shown as what it did: in the collective it failed
        in, idle (its function returned, with the collectives it entered when it left them, so that it shows as
        having passed the ones it did), or dead (it raised), from what the job's ranks left; a rank that left
        nothing stays dead."""
        if rc is None or self.job is None:
            return rc
        clean = {s.rank for s in rc if s.state == "dead" and self.processes[s.rank].exitcode == 0}
        if not clean:
            return rc
        reports, returned = self.job.left()
        late = self.host.failed() if self.host is not None else {}  # ranks that failed while it was taken
        refused = self.host.refused() if self.host is not None else {}  # calls they refused and went on
        counts = self._read_returned() if self._read_returned is not None else {}
        over = []
        for r in sorted(clean):
            if r in late:
                over.append(late[r])
            elif r in reports:
                over.append(RankStatus(r, "dead", note=f"it raised {reports[r][0]}"[:300]))
            elif r in returned:
                c = counts.get(r)
                kept = {"entered": c.entered, "refused": c.refused, "refused_entered": c.refused_entered} if c else {}
                over.append(RankStatus(r, "idle", note="its function returned", **{**kept, **refused.get(r, {})}))
        return rc.merged(over) if over else rc

    @property
    def error_files(self) -> list[str]:
        """Where torch's wrapper writes a raising rank's traceback (pickled text)."""
        return self._ctx.error_files if self._ctx is not None else []

    def torch_reports(self) -> tuple[dict, None]:
        """(rank -> report, None): what torch's wrapper wrote for the ranks that raised (see :func:`read_report`)."""
        reports = {}
        for r, path in enumerate(self.error_files):
            rep = read_report(path)
            if rep is not None:
                reports[r] = rep
        return reports, None

    def wait(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` seconds for any running rank to exit; note which exited."""
        live = {p.sentinel: i for i, p in enumerate(self.processes) if i not in self._seen}
        if not live:
            return
        ready = multiprocessing.connection.wait(list(live), timeout=timeout)
        if ready:
            self._waits += 1
        for s in ready:
            i = live[s]
            self.processes[i].join()
            self._seen[i] = self._waits

    def done(self) -> bool:
        return len(self._seen) == self.nprocs

    def failed(self) -> list[int]:
        """Ranks that exited with a non-zero code."""
        return [i for i in self._seen if self.processes[i].exitcode != 0]

    def running(self) -> list[int]:
        return [i for i in range(self.nprocs) if i not in self._seen]

    def stranded(self) -> list[int]:
        """Ranks whose process exited without reaching the rendezvous while a rank still running reached it: that
        rank waits in ``init_parallel_env`` for them until the timeout, though they can no longer come."""
        if not self._seen or self.store is None:
            return []
        try:
            came = rendezvous.arrived(self.store, self.nprocs)
        except Exception:  # the store is closing: nothing more to learn from it
            return []
        return stranded(came, self._seen, self.running())

    def terminate(self, why: str = "stopped", grace: float = 10.0) -> None:
        """End every rank still running (SIGTERM, then SIGKILL after ``grace`` seconds); their outcome is ``why``:
        ``"stopped"`` (a rank failed), ``"hang"`` (a wait nothing ends), ``"running"`` (the deadline) or ``"stop"``."""
        procs = self.processes
        live = [i for i, p in enumerate(procs) if p.is_alive()]
        for i in live:
            self.ended.setdefault(i, why)
            procs[i].terminate()
        end = time.monotonic() + grace
        for i in live:
            procs[i].join(max(0.0, end - time.monotonic()))
        for i in live:
            if procs[i].is_alive():
                procs[i].kill()
            procs[i].join()

    def arrived(self) -> list[bool]:
        if self.store is None and self._arrived is not None:
            return list(self._arrived)
        return rendezvous.arrived(self.store, self.nprocs)

    def close(self) -> None:
        """Stop serving the store (every rank has exited or been ended)."""
        if self.host is not None:
            self.host.stop()
        if self.store is not None:
            self._arrived = self.arrived()
        self.store = None

    def blame(self):
        """The roll-call that explains a failure (before the others are ended: they still answer), or None."""
        return self.relabel(self.host.blame()) if self.host is not None else None

    # -- what the ranks ended as ---------------------------------------------------------------------------------
    def outcomes(self, reports: dict[int, tuple[str, str | None, float]], values: dict[int, object] | None = None,
                 deadline_s: float | None = None) -> list[RankOutcome]:
        """Every rank's outcome: ``reports`` maps a rank that raised to (summary, traceback, when written);
        ``values`` (when given) the ranks that returned a result to it."""
        arrived = self.arrived()
        outcomes = []
        for r, p in enumerate(self.processes):
            rep = reports.get(r)
            ended = self.ended.get(r)
            if rep is not None:
                o = RankOutcome(r, status="error", error=rep[0], traceback=rep[1])
            elif ended == "stopped":
                o = RankOutcome(r, status="stopped", error="ended when another rank failed")
            elif ended == "hang":
                o = RankOutcome(r, status="stopped", error="ended at the roll-call that found the hang")
            elif ended == "stop":  # the caller ended it: whether it reached the rendezvous says nothing
                outcomes.append(RankOutcome(r, status="stopped", error="ended by stop() before it returned"))
                continue
            elif ended == "running":
                what = f"no result after {deadline_s:.0f} s; killed" if deadline_s else "no result; killed"
                o = RankOutcome(r, status="running", error=what)
            elif p.exitcode is None:
                o = RankOutcome(r, status="running", error="no result yet")
            elif p.exitcode == 0 and (values is None or r in values):
                o = RankOutcome(r, status="ok", value=(values or {}).get(r))
            elif p.exitcode == 0:
                o = RankOutcome(r, status="died", error="exit code 0 before returning a result")
            else:
                o = RankOutcome(r, status="died", error=exit_text(p.exitcode))
            outcomes.append(replace(o, arrived=arrived[r]))
        return outcomes

    def rank_error(self, reports: dict[int, tuple[str, str | None, float]], values: dict[int, object] | None = None,
                   deadline_s: float | None = None, rollcall=None, stranded=()) -> RankError:
        """The RankError for this run (:func:`meshviz.ranks.outcomes.rank_error`), with what only this runner
        knows: who reached the rendezvous, the order the ranks' exits were seen in (a rank that died without a
        report before one that raised in the same instant, which most likely lost its connection to it, then
        the earliest report), and which ranks sat inside a collective (``rollcall``). ``stranded``: the ranks that
        left without joining (:meth:`stranded`), named as the cause (not a rank ended before it reached the
        rendezvous because of them)."""
        outcomes = self.outcomes(reports, values, deadline_s)
        if stranded:
            return _outcomes.rank_error(outcomes, [tuple(stranded)])
        first = sorted(
            (r for r in self._seen if outcomes[r].status in ("error", "died") and r not in self.ended),
            key=lambda r: (self._seen[r], outcomes[r].status == "error", reports.get(r, (0, 0, 0.0))[2]),
        )
        inside = {s.rank for s in rollcall if s.state == "in_collective"} if rollcall is not None else ()
        stopped = tuple(r for r, why in sorted(self.ended.items()) if why == "stop")
        return _outcomes.rank_error(outcomes, first or ([stopped] if stopped else []), inside=inside,
                                    rollcall=rollcall)


def stranded(came: list[bool], exited, running) -> list[int]:
    """The ranks of ``exited`` that never reached the rendezvous (``came[r]`` False) while a rank of ``running``
    did: that rank waits for them in ``init_parallel_env`` until the timeout. Spawn's rule, and the launcher's."""
    gone = [r for r in sorted(exited) if not came[r]]
    return gone if gone and any(came[r] for r in running) else []


def _me() -> tuple[int, float]:
    import psutil

    return os.getpid(), psutil.Process().create_time()


def _end_with(parent: tuple[int, float]) -> None:
    """End this rank (SIGKILL) once the process that started it is gone (killed: nobody is left to end the ranks,
    which would wait in a collective until the timeout, or run on); a forked rank's parent is the fork server,
    which outlives it, so the starting process is watched by its pid and start time, once a second."""
    import threading

    import psutil

    def watch():
        while True:
            try:
                p = psutil.Process(parent[0])
                if abs(p.create_time() - parent[1]) < 0.5 and p.status() != psutil.STATUS_ZOMBIE:
                    time.sleep(1.0)
                    continue
            except psutil.Error:
                pass
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="meshviz-parent-watch", daemon=True).start()


def _call(index, fn, parent=None):
    # a parent started in the background (nohup, `cmd &` without job control) ignores SIGINT, and its children
    # inherit that: interrupt() must still reach the rank
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if parent is not None:
        _end_with(parent)
    os.environ.pop(rendezvous.ATTEMPT, None)  # a launched worker's run: not this rank's, whose store is this job's
    try:
        fn(index)
    except KeyboardInterrupt as e:
        # torch's wrapper would end the rank quietly with exit code 0, as if it had returned: make it a failure
        # the wrapper reports, as an interrupted thread or engine rank's
        raise RuntimeError(f"rank {index} was interrupted (KeyboardInterrupt)") from e


def _with_environ(index, environ, fn, parent=None):
    """A forked rank's start: this process's environment as it is now (the fork server's is the one it had when
    the server started), then ``fn(index)`` as a spawned rank would run it."""
    os.environ.clear()
    os.environ.update(environ)
    _call(index, fn, parent)


def _spawn_entry(index, port, func, args, world, env, rank_envs=None, returns=None):
    os.environ.update(env)
    if rank_envs:
        os.environ.update(rank_envs[index])  # this rank's device, before anything starts CUDA here
    os.environ.update(rendezvous.rank_env(index, world, rendezvous.LOOPBACK, port, hosted=True))
    # Paddle's variables, as its spawn sets them: the first endpoint is the master (the store)
    os.environ.update(rendezvous.paddle_env(index, rendezvous.paddle_endpoints(rendezvous.LOOPBACK, port, world)))
    import torch

    from ..runtime.world import exit_quietly

    torch.set_num_threads(int(env.get("MESHVIZ_THREADS", "1")))
    patches.record_torch_calls_when_watched(env)  # a raw tdist collective shows in the roll-call, as meshviz's own
    value = func(*args)
    if returns is not None:
        put_return(returns, index, value)
    exit_quietly(0, note="its function returned")


def _importable(func) -> bool:
    """Can a fresh interpreter find ``func`` by name? Not so for one typed into a REPL or notebook."""
    import sys

    mod = getattr(func, "__module__", None)
    if mod == "__main__" and not getattr(sys.modules.get("__main__"), "__file__", None):
        return False
    try:
        pickle.dumps(func)
    except Exception:
        return False
    return True


def spawn(func, args=(), nprocs: int = -1, join: bool = True, daemon: bool = False, **options):
    """Run ``func(*args)`` in ``nprocs`` new processes, ranks 0..nprocs-1, with the process-group variables set.

    ``nprocs=-1`` uses one process per GPU, or 2 on a CPU-only machine. If one rank raises or dies, the others are
    stopped and a :class:`RankError` names that rank (and any rank that never reached the rendezvous) with its
    traceback; so too, at once, a rank that returned without joining the process group the others joined.
    ``options``: ``backend`` (``"gloo"``, ``"nccl"``; ``"auto"`` or None: meshviz picks, as Paddle's default),
    ``devices`` (``"auto"``, ``"cpu"``, ``"cuda"`` or GPU ids; Paddle's ``gpus="0,1"`` too), ``timeout`` (seconds),
    ``trace`` (a JSONL path, ``{rank}`` filled in), ``threads`` (torch threads per rank, default 1),
    ``start_method`` (default ``"forkserver"``: ranks forked from a server that imported torch once; ``"fork"`` for
    a function a new process cannot import by name), ``hang_after`` (seconds a rank may wait in one collective
    before the roll-call is printed to stderr, default 5; None: no watchdog), ``check_collectives`` (compare op,
    shapes and dtypes before each collective on gloo, default off); Paddle's ``print_config`` is accepted and
    ignored (its deprecated options warned about), ``ips`` may name this machine; any other name raises
    ValueError, as in Paddle, and so does a bad value of meshviz's own, before any rank starts. Each rank gets
    torch's variables and Paddle's spawn's (PADDLE_TRAINER_ID, PADDLE_TRAINERS_NUM, PADDLE_TRAINER_ENDPOINTS,
    PADDLE_CURRENT_ENDPOINT, PADDLE_DISTRI_BACKEND, and a GPU rank FLAGS_selected_gpus). Returns the joined
    :class:`SpawnContext`, as Paddle (``join=False``: at once). When a collective times out, the error names the
    ranks that never entered it; where every rank missing from it has returned (or died), it says so at the
    roll-call, without waiting.

    Ranks and GPUs are counted before any process starts (:func:`meshviz.core.devices.plan_devices`): one GPU per
    rank with NCCL when there are enough; otherwise, unless ``devices``/``backend`` insist on GPUs, every rank runs
    on the CPU with gloo (said once, as a :class:`~meshviz.runtime.devices.DeviceNotice` warning), and bad
    device requests raise ValueError at once.
    """
    import warnings

    from ..core.devices import plan_devices
    from ..runtime import watchdog
    from ..runtime.devices import DeviceNotice, rank_env, visible_gpu_count
    from ..runtime.watchdog import DEFAULT_HANG_AFTER
    from ..runtime.world import DEFAULT_TIMEOUT_S

    if not callable(func):  # else every rank would start, and fail calling it
        raise TypeError(f"spawn: func must be a function, got {type(func).__name__}")
    try:
        args = tuple(args)
    except TypeError:
        raise TypeError(f"spawn: args must be a tuple or list of func's arguments, got {type(args).__name__}") \
            from None
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or (nprocs < 1 and nprocs != -1):
        raise ValueError(f"spawn: nprocs must be a positive int or -1, got {nprocs!r}")
    check_spawn_options(options)
    backend = options.get("backend") or None
    backend = None if backend == "auto" else backend  # Paddle's default: NCCL on GPUs, else gloo
    plan = plan_devices(None if nprocs == -1 else nprocs, options.get("devices", options.get("gpus")),
                        visible_gpu_count(), backend, default_cpu=2, who="spawn", names={"n": "nprocs"})
    nprocs = plan.n
    if plan.notice:
        warnings.warn(plan.notice, DeviceNotice, stacklevel=2)
    env = {"PADDLE_DISTRI_BACKEND": plan.backend}
    if backend:
        env["MESHVIZ_BACKEND"] = backend
    if options.get("timeout") is not None:
        env["MESHVIZ_TIMEOUT"] = str(options["timeout"])
    if options.get("trace"):
        env["MESHVIZ_TRACE"] = str(options["trace"])
    env["MESHVIZ_THREADS"] = str(options.get("threads", 1))
    hang_after = options.get("hang_after", DEFAULT_HANG_AFTER)
    if hang_after is not None:
        env[watchdog.HANG_AFTER_ENV] = str(float(hang_after))
        env[watchdog.HOST_ENV] = "parent"
    if options.get("check_collectives"):
        env["MESHVIZ_CHECK_COLLECTIVES"] = "1"
    method = options.get("start_method")
    if method is None:
        method = DEFAULT_START_METHOD if _importable(func) else "fork"
    timeout = float(env.get("MESHVIZ_TIMEOUT", os.environ.get("MESHVIZ_TIMEOUT", DEFAULT_TIMEOUT_S)))
    rank_envs = [_with_selected_gpu(rank_env(plan, r), plan, r) for r in range(nprocs)]
    procs = RankProcesses(nprocs, timeout, method, daemon, hang_after=hang_after).start()
    returns = Returns()
    ctx = procs.submit(partial(_spawn_entry, port=procs.port, func=func, args=args, world=nprocs, env=env,
                               rank_envs=rank_envs, returns=returns.folder))
    ctx.returns, ctx.return_queues = returns, returns.watch(ctx.processes)
    if not join:
        return ctx
    ctx.join()
    return ctx


def _with_selected_gpu(env: dict, plan, rank: int) -> dict:
    """A GPU rank's id in FLAGS_selected_gpus too, as Paddle's spawn sets it (a CPU rank gets none, as in Paddle)."""
    if plan.on_gpu:
        env["FLAGS_selected_gpus"] = str(rank if plan.gpus is None else plan.gpus[rank])
    return env
