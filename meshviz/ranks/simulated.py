"""Simulated ranks: the user's own code on tensors without storage, with collectives that move nothing."""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as tdist

from .. import compat, trace
from ..backends import simulated as sim_backend
from ..errors import RankError, RankOutcome
from ..rank_context import RankContext, bound
from . import patches
from .fake import Layouts, SimulatedTensors, WatchedEnv, users_read
from .ledger import SIM, Held, Ledger, install_hooks, remove_hooks
from .outcomes import error_of
from .threads import _format_exception, _summary, internal_frames

__all__ = ["SimulatedWorld", "SimulatedJob", "RankRun", "run", "keep_rngs"]


# -- the Runner -----------------------------------------------------------------------------------------------------

@dataclass
class RankRun:
    """What one simulated rank left: its outcome, its events, what it held and printed; ``layouts``, every
    (mesh, placements, global shape) a dist tensor had when an op met it (see :class:`Layouts`), and ``reads``,
    where the function itself read its rank ("train.py:12 in step()")."""

    outcome: RankOutcome
    events: list = field(default_factory=list)
    held: Held | None = None
    stdout: str = ""
    layouts: list = field(default_factory=list)
    reads: list = field(default_factory=list)
    seconds: float = 0.0


class _Capture:
    def __init__(self):
        self.stdout: list[str] = []
        self.stderr: list[str] = []


class SimulatedJob:
    """A function run on some simulated ranks (a :class:`~meshviz.ranks.runner.Job`), one rank after another."""

    def __init__(self, world: "SimulatedWorld", fn: Callable[[int], Any], ranks: list[int]):
        self.world = world
        self.fn = fn
        self.ranks = list(ranks)
        self.runs: dict[int, RankRun] = {}
        self.first_failed: list[int] = []
        self.finished = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = False

    def done(self) -> bool:
        return self.finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self.finished.wait(timeout)

    def pending(self) -> list[int]:
        return [r for r in self.ranks if r not in self.runs]

    def outcomes(self) -> list[RankOutcome]:
        return [self.runs[r].outcome if r in self.runs else RankOutcome(r, None, "running", "not simulated yet")
                for r in self.ranks]

    def error(self) -> RankError | None:
        if not self.done():
            return None
        return error_of(self.outcomes(), [r for r in self.first_failed if r in self.ranks])

    # -- running ---------------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            for r in self.ranks:
                if self._stop or self.first_failed:
                    why = f"rank {self.first_failed[0]} failed" if self.first_failed else "the run was stopped"
                    self.runs[r] = RankRun(RankOutcome(r, None, "stopped", f"not simulated: {why}"))
                    continue
                box: list = []
                t = threading.Thread(target=lambda r=r: box.append(self.world._run_rank(self.fn, r)),
                                     name=f"{self.world.name}-{r}", daemon=True)
                self.world._current = t
                t.start()
                t.join()
                self.world._current = None
                run = box[0] if box else RankRun(RankOutcome(r, None, "died", "its thread ended without a result"))
                self.runs[r] = run
                if run.outcome.status == "error":
                    self.first_failed.append(r)
        finally:
            self.finished.set()


