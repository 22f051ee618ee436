"""The roll-call for scripts (``spawn``, ``meshviz.launch``): through the process-group store, free while nothing
hangs.

Each rank runs two daemon threads. The watcher looks at the rank's own roll-call record a few times a second (no
communication); once the rank has waited ``hang_after`` seconds in one collective it asks for a roll-call by
setting ``ask/<n>`` on the store. The answerer sits in a blocking store wait for that key and then writes the
rank's record to ``ans/<n>/<rank>``. Whoever serves the store (spawn's parent, launch's agent process, else rank
0) also waits for ``ask/<n>``, gathers the answers and prints the roll-call. A collective that raises writes the
rank's record to ``failed/<rank>``, so the error can say which collective each rank failed in. In a launched job
these keys are each run's (``rendezvous.attempt_store``): a restart never reads what the run before left.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass

from ..trace.status import RankStatus, RollCall
from . import rollcall

__all__ = ["Ask", "RollCallHost", "start_rank_watch", "HANG_AFTER_ENV", "HOST_ENV", "PREFIX", "DEFAULT_HANG_AFTER",
           "note_stage_failure", "stage_failures", "local_pids"]

DEFAULT_HANG_AFTER = 5.0  # seconds, as a Cluster's
HANG_AFTER_ENV = "MESHVIZ_HANG_AFTER"  # seconds; unset: no watchdog
HOST_ENV = "MESHVIZ_ROLLCALL_HOST"  # "parent": the launching process prints the roll-call (else rank 0 does)
PREFIX = "meshviz/rollcall/"
_LONG = datetime.timedelta(days=1)


def _key(*parts) -> str:
    return PREFIX + "/".join(str(p) for p in parts)


def _client(host: str, port: int, timeout: float = 30.0):
    """A store client of its own (a blocking wait on a shared one would hold up its other users)."""
    from .rendezvous import connect_store

    return connect_store(host, port, None, timeout)


def _run_view(store, attempt=None):
    """``store`` as this run of a launched job sees it (``attempt``: the run's number, default this process's)."""
    from .rendezvous import attempt_store

    return attempt_store(store, attempt)


@dataclass(frozen=True)
class Ask:
    """What ``ask/<n>`` holds: a roll-call asked by ``rank`` (-1: the host itself) that waited in collective ``op``
    #``seq``, or (``stop``) no roll-call: the rank is closing and its answerer ends."""

    rank: int
    op: str | None = None
    seq: int | None = None
    stop: bool = False

    def to_json(self) -> str:
        if self.stop:
            return json.dumps({"stop": self.rank})
        d: dict = {"rank": self.rank}
        if self.op is not None:
            d.update(op=self.op, seq=self.seq)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text) -> "Ask":
        d = json.loads(text)
        if "stop" in d:
            return cls(d["stop"], stop=True)
        return cls(d.get("rank", -1), d.get("op"), d.get("seq"))


