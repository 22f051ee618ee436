"""A worker that ended without joining the process group its peers joined says so; the launcher ends them."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading

__all__ = ["say_left", "Leavers"]

_LEFT = "meshviz/launch/left/"  # + global rank: that worker's script ended well without joining
_COUNT = "meshviz/launch/left"  # how many said so (one look at the store while nobody did)


def say_left() -> None:
    """In a worker whose script ended well (or with ``sys.exit(0)``) before joining a process group of several
    ranks: say so on the agent's store, so that the launcher ends the workers that joined (they would wait for
    this one in ``init_parallel_env`` until the timeout)."""
    from ..runtime.rendezvous import HOSTED

    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or os.environ.get(HOSTED) != "True":
        return
    tdist = sys.modules.get("torch.distributed")
    if tdist is not None and tdist.is_available() and tdist.is_initialized():
        return
    try:
        from ..runtime.rendezvous import attempt_store, connect_store

        store = connect_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, 2.0)
        _mark(attempt_store(store), int(os.environ["RANK"]))
    except Exception:  # the store is gone: nobody is left to wait for this worker
        pass


def _mark(store, rank: int) -> None:
    store.set(_LEFT + str(rank), "1")
    store.add(_COUNT, 1)


class Leavers:
    """The launcher's watch, while its workers run, for workers that said they left without joining while another
    joined (spawn's rule, :func:`meshviz.ranks.processes.stranded`): it keeps them in ``left`` and stops this
    node's workers (SIGTERM to this process: the agent ends them). Every node watches: each stops its own."""

    def __init__(self, master: str, world: int, nnodes: int = 1):
        self.master, self.world, self.nnodes = master, world, nnodes
        self.left: list[int] = []
        self.came: list[bool] = []
        self._marked: set[tuple[int, int]] = set()  # (run, rank): this node's workers seen exited with code 0
        self._store = None
        self._over = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, runner) -> Leavers:
        self._thread = threading.Thread(target=self._run, args=(runner,), name="meshviz-launch-leavers", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching; waits for the watch (a thread left inside a store call at exit can abort the process)."""
        self._over.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _run(self, runner) -> None:
        while not self._over.wait(0.25):
            job = runner.job
            if job is None or job.done():
                continue
            try:
                gone = self._look(job)
            except Exception:
                continue
            if gone and not job.done() and not self._over.is_set():
                self.left = gone
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def _look(self, job) -> list[int]:
        from ..ranks.processes import stranded
        from ..runtime import rendezvous

        if self._store is None:
            host, _, port = self.master.rpartition(":")
            # nobody serves there yet: fail now, not after a client's retries
            socket.create_connection((host, int(port)), timeout=1.0).close()
            self._store = rendezvous.connect_store(host, int(port), None, 2.0)
        attempt, exited = job.exited_well()
        store = rendezvous.attempt_store(self._store, attempt)  # this run's keys, not a run's before
        if exited:
            self._mark_quiet(store, attempt, exited)
        if int(store.add(_COUNT, 0)) == 0:
            return []
        if self.nnodes > 1:
            from .nodes import world

            self.world = world(self._store, self.nnodes) or self.world
        said = [r for r in range(self.world) if store.check([_LEFT + str(r)])]
        self.came = rendezvous.arrived(store, self.world)
        return stranded(self.came, said, [r for r in range(self.world) if r not in said])

    def _mark_quiet(self, store, attempt: int, exited: list[int]) -> None:
        """Say for this node's workers that exited with code 0 without joining and without saying so that they
        left (``os._exit(0)`` skips :func:`say_left`, and so does a program run as it is): the agent saw them
        exit, and the other nodes read it here."""
        from ..runtime import rendezvous

        new = [r for r in exited if (attempt, r) not in self._marked]
        if not new:
            return
        came = rendezvous.arrived(store, max(self.world, max(new) + 1))
        for r in new:
            if not came[r] and not store.check([_LEFT + str(r)]):
                _mark(store, r)
            self._marked.add((attempt, r))

    def report(self, args) -> int:
        """Say which workers left without joining (RankError's words, as spawn's) and that the others were stopped;
        the launcher's exit code, 1."""
        from ..errors import RankOutcome
        from ..ranks.outcomes import rank_error

        why = "ended by the launcher: it joined and waited for a worker that had left"
        outcomes = [RankOutcome(r, status="ok", arrived=False) if r in self.left else
                    RankOutcome(r, status="stopped", error=why, arrived=self.came[r])
                    for r in range(self.world)]
        head = rank_error(outcomes, [tuple(self.left)]).headline()
        print(f"meshviz.launch: {head}: the workers that joined would have waited for it until the timeout; they "
              f"were stopped. Logs: {os.path.join(args.log_dir, 'workerlog.N')}", file=sys.stderr, flush=True)
        return 1