class SimulatedWorld:
    """The ``"simulated"`` Runner: ``n`` ranks that run the user's code on tensors without storage, one rank at a
    time, each on a thread of its own (its own process group of the ``"simulated"`` backend, its own
    :class:`~meshviz.rank_context.RankContext`, its own :class:`SimulatedTensors` and :class:`Ledger`).

    A collective finishes at once and moves nothing; it is traced as on any rank, so a rank's events are what a
    real run of its code emits. Each rank's events are kept (``job.runs[r].events``), with what it held and
    printed; a rank that raises ends the job (the ranks after it are not simulated) and ``job.error()`` names it
    with its traceback."""

    kind = "simulated"

    def __init__(self, n: int, timeout: float = 600.0, env: dict | None = None, name: str = "meshviz-sim"):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"SimulatedWorld: n must be a positive int, got {n!r}")
        self.n = n
        self.timeout = float(timeout)
        self.env = dict(env or {})
        self.name = name
        self.started = False
        self._current: threading.Thread | None = None
        self._job: SimulatedJob | None = None
        self._routed = False

    def start(self) -> "SimulatedWorld":
        if not self.started:
            patches.install()
            sim_backend.register()
            install_hooks()
            compat.install_fake_ddp()
            sim_backend.install_object_collectives()
            _install_numpy()
            self._routed = not isinstance(__import__("sys").stdout, patches._Router)
            patches.route_streams()
            self.started = True
        return self

    def submit(self, fn: Callable[[int], Any], ranks=None) -> SimulatedJob:
        """Simulate ``fn(rank)`` on each of ``ranks`` (all by default), in rank order; returns the job at once."""
        if not self.started:
            self.start()
        ranks = list(range(self.n)) if ranks is None else [int(r) for r in ranks]
        bad = [r for r in ranks if not 0 <= r < self.n]
        if bad:
            raise ValueError(f"SimulatedWorld: ranks {bad} outside 0..{self.n - 1}")
        job = self._job = SimulatedJob(self, fn, ranks)
        job._thread = threading.Thread(target=job._main, name=f"{self.name}-job", daemon=True)
        job._thread.start()
        return job

    def interrupt(self, ranks=None) -> None:
        """KeyboardInterrupt in the rank being simulated; the ranks after it are not simulated."""
        job = self._job
        if job is not None:
            job._stop = True
        t = self._current
        if t is not None and t.ident is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(KeyboardInterrupt))

    def stop(self) -> None:
        if self._job is not None and not self._job.done():
            self.interrupt()
            self._job.wait(10)
        if self.started:
            if remove_hooks():
                compat.uninstall_fake_ddp()
                sim_backend.uninstall_object_collectives()
                _uninstall_numpy()
            patches.uninstall()
            if self._routed:
                patches.unroute_streams()
            self.started = False

    def __repr__(self) -> str:
        return f"SimulatedWorld({self.n} ranks, {'started' if self.started else 'stopped'})"

    # -- one rank ------------------------------------------------------------------------------------------------
    def _env(self, rank: int) -> dict[str, str]:
        n = str(self.n)
        return {**self.env, "RANK": str(rank), "WORLD_SIZE": n, "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": n,
                "MESHVIZ_TIMEOUT": str(self.timeout)}

    def _run_rank(self, fn: Callable[[int], Any], rank: int) -> RankRun:
        n, timeout = self.n, self.timeout

        def join():
            tdist.init_process_group(sim_backend.BACKEND, rank=rank, world_size=n, store=tdist.HashStore(),
                                     timeout=datetime.timedelta(seconds=timeout))
            patches.joined()

        reads: list[str] = []
        t0 = time.monotonic()
        ctx = RankContext(rank, init=join)
        ctx.env = WatchedEnv(self._env(rank), reads)
        ledger, layouts = Ledger(), Layouts()
        sink = trace.MemorySink()
        out = _Capture()

        def on_read(frame):
            where = users_read(frame)
            if where is not None:
                reads.append(where)

        with bound(ctx):
            SIM.get().ledger = ledger
            sim_backend.watch_reads(on_read)
            patches.capture().out = out
            trace.add_sink(sink)
            trace.set_rank(rank)
            compat.clear_dtensor_caches()
            try:
                with SimulatedTensors(ledger, layouts):
                    value = fn(rank)
                outcome = RankOutcome(rank, None, "ok", value=_plain(value))
            except BaseException as e:
                outcome = RankOutcome(rank, None, "error", _summary(e), _format_exception(e))
            held = ledger.held() if outcome.status == "ok" else None
            SIM.get().ledger = None
            sim_backend.watch_reads(None)
            trace.remove_sink(sink)
            patches.capture().out = None
            _leave()
        return RankRun(outcome, sink.events, held, "".join(out.stdout + out.stderr), layouts.layouts(),
                       list(dict.fromkeys(reads)), time.monotonic() - t0)


def _plain(value):
    """What a simulated rank returns, without its storage-less tensors (they have nothing to show)."""
    if isinstance(value, torch.Tensor):
        return None
    return value


_numpy: list = []  # torch.Tensor's own numpy (None: the base class's) while _install_numpy has replaced it


def _install_numpy() -> None:
    """``.numpy()`` of a tensor without storage: zeros of its shape (as ``item()`` reads 0), raising as for real where
    numpy has no such dtype; unchanged for every other tensor."""
    if _numpy:
        return
    fake = compat.fake_tensor_type()
    real = torch.Tensor.numpy

    def numpy(self, *args, **kwargs):
        if isinstance(self, fake):
            with compat.no_dispatch_modes():
                return real(torch.zeros(tuple(self.shape), dtype=self.dtype), *args, **kwargs)
        return real(self, *args, **kwargs)

    _numpy.append(vars(torch.Tensor).get("numpy"))
    torch.Tensor.numpy = numpy  # type: ignore[method-assign]


def _uninstall_numpy() -> None:
    if _numpy:
        own = _numpy.pop()
        if own is None:
            del torch.Tensor.numpy  # the base class's again, as before
        else:
            torch.Tensor.numpy = own  # type: ignore[method-assign]


def _leave() -> None:
    from ..runtime import groups

    try:
        if tdist.is_initialized():
            tdist.destroy_process_group()
    finally:
        groups.reset()


internal_frames(__file__)


@contextlib.contextmanager
def keep_rngs():
    """The process's RNG states (torch's, numpy's, Python's) as they were before the block: a simulated rank's
    ``manual_seed`` does not reach the caller."""
    import numpy as np

    state = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        yield
    finally:
        torch.set_rng_state(state[0])
        np.random.set_state(state[1])
        random.setstate(state[2])


def run(fn: Callable, nprocs: int, *args, timeout: float = 600.0, env: dict | None = None) -> list[RankRun]:
    """Simulate ``fn(*args)`` on every one of ``nprocs`` ranks; return each rank's :class:`RankRun`, or raise
    :class:`~meshviz.errors.RankError` naming the rank that failed (with its traceback)."""
    world = SimulatedWorld(nprocs, timeout=timeout, env=env).start()
    try:
        with keep_rngs():
            job = world.submit(lambda r: fn(*args))
            if not job.wait(timeout):
                world.interrupt()
                job.wait(10)
        err = job.error()
        if err is not None:
            raise err
        return [job.runs[r] for r in job.ranks]
    finally:
        world.stop()
