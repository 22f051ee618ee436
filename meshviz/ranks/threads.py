"""Ranks as threads of one process: ``ThreadWorld`` runs jobs on them, :func:`run` runs one function on all."""

from __future__ import annotations

import collections
import datetime
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as tdist

from ..backends import threads as thread_backend
from ..backends.threads import BACKEND, RankStopped, observers
from ..errors import RankError, RankOutcome
from ..errors import summary as _summary
from ..rank_context import RankContext, bound
from . import patches
from .baton import Baton, here, set_here
from .outcomes import error_of, rank_error

__all__ = ["BACKEND", "ThreadWorld", "RankStopped", "run", "world", "observers", "internal_frames"]


def world() -> "ThreadWorld | None":
    """The ThreadWorld the calling thread is a rank of (None outside rank threads)."""
    return here()


class _Job:
    """One function run on some ranks (a :class:`~meshviz.ranks.runner.Job`); ``outcomes`` as the ranks finish it."""

    def __init__(self, fn: Callable[[int], Any], ranks: list[int], world: "ThreadWorld | None" = None):
        self.fn = fn
        self.ranks = list(ranks)
        self.results: dict[int, RankOutcome] = {}
        self.finished = threading.Event()
        self.lock = threading.Lock()
        self.world = world
        self.awaited = False  # someone waits for it: no other job can come to unblock its ranks

    def _finish(self, rank: int, outcome: RankOutcome) -> None:
        with self.lock:
            self.results[rank] = outcome
            if len(self.results) == len(self.ranks):
                self.finished.set()

    def done(self) -> bool:
        return self.finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        if not self.awaited and self.world is not None:
            self.awaited = True
            self.world._recheck()
        return self.finished.wait(timeout)

    def pending(self) -> list[int]:
        return [r for r in self.ranks if r not in self.results]

    def outcomes(self) -> list[RankOutcome]:
        return [self.results.get(r) or RankOutcome(r, None, "running", "no result before the deadline")
                for r in self.ranks]

    def error(self) -> RankError | None:
        """The RankError of a job whose ranks did not all end well, naming the first rank that raised on its own
        (not stopped for a peer); None while it runs or when every rank ended well."""
        if not self.done():
            return None
        first = self.world.first_failed if self.world is not None else ()
        return error_of(self.outcomes(), [r for r in first if r in self.ranks])


