"""torchrun's elastic agent as the ``"torchrun"`` Runner: its one job is this node's workers running a script."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time

from ..errors import RankError, RankOutcome
from ..ranks.outcomes import error_of, exit_text
from .ending import Ending, end_leftovers, grace

__all__ = ["Torchrun", "TorchrunJob", "STOPPED"]

STOPPED = frozenset({-15, -9})  # exit codes of the workers the agent ended once one failed (SIGTERM, SIGKILL)
# the signals torch's agent takes over for its run (and leaves taken over): given back once the run ends
_AGENT_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
                       if hasattr(signal, name))


class TorchrunJob:
    """This node's workers of one torchrun run (a :class:`~meshviz.ranks.runner.Job`, done when the agent
    returns); ``failures`` are torch's ``ChildFailedError.failures`` (global rank -> ProcessFailure)."""

    def __init__(self, ranks: list[int]):
        self.ranks = list(ranks)
        self.failures: dict = {}
        self.exception: BaseException | None = None  # the agent's ChildFailedError, when a worker failed
        self.interrupted: str | None = None  # the signal ("SIGINT", ...) that made the agent stop every worker
        self.log_dir: str | None = None  # where workerlog.<local rank> is, when the launcher keeps the logs
        self.killed: dict[int, str] = {}  # the workers that outlived the signal's grace: rank -> when killed
        self.left_killed: dict[int, str] = {}  # the same for what a worker left running once it ended
        self.attempt = 0  # the agent's run of the workers (a restart is the next)
        self.workers = None  # that run's workers: the agent's process context (local rank -> handler)
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def exited_well(self) -> tuple[int, list[int]]:
        """(the agent's run, the global ranks of its workers that exited with code 0 so far), as the agent saw
        them exit (it reaps them a few times a second)."""
        attempt, workers = self.attempt, self.workers
        out = []
        for local, handler in dict(getattr(workers, "subprocess_handlers", None) or {}).items():
            if handler.proc.returncode == 0:
                out.append(int(workers.envs[local].get("RANK", local)))
        return attempt, out

    def end_run(self, attempt: int, sig: int = signal.SIGTERM) -> bool:
        """``sig`` to the workers of the agent's run ``attempt`` still running (with their process groups), while
        that run is the agent's: it sees them fail and restarts them (another node restarted: the nodes restart
        together, as Paddle's). False when that run is over or none of its workers still runs."""
        workers = self.workers
        envs = dict(getattr(workers, "envs", None) or {})
        if self.done() or not envs or any(int(e.get("TORCHELASTIC_RESTART_COUNT", -1)) != attempt
                                          for e in envs.values()):
            return False
        hit = False
        for handler in dict(getattr(workers, "subprocess_handlers", None) or {}).values():
            if handler.proc.poll() is not None:
                continue
            try:
                if os.getpgid(handler.proc.pid) == handler.proc.pid:  # its own session: what it started goes too
                    os.killpg(handler.proc.pid, sig)
                else:
                    handler.proc.send_signal(sig)
                hit = True
            except OSError:
                continue
        return hit

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def pending(self) -> list[int]:
        return [] if self.done() else list(self.ranks)

    def failed(self) -> list[int]:
        """The workers that failed on their own (not ended by the agent), else every worker that failed; in the
        order they failed, by the time of each one's report (a worker whose peer failed first raises too, a moment
        later; one that crashed without a report, by its log's last write, else first)."""
        own = self._own()
        when = {r: _reported_at(self.failures[r], self.log_dir) for r in own}
        return sorted(own, key=lambda r: (when[r], r)) if own else sorted(self.failures)

    def _own(self) -> list[int]:
        """The workers that failed on their own: not ended by the agent's SIGTERM; a SIGKILL beside workers the agent
        ended with SIGTERM came from elsewhere (the OOM killer, ``kill -9``)."""
        own = [r for r, f in self.failures.items() if f.exitcode not in STOPPED]
        if not own and any(f.exitcode == -15 for f in self.failures.values()):
            own = [r for r, f in self.failures.items() if f.exitcode == -9]
        return own

    def said(self, rank: int) -> str:
        """What worker ``rank`` failed with: the exception line its error file holds ("ValueError: ..."), else how
        its process ended ("exit code 3", "killed by SIGKILL")."""
        f = self.failures[rank]
        said = f.error_file_data.get("message") if isinstance(f.error_file_data, dict) else None
        what = str(said.get("message", "") if isinstance(said, dict) else said or "")
        return exit_text(f.exitcode) if what in ("", "<NONE>") else what  # torch's word for no error file

    def gone(self) -> dict[int, str]:
        """The workers that failed on their own, for a roll-call: rank -> how it ended and what it raised."""
        out = {}
        for r in self._own():
            how, what = exit_text(self.failures[r].exitcode), self.said(r)
            out[r] = how if what == how else f"{how}: {what}"
        return out

    def exit_code(self) -> int:
        """The launcher's exit code, as Paddle's launch's: the exit code of the first worker, in local-rank order,
        that failed (a signal's as ``sys.exit`` gives it: 247 for SIGKILL); 0 when none failed. The workers the
        agent ended once one had failed are passed over: Paddle's launch ends them too, and exits with 241 when it
        happened to end one before the worker that failed, which depends on timing."""
        own = self._own() or list(self.failures)
        if not own:
            return 0
        code = self.failures[min(own)].exitcode % 256
        return code or 1

    def killed_text(self) -> str:
        """The workers the launcher killed after a signal (they did not end on it), as "; rank 1 did not end on
        SIGTERM: killed (SIGKILL) after 30 s", and what ended workers left running, as "; what rank 1 started did
        not end on SIGTERM: ...", or ""."""
        out = ""
        for killed, what in ((self.killed, ""), (self.left_killed, "what ")):
            if killed:
                ranks = sorted(killed)
                who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
                out += (f"; {what}{who}{' started' if what else ''} did not end on {self.interrupted or 'SIGTERM'}: "
                        f"killed (SIGKILL) {killed[ranks[0]]}")
        return out

    def outcomes(self) -> list[RankOutcome]:
        if not self.done():
            return [RankOutcome(r, status="running", error="the agent still runs it") for r in self.ranks]
        if self.interrupted is not None:
            why = f"interrupted: the agent got {self.interrupted} and stopped every worker"
            return [RankOutcome(r, status="stopped", error=why) for r in self.ranks]
        out, own = [], set(self._own())
        for r in sorted(set(self.ranks) | set(self.failures)):
            f = self.failures.get(r)
            if f is None:
                out.append(RankOutcome(r))
            elif f.exitcode in STOPPED and r not in own:
                out.append(RankOutcome(r, status="stopped", error="ended by the agent when another worker failed"))
            else:
                out.append(RankOutcome(r, status="died", error=exit_text(f.exitcode)))
        return out

    def error(self) -> RankError | None:
        """The RankError naming the first worker that failed on its own; None while running or when all did well."""
        if not self.done():
            return None
        return error_of(self.outcomes(), [tuple(self.ranks)] if self.interrupted else self.failed())


