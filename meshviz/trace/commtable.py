"""Where the bytes go: communication events counted per cell, issuing module, collective and mesh axis."""

from __future__ import annotations

import html
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..core.planner import fmt_bytes
from .payloads import Issued

__all__ = ["CommRow", "CommTable", "comm_table", "TOP"]

TOP = "(top level)"  # collectives issued outside any nn.Module's forward or backward
_MOVES = {"slice", "zero_fill"}  # reshard steps that move nothing


@dataclass(frozen=True)
class CommRow:
    """One line of the table: ``op`` along ``axis`` (a mesh axis name, or ``"group [0, 1]"``) issued by
    ``module`` (its forward, or its backward when ``backward``) in engine cell ``cell``. ``count``, ``bytes`` and
    ``seconds`` are per rank (the most any of ``ranks`` reached); bytes are what the events report, which is
    what their rank received (:mod:`meshviz.core.traffic`)."""

    cell: int | None
    module: str
    backward: bool
    op: str
    axis: str
    count: int
    bytes: int
    seconds: float
    ranks: tuple

    @property
    def phase(self) -> str:
        return "backward" if self.backward else "forward"


def _axis(e) -> str:
    if e.kind == "reshard_step" and e.axis is not None and e.mesh:
        names = e.mesh.get("dim_names") or []
        name = names[e.axis] if e.axis < len(names) else str(e.axis)
        return f"axis {name}"
    if e.kind in ("send", "recv") or e.op == "send_recv":
        return "p2p" if e.peer is None else f"p2p with {e.peer}"
    if e.group and all(isinstance(r, int) for r in e.group):
        return f"group {list(e.group)}"
    return "?"


def _issuer(e) -> tuple[str, bool]:
    p = e.payload_as(Issued)
    if p.module:
        return p.module, p.backward
    return TOP, False


def comm_table(events, cell=None) -> "CommTable":
    """The communication in ``events`` (a Cluster's log, a list, or events loaded from JSONL), one row per
    (cell, module, forward/backward, op, axis); ``cell``: only that cell (``-1``: the last one seen)."""
    evs = [e for e in events if e.kind in ("collective", "reshard_step", "send", "recv")
           and not (e.kind == "reshard_step" and e.op in _MOVES)]
    if cell == -1:
        cells = [e.cell for e in evs if e.cell is not None]
        cell = max(cells) if cells else None
    if cell is not None:
        evs = [e for e in evs if e.cell == cell]
    acc: dict = defaultdict(lambda: defaultdict(lambda: [0, 0, 0.0]))
    for e in evs:
        module, backward = _issuer(e)
        key = (e.cell, module, backward, e.op or e.kind, _axis(e))
        per = acc[key][e.rank]
        per[0] += 1
        per[1] += int(e.bytes or 0)
        per[2] += max(0.0, (e.end or e.start) - e.start)
    rows = []
    for (c, module, backward, op, axis), by_rank in acc.items():
        rows.append(CommRow(c, module, backward, op, axis, max(v[0] for v in by_rank.values()),
                            max(v[1] for v in by_rank.values()), max(v[2] for v in by_rank.values()),
                            tuple(sorted(by_rank))))
    rows.sort(key=lambda r: (-1 if r.cell is None else r.cell, r.module != TOP, r.module, r.backward, r.op, r.axis))
    return CommTable(rows)



class CommTable(Sequence):
    """Rows of :class:`CommRow`; prints as a text table, shows as HTML in a notebook, ``meshviz.show`` draws it."""

    HEAD = ("cell", "module", "pass", "op", "axis", "count", "bytes/rank", "ms/rank")

    def __init__(self, rows):
        self.rows = tuple(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def __iter__(self) -> Iterator[CommRow]:
        return iter(self.rows)

    def where(self, **match) -> "CommTable":
        """The rows whose fields equal ``match`` (``table.where(op="all_reduce", backward=True)``)."""
        return CommTable(r for r in self.rows if all(getattr(r, k) == v for k, v in match.items()))

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.rows)

    def cells(self) -> list[list[str]]:
        return [["" if r.cell is None else str(r.cell), r.module, r.phase, r.op, r.axis, str(r.count),
                 fmt_bytes(r.bytes), f"{1000 * r.seconds:.1f}"] for r in self.rows]

    def text(self, times: bool = True) -> str:
        """The table as aligned text (``times=False`` leaves the measured milliseconds out)."""
        head = list(self.HEAD if times else self.HEAD[:-1])
        body = [c if times else c[:-1] for c in self.cells()]
        if not body:
            return "no communication"
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        right = {0, 5, 6, 7}
        fmt = lambda row: "  ".join(x.rjust(w) if i in right else x.ljust(w)  # noqa: E731
                                    for i, (x, w) in enumerate(zip(row, widths))).rstrip()
        return "\n".join([fmt(head)] + [fmt(r) for r in body])

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        th = "".join(f"<th>{h}</th>" for h in self.HEAD)
        rows = "".join("<tr>" + "".join(f"<td>{html.escape(x)}</td>" for x in r) + "</tr>" for r in self.cells())
        return f"<table><thead><tr>{th}</tr></thead><tbody>{rows}</tbody></table>"
