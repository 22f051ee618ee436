"""What ``spawn`` returns: its processes' one job, waited for, and the error naming the rank that failed first."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from ..errors import RankError, RankOutcome

if TYPE_CHECKING:
    from .processes import RankProcesses
    from .returns import Returns

__all__ = ["SpawnContext"]


class SpawnContext:
    """The processes' one job (a :class:`~meshviz.ranks.runner.Job`), and what ``spawn`` returns: ``join()`` waits
    and raises :class:`RankError` when a rank fails; ``processes`` are the children; after ``spawn``,
    ``return_queues[r].get()`` is what rank ``r``'s function returned, as in Paddle."""

    def __init__(self, procs: RankProcesses, read_reports, stop_on_failure: bool = True):
        self._procs = procs
        self.processes = procs.processes
        self.ranks = list(range(procs.n))
        self._read = read_reports
        self._stop_on_failure = stop_on_failure
        self._error: RankError | None = None
        self._results: tuple[dict, dict | None] | None = None
        self._deadline_s: float | None = None  # the wait that ran out, when one did
        self._deadline_rc = None  # the roll-call taken when the ranks still running at it were ended
        self._failure_rc = None  # without stop_on_failure: the roll-call taken when a rank was first seen failing
        self._exits = 0  # how many ranks had exited at the last look for a failure
        self._closed = False
        self.return_queues: list = []
        self.returns: Returns | None = None  # spawn's: closed with the job, the values read first

    def done(self) -> bool:
        return all(p.exitcode is not None for p in self.processes)

    def pending(self) -> list[int]:
        return [r for r, p in enumerate(self.processes) if p.exitcode is None]

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every rank (at most ``timeout`` seconds; with ``stop_on_failure`` the others are ended once
        one fails, and always once one left without joining the process group the others joined); True once all
        have ended, well or not."""
        deadline = None if timeout is None else time.monotonic() + timeout
        procs = self._procs
        try:
            while not self._closed and not procs.done():
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if procs.host is not None or len(procs.running()) < procs.n:
                    # a few times a second: the roll-call, and whether a rank that exited strands the others
                    left = 0.25 if left is None else min(left, 0.25)
                procs.wait(left)
                rc = None if procs.host is None else procs.relabel(procs.host.unending())
                if not self._stop_on_failure:
                    self._look_for_failure()
                if self._stop_on_failure and rc is not None:
                    # a mismatch, or ranks missing that returned: they would wait until the timeout
                    procs.terminate("hang")
                    self._error = procs.rank_error({}, rollcall=rc)
                    break
                if self._stop_on_failure and procs.failed():
                    rc = procs.blame()  # before the others are ended: they still answer the roll-call
                    procs.terminate()
                    self._error = procs.rank_error(self.results()[0], rollcall=rc)
                    break
                gone = procs.stranded()  # with or without stop_on_failure: those that joined cannot go on
                if gone:  # a rank left without joining: the ones that joined would wait for it until the timeout
                    procs.terminate()
                    self._error = procs.rank_error(self.results()[0], stranded=gone)
                    break
                if deadline is not None and time.monotonic() >= deadline and not procs.done():
                    self._deadline_s = timeout
                    return False
        except BaseException:
            procs.terminate()
            self._close()
            raise
        self._close()
        return True

    def _look_for_failure(self) -> None:
        """Without stop_on_failure: once a rank is first seen failing, take the roll-call while the store still
        serves (a peer left waiting in a collective for a rank that returned fails with a lost connection: the
        roll-call says that the rank returned without entering it)."""
        procs = self._procs
        exits = len(procs.processes) - len(self.pending())
        if self._failure_rc is not None or procs.host is None or exits == self._exits:
            return
        self._exits = exits
        if procs.failed() or self._read()[0]:
            self._failure_rc = procs.blame()

    def left(self) -> tuple[dict, set]:
        """(rank -> report for the ranks that raised, the ranks whose function returned), as they left them."""
        reports, values = self._read()
        returned = set(values or ())
        if self.returns is not None:
            returned |= self.returns.returned()
        return reports, returned

    def _close(self) -> None:
        if not self._closed:
            _remove(self._procs.error_files)
            if self.returns is not None:
                self.returns.close()
            self._procs.close()
            self._closed = True

    def results(self) -> tuple[dict, dict | None]:
        """(reports, values) as the ranks left them: rank -> (summary, traceback, when) for the ranks that raised,
        rank -> the value each returned (None when the function returns nothing to this process)."""
        if self._results is None:
            results = self._read()
            if not self.done():
                return results
            self._results = results
        return self._results

    def end_running(self) -> None:
        """End the ranks still running after a wait ran out (their outcome: ``"running"``), the roll-call taken
        first: the error then names a rank that never entered the collective the others wait in."""
        if not self.done():
            self._deadline_rc = self._procs.blame()
        self._procs.terminate("running")

    def outcomes(self) -> list[RankOutcome]:
        if self._error is not None:
            return list(self._error.outcomes)
        reports, values = self.results()
        return self._procs.outcomes(reports, values, self._deadline_s)

    def error(self) -> RankError | None:
        """The RankError once a rank failed: it raised, died, or returned no result (None while running)."""
        if self._error is None and self.done():
            reports, values = self.results()
            bad = reports or (len(values) < len(self.ranks) if values is not None else self._procs.failed())
            bad = bad or bool(self._procs.ended)  # ended by stop() or a deadline: no result
            if bad:
                self._error = self._procs.rank_error(reports, values, self._deadline_s,
                                                     self._deadline_rc or self._failure_rc)
        return self._error

    def join(self, timeout: float | None = None) -> bool:
        """Wait for every rank (at most ``timeout`` seconds); True once all exited cleanly."""
        if not self.wait(timeout):
            return False
        err = self.error()
        if err is not None:
            raise err
        return True


def _remove(paths) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass
