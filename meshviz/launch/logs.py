"""Workers' logs, Paddle's way: ``<log_dir>/workerlog.<local rank>``, appended to unless ``--log_overwrite``."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

__all__ = ["WorkerLogs", "LogCopier", "attempt_dir"]


def _make_logs_specs():
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

    class _WorkerLogs(LogsSpecs):
        """torch's agent writes each worker's output (stdout and stderr together; rank 0's tee'd to the console)
        to ``workerlog.<local rank>`` in a folder of its own for each attempt, ``attempt.<k>`` in ``raw_dir``
        (``root_log_dir``: the latest's): a :class:`LogCopier` adds it to ``log_dir``'s as it comes."""

        def __init__(self, log_dir, tee_ranks=frozenset()):
            os.makedirs(log_dir, exist_ok=True)
            self.log_dir = log_dir
            self.raw_dir = tempfile.mkdtemp(prefix="meshviz-launch-")
            super().__init__(log_dir=attempt_dir(self.raw_dir, 0))
            self._tee_ranks = set(tee_ranks)

        @property
        def root_log_dir(self) -> str:
            return str(self._root_log_dir)

        def reify(self, envs):
            attempt = int(next(iter(envs.values()), {}).get("TORCHELASTIC_RESTART_COUNT", 0)) if envs else 0
            self._root_log_dir = root = attempt_dir(self.raw_dir, attempt)
            os.makedirs(root, exist_ok=True)
            dest = LogsDest()
            for local_rank in range(len(envs)):
                path = os.path.join(root, f"workerlog.{local_rank}")
                dest.stdouts[local_rank] = path
                dest.stderrs[local_rank] = ""  # the worker joins stderr to stdout
                if local_rank in self._tee_ranks:
                    dest.tee_stdouts[local_rank] = path
                dest.error_files[local_rank] = os.path.join(root, f"error.{local_rank}.json")
                # where the worker writes what its script raised (torch's own LogsSpecs sets it there too)
                envs[local_rank]["TORCHELASTIC_ERROR_FILE"] = dest.error_files[local_rank]
            return dest

    return _WorkerLogs


def attempt_dir(raw_dir: str, attempt: int) -> str:
    """Where torch's agent writes the workers' output of attempt ``attempt`` (0, then one more per restart)."""
    return os.path.join(raw_dir, f"attempt.{attempt}")


class _Lazy:
    cls = None


def WorkerLogs(log_dir, tee_ranks=frozenset()):
    """torch's ``LogsSpecs`` for the workers of ``log_dir`` (made when first asked: it imports torch)."""
    if _Lazy.cls is None:
        _Lazy.cls = _make_logs_specs()
    return _Lazy.cls(log_dir, tee_ranks)


class LogCopier:
    """Adds what the ``n`` workers write to torch's files in ``raw_dir`` to ``<log_dir>/workerlog.<i>`` while they
    run, attempt after attempt: appended to what earlier runs left there, as Paddle's launch does, or written afresh
    with ``overwrite`` (Paddle's ``--log_overwrite``)."""

    def __init__(self, raw_dir: str, log_dir: str, n: int, overwrite: bool = False, interval: float = 0.1):
        self.raw_dir, self.log_dir, self.n, self.interval = raw_dir, log_dir, n, interval
        os.makedirs(log_dir, exist_ok=True)
        self._out = [open(self.path(i), "wb" if overwrite else "ab") for i in range(n)]
        self.start_at = [f.tell() for f in self._out]  # where this run's lines begin
        self._read = [0] * n  # how much of worker i's file in attempt self._attempt[i] was copied
        self._attempt = [0] * n
        self._lock = threading.Lock()
        self._over = threading.Event()
        self._thread: threading.Thread | None = None

    def path(self, i: int) -> str:
        return os.path.join(self.log_dir, f"workerlog.{i}")

    def start(self) -> LogCopier:
        self._thread = threading.Thread(target=self._run, name="meshviz-launch-logs", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._over.wait(self.interval):
            self.copy()

    def copy(self) -> None:
        """Add what each worker wrote since the last copy (the rest of an attempt before the next one's)."""
        with self._lock:
            for i, out in enumerate(self._out):
                while not out.closed:
                    self._copy(i, out)
                    if not os.path.exists(self._raw(i, self._attempt[i] + 1)):
                        break
                    self._copy(i, out)  # what the worker wrote before it was restarted
                    self._attempt[i] += 1
                    self._read[i] = 0

    def _raw(self, i: int, attempt: int) -> str:
        return os.path.join(attempt_dir(self.raw_dir, attempt), f"workerlog.{i}")

    def _copy(self, i: int, out) -> None:
        try:
            with open(self._raw(i, self._attempt[i]), "rb") as fh:
                fh.seek(self._read[i])
                data = fh.read()
        except OSError:
            return
        self._read[i] += len(data)
        if data:
            out.write(data)
            out.flush()

    def stop(self) -> None:
        """Copy the rest and close the logs (the workers have ended)."""
        self._over.set()
        if self._thread is not None:
            self._thread.join()
        self.copy()
        with self._lock:
            for out in self._out:
                out.close()

    def this_run(self, i: int) -> str:
        """What worker ``i`` wrote in this run (its log may begin with earlier runs')."""
        try:
            with open(self.path(i), "rb") as fh:
                fh.seek(self.start_at[i])
                return fh.read().decode(errors="replace")
        except OSError:
            return ""

    def remove_raw(self) -> None:
        shutil.rmtree(self.raw_dir, ignore_errors=True)
