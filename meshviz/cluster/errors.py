"""Errors a Cluster raises in the notebook: which rank failed first, with its traceback, and what the others saw."""

from __future__ import annotations

__all__ = ["RankError", "RankOutcome"]


class RankOutcome:
    """What one rank's part of a parallel execution ended as: ok, error, died or running."""

    __slots__ = ("rank", "engine", "status", "error", "traceback", "value")

    def __init__(self, rank, engine, status, error=None, traceback=None, value=None):
        self.rank, self.engine, self.status = rank, engine, status
        self.error, self.traceback, self.value = error, traceback, value

    def __repr__(self) -> str:
        return f"RankOutcome(rank={self.rank}, {self.status}{': ' + self.error if self.error else ''})"


class RankError(RuntimeError):
    """One or more ranks failed; ``ranks`` are the ranks that caused it, ``outcomes`` has every rank's outcome."""

    def __init__(self, outcomes: list[RankOutcome], origin: list[int], note: str = ""):
        self.outcomes = outcomes
        self.ranks = origin
        self.note = note
        self.streamed = False  # tracebacks were already shown as they arrived: render only the summary
        super().__init__(self._headline())

    def _by_rank(self):
        return {o.rank: o for o in self.outcomes}

    def _headline(self) -> str:
        by = self._by_rank()
        parts = []
        for r in self.ranks:
            o = by.get(r)
            if o is None:
                continue
            if o.status == "died":
                parts.append(f"rank {r} died ({o.error})")
            elif o.status == "running":
                parts.append(f"rank {r} was still running ({o.error})")
            else:
                parts.append(f"rank {r} raised {o.error}")
        others = [o.rank for o in self.outcomes if o.rank not in self.ranks and o.status != "ok"]
        line = "; ".join(parts) or "ranks failed"
        if others:
            line += f" (rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} stopped because of it)"
        return line

    def render_traceback(self) -> list[str]:
        by = self._by_rank()
        lines = [f"RankError: {self._headline()}"]
        if self.note:
            lines.append(self.note)
        for r in self.ranks:
            o = by.get(r)
            if o is not None and o.traceback and not self.streamed:
                lines += ["", f"--- rank {r} (engine {o.engine}) traceback ---", o.traceback.rstrip()]
        for o in self.outcomes:
            if o.rank in self.ranks or o.status == "ok":
                continue
            lines += ["", f"--- rank {o.rank} (engine {o.engine}): {o.status}: {o.error}"]
        return lines

    def _render_traceback_(self) -> list[str]:
        return self.render_traceback()

    def __str__(self) -> str:
        return "\n".join(self.render_traceback())