class _RankWatch:
    """This rank's watcher and answerer threads (see the module's docstring)."""

    def __init__(self, host: str, port: int, rank: int, world: int, hang_after: float):
        self.rank = rank
        self.world = world
        self.hang_after = hang_after
        self._writer = _run_view(_client(host, port, 5.0))
        self._waiter = _run_view(_client(host, port))
        self._lock = threading.Lock()
        self._announced: dict = {}  # collective -> how long this rank waits in it before it asks again
        self._stopped = False
        self._next = int(self._writer.add(_key("gen"), 0)) + 1
        # where this rank runs: a failing pipeline stage shuts its sockets to its peers' processes (local_pids)
        self._writer.set(_key("pid", rank), json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        rollcall._state().fail_hooks.append(self._failed)
        rollcall._state().refuse_hooks.append(self._refused)
        threading.Thread(target=self._watch, name="meshviz-watchdog", daemon=True).start()
        self._answerer = threading.Thread(target=self._answer, name="meshviz-rollcall", daemon=True)
        self._answerer.start()
        atexit.register(self.close)

    def close(self) -> None:
        """Wake the answerer out of its store wait and let it end: a daemon thread still blocked inside torch's
        store when the interpreter finalizes would abort the process ("terminate called ...")."""
        if self._stopped:
            return
        self._stopped = True
        try:
            with self._lock:
                n = int(self._writer.add(_key("gen"), 1))
                self._writer.set(_key("ask", n), Ask(self.rank, stop=True).to_json())
        except Exception:
            return
        self._answerer.join(2.0)

    def _watch(self) -> None:
        every = min(0.25, max(0.05, self.hang_after / 5))
        rec = rollcall.current()
        while not self._stopped:
            time.sleep(every)
            op, since = rec.op, rec.since
            if op is None:
                continue  # outside a collective (a DataParallel backward shows in the answers, it does not ask)
            what = (op, rec.group, rec.seq if rec.seq is not None else since)  # a send or recv has no number
            # asked again at 2, 4, 8 ... times hang_after: a rank running at the first roll-call may finish later
            # without entering, which makes the wait one nothing can end (RollCall.stuck)
            waited = time.monotonic() - since
            if waited < self._announced.get(what, self.hang_after):
                continue
            self._announced[what] = 2 * waited
            try:
                with self._lock:
                    n = int(self._writer.add(_key("gen"), 1))
                    self._writer.set(_key("ask", n), Ask(self.rank, op, rec.seq).to_json())
            except Exception:
                return

    def _answer(self) -> None:
        errors = 0
        while not self._stopped:
            key = _key("ask", self._next)
            try:
                self._waiter.wait([key], _LONG)
                errors = 0
            except Exception:  # the store went away (the run is ending): stop after a few tries
                errors += 1
                if errors >= 3:
                    return
                time.sleep(0.2)
                continue
            if self._stopped:
                return
            try:
                status = rollcall.snapshot().to_dict()
                with self._lock:
                    self._writer.set(_key("ans", self._next, self.rank), json.dumps(status))
            except Exception:
                pass
            self._next += 1

    def _failed(self, rec) -> None:
        f = rec.failed
        if f is None:
            return
        status = RankStatus(self.rank, "in_collective", op=f["op"], group=tuple(f["group"]), seq=f["seq"],
                            waiting_s=f["waited_s"], where=f.get("where"),
                            entered=tuple(sorted(dict(rec.entered).items())))
        try:
            with self._lock:
                self._writer.set(_key("failed", self.rank), json.dumps(status.to_dict()))
        except Exception:
            pass

    def _refused(self, rec) -> None:
        """A refusal, kept where the host finds it after this rank returned (its answers end then)."""
        status = RankStatus(self.rank, "running", **rollcall.refusal(rec))
        try:
            with self._lock:
                self._writer.set(_key("refused", self.rank), json.dumps(status.to_dict()))
        except Exception:
            pass


_watch: _RankWatch | None = None


def note_stage_failure(text: str) -> bool:
    """Record ``text`` (a failed pipeline stage's summary) as this rank's, where its peers read it
    (:func:`stage_failures`); False without a watchdog."""
    w = _watch
    if w is None:
        return False
    try:
        with w._lock:
            w._writer.set(_key("stage", w.rank), text)
        return True
    except Exception:
        return False


def _records(store, kind: str, ranks) -> dict:
    """rank -> the record it left under ``kind`` on ``store``, for those of ``ranks`` that left one (those read
    before the store failed, if it does)."""
    out = {}
    try:
        for r in ranks:
            if store.check([_key(kind, r)]):
                out[r] = store.get(_key(kind, r))
    except Exception:
        pass
    return out


def _read(kind: str, ranks) -> dict:
    w = _watch
    if w is None:
        return {}
    with w._lock:
        left = _records(w._writer, kind, [r for r in ranks if r != w.rank])
    return {r: v.decode() for r, v in left.items()}


def stage_failures(ranks) -> dict[int, str]:
    """rank -> the failed pipeline stage it recorded (:func:`note_stage_failure`), for those of ``ranks`` that did."""
    return _read("stage", ranks)


def local_pids(ranks) -> dict[int, int]:
    """rank -> its process id, for those of ``ranks`` (this one left out) running on this machine."""
    me = socket.gethostname()
    out = {}
    for r, text in _read("pid", ranks).items():
        try:
            d = json.loads(text)
        except ValueError:
            continue
        if d.get("host") == me:
            out[r] = int(d["pid"])
    return out


def start_rank_watch(rank: int, world: int) -> bool:
    """Start this rank's watchdog when ``MESHVIZ_HANG_AFTER`` is set (spawn and launch set it) and the world has
    more than one rank; also the roll-call host on rank 0 when no launching process prints it. Idempotent."""
    global _watch
    raw = os.environ.get(HANG_AFTER_ENV)
    if _watch is not None or not raw or world < 2:
        return _watch is not None
    try:
        hang_after = float(raw)
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        _watch = _RankWatch(host, port, rank, world, hang_after)
        if rank == 0 and os.environ.get(HOST_ENV) != "parent":
            RollCallHost(host, port, world, hang_after).start()
    except Exception:
        return False
    rec = rollcall.current()
    rec.rank = rank
    return True


class RollCallHost:
    """Prints the roll-call when a rank asks for one (``out``: stderr), once per situation; ``rollcalls``: every
    one taken. ``dead()``: rank -> why, for ranks known to be gone (their answer will not come). ``attempt()``: the
    run of a launched job now under way (a restart is the next; its keys and roll-calls are its own), None: this
    process's (``MESHVIZ_LAUNCH_ATTEMPT``)."""

    POLL = 0.2  # seconds between two looks at the store for a rank's request
    def __init__(self, host: str, port: int, world: int, hang_after: float, out=None, dead=None,
                 wait_for_store: float = 0.0, attempt=None):
        self.host, self.port = host, int(port)
        self.attempt = attempt
        self.world = world
        self.hang_after = hang_after
        self.out = out
        self.dead = dead or (lambda: {})
        self.ended = None  # ranks known to have ended besides dead()'s (a launch's stopped workers): never answer
        self.rollcalls: list[RollCall] = []
        self.mismatch: RollCall | None = None  # the first roll-call that found ranks in different collectives
        self.stuck: RollCall | None = None  # the first where ranks wait for ranks that are done (RollCall.stuck)
        self._wait_for_store = wait_for_store
        self._stopped = False
        self._client = None
        self._thread: threading.Thread | None = None
        self._seen = None  # the run whose roll-calls ``rollcalls`` holds

    def _connect(self):
        if self._client is None:
            deadline = time.monotonic() + self._wait_for_store
            while True:
                try:
                    self._client = _client(self.host, self.port)
                    break
                except Exception:
                    if time.monotonic() > deadline or self._stopped:
                        raise
                    time.sleep(0.5)
        return self._client

    def _run_no(self):
        return None if self.attempt is None else self.attempt()

    def _store(self):
        """The store as the run now under way sees it (its roll-call keys)."""
        return _run_view(self._connect(), self._run_no())

    def start(self) -> "RollCallHost":
        self._thread = threading.Thread(target=self._run, name="meshviz-rollcall-host", daemon=True)
        self._thread.start()
        atexit.register(self.stop)
        return self

    def _run(self) -> None:
        # polls (a check on the store every POLL s) rather than blocking in the store: this thread must be able to
        # end at any moment, the store's server may close under it
        try:
            poller = _client(self.host, self.port, 5.0) if self._wait_for_store == 0 else None
            if poller is None:
                self._connect()  # the store may come up later (launch's agent makes it)
                poller = _client(self.host, self.port, 5.0)
            run = self._seen = self._run_no()
            view = _run_view(poller, run)
            n = int(view.add(_key("gen"), 0)) + 1
        except Exception:
            return
        said = None
        while not self._stopped:
            try:
                if self._run_no() != run:  # a restart: its roll-calls are counted afresh, under its own keys
                    run = self._seen = self._run_no()
                    view, n, said = _run_view(poller, run), 1, None
                    self.rollcalls, self.mismatch, self.stuck = [], None, None
                if not view.check([_key("ask", n)]):
                    time.sleep(self.POLL)
                    continue
                ask = Ask.from_json(view.get(_key("ask", n)))
            except Exception:
                return
            n += 1
            if ask.stop or self._stopped:
                continue
            try:
                rc = self.collect(n - 1)
            except Exception:
                continue
            if rc.hung(self.hang_after):
                self.rollcalls.append(rc)
                if rc.mismatches() and self.mismatch is None:
                    self.mismatch = rc
                if rc.stuck() and self.stuck is None:
                    self.stuck = rc
                if rc.gist() != said:
                    said = rc.gist()
                    self._print(rc)

    def _print(self, rc: RollCall) -> None:
        out = self.out or sys.stderr
        try:
            print(rc.text(), file=out, flush=True)
        except Exception:
            pass

    def collect(self, n: int, timeout: float = 1.5) -> RollCall:
        """The answers to roll-call ``n``: every rank that answered within ``timeout`` s, the dead ones as dead.
        The wait ends early once every rank yet to answer has ended: its answer will not come."""
        store = self._store()
        dead = self.dead()
        want = [r for r in range(self.world) if r not in dead]
        got: dict = {}
        deadline = time.monotonic() + timeout
        last = False
        while True:
            for r in want:
                if r not in got and store.check([_key("ans", n, r)]):
                    got[r] = json.loads(store.get(_key("ans", n, r)))
            if len(got) == len(want) or last or time.monotonic() > deadline:
                break
            # a rank that ended while asked (a failing run's others exit at once) stays unknown, as at the deadline;
            # the answers are read once more after, for one that answered just before it ended
            last = not set(want) - set(got) - set(self.dead()) - set(self.ended() if self.ended else ())
            if not last:
                time.sleep(0.02)
        out = []
        for r in range(self.world):
            if r in dead:
                out.append(RankStatus(r, "dead", note=dead[r]))
            elif r in got:
                out.append(RankStatus.from_dict({**got[r], "rank": r}))
            else:
                out.append(RankStatus(r, "unknown"))
        return RollCall(out, title=f"meshviz roll-call (a rank waited over {self.hang_after:g} s in a collective):")

    def unending(self) -> RollCall | None:
        """The first roll-call that found a wait nothing can end (a mismatch, or ranks missing that are done)."""
        return self.mismatch or self.stuck

    def ask(self, timeout: float = 1.0) -> RollCall | None:
        """Take a roll-call now (the ranks' answerers reply even while blocked); None if the store is gone."""
        try:
            store = self._store()
            n = int(store.add(_key("gen"), 1))
            store.set(_key("ask", n), Ask(-1).to_json())
            return self.collect(n, timeout)
        except Exception:
            return None

    def _left(self, kind: str) -> dict[int, RankStatus]:
        """rank -> the status it left under ``kind`` ("failed", "refused"), for the ranks that left one."""
        out = {}
        try:
            for r, record in _records(self._store(), kind, range(self.world)).items():
                out[r] = RankStatus.from_dict(json.loads(record))
        except Exception:
            pass
        return out

    def failed(self) -> dict[int, RankStatus]:
        """rank -> the collective its error came out of, for the ranks that failed inside one."""
        return self._left("failed")

    def refused(self) -> dict[int, dict]:
        """rank -> the roll-call fields of the last call it refused (``refused``, ``refused_entered``)."""
        left = self._left("refused")
        return {r: {"refused": s.refused, "refused_entered": s.refused_entered} for r, s in left.items()}

    def blame(self) -> RollCall | None:
        """The roll-call that explains a failed run: the last one printed (else one taken now), with each rank that
        failed inside a collective shown there and the dead ranks as dead."""
        calls = self.rollcalls  # the run's own: a restart the thread has not seen yet has none
        base = calls[-1] if calls and self._seen == self._run_no() else self.ask()
        if base is None:
            return None
        failed = self.failed()  # after the roll-call: a rank that ended while asked left its collective there
        by = base.by_rank()
        over = []
        for r, s in failed.items():
            old = by.get(r)
            if old is not None and old.state == "in_collective" and (old.op, old.group, old.seq) == (
                    s.op, s.group, s.seq):
                s = dataclasses.replace(old, waiting_s=s.waiting_s)  # keeps its shapes and dtypes
            over.append(s)
        over += [RankStatus(r, "dead", note=why) for r, why in self.dead().items() if r not in failed]
        return base.merged(over)

    def stop(self) -> None:
        """End the host's thread (before the store goes away)."""
        self._stopped = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)