def _reported_at(failure, log_dir: str | None = None) -> float:
    """When the worker wrote its error file (``_worker`` writes what the script raised, and when, to the
    microsecond: a file's own time may be a few ms coarse, within which a peer that lost its connection reports
    too); for a worker that wrote none (it crashed), when it last wrote to its log (a crash's own last words, such
    as an abort because a peer had gone, come at the crash; a silent crash's log is older still), or -1."""
    try:
        with open(failure.error_file) as fh:
            return float(json.load(fh)["message"]["extraInfo"]["meshviz_time"])
    except (OSError, TypeError, ValueError, KeyError):
        pass
    paths = [failure.error_file]
    if log_dir is not None:
        paths.append(os.path.join(log_dir, f"workerlog.{failure.local_rank}"))
    for path in paths:
        try:
            return os.path.getmtime(path)
        except (OSError, TypeError):
            pass
    return -1.0


def _polled_barrier(store, world_size: int, key_prefix: str, barrier_timeout: float = 300, **_) -> None:
    """torch's barrier of the agents (its keys), waiting in Python: torch's waits in one C++ call, which a SIGTERM
    or SIGINT does not end (its handler runs once the wait is over), so a node whose workers were done sat out the
    exit barrier's 300 s when another node's worker failed, deaf to what the other nodes said."""
    from torch.distributed import DistStoreError
    from torch.distributed.elastic.utils import store as store_util

    last = store_util._barrier_nonblocking(store=store, world_size=world_size, key_prefix=key_prefix)
    end = time.monotonic() + barrier_timeout
    while not store.check([last]):
        if time.monotonic() > end:
            raise DistStoreError(f"the agents' barrier {key_prefix!r} timed out after {barrier_timeout:g} s")
        time.sleep(0.2)


