"""The baton: one rank thread runs at a time, handing it on only while it waits."""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass

from .. import rank_context
from ..backends.threads import RankStopped, ThreadComms
from ..runtime.match import called_differently

__all__ = ["Baton", "here", "set_here"]


# a meeting left half done would pair each later call with the next one of its peers: every call fails instead
_STOPPED = "the ranks' collectives stopped at a failed wait ({}); none runs again in this run of the ranks"


@dataclass
class BatonState:
    baton: Baton | None = None  # the Baton this rank thread runs under


BATON = rank_context.slot("baton", BatonState)


def here() -> "Baton | None":
    """The Baton the calling thread is a rank of (None outside rank threads)."""
    return BATON.get().baton


def set_here(baton: "Baton | None") -> None:
    BATON.get().baton = baton


def _refusals(rc) -> dict:
    """rank -> the call it refused instead of the collective the others wait in, from roll-call ``rc``."""
    try:
        return {r: t for x in rc.situations() for r, t in x.refused.items()} if rc is not None else {}
    except Exception:  # a roll-call of another kind (a cluster's hook returns none)
        return {}


def _safe_point() -> None:
    """Called first under the lock: an interrupt's KeyboardInterrupt, sent to the holder while it waited for the
    lock, is raised here (on entering a Python function), before the scheduling state changes."""


