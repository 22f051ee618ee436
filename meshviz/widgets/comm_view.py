"""CommView: where the bytes go, as bars per issuing module, collective and mesh axis (a comm table drawn)."""

from __future__ import annotations

from matplotlib.ticker import FuncFormatter, MaxNLocator

from ..trace.commtable import CommTable, comm_table
from .base import View, as_events
from .draw import MAX_W
from .sheet import Block, line_height, text_block, text_width, vstack
from .style import LABEL, TICK, TITLE, block_colours, fmt_bytes

__all__ = ["CommView", "MAX_ROWS"]

MAX_ROWS = 24  # bars drawn; the rest are counted under them


class CommView(View):
    """``CommView(cluster.comm_table())`` (or events, or a JSONL path): one bar per row, its length the bytes a rank
    moved, coloured by collective, labelled with the module (forward or backward) and the axis; the count and
    the time beside it. ``cell``: only that cell of events (``-1``: the last)."""

    def __init__(self, table, cell=None, title: str | None = None):
        if not isinstance(table, CommTable):
            events, _ = as_events(table)
            table = comm_table(events, cell=cell)
        elif cell is not None:
            table = table.where(cell=cell) if cell != -1 else table
        self.table = table
        self.title = title
        super().__init__()

    def _block(self) -> Block:
        rows = list(self.table)
        title = self.title or f"communication: {fmt_bytes(self.table.total_bytes)} per rank"
        if not rows:
            return vstack([text_block(title, TITLE), text_block("no communication", LABEL)], gap=0.1)
        rest = None
        if len(rows) > MAX_ROWS:  # the largest, largest first: a bar per row of a long run is metres of picture
            top_rows = sorted(rows, key=lambda r: -r.bytes)
            rows, left_out = top_rows[:MAX_ROWS], top_rows[MAX_ROWS:]
            rest = (f"the {MAX_ROWS} largest of {len(self.table)} rows; the other {len(left_out)} move "
                    f"{fmt_bytes(sum(r.bytes for r in left_out))} per rank (the comm table lists every row)")
        labels = [f"{'' if r.cell is None else f'[{r.cell}] '}{r.module}{' (bwd)' if r.backward else ''} · {r.op} · "
                  f"{r.axis}" for r in rows]
        notes = [f"{fmt_bytes(r.bytes)} · {r.count}x · {1000 * r.seconds:.1f} ms" for r in rows]
        row_h = max(0.22, line_height(TICK) + 0.06)
        left = max(text_width(s, TICK) for s in labels) + 0.1
        bar_w = 3.0
        right = max(text_width(s, TICK) for s in notes) + 0.1
        ax_h = row_h * len(rows)
        below = 3.5 / 72 + line_height(TICK) + 2 / 72 + line_height(LABEL) + 0.04
        width = left + bar_w + right
        head = text_block(title, TITLE, width=max(width, min(text_width(title, TITLE), MAX_W)))
        ops = sorted({r.op for r in rows})
        colour = dict(zip(ops, block_colours(len(ops))))

        def paint(sheet, x, y):
            ax = sheet.axes(x + left, y, bar_w, ax_h)
            ys = list(range(len(rows)))
            top = max(r.bytes for r in rows) or 1
            ax.barh(ys, [r.bytes for r in rows], color=[colour[r.op] for r in rows], edgecolor="grey",
                    linewidth=0.5)
            ax.set_yticks(ys, labels, fontsize=TICK)
            ax.set_ylim(len(rows) - 0.5, -0.5)
            ax.set_xlim(0, top * 1.05)
            ax.xaxis.set_major_locator(MaxNLocator(nbins=3, integer=True))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_bytes(v)))
            ax.tick_params(labelsize=TICK, length=2, pad=1.5)
            ax.set_xlabel("bytes per rank", fontsize=LABEL, labelpad=2)
            for i, s in enumerate(notes):
                sheet.text(x + left + bar_w + 0.08, y + (i + 0.5) * row_h, s, TICK, va="center")

        body = Block(width, ax_h + below, paint)
        return vstack([head, body, text_block(rest, LABEL, width=width) if rest else None], gap=0.1)

    def _status_html(self) -> str:
        return self.table._repr_html_() + super()._status_html()

    def __repr__(self) -> str:
        return f"<CommView {len(self.table)} rows, {fmt_bytes(self.table.total_bytes)} per rank>"
