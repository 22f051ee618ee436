"""A Cluster's control: its state, the ranks' failure reports, the abort protocol, the monitor and the blame."""

from __future__ import annotations

import threading
import time
from enum import Enum
from typing import Callable

from ..errors import RankError, RankOutcome

__all__ = ["ClusterState", "Control"]


class ClusterState(str, Enum):
    """Where a Cluster is in its life; equal to (and printed as) its lower-case name, e.g. ``"ready"``."""

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    ABORTED = "aborted"  # a failure tore the ranks' process group down: it is re-created before the next execution
    BROKEN = "broken"  # a rank's process died: only restart() gives a working cluster
    FAILED = "failed"  # start() did not finish

    __str__ = str.__str__
    __format__ = str.__format__

    def __repr__(self) -> str:
        return repr(self.value)


S = ClusterState
_NEXT = {
    S.STOPPED: {S.STARTING},
    S.STARTING: {S.READY, S.FAILED, S.STOPPED},
    S.READY: {S.READY, S.ABORTED, S.BROKEN, S.STOPPED},
    S.ABORTED: {S.READY, S.ABORTED, S.BROKEN, S.STOPPED},
    S.BROKEN: {S.BROKEN, S.STOPPED},
    S.FAILED: {S.STARTING, S.STOPPED},
}


class Control:
    """The part of a Cluster that several threads touch: the caller's, the monitor's and the one receiving the
    ranks' messages. Every state change goes through one lock and the table of allowed transitions above.

    Messages from the ranks arrive in :meth:`on_control`; messages to every rank leave through the ``publish``
    function that the rank backend attaches (the engines' control socket).

    Abort protocol: a rank that raises reports ``failed`` at once; the others are told, and a rank still running
    a moment later (``engine.GRACE``) reports itself ``stuck``; then, or when the caller sees a failure with ranks
    still pending, :meth:`abort` tells every rank to tear its process group down, so that collectives waiting
    for the failed rank fail now rather than at the timeout; the group is re-created before the next execution.
    """

    def __init__(self):
        self._lock = threading.RLock()
        self._state = S.STOPPED
        self.failures: list[dict] = []  # failure reports from ranks, in arrival order
        self.dead: dict[int, str] = {}  # rank -> why its process is gone
        self.abort_sent = False
        self.needs_reset = False
        self._publish: Callable[[dict], None] | None = None
        self._monitor: threading.Thread | None = None
        self._stop_monitor = threading.Event()

    # -- state --------------------------------------------------------------------------------------------------
    @property
    def state(self) -> ClusterState:
        return self._state

    def _move(self, to: ClusterState) -> bool:
        """Go to ``to`` if the table allows it from here; False (state unchanged) if not. Call with the lock."""
        if to in _NEXT[self._state]:
            self._state = to
            return True
        return False

    def begin_start(self) -> None:
        with self._lock:
            if self._state not in (S.STOPPED, S.FAILED):
                raise RuntimeError(f"Cluster.start: already {self._state}")
            self._move(S.STARTING)

    def started(self) -> None:
        """The ranks are set up and their process group is ready."""
        with self._lock:
            self.dead = {}
            self.abort_sent = False
            self.needs_reset = False
            self._move(S.READY)

    def start_failed(self) -> None:
        with self._lock:
            self._move(S.FAILED)

    def stopped(self) -> bool:
        """Go to ``stopped``; False if it already was."""
        with self._lock:
            if self._state == S.STOPPED:
                return False
            self._move(S.STOPPED)
            return True

    def reset_done(self) -> None:
        """The ranks' process group was re-created after an abort."""
        with self._lock:
            self.abort_sent = False
            self.needs_reset = False
            self._move(S.READY)

    def mark_dead(self, rank: int, why: str) -> bool:
        """A rank's process is gone: the cluster is broken. False if it was known already."""
        with self._lock:
            if rank in self.dead:
                return False
            self.dead[rank] = why
            self._move(S.BROKEN)
            return True

    # -- messages -----------------------------------------------------------------------------------------------
    def attach(self, publish: Callable[[dict], None] | None) -> None:
        """Set (or with None, remove) how a message reaches every rank."""
        self._publish = publish

    def publish(self, msg: dict) -> None:
        send = self._publish
        if send is not None:
            send(msg)

    def on_control(self, msg: dict) -> None:
        """A message from a rank: ``failed`` (it raised; the others are told) or ``stuck`` (it is still running
        after a peer failed: abort)."""
        kind = msg.get("type")
        if kind == "failed":
            msg["received"] = time.time()
            self.failures.append(msg)
            self.publish({"type": "failed", "rank": msg.get("rank")})
        elif kind == "stuck":
            self.abort(msg.get("failed"))

    def abort(self, origin) -> None:
        """Tell every rank to tear its process group down (once per execution); it is re-created before the next."""
        with self._lock:
            if self.abort_sent:
                return
            self.abort_sent = True
            self.needs_reset = True
            self._move(S.ABORTED)  # a broken cluster stays broken
        self.publish({"type": "abort", "origin": origin})

    def report_dead(self, rank: int, why: str) -> None:
        """The monitor found a rank's process gone: record it as that rank's failure and stop the others."""
        if not self.mark_dead(rank, why):
            return
        now = time.time()
        self.failures.append({"type": "failed", "rank": rank, "error": why, "time": now, "received": now})
        self.publish({"type": "failed", "rank": rank})
        self.abort(rank)

    # -- the monitor --------------------------------------------------------------------------------------------
    def start_monitor(self, find_dead: Callable[[], dict[int, str]], interval: float = 0.25) -> None:
        """Every ``interval`` seconds, ask ``find_dead()`` which ranks' processes are gone (rank -> why)."""
        self.stop_monitor()
        self._stop_monitor.clear()

        def watch():
            while not self._stop_monitor.wait(interval):
                try:
                    found = find_dead()
                except Exception:
                    continue
                if found is None:
                    return
                for rank, why in sorted(found.items()):
                    if rank not in self.dead:
                        self.report_dead(rank, why)

        self._monitor = threading.Thread(target=watch, name="meshviz-monitor", daemon=True)
        self._monitor.start()

    def stop_monitor(self) -> None:
        self._stop_monitor.set()
        m = self._monitor
        if m is not None and m is not threading.current_thread():
            m.join(2)
        self._monitor = None

    # -- blame --------------------------------------------------------------------------------------------------
    def rank_error(self, outcomes: list[RankOutcome], since: int, t0: float) -> RankError:
        """The RankError for an execution that started at ``t0`` (``since``: failure reports before it).

        The cause: the ranks whose process died; else the first rank that reported a failure during the
        execution; else the first rank that raised (or did not finish).
        """
        dead = [o.rank for o in outcomes if o.status == "died"]
        reports = [f for f in self.failures[since:] if f.get("time", 0) >= t0 - 1]
        if dead:
            origin = dead
        elif reports:
            origin = [reports[0]["rank"]]
        else:
            errs = [o for o in outcomes if o.status == "error"] or [o for o in outcomes if o.status != "ok"]
            origin = [errs[0].rank]
        note = ""
        if self.needs_reset:
            note = "The other ranks' process group was torn down to stop them; it is re-created before the next cell."
        if dead:
            note = "Call cluster.restart() for a working cluster."
        return RankError(outcomes, origin, note)
