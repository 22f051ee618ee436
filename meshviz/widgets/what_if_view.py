"""WhatIfView: a what-if report drawn: the mesh coloured by each rank's peak, one rank's bytes, bytes per module."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import Normalize

from ..trace.commtable import TOP
from .base import View
from .draw import MAX_W, ids_text, legend_block, mesh_block
from .sheet import MIN_FONT, Block, Panel, elide, hstack, line_height, text_block, text_width, vstack
from .style import HEAD, LABEL, TICK, TITLE, block_colours

__all__ = ["WhatIfView", "PARTS", "by_module"]

PARTS = ("params", "grads", "optimizer", "activations")
_GB = 1e9
_ROWS = 12  # modules in the communication panel
_COMM = ("collective", "reshard_step", "send", "recv")
_SIDE_W = 2.9
_FACETS = 8  # panels of a mesh beyond two axes drawn (the rest summarized)
_LABEL_W = 3.6


def _gb(n: float) -> str:
    return f"{n / _GB:.2f} GB" if abs(n) >= 1e7 else f"{n / 1e6:.3f} MB" if abs(n) >= 1e3 else f"{int(n)} B"


class WhatIfView(View):
    """``WhatIfView(report)`` (what :func:`meshviz.what_if` returns): the mesh with every rank coloured by its peak
    (the ranks over ``limit`` bytes hatched), rank ``rank``'s params, grads, optimizer state and activations beside
    its peak and the limit, and the bytes a rank receives per issuing module (forward and backward). ``rank``
    defaults to the tightest rank (the highest peak). In a notebook the rank and the limit can be changed."""

    def __init__(self, report, limit: float | None = None, rank: int | None = None, title: str | None = None):
        self.report = report
        self.limit = getattr(report, "limit", None) if limit is None else limit
        self.rank = report.tightest(1)[0] if rank is None else int(rank)
        if self.rank not in report.per_rank:
            raise ValueError(f"WhatIfView: no rank {self.rank} in a report of {report.nranks} ranks")
        self.title = title
        self.grid = report.mesh()
        self._modules = by_module(report.events)
        super().__init__()

    # -- what it shows ---------------------------------------------------------------------------------------
    def over(self) -> list[int]:
        """The ranks over the limit (hatched)."""
        return self.report.over(self.limit) if self.limit is not None else []

    def peaks(self) -> np.ndarray:
        """Each mesh cell's peak bytes (the mesh's shape)."""
        per = self.report.per_rank
        ranks = np.fromiter(per, dtype=np.int64, count=len(per))
        peak = np.fromiter((v["peak"] for v in per.values()), dtype=float, count=len(per))
        order = np.argsort(ranks)
        ranks, peak = np.append(ranks[order], -1), np.append(peak[order], 0.0)  # (-1: where an id is past them all)
        ids = np.asarray(self.grid.ids, dtype=np.int64)
        at = np.searchsorted(ranks[:-1], ids)
        missing = ranks[at] != ids
        if missing.any():
            raise KeyError(int(ids[missing].flat[0]))  # as the report's own lookup of a rank it does not have
        return peak[at]

    def set_rank(self, rank: int) -> None:
        if int(rank) not in self.report.per_rank:
            raise ValueError(f"no rank {rank} in a report of {self.report.nranks} ranks")
        self.rank = int(rank)
        self._refresh()

    def set_limit(self, limit: float | None) -> None:
        self.limit = limit
        self._refresh()

    # -- drawing ---------------------------------------------------------------------------------------------
    def _block(self) -> Block:
        title = self.title or self._heading()
        peaks = self.peaks()
        hi = max(float(peaks.max()), float(self.limit or 0)) or 1.0
        rgb = colormaps["viridis"](Normalize(0, hi)(peaks))[..., :3]
        text = {r: _gb(self.report.per_rank[r]["peak"]) for r in self.grid.process_ids} \
            if self.grid.size <= 16 else None
        mesh = mesh_block(self.grid, rgb, hatched=self.over(), text_extra=text, max_w=MAX_W, max_facets=_FACETS)
        hidden = self._hidden_note(peaks)
        if hidden:
            mesh = vstack([mesh, text_block(hidden, MIN_FONT, width=max(mesh.w, 2.2), color="#a00")], gap=0.04)
        top = hstack([self._breakdown_block(), self._scale_block(hi)], gap=0.4)
        comm = self._comm_block()
        width = max(top.w, mesh.w, comm.w)
        head = text_block(title, HEAD, width=max(min(text_width(title, HEAD), MAX_W), min(width, MAX_W)))
        return vstack([head, top, mesh, comm], gap=0.18)

    def _hidden_note(self, peaks) -> str | None:
        """What the panels left out of a mesh of more than ``_FACETS`` panels hold that the picture is about: the
        ranks over the limit (none hatched where all are left out) and the rank whose bytes are shown."""
        ids = self.grid.ids
        if ids.ndim <= 2 or int(np.prod(ids.shape[:-2])) <= _FACETS:
            return None
        per = int(ids.shape[-2] * ids.shape[-1])
        left_out = ids.reshape(-1, per)[_FACETS:]
        out_peaks = peaks.reshape(-1, per)[_FACETS:]
        said = []
        if self.limit is not None:
            over = np.sort(left_out[out_peaks > self.limit])
            if len(over):
                listed = ids_text(over) if len(over) <= 8 else ids_text(over).split(" (")[0]
                said.append(f"{len(over)} of the {int((peaks > self.limit).sum())} ranks over the limit {listed}")
        if bool((left_out == self.rank).any()):
            said.append(f"rank {self.rank}, whose bytes are shown above")
        if not said:
            return None
        return f"in the {len(left_out)} panels not drawn (peaks up to {_gb(float(out_peaks.max()))}): " + \
            "; ".join(said)

    def _heading(self) -> str:
        r = self.report
        over = f", {len(self.over())} over {self.limit / _GB:g} GB" if self.limit is not None else ""
        return f"what if: {r.nranks} rank{'s' * (r.nranks != 1)} ({len(r.simulated)} simulated){over}"

    def _scale_block(self, hi: float) -> Block:
        """The colours of the mesh: peak bytes from 0 to ``hi``."""
        w, strip = _SIDE_W, 0.14
        caption = "colour: a rank's peak" + (" (hatched: over the limit)" if self.over() else "")
        lh = line_height(TICK)

        def paint(sheet, x, y):
            sheet.text(x, y, caption, LABEL)
            y0 = y + line_height(LABEL) + 0.04
            Panel(sheet, x, y0, w, strip).image(colormaps["viridis"](np.linspace(0, 1, 256))[None, :, :3])
            sheet.rect(x, y0, w, strip, fill=False, edgecolor="black", linewidth=0.6)
            sheet.text(x, y0 + strip + 0.03, "0", TICK)
            sheet.text(x + w, y0 + strip + 0.03, _gb(hi), TICK, ha="right")

        return Block(w, line_height(LABEL) + 0.04 + strip + 0.03 + lh, paint)

    def _breakdown_block(self) -> Block:
        row = self.report.per_rank[self.rank]
        like = self.report.like.get(self.rank, self.rank)
        head = f"rank {self.rank}" + (f" (its run: rank {like}'s)" if like != self.rank else "") \
            + f": receives {_gb(row['comm_bytes'])}"
        colours = block_colours(len(PARTS))
        legend = legend_block([(f"{p} {_gb(row[p])}", {"facecolor": c, "edgecolor": "white"})
                               for p, c in zip(PARTS, colours)], LABEL, max_w=_SIDE_W)
        total = sum(row[p] for p in PARTS)
        top = max(total, row["peak"], self.limit or 0) * 1.08 or 1.0
        w, bar_h, lh = _SIDE_W, 0.22, line_height(TICK)
        title = text_block(head, TITLE, width=w)

        def at(v):
            return w * v / top

        def mark(sheet, x, y, v, label, colour, below, dashes=None):
            xv = x + at(v)
            sheet.line(xv, y - 0.04, xv, y + bar_h + 0.04, color=colour, linewidth=1.2, linestyle=dashes or "-")
            ha = "right" if at(v) > w / 2 else "left"
            dx = -0.03 if ha == "right" else 0.03
            yy = y + bar_h + 0.05 if below else y - 0.05 - lh
            sheet.text(xv + dx, yy, label, TICK, ha=ha, color=colour)

        def paint(sheet, x, y):
            title.paint(sheet, x, y)
            yb = y + title.h + 0.08 + lh
            left = 0.0
            for p, c in zip(PARTS, colours):
                if row[p] > 0:
                    sheet.rect(x + at(left), yb, at(row[p]), bar_h, facecolor=c, edgecolor="white", linewidth=0.5)
                left += row[p]
            sheet.rect(x, yb, w, bar_h, fill=False, edgecolor="grey", linewidth=0.5)
            mark(sheet, x, yb, row["peak"], f"peak {_gb(row['peak'])}", "black", below=False)
            if self.limit is not None:
                mark(sheet, x, yb, self.limit, f"limit {self.limit / _GB:g} GB", "#b00", below=True, dashes="--")
            legend.paint(sheet, x, yb + bar_h + 0.1 + lh + 0.06)

        h = title.h + 0.08 + lh + bar_h + 0.1 + lh + 0.06 + legend.h
        return Block(w, h, paint)

    def _comm_block(self) -> Block:
        rows = self._modules[:_ROWS]
        more = len(self._modules) - len(rows)
        title = "communication per module: the bytes a rank receives" \
            + (f" (the {_ROWS} largest of {len(self._modules)})" if more else "")
        if not rows:
            return vstack([text_block(title, TITLE), text_block("no communication", LABEL)], gap=0.08)
        labels = [elide(f"{m} ({p})", TICK, _LABEL_W) for m, p, _ in rows]
        notes = [_gb(b) for _, _, b in rows]
        row_h = max(0.2, line_height(TICK) + 0.05)
        left = max(text_width(s, TICK) for s in labels) + 0.1
        bar_w = 3.0
        right = max(text_width(s, TICK) for s in notes) + 0.1
        top = max(b for _, _, b in rows) or 1
        colour = {"forward": block_colours(2)[0], "backward": block_colours(2)[1]}
        legend = legend_block([(p, {"facecolor": colour[p], "edgecolor": "grey"}) for p in ("forward", "backward")],
                              LABEL, max_w=left + bar_w + right)

        def paint(sheet, x, y):
            for i, ((_, p, b), label, note) in enumerate(zip(rows, labels, notes)):
                yy = y + i * row_h
                sheet.text(x + left - 0.08, yy + row_h / 2, label, TICK, ha="right", va="center")
                bw = bar_w * b / top
                sheet.rect(x + left, yy + 0.03, bw, row_h - 0.06, facecolor=colour[p], edgecolor="grey",
                           linewidth=0.5)
                sheet.text(x + left + bw + 0.06, yy + row_h / 2, note, TICK, va="center")
            legend.paint(sheet, x + left, y + len(rows) * row_h + 0.06)

        body = Block(left + bar_w + right, len(rows) * row_h + 0.06 + legend.h, paint)
        return vstack([text_block(title, TITLE, width=max(body.w, min(text_width(title, TITLE), MAX_W))), body],
                      gap=0.08)

    # -- widget ----------------------------------------------------------------------------------------------
    def _controls(self):
        import ipywidgets as w

        rank = w.BoundedIntText(value=self.rank, min=0, max=self.report.nranks - 1, description="rank",
                                layout=w.Layout(width="160px"))
        limit = w.FloatText(value=(self.limit or 0) / _GB, description="limit GB", layout=w.Layout(width="180px"))
        rank.observe(lambda ch: self.set_rank(ch["new"]), names="value")
        limit.observe(lambda ch: self.set_limit(ch["new"] * _GB if ch["new"] else None), names="value")
        return [w.HBox([rank, limit])]

    def __repr__(self) -> str:
        row = self.report.per_rank[self.rank]
        over = f", {len(self.over())} over {self.limit / _GB:g} GB" if self.limit is not None else ""
        return f"<WhatIfView {self.report.nranks} ranks, rank {self.rank}: peak {_gb(row['peak'])}{over}>"


def by_module(events) -> list[tuple[str, str, int]]:
    """(module, pass, bytes) from communication events: what one rank receives in each module's forward and
    backward (the most of any rank), largest first."""
    per: dict = defaultdict(int)
    for e in events:
        if e.kind in _COMM:
            p = e.payload
            module = getattr(p, "module", None) or TOP
            per[(e.rank, module, "backward" if getattr(p, "backward", False) else "forward")] += int(e.bytes or 0)
    most: dict = defaultdict(int)
    for (_, module, phase), b in per.items():
        most[(module, phase)] = max(most[(module, phase)], b)
    return sorted(((m, p, b) for (m, p), b in most.items()), key=lambda x: (-x[2], x[0], x[1]))