class ThreadWorld(Baton):
    """``n`` ranks as threads of this process, each with its own process group (backend ``"threads"``), its own
    :class:`~meshviz.rank_context.RankContext` and its own RNG states.

    The baton: one rank runs at a time. A rank hands it on only while it waits — in a collective, a receive,
    ``time.sleep`` — so the code between two waits runs without interleaving, and process-wide state (torch's,
    numpy's and Python's RNGs; ``sys.stdout``) behaves per rank as it does in rank processes. The next rank to
    run is the next ready one in rank order after the last, so a run is repeatable.

    A wait ends when its peers arrive, or with :class:`RankStopped`: a peer failed (at once), the world was
    aborted or interrupted, ``timeout`` seconds passed, or every rank with work is waiting for another (a
    deadlock is named at once, with what each rank waits for).
    """

    kind = "threads"

    def __init__(self, n: int, timeout: float = 60.0, env: dict | None = None, name: str = "meshviz-rank"):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"ThreadWorld: n must be a positive int, got {n!r}")
        super().__init__(n, timeout, patches.Generators())
        self.name = name
        self.first_failed: list[int] = []  # ranks that raised on their own (not stopped for a peer), in order
        self._queues = [collections.deque() for _ in range(n)]
        self._work = [threading.Condition(threading.Lock()) for _ in range(n)]
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self.store = tdist.HashStore()
        base = dict(env or {})
        self.contexts = [RankContext(r, env={**base, **_rank_env(r, n, self.timeout)}, init=self._joiner(r))
                         for r in range(n)]
        self.started = False

    @property
    def dirty(self) -> bool:
        """Meetings were left half done: :meth:`reset` comes before the next job."""
        return self.comms.dirty

    # -- life cycle ------------------------------------------------------------------------------------------
    def start(self, join: bool = True) -> "ThreadWorld":
        """Start the rank threads; with ``join``, every rank joins its process group before this returns."""
        if self.started:
            return self
        patches.install()
        self.started = True
        for r in range(self.n):
            t = threading.Thread(target=self._serve, args=(r,), name=f"{self.name}-{r}", daemon=True)
            self._threads.append(t)
            t.start()
        if join:
            from ..runtime.world import init_parallel_env

            job = self.submit(lambda r: init_parallel_env() and tdist.get_rank())
            if not job.wait(self.timeout + 30) or any(o.status != "ok" for o in job.outcomes()):
                outcomes = job.outcomes()
                self.stop()
                raise rank_error(outcomes, note="the rank threads did not join their process group")
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Tear the process groups down and end the rank threads (a rank still running is interrupted)."""
        if not self.started:
            return
        if any(self._pending):
            self.interrupt()
        self.submit(lambda r: _leave_world(), wait=False)
        self._stopping = True
        for cv in self._work:
            with cv:
                cv.notify()
        for t in self._threads:
            t.join(timeout)
        self.started = False
        patches.uninstall()
        with self.lock:
            self._gens.switch(None)

    def _joiner(self, rank: int) -> Callable[[], None]:
        def join():
            tdist.init_process_group(BACKEND, rank=rank, world_size=self.n, store=self.store,
                                     timeout=datetime.timedelta(seconds=self.timeout))
            patches.joined()
        return join

    # -- jobs ------------------------------------------------------------------------------------------------
    def submit(self, fn: Callable[[int], Any], ranks=None, wait: bool = False) -> _Job:
        """Run ``fn(rank)`` on each of ``ranks`` (all by default), each on its own thread with the baton; returns
        the job (``wait``: after it finished)."""
        ranks = list(range(self.n)) if ranks is None else [int(r) for r in ranks]
        job = _Job(fn, ranks, self)
        with self.lock:
            if not any(self._pending):
                self._begin()
            self._jobs.add(job)
            for r in ranks:
                self._pending[r] += 1
        for r in ranks:
            with self._work[r]:
                self._queues[r].append(job)
                self._work[r].notify()
        if wait:
            job.wait()
        return job

    def _begin(self) -> None:
        """A new round of jobs (nothing is running): forget last round's failures; reset if it left a mess."""
        self.comms.failed.clear()
        self.first_failed = []
        self._interrupted = False
        self._verdict.clear()
        if self.comms.dirty or self.comms.aborted is not None:
            self._reset_comms()

    def reset(self) -> None:
        """Fresh meetings, mailboxes and call numbers on every group (after a failure or an abort)."""
        with self.lock:
            self._reset_comms()

    def _reset_comms(self) -> None:
        from ..runtime import rollcall

        self.comms.reset()
        for ctx in self.contexts:  # the roll-call counts from 1 again too, as in a new world of rank processes
            with bound(ctx):
                rollcall.reset()

    def _serve(self, rank: int) -> None:
        ctx = self.contexts[rank]
        self._idents[rank] = threading.get_ident()
        with bound(ctx):
            set_here(self)
            thread_backend.join(self.comms)
            while True:
                with self._work[rank]:
                    while not self._queues[rank] and not self._stopping:
                        self._work[rank].wait()
                    if not self._queues[rank]:
                        return
                    job = self._queues[rank].popleft()
                outcome = self._run(job, rank)
                job._finish(rank, outcome)
                if job.done():
                    with self.lock:
                        self._jobs.discard(job)

    def _run(self, job: _Job, rank: int) -> RankOutcome:
        try:
            out = self._call(job, rank)
        except BaseException as e:  # an interrupt that came as the job ended, in the bookkeeping
            out = RankOutcome(rank, None, "error", _summary(e), traceback.format_exc())
        while True:
            try:
                self._leave(rank)
                return out
            except KeyboardInterrupt:  # sent as the job ended, taken at _leave's safe point: nothing changed yet
                continue

    def _call(self, job: _Job, rank: int) -> RankOutcome:
        try:
            self._enter(rank)
        except BaseException as e:  # interrupted before it ran
            return RankOutcome(rank, None, "error", _summary(e), traceback.format_exc())
        try:
            value = job.fn(rank)
        except BaseException as e:
            tb = _format_exception(e)
            self.rank_failed(rank, e)
            return RankOutcome(rank, None, "error", _summary(e), tb)
        return RankOutcome(rank, None, "ok", value=value)

    # -- failures --------------------------------------------------------------------------------------------
    def rank_failed(self, rank: int, error: BaseException) -> None:
        """``rank`` raised: every rank waiting for it (in a collective or a receive) is stopped at once."""
        with self.lock:
            if not isinstance(error, (RankStopped, KeyboardInterrupt)):
                self.first_failed.append(rank)
            self.comms.rank_failed(rank, _summary(error))

    def abort(self, origin=None) -> None:
        """Stop every waiting rank now, and every collective until :meth:`reset` (a rank's failure report, or
        an interrupt that found ranks still busy)."""
        with self.lock:
            why = (f"the process group was torn down (rank {origin} failed)" if origin is not None
                   else "the process group was torn down")
            self.comms.tear_down(why)
            for r in list(self._blocked):
                self._stop_rank(r, RankStopped(why))

    def __repr__(self) -> str:
        return f"ThreadWorld({self.n} ranks, {'started' if self.started else 'stopped'}, holder={self.holder})"


