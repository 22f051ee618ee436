"""WhatIfView: a what-if report drawn: the mesh coloured by each rank's peak, one rank's bytes, bytes per module."""

from __future__ import annotations

import html
from collections import defaultdict

import numpy as np
from matplotlib import colormaps
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize

from ..trace.commtable import TOP
from .base import View
from .draw import draw_mesh
from .style import block_colours

__all__ = ["WhatIfView", "PARTS", "by_module"]

PARTS = ("params", "grads", "optimizer", "activations")
_GB = 1e9
_ROWS = 12  # modules in the communication panel
_COMM = ("collective", "reshard_step", "send", "recv")


def _gb(n: float) -> str:
    return f"{n / _GB:.2f} GB" if abs(n) >= 1e7 else f"{n / 1e6:.3f} MB" if abs(n) >= 1e3 else f"{int(n)} B"


class WhatIfView(View):
    """``WhatIfView(report)`` (what :func:`meshviz.what_if` returns): the mesh with every rank coloured by its peak
    (the ranks over ``limit`` bytes hatched), rank ``rank``'s params, grads, optimizer state and activations beside
    its peak and the limit, and the bytes a rank receives per issuing module (forward and backward). ``rank``
    defaults to the tightest rank (the highest peak). In a notebook the rank and the limit can be changed."""

    width = 11.0

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
        out = np.zeros(self.grid.shape)
        for c in np.ndindex(*self.grid.shape):
            out[c] = self.report.per_rank[self.grid.rank_at(c)]["peak"]
        return out

    def set_rank(self, rank: int) -> None:
        if int(rank) not in self.report.per_rank:
            raise ValueError(f"no rank {rank} in a report of {self.report.nranks} ranks")
        self.rank = int(rank)
        self._refresh()

    def set_limit(self, limit: float | None) -> None:
        self.limit = limit
        self._refresh()

    # -- drawing ---------------------------------------------------------------------------------------------
    def _size(self):
        return self.width, 4.6 + 0.24 * max(2, min(_ROWS, len(self._modules)))

    def _draw(self, fig) -> None:
        h = fig.get_figheight()
        inch = 1.0 / h  # figure fraction of one inch of height
        comm_h = 0.24 * max(2, min(_ROWS, len(self._modules))) * inch
        top_bottom = 0.55 * inch + comm_h + 0.75 * inch  # the upper panels sit above the communication panel
        spec = fig.add_gridspec(1, 1, left=0.05, right=0.55, top=1 - 0.75 * inch, bottom=top_bottom)[0]
        peaks = self.peaks()
        hi = max(float(peaks.max()), float(self.limit or 0)) or 1.0
        norm = Normalize(0, hi)
        rgb = colormaps["viridis"](norm(peaks))[..., :3]
        text = {r: _gb(self.report.per_rank[r]["peak"]) for r in self.grid.process_ids} \
            if self.grid.size <= 16 else None
        axes = draw_mesh(fig, spec, self.grid, rgb, hatched=self.over(), text_extra=text)
        bar = fig.colorbar(ScalarMappable(norm, "viridis"), ax=axes, fraction=0.04, pad=0.02)
        bar.ax.tick_params(labelsize=7)
        bar.ax.yaxis.set_major_formatter(lambda v, _: f"{v / _GB:g}")
        bar.set_label("peak GB" + (" (hatched: over the limit)" if self.over() else ""), fontsize=7)
        self._breakdown(fig.add_axes((0.64, top_bottom + 0.9 * inch, 0.31, 1 - top_bottom - 2.0 * inch)))
        self._comm(fig.add_axes((0.34, 0.55 * inch, 0.56, comm_h)))
        fig.suptitle(self.title or self._heading(), fontsize=10, y=1 - 0.15 * inch)

    def _heading(self) -> str:
        r = self.report
        over = f", {len(self.over())} over {self.limit / _GB:g} GB" if self.limit is not None else ""
        return f"what if: {r.nranks} ranks ({len(r.simulated)} simulated){over}"

    def _breakdown(self, ax) -> None:
        row = self.report.per_rank[self.rank]
        colours = block_colours(len(PARTS))
        left = 0.0
        for part, c in zip(PARTS, colours):
            ax.barh([0], [row[part]], left=left, color=c, edgecolor="white", label=f"{part} {_gb(row[part])}")
            left += row[part]
        ax.axvline(row["peak"], color="black", linewidth=1.2)
        ax.text(row["peak"], 0.55, f" peak {_gb(row['peak'])}", fontsize=7, va="bottom")
        top = max(left, row["peak"])
        if self.limit is not None:
            ax.axvline(self.limit, color="#b00", linestyle="--", linewidth=1.2)
            ax.text(self.limit, -0.6, f" limit {self.limit / _GB:g} GB", fontsize=7, color="#b00", va="top")
            top = max(top, self.limit)
        ax.set_xlim(0, top * 1.15 or 1)
        ax.set_ylim(-1, 1)
        ax.set_yticks([])
        ax.tick_params(axis="x", labelsize=7)
        ax.xaxis.set_major_formatter(lambda v, _: f"{v / _GB:g}")
        ax.set_xlabel("GB", fontsize=8)
        like = self.report.like.get(self.rank, self.rank)
        ax.set_title(f"rank {self.rank}" + (f" (its run: rank {like}'s)" if like != self.rank else "")
                     + f": receives {_gb(row['comm_bytes'])}", fontsize=8)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0, -0.32), ncol=2, frameon=False)

    def _comm(self, ax) -> None:
        rows = self._modules[:_ROWS]
        if not rows:
            ax.set_axis_off()
            ax.text(0.5, 0.5, "no communication", ha="center", va="center")
            return
        ys = list(range(len(rows)))[::-1]
        colour = {"forward": block_colours(2)[0], "backward": block_colours(2)[1]}
        ax.barh(ys, [b for _, _, b in rows], color=[colour[p] for _, p, _ in rows], edgecolor="grey", linewidth=0.5)
        ax.set_yticks(ys)
        ax.set_yticklabels([f"{m} ({p})" for m, p, _ in rows], fontsize=7)
        top = max(b for _, _, b in rows) or 1
        for y, (_, _, b) in zip(ys, rows):
            ax.text(b + 0.01 * top, y, _gb(b), va="center", fontsize=7)
        ax.set_xlim(0, top * 1.25)
        ax.tick_params(axis="x", labelsize=7)
        ax.xaxis.set_major_formatter(lambda v, _: f"{v / _GB:g}")
        ax.set_xlabel("GB a rank receives", fontsize=8)
        more = len(self._modules) - len(rows)
        ax.set_title("communication per module" + (f" (the {_ROWS} largest of {len(self._modules)})" if more else ""),
                     fontsize=8)

    # -- widget ----------------------------------------------------------------------------------------------
    def _controls(self):
        import ipywidgets as w

        rank = w.BoundedIntText(value=self.rank, min=0, max=self.report.nranks - 1, description="rank",
                                layout=w.Layout(width="160px"))
        limit = w.FloatText(value=(self.limit or 0) / _GB, description="limit GB", layout=w.Layout(width="180px"))
        rank.observe(lambda ch: self.set_rank(ch["new"]), names="value")
        limit.observe(lambda ch: self.set_limit(ch["new"] * _GB if ch["new"] else None), names="value")
        return [w.HBox([rank, limit])]

    def _status_html(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"

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