class Baton:
    """Schedules ``n`` rank threads, one at a time, and is the :class:`~meshviz.backends.threads.Scheduler` of
    their process groups (``comms``). The next rank to run is the next ready one in rank order after the last,
    so a run is repeatable. A wait ends when a peer wakes it, or with a verdict: a timeout, a deadlock (every
    rank with work waiting for another, named at once), an abort or an interrupt.

    ``gens`` (switched to each rank as it gets the baton, to the process's when none has work) keeps the
    process-wide RNGs per rank. Subclasses count jobs in ``_pending`` and ``_jobs``.
    """

    def __init__(self, n: int, timeout: float, gens):
        self.n = n
        self.timeout = float(timeout)
        self.lock = threading.Lock()
        self._turn = [threading.Condition(self.lock) for _ in range(n)]
        self.holder: int | None = None
        self._last = n - 1
        self._runnable: set[int] = set()
        self._queued: dict[int, float] = {}  # rank -> since when it is ready and waits for the baton
        self._blocked: dict[int, str] = {}  # rank -> what it waits for
        self._away: set[int] = set()  # sleeping, baton handed on
        self._naps = [threading.Event() for _ in range(n)]
        self._verdict: dict[int, BaseException] = {}
        self._pending = [0] * n  # jobs given to each rank and not finished
        self._jobs: set = set()  # jobs not finished on every rank
        self._interrupted = False
        self._idents: dict[int, int] = {}
        self._gens = gens
        self.comms = ThreadComms(self, called_differently)
        self.on_deadlock = None  # called as a deadlock (or the first collective timeout) is found, before a stop
        self.deadlock = None  # what on_deadlock gave

    # -- the scheduler of the thread groups ------------------------------------------------------------------
    def check(self, rank: int) -> None:
        if self._interrupted:
            raise KeyboardInterrupt(f"rank {rank} interrupted")

    def block(self, rank: int, what: str) -> None:
        """The holder waits (call with the lock): the baton moves on until a peer wakes it (or a verdict does)."""
        self._blocked[rank] = what
        self.holder = None
        self._grant()
        self._check_deadlock()
        deadline = time.monotonic() + self.timeout
        while self.holder != rank:
            if rank in self._blocked:
                left = deadline - time.monotonic()
                if left <= 0:
                    if self.on_deadlock is not None and self.deadlock is None:  # who never came, and where it is
                        self.deadlock = self.on_deadlock()
                    timed_out = f"rank {rank} timed out after {self.timeout:g} s in {what}"
                    self._stop_rank(rank, RankStopped(timed_out, own=True))
                    self.comms.tear_down(_STOPPED.format(timed_out))
                    continue
                self._turn[rank].wait(min(left, 1.0))
            else:
                self._turn[rank].wait(1.0)
        verdict = self._verdict.pop(rank, None)
        if verdict is not None:
            raise verdict

    def wake(self, rank: int) -> None:
        """A blocked rank may go on: it is ready for the baton (call with the lock)."""
        if self._blocked.pop(rank, None) is not None:
            self._ready(rank)
            self._grant()

    # -- taking and handing on -------------------------------------------------------------------------------
    def _enter(self, rank: int) -> None:
        with self.lock:
            self._ready(rank)
            self._grant()
            self._await_turn(rank)

    def _leave(self, rank: int) -> None:
        with self.lock:
            _safe_point()
            self._pending[rank] -= 1
            # a rank between jobs neither waits nor sleeps, whatever a stray interrupt left half done
            self._runnable.discard(rank)
            self._queued.pop(rank, None)
            self._away.discard(rank)
            self._blocked.pop(rank, None)
            if self.holder == rank:
                self.holder = None
            self._grant()
            self._check_deadlock()
            if not any(self._pending) and self.holder is None:
                self._gens.switch(None)  # the process gets its own RNG states back

    def _grant(self) -> None:
        """Give the baton to the next ready rank after the last holder (call with the lock)."""
        if self.holder is not None or not self._runnable:
            return
        nxt = min(self._runnable, key=lambda r: (r - self._last - 1) % self.n)
        self._runnable.discard(nxt)
        self._queued.pop(nxt, None)
        self.holder = self._last = nxt
        self._gens.switch(nxt)
        self._turn[nxt].notify()

    def _ready(self, rank: int) -> None:
        self._runnable.add(rank)
        self._queued.setdefault(rank, time.monotonic())

    def _await_turn(self, rank: int) -> None:
        while self.holder != rank:
            self._turn[rank].wait(1.0)
        verdict = self._verdict.pop(rank, None)
        if verdict is not None:
            raise verdict

    def _stop_rank(self, rank: int, err: BaseException) -> None:
        self._verdict.setdefault(rank, err)
        self.wake(rank)

    def nap(self, rank: int, seconds, real_sleep) -> None:
        """``time.sleep`` on a rank thread: the baton moves on while it sleeps (so timelines overlap as they do
        with rank processes)."""
        with self.lock:
            _safe_point()
            if self.holder != rank:
                return real_sleep(seconds)
            self._away.add(rank)
            self.holder = None
            self._naps[rank].clear()
            self._grant()
        try:
            self._naps[rank].wait(seconds)
        finally:
            with self.lock:
                self._away.discard(rank)
                self._ready(rank)
                self._grant()
                self._await_turn(rank)

    def _recheck(self) -> None:
        with self.lock:
            self._check_deadlock()

    def _check_deadlock(self) -> None:
        """A deadlock: every rank with work waits for another, and no other job can come to unblock them (every
        job in flight is waited for; a notebook's non-blocking cell leaves room for a later cell to join it)."""
        if self.holder is not None or self._runnable or self._away or not self._blocked:
            return
        if not all(j.awaited for j in self._jobs):
            return
        working = [r for r in range(self.n) if self._pending[r] > 0]
        if not all(r in self._blocked for r in working):
            return
        if self.on_deadlock is not None:
            self.deadlock = self.on_deadlock()
        lines = "; ".join(f"rank {r} waits in {self._blocked[r]}" for r in sorted(self._blocked))
        idle = [r for r in range(self.n) if r not in self._blocked]
        if idle:
            lines += f"; rank{'s' if len(idle) > 1 else ''} {', '.join(map(str, idle))} finished"
        for r, what in _refusals(self.deadlock).items():  # a rank that refused a call and went on: why
            lines += f"; rank {r} refused {what} and went on"
        why = f"deadlock: every rank waits for another: {lines}"
        for r in list(self._blocked):
            self._stop_rank(r, RankStopped(why, own=True))
        self.comms.tear_down(_STOPPED.format(why))

    # -- interrupting ----------------------------------------------------------------------------------------
    def interrupt(self, ranks=None) -> None:
        """KeyboardInterrupt on every rank with work: at once in a wait or a sleep, at the next Python line in
        code that runs (as SIGINT does). ``ranks`` is the Runner contract's: the ranks share one baton, so every
        rank with work is interrupted, whichever are named."""
        with self.lock:
            self._interrupted = True
            self.comms.dirty = True
            for r in list(self._blocked):
                self._stop_rank(r, KeyboardInterrupt(f"rank {r} interrupted"))
            for r in range(self.n):
                if self._pending[r] and r not in self._blocked:
                    self._verdict.setdefault(r, KeyboardInterrupt(f"rank {r} interrupted"))
                self._naps[r].set()
            holder = self.holder
            # sent holding the lock: the holder runs its own code, or waits for the lock and takes it at a
            # _safe_point, never halfway through a change of the scheduling state
            if holder is not None and holder not in self._away and self._idents.get(holder) is not None:
                self._verdict.pop(holder, None)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._idents[holder]),
                                                           ctypes.py_object(KeyboardInterrupt))

    def busy(self) -> bool:
        return any(self._pending)

    def waiting(self) -> dict[int, str]:
        """rank -> what it waits for, now."""
        with self.lock:
            return dict(self._blocked)

    def turn_waits(self) -> dict[int, tuple[int, float]]:
        """rank -> (the rank that holds the baton, seconds waited) for each rank with work waiting for its turn."""
        with self.lock:
            holder, now = self.holder, time.monotonic()
            if holder is None:
                return {}
            return {r: (holder, now - t) for r, t in self._queued.items() if r != holder and self._pending[r]}
