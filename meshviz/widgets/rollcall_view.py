"""RollCallView: the ranks coloured by what the roll-call says each is doing, with one line per situation."""

from __future__ import annotations

import re

import numpy as np

from ..core import ProcessMesh
from ..trace.status import RankStatus, RollCall
from .base import View
from .draw import MAX_CELL_TEXT, MAX_W, legend_block, mesh_block
from .mesh_view import as_mesh
from .sheet import Block, hstack, text_block, text_width, vstack
from .style import LABEL

__all__ = ["RollCallView", "STATE_COLOUR", "short_lists"]

STATE_COLOUR = {
    "idle": np.array([0.80, 0.84, 0.90]),
    "running": np.array([0.55, 0.80, 0.55]),
    "in_collective": np.array([0.98, 0.70, 0.35]),
    "dead": np.array([0.35, 0.35, 0.35]),
    "unknown": np.array([1.0, 1.0, 1.0]),
}
_MISMATCH = np.array([0.90, 0.35, 0.35])
_LIST = 8  # a list of ranks longer than this is drawn as its first few, '…', its last and its length
_IDS = re.compile(r"(\d+(?:, \d+){" + str(_LIST) + r",})(\]?)")


def short_lists(line: str, limit: int = _LIST) -> str:
    """``line`` with each list of more than ``limit`` ranks cut to its first few and last and counted:
    'ranks 0, 1, 2, 3, 4, 5, …, 1022 (1023 ranks) wait … on group [0, 1, 2, 3, 4, 5, …, 1023] (1024 ranks)'."""
    def cut(m) -> str:
        ids = m.group(1).split(", ")
        return f"{', '.join(ids[: limit - 2])}, …, {ids[-1]}{m.group(2)} ({len(ids)} ranks)"

    return _IDS.sub(cut, line)


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
        self._grid = mesh is None
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

    def _block(self) -> Block:
        entries = [(k.replace("_", " "), dict(facecolor=STATE_COLOUR[k], edgecolor="grey"))
                   for k in ("idle", "running", "in_collective", "dead", "unknown")]
        entries += [("mismatch", dict(facecolor=_MISMATCH, edgecolor="grey")),
                    ("to blame", dict(facecolor="white", edgecolor="grey", hatch="xx"))]
        legend = legend_block(entries, LABEL)
        mesh = mesh_block(self.mesh, self.cell_rgb(), hatched=self.rollcall.culprits(), text_extra=self.labels(),
                          title=self.title or "roll-call", max_w=MAX_W - legend.w - 0.3)
        top = hstack([mesh, legend], gap=0.3)
        lines = [short_lists(ln) for ln in self.lines] or ["no rank waits in a collective"]
        if self._grid and self.mesh.ndim == 2 and self.mesh.size > MAX_CELL_TEXT:  # no ids in the cells
            lines.insert(0, f"the cell in row r, column c is rank r × {self.mesh.shape[1]} + c")
        width = max(top.w, min(MAX_W, max(text_width(ln, LABEL, "monospace") for ln in lines)))
        return vstack([top, text_block(lines, LABEL, width=width, family="monospace")], gap=0.15)

    def __repr__(self) -> str:
        counts: dict = {}
        for s in self.rollcall:
            counts[s.state] = counts.get(s.state, 0) + 1
        parts = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in counts.items())
        lines = "".join(f"\n  {short_lists(ln)}" for ln in self.lines)
        return f"<RollCallView {len(self.rollcall)} ranks: {parts}>{lines}"
