"""RollCallView: the ranks coloured by what the roll-call says each is doing, with one line per situation."""

from __future__ import annotations

import textwrap

import numpy as np
from matplotlib.patches import Patch

from ..core import ProcessMesh
from ..trace.status import RankStatus, RollCall
from .base import View
from .draw import draw_mesh
from .mesh_view import as_mesh

__all__ = ["RollCallView", "STATE_COLOUR"]

STATE_COLOUR = {
    "idle": np.array([0.80, 0.84, 0.90]),
    "running": np.array([0.55, 0.80, 0.55]),
    "in_collective": np.array([0.98, 0.70, 0.35]),
    "dead": np.array([0.35, 0.35, 0.35]),
    "unknown": np.array([1.0, 1.0, 1.0]),
}
_MISMATCH = np.array([0.90, 0.35, 0.35])


def _grid(n: int) -> ProcessMesh:
    """Ranks 0..n-1 as a row (up to 8), else as a near-square grid."""
    if n <= 8:
        return ProcessMesh(list(range(n)), dim_names=["rank"])
    cols = next(c for c in range(int(np.ceil(np.sqrt(n))), n + 1) if n % c == 0)
    return ProcessMesh(np.arange(n).reshape(n // cols, cols).tolist(), dim_names=["row", "col"])


def _as_rollcall(obj) -> RollCall:
    if isinstance(obj, RollCall):
        return obj
    statuses = [s if isinstance(s, RankStatus) else RankStatus.from_dict(s) for s in obj]
    return RollCall(statuses)


class RollCallView(View):
    """``RollCallView(cluster.status())``: each rank's cell coloured by its state (idle, running, inside a
    collective, dead, no answer), labelled with the collective and how long it has waited; ranks to blame are
    hatched, ranks of a mismatch red; below, one line per situation. ``mesh``: draw on that mesh instead of the
    ranks in a row."""

    def __init__(self, rollcall, mesh=None, title: str | None = None):
        self.rollcall = _as_rollcall(rollcall)
        ranks = [s.rank for s in self.rollcall]
        self.mesh = as_mesh(mesh) if mesh is not None else _grid(max(ranks, default=-1) + 1)
        self.title = title or self.rollcall.title
        super().__init__()

    @property
    def lines(self) -> list[str]:
        return self.rollcall.lines()

    def cell_rgb(self) -> np.ndarray:
        by = self.rollcall.by_rank()
        mism = {r for x in self.rollcall.mismatches() for r in x.mismatch}
        rgb = np.ones(tuple(self.mesh.shape) + (3,))
        for c in np.ndindex(*self.mesh.shape):
            r = self.mesh.rank_at(c)
            s = by.get(r)
            rgb[c] = _MISMATCH if r in mism else STATE_COLOUR[s.state if s is not None else "unknown"]
        return rgb

    def labels(self) -> dict[int, str]:
        out = {}
        for s in self.rollcall:
            if s.state == "in_collective":
                text = s.op if s.seq is None else f"{s.op} #{s.seq}"
                if s.waiting_s is not None:
                    text += f"\n{s.waiting_s:.1f} s"
            else:
                text = s.state
            out[s.rank] = text
        return out

    def _wrapped(self) -> list[str]:
        return [w for ln in self.lines for w in textwrap.wrap(ln, 110, subsequent_indent="    ")] or [
            "no rank waits in a collective"]

    _LINE = 0.16  # inches per line of text below the ranks

    def _size(self):
        rows = 1 if self.mesh.ndim == 1 else self.mesh.shape[0]
        return 9.0, 1.5 + 0.6 * rows + self._LINE * len(self._wrapped())

    def _draw(self, fig) -> None:
        wrapped = self._wrapped()
        h = fig.get_figheight()
        text_h = (self._LINE * len(wrapped) + 0.15) / h
        spec = fig.add_gridspec(1, 1, left=0.08, right=0.75, top=1 - 0.35 / h, bottom=text_h + 0.45 / h)[0]
        culprits = self.rollcall.culprits()
        draw_mesh(fig, spec, self.mesh, self.cell_rgb(), hatched=culprits, text_extra=self.labels(),
                  title=self.title or "roll-call")
        handles = [Patch(facecolor=STATE_COLOUR[k], edgecolor="grey", label=k.replace("_", " "))
                   for k in ("idle", "running", "in_collective", "dead", "unknown")]
        handles.append(Patch(facecolor=_MISMATCH, edgecolor="grey", label="mismatch"))
        handles.append(Patch(facecolor="white", edgecolor="grey", hatch="xx", label="to blame"))
        fig.legend(handles=handles, loc="upper right", fontsize=7, frameon=False, bbox_to_anchor=(0.99, 0.9))
        y = text_h
        for ln in wrapped:
            fig.text(0.02, y, ln, fontsize=7.5, family="monospace", va="top")
            y -= self._LINE / h

    def __repr__(self) -> str:
        counts: dict = {}
        for s in self.rollcall:
            counts[s.state] = counts.get(s.state, 0) + 1
        parts = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in counts.items())
        lines = "".join(f"\n  {ln}" for ln in self.lines)
        return f"<RollCallView {len(self.rollcall)} ranks: {parts}>{lines}"
