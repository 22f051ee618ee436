"""A Cluster's control: its state, the ranks' failure reports, the abort protocol, the monitor and the blame."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable
from enum import Enum

from ..errors import RankError, RankOutcome, alike
from ..ranks.outcomes import rank_error
from ..trace.status import RankStatus, RollCall
from .messages import FROM_RANKS, Abort, Failure, Message, PeerFailed, StatusReply, StatusRequest, Stuck, decode

__all__ = ["ClusterState", "Control", "blame_rollcall"]


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
        self.stuck: dict[int, str] = {}  # rank -> why it counts as stuck: alive, still running what it was told to stop
        self.abort_sent = False
        self.needs_reset = False
        self._publish: Callable[[dict], None] | None = None
        self._monitor: threading.Thread | None = None
        self._stop_monitor = threading.Event()
        self._replies: dict[int, dict[int, dict]] = {}  # roll-call request id -> rank -> its status
        self._replied = threading.Condition()
        self._ids = itertools.count(1)

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
            self.dead, self.stuck = {}, {}
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

    def mark_stuck(self, rank: int, why: str) -> None:
        """A rank still runs what an abort and an interrupt should have stopped: the cluster is broken."""
        with self._lock:
            self.stuck.setdefault(rank, why)
            self._move(S.BROKEN)

    # -- messages -----------------------------------------------------------------------------------------------
    def attach(self, publish: Callable[[dict], None] | None) -> None:
        """Set (or with None, remove) how a message reaches every rank."""
        self._publish = publish

    def publish(self, msg: Message) -> None:
        """Send ``msg`` to every rank (as its wire dict)."""
        send = self._publish
        if send is not None:
            send(msg.to_dict())

    def on_control(self, raw: dict) -> None:
        """A message from a rank, as its wire dict: ``failed`` (it raised; the others are told; ``aborted``: it
        tore its own process group down, so the group is re-created before the next execution), ``stuck`` (it is
        still running after a peer failed: abort) or ``status`` (its roll-call answer)."""
        msg = decode(FROM_RANKS, raw)
        if isinstance(msg, Failure):
            msg = dataclasses.replace(msg, received=time.time())
            if msg.aborted:
                with self._lock:
                    self.needs_reset = True
                    self._move(S.ABORTED)
            self.failures.append(msg.to_dict())
            self.publish(PeerFailed(msg.rank))
        elif isinstance(msg, Stuck):
            self.abort(msg.failed)
        elif isinstance(msg, StatusReply):
            with self._replied:
                box = self._replies.get(msg.id) if msg.id is not None else None
                if box is not None and msg.rank is not None and isinstance(msg.status, dict):
                    box[msg.rank] = msg.status
                    self._replied.notify_all()

    # -- the roll-call ------------------------------------------------------------------------------------------
    def request_status(self, stacks: bool = False) -> int:
        """Ask every rank for its roll-call record; returns the request's id for :meth:`collect_status`."""
        rid = next(self._ids)
        with self._replied:
            self._replies[rid] = {}
        self.publish(StatusRequest(rid, bool(stacks)))
        return rid

    def replies(self, rid: int) -> dict[int, dict]:
        with self._replied:
            return dict(self._replies.get(rid, {}))

    def collect_status(self, rid: int, ranks, timeout: float, taken: float | None = None) -> RollCall:
        """The roll-call of request ``rid``: every rank of ``ranks`` that answered within ``timeout`` seconds, the
        dead ones as ``dead``, the rest as ``unknown``."""
        want = set(ranks) - set(self.dead)
        deadline = time.monotonic() + timeout
        with self._replied:
            while not want <= set(self._replies.get(rid, {})):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._replied.wait(left)
            got = self._replies.pop(rid, {})
        return self.rollcall(got, ranks, taken)

    def rollcall(self, got: dict, ranks, taken: float | None = None) -> RollCall:
        """RankStatus for every rank of ``ranks`` from the answers ``got`` (rank -> status dict)."""
        out = []
        for r in ranks:
            if r in self.dead:
                out.append(RankStatus(r, "dead", note=self.dead[r]))
            elif r in got:
                try:
                    out.append(RankStatus.from_dict({**got[r], "rank": r}))
                except Exception:
                    out.append(RankStatus(r, "unknown"))
            else:
                out.append(RankStatus(r, "unknown"))
        return RollCall(out, taken)

    def abort(self, origin) -> None:
        """Tell every rank to tear its process group down (once per execution); it is re-created before the next."""
        with self._lock:
            if self.abort_sent:
                return
            self.abort_sent = True
            self.needs_reset = True
            self._move(S.ABORTED)  # a broken cluster stays broken
        self.publish(Abort(origin))

    def report_dead(self, rank: int, why: str) -> None:
        """The monitor found a rank's process gone: record it as that rank's failure and stop the others."""
        if not self.mark_dead(rank, why):
            return
        now = time.time()
        self.failures.append(Failure(rank, error=why, time=now, received=now).to_dict())
        self.publish(PeerFailed(rank))
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
    def reports(self, since: int, t0: float) -> list[dict]:
        """The failure reports of an execution that started at ``t0`` (``since``: reports before it)."""
        return [f for f in self.failures[since:] if f.get("time", 0) >= t0 - 1]

    def rank_error(self, outcomes: list[RankOutcome], since: int, t0: float,
                   rollcall: RollCall | None = None, interrupted: bool = False) -> RankError:
        """The RankError for an execution that started at ``t0`` (``since``: failure reports before it), from
        :func:`meshviz.ranks.outcomes.rank_error` with what the control knows.

        The cause: the ranks of a collective mismatch; else the ranks whose process died (seen first, all at
        once); else the first rank that reported a failure during the execution, unless it failed inside a
        collective and ``rollcall`` (the roll-call of the hang, merged with the failing ranks' collectives) names
        the members that never entered it: then those; else the first rank that raised (or did not finish),
        unless the roll-call names culprits (with no report, where it failed is unknown). ``interrupted``: the
        execution was interrupted (Ctrl-C, ``interrupt()``); when that is what the ranks failed with, every rank it
        stopped is named, none as stopped because of another.
        """
        dead = [o.rank for o in outcomes if o.status == "died"]
        reports = self.reports(since, t0)
        mismatch = next((f["mismatch"] for f in reports if f.get("mismatch")), None)
        seen, inside = [], set()
        if dead:
            seen = [tuple(dead)]
        elif reports:
            seen = [reports[0]["rank"]]
            if reports[0].get("collective"):
                inside = {reports[0]["rank"]}
        else:
            errs = [o for o in outcomes if o.status == "error"] or [o for o in outcomes if o.status != "ok"]
            seen = [errs[0].rank] if errs else []
            inside = set(seen)
        hit = [o.rank for o in outcomes if o.status == "error" and (o.error or "").startswith("KeyboardInterrupt")]
        if interrupted and hit and not dead and (not reports or str(reports[0].get("error")).startswith(
                "KeyboardInterrupt")):
            inside = {f["rank"] for f in reports if f.get("collective")}
            seen = [tuple(sorted(hit, key=lambda r: (r not in inside, r)))]
        note = "The cell was interrupted." if interrupted else ""
        if self.needs_reset:
            note = (note + " " if note else "") + (
                "The ranks' process group was torn down to stop them; it is re-created before the next cell.")
        if dead or self.stuck:
            note = "Call cluster.restart() for a working cluster." + "".join(
                f" Rank {r} is {why}." for r, why in sorted(self.stuck.items()))
        err = rank_error(outcomes, seen, inside=inside, rollcall=rollcall, note=note,
                         mismatch=None if mismatch is None else (
                             mismatch.get("ranks") or [f["rank"] for f in reports if f.get("mismatch")],
                             mismatch["line"]))
        if err.lead or mismatch is not None or dead or len(err.ranks) != 1 or (interrupted and hit):
            return err
        same = alike(err.outcomes, err.ranks[0])  # the others raised what it raised on their own, not because of it
        if len(same) == 1:
            return err
        return RankError(err.outcomes, same, err.note, err.diagnosis, False, err.rollcall, same=True)


def blame_rollcall(base: RollCall | None, reports: list[dict], ranks, dead: dict) -> RollCall | None:
    """The roll-call an error is explained from: ``base`` (taken while the ranks hung, or right after), with each
    failing rank shown inside the collective its error came out of, and dead ranks as dead. None without a base
    or without a failure inside a collective."""
    failed = {f["rank"]: f["collective"] for f in reports if f.get("collective")}
    if base is None or not (failed or dead):
        return None
    by = base.by_rank()
    over = []
    for r, c in failed.items():
        old = by.get(r)
        group = tuple(c.get("group") or ()) or None
        if old is not None and old.state == "in_collective" and (old.op, old.group, old.seq) == (
                c.get("op"), group, c.get("seq")):
            over.append(dataclasses.replace(old, waiting_s=c.get("waited_s")))  # keeps its shapes and dtypes
            continue
        over.append(RankStatus(r, "in_collective", op=c.get("op"), group=group, seq=c.get("seq"),
                               waiting_s=c.get("waited_s"), where=c.get("where"),
                               entered=old.entered if old is not None else ()))
    over += [RankStatus(r, "dead", note=why) for r, why in dead.items() if r in set(ranks)]
    return base.merged(over)