def _leave_world() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()
    from ..runtime import groups

    groups.reset()
    set_here(None)
    thread_backend.join(None)


def _rank_env(rank: int, n: int, timeout: float) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n),
            "MESHVIZ_TIMEOUT": str(timeout)}


_INTERNAL: set[str] = {__file__}


def internal_frames(filename: str) -> None:
    """Leave frames of ``filename`` (a module that runs rank jobs) out of the tracebacks rank failures show."""
    _INTERNAL.add(filename)


def _format_exception(e: BaseException) -> str:
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in _INTERNAL:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb))


def run(fn: Callable, nprocs: int, *args, timeout: float = 120.0, collective_timeout: float = 30.0,
        env: dict | None = None) -> list:
    """Run ``fn(*args)`` on ranks 0..nprocs-1 as threads of this process (process group ready; ``env``: variables
    every rank reads as its own); return the per-rank values, or raise :class:`~meshviz.errors.RankError` naming
    the rank that failed first (in a deadlock, as rank processes do: the ranks that never entered what the others
    wait in)."""
    from ..runtime import rollcall
    from ..trace.status import RankStatus, RollCall, name_ranks

    tw = ThreadWorld(nprocs, timeout=collective_timeout, env=env).start(join=False)  # as a process: init on demand
    records: dict = {}

    def ranked(r):
        rec = records[r] = rollcall.current()
        rec.rank, rec.thread = r, threading.get_ident()
        rec.start()
        try:
            return fn(*args)
        finally:
            rec.finish("its function returned")

    # the roll-call a deadlock is named from, taken as the baton finds it (the waiting ranks still inside)
    tw.on_deadlock = lambda: RollCall([rollcall.snapshot(records[r]) if r in records else RankStatus(r, "unknown")
                                       for r in range(nprocs)])
    try:
        job = tw.submit(ranked)
        late = holder = None
        if not job.wait(timeout):
            late, holder = tw.on_deadlock(), tw.holder  # as the deadline finds them: who waits where, who runs
            tw.interrupt()
            job.wait(10)
        outcomes = job.outcomes()
        rc = tw.deadlock or late
        seen, note = tw.first_failed, ""
        if late is not None:
            outcomes = _ran_out(outcomes, timeout, late)
            if not seen and not late.culprits() and holder is not None:
                # nobody waits in a collective: the rank that kept the turn held the others back
                seen = [holder]
                others = [o.rank for o in outcomes if o.rank != holder]
                note = (f"ranks as threads take turns: rank {holder} kept the turn for {timeout:g} s without "
                        f"entering a collective or sleeping, so {name_ranks(others)} could not go on")
        inside = {s.rank for s in rc if s.state == "in_collective"} if rc is not None else ()
        err = error_of(outcomes, seen, inside=inside, rollcall=rc, note=note)
        if err is not None:
            raise err
        return [o.value for o in outcomes]
    finally:
        tw.stop()


def _ran_out(outcomes: list[RankOutcome], timeout: float, rollcall) -> list[RankOutcome]:
    """The outcomes of the ranks a deadline interrupted: still running at it, not failed."""
    where = {s.rank: s.where for s in rollcall}
    out = []
    for o in outcomes:
        if o.status == "error" and (o.error or "").startswith("KeyboardInterrupt"):
            at = f" at {where[o.rank]}" if where.get(o.rank) else ""
            o = RankOutcome(o.rank, o.engine, "running", f"no result after {timeout:g} s; interrupted{at}")
        out.append(o)
    return out
