"""CommView: where the bytes go, as bars per issuing module, collective and mesh axis (a comm table drawn)."""

from __future__ import annotations

import html

from ..trace.commtable import CommTable, comm_table
from .base import View, as_events
from .style import block_colours, fmt_bytes

__all__ = ["CommView"]


class CommView(View):
    """``CommView(cluster.comm_table())`` (or events, or a JSONL path): one bar per row, its length the bytes a rank
    moved, coloured by collective, labelled with the module (forward or backward) and the axis; the count and
    the time beside it. ``cell``: only that cell of events (``-1``: the last)."""

    width = 10.0

    def __init__(self, table, cell=None, title: str | None = None):
        if not isinstance(table, CommTable):
            events, _ = as_events(table)
            table = comm_table(events, cell=cell)
        elif cell is not None:
            table = table.where(cell=cell) if cell != -1 else table
        self.table = table
        self.title = title
        super().__init__()

    def _size(self):
        return self.width, 1.0 + 0.32 * max(1, len(self.table))

    def _draw(self, fig) -> None:
        rows = list(self.table)
        h = fig.get_figheight()
        bottom, top = 0.5 / h, 0.35 / h  # room for the x label and the title, in inches
        ax = fig.add_axes([0.42, bottom, 0.4, 1 - bottom - top])
        if not rows:
            ax.set_axis_off()
            ax.text(0.5, 0.5, "no communication", ha="center", va="center")
            return
        ops = sorted({r.op for r in rows})
        colour = dict(zip(ops, block_colours(len(ops))))
        ys = list(range(len(rows)))[::-1]
        ax.barh(ys, [r.bytes for r in rows], color=[colour[r.op] for r in rows], edgecolor="grey", linewidth=0.5)
        labels = []
        for r in rows:
            cell = "" if r.cell is None else f"[{r.cell}] "
            labels.append(f"{cell}{r.module}{' (bwd)' if r.backward else ''} · {r.op} · {r.axis}")
        ax.set_yticks(ys)
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_xlabel("bytes per rank", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        top = max(r.bytes for r in rows) or 1
        for y, r in zip(ys, rows):
            ax.text(r.bytes + 0.02 * top, y, f"{fmt_bytes(r.bytes)} · {r.count}x · {1000 * r.seconds:.1f} ms",
                    va="center", fontsize=7)
        ax.set_xlim(0, top * 1.6)
        ax.set_title(self.title or f"communication: {fmt_bytes(self.table.total_bytes)} per rank", fontsize=9)

    def _status_html(self) -> str:
        return self.table._repr_html_() + f"<code>{html.escape(repr(self))}</code>"

    def __repr__(self) -> str:
        return f"<CommView {len(self.table)} rows, {fmt_bytes(self.table.total_bytes)} per rank>"
