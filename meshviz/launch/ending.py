"""After a signal to the launcher, the workers still running past the grace (or at a second signal) are killed."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable

__all__ = ["Ending", "end_leftovers", "grace", "leftovers"]

# the signals torch's agent stops its workers on (it sends them the same one, then waits for them)
_SIGNALS = {int(getattr(signal, n)): n for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, n)}


def end_leftovers(workers, sig) -> list[int]:
    """When a worker of ``workers`` (torch's process context) failed: ``sig`` to what each failed worker started
    and left running, its process group (torch starts each worker in a session of its own; its ``close`` signals
    the groups of the workers still running only, as Paddle's launch). Returns the groups signalled."""
    out: list[int] = []
    if not hasattr(os, "killpg"):
        return out
    for handler in dict(getattr(workers, "subprocess_handlers", None) or {}).values():
        pid, code = handler.proc.pid, handler.proc.poll()
        if code in (None, 0):
            continue
        try:
            os.kill(pid, 0)
            continue  # the worker is reaped: a process of that number now is another's, and so is its group
        except ProcessLookupError:
            pass
        except OSError:
            continue
        try:
            os.killpg(pid, sig)  # the number stays taken while the group has members: they are the worker's
            out.append(pid)
        except OSError:
            pass  # nothing left there
    return out


def leftovers(workers) -> dict[int, int]:
    """What the workers of ``workers`` that ended with a failure (or were ended) left running: process group ->
    global rank, for each such group that still has a live member once the worker is reaped (its number stays
    taken while the group has members, so they are the worker's)."""
    import psutil

    groups = {}
    for local, handler in dict(getattr(workers, "subprocess_handlers", None) or {}).items():
        if handler.proc.returncode not in (None, 0):
            groups[handler.proc.pid] = int(workers.envs[local].get("RANK", local))
    if not groups or not hasattr(os, "getpgid"):
        return {}
    live = set()
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) in groups and p.status() != psutil.STATUS_ZOMBIE:
                live.add(os.getpgid(p.pid))
        except (psutil.Error, OSError):
            continue
    return {g: r for g, r in groups.items() if g in live}


def grace() -> float:
    """Seconds the workers get to end after a signal to the launcher: torch's ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``
    (default 30, as torch's agent), on every torch (torch 2.11's agent has no such setting)."""
    try:
        return max(0.0, float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")))
    except ValueError:
        return 30.0


class Ending:
    """Around the agent's run, in the main thread: sees each signal the agent takes (through the wakeup file
    descriptor Python writes a signal's number to); from the first, the workers still running ``grace_s`` seconds
    later, or at once at a second signal (Paddle's launch ends them so too), are killed with their process groups
    (what they started goes too). So too while the agent ends the workers on its own (:meth:`graced`: one failed),
    and what the ended workers left running (:meth:`end_leftovers`). ``killed``: global rank -> when it was killed
    ("after 30 s", "at a second signal"); ``left_killed``: the same for what a worker left running.

    A signal while ``idle()`` (no worker has started) that the agent has not acted on within a second (it waits
    inside a C++ call, as torch's rendezvous waits for the other nodes, where the signal's handler runs only once
    the wait is over: up to the rendezvous timeout) calls ``leave(name)``, which ends this process."""

    def __init__(self, grace_s: float, idle: Callable[[], bool] | None = None,
                 leave: Callable[[str], None] | None = None):
        self.grace_s = grace_s
        self._idle, self._leave = idle, leave
        self._unheard: tuple[float, str] | None = None  # (when, name): a signal that came while idle
        self.killed: dict[int, str] = {}
        self.left_killed: dict[int, str] = {}
        self._kills: list[str] = []  # when the thread killed (it kills the workers; the caller, their leftovers)
        self.first: str | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._got, self._since = 0, None  # signals seen, and when the grace began (None: no ending under way)
        self._old = None
        self._pair: tuple[socket.socket, socket.socket] | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Ending:
        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread takes signals (and sets the wakeup descriptor)
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        self._pair = (r, w)
        self._old = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._run, name="meshviz-launch-ending", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._pair is None:
            return
        signal.set_wakeup_fd(self._old if self._old is not None else -1)
        self._stopped.set()
        self._thread.join(2.0)
        for s in self._pair:
            s.close()

    @contextlib.contextmanager
    def graced(self):
        """Around the agent's ending of the workers (SIGTERM, then torch waits 30 s): the grace runs from here,
        as after a signal; it is called off when the ending is over before it ran out (unless a signal came)."""
        with self._lock:
            mine = self._since is None and self._pair is not None
            if mine:
                self._since = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                if mine and self._got == 0:
                    self._since = None

    def end_leftovers(self, workers) -> None:
        """Once the agent's ending of ``workers`` is over (in :meth:`graced`): what they left running (see
        :func:`leftovers`: a child that ignored the signal) is killed (SIGKILL, with its process group) when the
        grace runs out, or at once at a second signal; waits until then unless it ends first."""
        with self._lock:
            since, kills = self._since, len(self._kills)
        deadline = (time.monotonic() if since is None else since) + self.grace_s
        groups = leftovers(workers)
        while groups and time.monotonic() < deadline and len(self._kills) == kills:
            time.sleep(0.1)
            groups = leftovers(workers)
        when = self._kills[kills] if len(self._kills) > kills else f"after {self.grace_s:g} s"
        for group, rank in groups.items():
            try:
                os.killpg(group, signal.SIGKILL)
            except OSError:
                continue
            self.left_killed[rank] = when

    def _run(self) -> None:
        r = self._pair[0]
        while not self._stopped.is_set():
            with self._lock:
                since = self._since
            left = 0.2 if since is None else min(0.2, max(0.0, since + self.grace_s - time.monotonic()))
            if select.select([r], [], [], left)[0]:
                try:
                    data = r.recv(64)
                except OSError:
                    data = b""
                for b in data:
                    if b in _SIGNALS:
                        with self._lock:
                            self._got += 1
                            if self._since is None:
                                self._since, self.first = time.monotonic(), _SIGNALS[b]
                        if self._unheard is None and self._leave is not None and self._idle is not None \
                                and self._idle():
                            self._unheard = (time.monotonic(), _SIGNALS[b])
            if self._unheard is not None and time.monotonic() > self._unheard[0] + 1.0 and self._idle() \
                    and not self._stopped.is_set():
                self._leave(self._unheard[1])
            with self._lock:
                got, since = self._got, self._since
            if since is not None and (got > 1 or time.monotonic() >= since + self.grace_s):
                when = "at a second signal" if got > 1 else f"after {self.grace_s:g} s"
                self._kill(when)
                self._kills.append(when)
                with self._lock:
                    self._got, self._since = 0, None  # a worker started later (a restart) gets its own grace

    def _kill(self, when: str) -> None:
        """SIGKILL to every worker still running (the children of this process: the agent's), and what it started."""
        import psutil

        for child in psutil.Process().children():
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    continue
                rank = int(child.environ().get("RANK", "-1"))
                if os.getpgid(child.pid) == child.pid:  # the agent starts each worker in a session of its own
                    os.killpg(child.pid, signal.SIGKILL)
                else:
                    child.kill()
            except (psutil.Error, OSError, ValueError):
                continue
            if rank >= 0:
                self.killed[rank] = when