@contextlib.contextmanager
def _watched(job: TorchrunJob, ending: Ending, before=None):
    """While the agent runs: ``before()`` called after each rendezvous, before the agent assigns the ranks (it may
    refuse the job: no worker has started), each run of its workers kept in ``job`` (the launcher's watches see
    which exited), the workers told the launcher's pid when it starts them from its main thread (they end with
    it), and the agent's own ending of the workers once one failed given the grace of :class:`Ending` (torch waits
    30 s for a worker that ignores SIGTERM), what a failed worker started ended with the others
    (:func:`end_leftovers`), and its exit barrier waited out where a signal can end it (:func:`_polled_barrier`)."""
    from torch.distributed.elastic.agent.server import local_elastic_agent as agent
    from torch.distributed.elastic.utils import store as store_util

    real = agent.start_processes

    def start_processes(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            for env in (kwargs.get("envs") or {}).values():
                env["MESHVIZ_LAUNCH_PID"] = str(os.getpid())
        envs = kwargs.get("envs") or {}  # the run's number known before its workers ask for a roll-call
        job.attempt = int(next(iter(envs.values()), {}).get("TORCHELASTIC_RESTART_COUNT", job.attempt))
        workers = real(*args, **kwargs)
        job.workers = workers
        close = workers.close

        def graced_close(death_sig=None, timeout=30):
            with ending.graced():
                end_leftovers(workers, death_sig or signal.SIGTERM)  # torch signals only the workers still running
                close(death_sig, timeout)
                ending.end_leftovers(workers)  # torch kills only its workers: what ignored the signal, after the grace

        workers.close = graced_close
        return workers

    assign = agent.SimpleElasticAgent._assign_worker_ranks

    def assign_agreed(self, *args, **kwargs):
        if before is not None:
            before()
        return assign(self, *args, **kwargs)

    exit_barrier, barrier = agent.SimpleElasticAgent._exit_barrier, store_util.barrier

    def exit_barrier_polled(self, *args, **kwargs):
        store_util.barrier = _polled_barrier
        try:
            return exit_barrier(self, *args, **kwargs)
        finally:
            store_util.barrier = barrier

    agent.start_processes = start_processes
    agent.SimpleElasticAgent._assign_worker_ranks = assign_agreed
    agent.SimpleElasticAgent._exit_barrier = exit_barrier_polled
    try:
        yield
    finally:
        agent.start_processes = real
        agent.SimpleElasticAgent._assign_worker_ranks = assign
        agent.SimpleElasticAgent._exit_barrier = exit_barrier


class Torchrun:
    """The ``"torchrun"`` Runner: torchrun's elastic agent (``config``, a ``LaunchConfig``) starting this node's
    ``n`` workers. One-shot: ``submit(args)`` runs ``entrypoint args...`` on every worker, in the calling thread
    (the agent's signal handlers are the main thread's) until every worker ended, and returns the finished job.
    ``interrupt()``, from another thread while that runs, is a SIGINT to this process: the agent stops every
    worker. ``leave``: the process is the launcher's own, which a signal torch's rendezvous cannot hear (it waits
    in C++) ends within a second; elsewhere (a notebook's kernel) the wait goes on to the rendezvous timeout."""

    kind = "torchrun"

    def __init__(self, config, entrypoint: str = sys.executable, leave: bool = False):
        self.config = config
        self.entrypoint = entrypoint
        self.leave = leave  # the launcher's own process: a signal its rendezvous cannot hear ends it (_leave)
        self.n = config.nproc_per_node
        node = config.rdzv_configs["rank"]
        self.ranks = [node * self.n + i for i in range(self.n)]
        self.job: TorchrunJob | None = None
        self._agreed = False

    def start(self) -> Torchrun:
        """Nothing starts before :meth:`submit`: the agent makes the workers for the one job."""
        return self

    def submit(self, args, ranks=None) -> TorchrunJob:
        """Run the agent with the workers' command line ``args`` (after the entrypoint); returns the job when
        every worker ended (a worker's failure is the job's, and so is an interrupt: SIGINT or SIGTERM to this
        process; any other error of the agent is raised). The agent's signal handlers are given back after."""
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import elastic_launch

        if ranks is not None and sorted(int(r) for r in ranks) != self.ranks:
            raise ValueError(f"torchrun runs its workers as ranks {self.ranks}, not {list(ranks)}")
        if self.job is not None:
            raise RuntimeError("Torchrun runs one job; make another Torchrun for the next")
        job = self.job = TorchrunJob(self.ranks)
        main = threading.current_thread() is threading.main_thread()
        handlers = {s: signal.getsignal(s) for s in _AGENT_SIGNALS} if main else {}
        if main and self.leave and handlers.get(signal.SIGINT) is signal.SIG_IGN:
            # the launcher started in a script's background (`cmd &`), which ignores SIGINT: torch's agent takes it
            # over once the workers start anyway, so the rendezvous before them hears it too
            signal.signal(signal.SIGINT, signal.default_int_handler)
        ending = Ending(grace(), idle=lambda: job.workers is None, leave=self._leave if self.leave else None)
        if main and getattr(self.config, "shutdown_timeout", None) is not None:  # torch's own kill after ending's
            self.config.shutdown_timeout = int(ending.grace_s) + 10
        try:
            with ending, _watched(job, ending, self._agree):
                elastic_launch(self.config, entrypoint=self.entrypoint)(*args)
        except ChildFailedError as e:
            job.failures = dict(e.failures)
            job.exception = e
        except SignalException as e:
            job.interrupted = signal.Signals(e.sigval).name
        except KeyboardInterrupt:  # before the agent took SIGINT over
            job.interrupted = "SIGINT"
        finally:
            job.log_dir = getattr(getattr(self.config, "logs_specs", None), "root_log_dir", None)  # the last attempt's
            job.killed, job.left_killed = dict(ending.killed), dict(ending.left_killed)
            for s, handler in handlers.items():
                signal.signal(s, handler)
            job._done.set()
        return job

    def _leave(self, name: str) -> None:
        """End this process (from :class:`Ending`'s thread): signal ``name`` came while no worker had started, and
        the agent waits in torch's rendezvous, deaf to it until the rendezvous timeout."""
        import shutil

        print(f"meshviz.launch: {name}: stopped while waiting at the rendezvous at {self.config.rdzv_endpoint} "
              "(no worker had started)", file=sys.stderr, flush=True)
        shutil.rmtree(getattr(getattr(self.config, "logs_specs", None), "raw_dir", None) or "", ignore_errors=True)
        os._exit(signal.Signals[name].value)

    def _agree(self) -> None:
        """At the first rendezvous of several nodes: refuse settings they were given differently (agreement.agree)."""
        config = self.config
        if config.min_nodes > 1 and not self._agreed:
            from .agreement import agree, settings

            agree(config.rdzv_endpoint, config.rdzv_configs["rank"], settings(config),
                  config.rdzv_configs.get("timeout", 900))
            self._agreed = True

    def interrupt(self, ranks=None) -> None:
        """SIGINT to this process while the job runs: the agent ends every worker (it stops all or none)."""
        if ranks is not None and sorted(int(r) for r in ranks) != self.ranks:
            raise ValueError("torchrun's agent interrupts every worker of this node, or none")
        if self.job is not None and not self.job.done():
            os.kill(os.getpid(), signal.SIGINT)

    def stop(self) -> None:
        """Nothing outlives the job; while it runs, its workers are interrupted."""
        self.interrupt()
