"""RankError: which ranks failed, with their tracebacks, and what every other rank ended as."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["RankError", "RankOutcome", "alike", "strip_ansi", "summary"]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def strip_ansi(text: str) -> str:
    """``text`` without terminal colour codes (ipyparallel's remote tracebacks carry them)."""
    return _ANSI.sub("", text)


def summary(e: BaseException, limit: int = 500) -> str:
    """``Type: text`` of an exception, cut to ``limit`` characters; where its ``__str__`` raises, what Python's
    tracebacks show for it."""
    try:
        text = f"{type(e).__name__}: {e}"
    except Exception:
        text = f"{type(e).__name__}: <exception str() failed>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True, eq=False)
class RankOutcome:
    """How one rank's part of a run ended: ``status`` is ``"ok"``, ``"error"`` (it raised), ``"died"`` (its process
    ended without a result), ``"running"`` (no result before the deadline) or ``"stopped"`` (ended by the launcher
    because another rank failed). ``arrived`` is False for a rank that never joined the process group."""

    rank: int
    engine: int | None = None
    status: str = "ok"
    error: str | None = None
    traceback: str | None = None
    value: Any = None
    arrived: bool | None = None

    def __repr__(self) -> str:
        return f"RankOutcome(rank={self.rank}, {self.status}{': ' + self.error if self.error else ''})"


def _where(o: RankOutcome) -> str:
    return f"rank {o.rank}" if o.engine is None else f"rank {o.rank} (engine {o.engine})"


def alike(outcomes, rank: int) -> list[int]:
    """The ranks that raised what ``rank`` raised (the same ``Type: text``), ``rank`` among them; ``[rank]`` when it
    did not raise."""
    by = {o.rank: o for o in outcomes}
    o = by.get(rank)
    if o is None or o.status != "error" or not o.error:
        return [rank]
    return sorted(r for r, p in by.items() if p.status == "error" and p.error == o.error)


def _span(ranks: list[int]) -> str:
    """``"0-3"`` for consecutive ranks, else ``"0, 2, 5"``."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


class RankError(RuntimeError):
    """One or more ranks failed. ``ranks`` are the ranks that caused it (``rank`` the first of them), ``outcomes``
    every rank's :class:`RankOutcome` in rank order. ``diagnosis``: what the roll-call says about a hang, one line
    each ("rank 1 never entered all_reduce #1 on group [0, 1] (idle: its cell finished)", then the ranks that
    waited); ``rollcall``: the roll-call it was read from. ``same``: each rank of ``ranks`` raised the same
    error on its own (a NameError in a cell, on every rank), said once ("every rank (0-2) raised ..."). ``str()``
    is plain text; a notebook shows the tracebacks as the ranks printed them, in colour (IPython's
    ``_render_traceback_``)."""

    def __init__(self, outcomes: list[RankOutcome], ranks: list[int], note: str = "", diagnosis=(),
                 lead: bool = False, rollcall=None, same: bool = False):
        self.outcomes = sorted(outcomes, key=lambda o: o.rank)
        self.ranks = list(ranks)
        self.note = note
        self.diagnosis = list(diagnosis)
        self.lead = lead  # the diagnosis is the headline: the ranks named did not fail on their own
        self.rollcall = rollcall
        by = self._by_rank()
        self.same = same and len(self.ranks) > 1 and all(r in by for r in self.ranks) and len(
            {(by[r].status, by[r].error) for r in self.ranks}) == 1 and by[self.ranks[0]].status == "error"
        self.streamed = False  # tracebacks were already shown as they arrived: render only the summary
        super().__init__(self.headline())

    @property
    def rank(self) -> int | None:
        """The first rank that caused the failure."""
        return self.ranks[0] if self.ranks else None

    def _by_rank(self) -> dict[int, RankOutcome]:
        return {o.rank: o for o in self.outcomes}

    def headline(self) -> str:
        """One line: what the failing ranks did, and how many others stopped because of it."""
        if self.lead and self.diagnosis:
            return strip_ansi("; ".join(self.diagnosis))
        by = self._by_rank()
        parts = []
        if self.same:
            who = f"every rank ({_span(self.ranks)})" if set(self.ranks) == set(by) else f"ranks {_span(self.ranks)}"
            parts.append(f"{who} raised {by[self.ranks[0]].error}")
        for r in [] if self.same else self.ranks:
            o = by.get(r)
            if o is None:
                continue
            if o.arrived is False and o.status != "error":
                how = {"ok": "it returned without joining",
                       "stopped": "the others gave up waiting; it was stopped"}.get(o.status, f"{o.status}: {o.error}")
                parts.append(f"rank {r} never joined the process group ({how})")
            elif o.status == "died":
                parts.append(f"rank {r} died ({o.error})")
            elif o.status == "running":
                parts.append(f"rank {r} was still running ({o.error})")
            elif o.status == "stopped":
                parts.append(f"rank {r} was stopped ({o.error})")
            else:
                parts.append(f"rank {r} raised {o.error}")
        others = [o for o in self.outcomes if o.rank not in self.ranks and o.status != "ok"]
        line = strip_ansi("; ".join(parts) or "ranks failed")
        for what, rs in (("stopped because of it", [o.rank for o in others if o.status != "running"]),
                         ("still running", [o.rank for o in others if o.status == "running"])):
            if rs:
                line += f" (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} {what})"
        return line

    def render_traceback(self, color: bool = False) -> list[str]:
        """The lines a notebook shows: the headline, the roll-call's diagnosis, the failing ranks' tracebacks, one
        line per other rank. ``color``: keep the ranks' terminal colour codes (plain text otherwise)."""
        by = self._by_rank()
        lines = [f"RankError: {self.headline()}"]
        if self.diagnosis and not self.lead:
            lines += [f"  {d}" for d in self.diagnosis]
        if self.note:
            lines.append(self.note)
        tracebacks: dict[str, list[RankOutcome]] = {}  # ranks that raised alike and printed one traceback: it once
        for r in self.ranks:
            o = by.get(r)
            if o is not None and o.traceback and not self.streamed:
                key = strip_ansi(o.traceback).strip() if self.same else str(r)
                tracebacks.setdefault(key, []).append(o)
        for o, *twins in tracebacks.values():
            also = f" (the same on rank{'s' if len(twins) > 1 else ''} {_span([p.rank for p in twins])})" \
                if twins else ""
            lines += ["", f"--- {_where(o)} traceback{also} ---", (o.traceback or "").rstrip()]
        for o in self.outcomes:
            if o.rank in self.ranks or o.status == "ok":
                continue
            lines += ["", f"--- {_where(o)}: {o.status}: {o.error}"]
        return lines if color else [strip_ansi(ln) for ln in lines]

    def _render_traceback_(self) -> list[str]:  # IPython's hook: its front ends render colour codes
        return self.render_traceback(color=True)

    def __str__(self) -> str:
        return "\n".join(self.render_traceback()).removeprefix("RankError: ")

    def __reduce__(self):
        return (_rebuild, (self.outcomes, self.ranks, self.note, self.streamed, self.diagnosis, self.lead, self.same))


def _rebuild(outcomes, ranks, note, streamed, diagnosis=(), lead=False, same=False):
    err = RankError(outcomes, ranks, note, diagnosis, lead, same=same)
    err.streamed = streamed
    return err
