"""The one place that turns the ranks' outcomes into a RankError, and chooses the rank that caused it."""

from __future__ import annotations

import os
import pickle
import signal
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING

from ..errors import RankError, RankOutcome

if TYPE_CHECKING:
    from ..trace.status import RollCall

__all__ = ["rank_error", "error_of", "exit_text", "read_report"]


def rank_error(outcomes: Iterable[RankOutcome], seen: Sequence[int | Sequence[int]] = (), *,
               inside: Collection[int] = (), rollcall: RollCall | None = None,
               mismatch: tuple[Sequence[int], str] | None = None, note: str = "") -> RankError:
    """The RankError for ``outcomes`` (every rank's, any order), with the ranks that caused it.

    Evidence, as each runner has it: ``seen``, the failures in the order they were seen, each a rank or a tuple
    of ranks seen failing together; ``inside``, the ranks whose failure came out of a collective; ``rollcall``,
    the roll-call of the hang (its ``blame()`` is the diagnosis); ``mismatch``, (ranks, line) when ranks sat in
    different collectives at one sequence number; ``RankOutcome.arrived``, who reached the rendezvous.

    Named as the cause, the first that applies: the ranks of a mismatch; the ranks that never arrived at the
    rendezvous while every rank seen failing did (those waited for them until the timeout); the roll-call's
    culprits (the members that never entered the collective) when the first failure came out of a collective
    (or nothing was seen failing), unless a rank died first; the first failure seen (a rank that died without
    a report is put before one that raised in the same instant by the runner that tells them apart); else the
    first rank that did not end well.
    """
    outcomes = sorted(outcomes, key=lambda o: o.rank)
    if mismatch is not None:
        ranks, line = mismatch
        return RankError(outcomes, sorted(set(ranks)), note, [line], True, rollcall)
    by = {o.rank: o for o in outcomes}
    moments = [tuple(m) if isinstance(m, (tuple, list)) else (m,) for m in seen]
    origin: list[int] = []
    diagnosis: list[str] = []
    lead = False
    if any(o.arrived for o in outcomes) and all(by[r].arrived for m in moments for r in m if r in by):
        # a rank that joined cannot get past the rendezvous without the others: it failed waiting for them
        origin = [o.rank for o in outcomes if o.arrived is False]
    if not origin and rollcall is not None:
        diagnosis = rollcall.blame()
        culprits = rollcall.culprits()
        head = moments[0] if moments else ()
        died_first = any(by[r].status == "died" for r in head if r in by)
        if culprits and not died_first and (not head or head[0] in inside):
            origin, lead = list(culprits), True
    if not origin and moments:
        origin = list(moments[0])
    if not origin:  # nothing was seen failing on its own: name whatever did not end well
        origin = [o.rank for o in outcomes if o.status != "ok"][:1]
    return RankError(outcomes, origin, note, diagnosis, lead, rollcall)


def error_of(outcomes: Iterable[RankOutcome], *args, **evidence) -> RankError | None:
    """None when every rank ended well, else :func:`rank_error` of the same arguments."""
    outcomes = list(outcomes)
    if all(o.status == "ok" for o in outcomes):
        return None
    return rank_error(outcomes, *args, **evidence)


def exit_text(code: int | None) -> str:
    """How a process ended, from its exit code: ``"exit code 1"``, ``"killed by SIGKILL"``, ``"still running"``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def read_report(path: str) -> tuple[str, str, float] | None:
    """(summary, traceback, when written) from torch's error file of a rank that raised; None if it wrote none."""
    try:
        with open(path, "rb") as fh:
            text = str(pickle.load(fh))
        return _summary_of(text), text, os.path.getmtime(path)
    except Exception:
        return None


def _summary_of(tb: str) -> str:
    """The exception line of a formatted traceback: "ValueError: failing on purpose"."""
    lines = [ln for ln in tb.rstrip().splitlines() if ln.strip()]
    i = len(lines)
    while i > 0 and not lines[i - 1].startswith((" ", "\t", "Traceback")):
        i -= 1
    head = lines[i] if i < len(lines) else (lines[-1] if lines else "unknown error")
    return head if len(head) <= 500 else head[:497] + "..."
