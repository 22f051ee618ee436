"""TensorView: a global tensor's index space cut into blocks, coloured like the mesh cells that hold them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core import Partial, ProcessMesh, layout, parse_placement
from ..core.layout import dense_to_local
from ..core.placements import placements_str
from ..core.planner import assemble
from .base import View, plan_ops, target_mesh
from .draw import MAX_W, mesh_block, tensor_block
from .mesh_view import as_mesh
from .sheet import Block, hstack, spacer, text_block, text_size, text_width, vstack
from .style import GREY, HEAD, TITLE, block_colours

__all__ = ["TensorView", "TensorState", "tensor_state", "tensor_state_block"]

MAX_SUMMAND_PANELS = 4
MAX_VALUE_NUMEL = 4096  # values are simulated per rank only for tensors this small
_OP_SYMBOL = {"sum": "+", "avg": "avg", "max": "max", "min": "min", "prod": "×"}


@dataclass
class TensorState:
    """What a tensor picture draws: blocks, who holds them, Partial summands and (small tensors) values."""

    shape: tuple
    mesh: ProcessMesh
    placements: tuple
    order: list  # distinct blocks; block i has colour i
    blocks: dict  # block -> ranks holding it (mesh order); equals Layout.owners()
    summands: list  # per Partial summand: block -> ranks (one entry when nothing is Partial)
    summand_ranks: list  # per summand: the ranks that hold it
    fills: dict  # rank -> 'value' | 'zero' | 'one'
    locals: dict | None = None  # rank -> numpy local value
    reduce: str | None = None  # 'sum', 'max', ... or 'mixed'
    empty: list = field(default_factory=list)  # ranks holding an empty block

    @property
    def colours(self) -> np.ndarray:
        return block_colours(len(self.order))

    @property
    def is_partial(self) -> bool:
        return self.reduce is not None

    def rank_block(self) -> dict:
        return {r: b for b, rs in self.blocks.items() for r in rs}

    def cell_rgb(self, world: ProcessMesh | None = None) -> np.ndarray:
        """Mesh-shaped colours: each cell the colour of its block (pale for identity summands)."""
        mesh = world or self.mesh
        cols = self.colours
        idx = {b: i for i, b in enumerate(self.order)}
        of = self.rank_block()
        rgb = np.broadcast_to(GREY, tuple(mesh.shape) + (3,)).copy()
        for c in np.ndindex(*mesh.shape):
            r = mesh.rank_at(c)
            if r in of:
                col = cols[idx[of[r]]]
                rgb[c] = col if self.fills.get(r, "value") == "value" else col * 0.3 + 0.7
        return rgb

    def dense(self, ranks=None) -> np.ndarray | None:
        """The global picture built from the values of ``ranks`` (default: the first holder of each block)."""
        if self.locals is None:
            return None
        out = np.full(self.shape, np.nan)
        for blk, holders in self.blocks.items():
            pick = [r for r in holders if ranks is None or r in ranks]
            if not pick or pick[0] not in self.locals:
                continue
            v = self.locals[pick[0]]
            sl = tuple(slice(a, b) for a, b in blk)
            if v is not None and np.size(v) == np.prod([b - a for a, b in blk]):
                out[sl] = np.asarray(v, dtype=float).reshape(out[sl].shape)
        return out

    def value(self) -> np.ndarray | None:
        """The global value (Partial summands reduced), when every rank's local value is known."""
        if self.locals is None or any(r not in self.locals for r in self.mesh.process_ids):
            return None
        try:
            return np.asarray(assemble(self.locals, self.shape, self.mesh, self.placements), dtype=float)
        except Exception:
            return None


def tensor_state(shape, mesh, placements, value=None, locals=None) -> TensorState:
    """Compute what to draw for ``shape`` laid out on ``mesh`` with ``placements`` (from the core's layout)."""
    mesh = as_mesh(mesh)
    placements = [parse_placement(p) for p in placements]
    lay = layout(shape, mesh, placements)
    paxes = [i for i, p in enumerate(lay.placements) if isinstance(p, Partial)]
    psizes = [mesh.shape[i] for i in paxes]
    k = int(np.prod(psizes)) if paxes else 1
    summands = [dict() for _ in range(k)]
    summand_ranks = [[] for _ in range(k)]
    fills = {}
    empty = []
    owners: dict = {}
    fill_at: dict = {}  # a rank's fill depends only on its coordinate along the Partial axes
    # every coordinate's block at once, in mesh order (one block at a time took seconds at 65,536 ranks)
    for c, r, blk in zip(np.ndindex(*mesh.shape), mesh.ids.ravel().tolist(), lay.block_list()):
        owners.setdefault(blk, []).append(r)
        at = tuple(c[i] for i in paxes)
        j = int(np.ravel_multi_index(at, psizes)) if paxes else 0
        summands[j].setdefault(blk, []).append(r)
        summand_ranks[j].append(r)
        if at not in fill_at:
            fill_at[at] = lay.fill(c)
        fills[r] = fill_at[at]
        if any(a >= b for a, b in blk):
            empty.append(r)
    order = sorted(owners)
    reduce = None
    if paxes:
        kinds = {lay.placements[i].reduce_type.short for i in paxes}
        reduce = kinds.pop() if len(kinds) == 1 else "mixed"
    if locals is None and value is not None:
        value = np.asarray(value)
        if tuple(value.shape) != tuple(lay.shape):
            raise ValueError(f"value of shape {list(value.shape)} for a tensor of shape {list(lay.shape)}")
        if value.size <= MAX_VALUE_NUMEL and mesh.size <= 1024:
            locals = {mesh.rank_at(c): dense_to_local(value, mesh, lay.placements, c)
                      for c in np.ndindex(*mesh.shape)}
    return TensorState(lay.shape, mesh, lay.placements, order, {b: tuple(r) for b, r in owners.items()},
                       [{b: tuple(r) for b, r in s.items()} for s in summands], summand_ranks, fills, locals,
                       reduce, empty)


def _rank_list(ranks, limit=6) -> str:
    ranks = list(ranks)
    s = ",".join(map(str, ranks[:limit]))
    return s + (",…" if len(ranks) > limit else "")


def _slot(text: str, size: float, bold: bool = True) -> Block:
    """An operator between panels ('+', '=', '+ … 3 more'), centred on their axes."""
    w, h = text_size(text, size, weight="bold" if bold else "normal")

    def paint(sheet, x, y):
        sheet.text(x + 0.06 + w / 2, y + h / 2, text, size, ha="center", va="center",
                   fontweight="bold" if bold else "normal")

    return Block(w + 0.12, h, paint, mid=h / 2)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _reduction(st: TensorState) -> str:
    """'the sum of 4 summands'; mixed reductions nest, mesh axis 0 outermost: 'the sum over pp of the max over dp
    of 4 summands'."""
    n = _count(len(st.summands), "summand")
    if st.reduce != "mixed":
        return f"the {st.reduce} of {n}"
    over = [f"the {p.reduce_type.short} over {st.mesh.dim_names[i]}" for i, p in enumerate(st.placements)
            if isinstance(p, Partial)]
    return " of ".join(over) + f" of {n}"


def _empty_note(st: TensorState) -> str | None:
    if not st.empty:
        return None
    n, ids = len(st.empty), [str(r) for r in st.empty]
    if n == 1:
        return f"empty block on rank {ids[0]}"
    listed = ", ".join(ids) if n <= 8 else ", ".join(ids[:6]) + f", …, {ids[-1]}"  # spaces: it wraps between ids
    return f"empty blocks on {n} ranks: {listed}"


def tensor_state_block(st: TensorState, *, world=None, groups_axis=None, mesh_title=None, text_extra=None,
                       max_w: float = 10.0, mesh_w: float | None = None) -> Block:
    """[mesh | blocks], or for a Partial [mesh | summand + summand ... = value], side by side within ``max_w``
    inches (as many summands as fit, the rest counted); ``mesh_w``: the width to give the mesh (rows line up)."""
    cols = st.colours
    hatched = st.empty
    extra = {r: "zeros" if f == "zero" else "ones" for r, f in st.fills.items() if f != "value"} \
        if st.mesh.size <= 64 else {}
    for r, t in (text_extra or {}).items():
        extra[r] = (extra[r] + " " + t) if r in extra else t
    mesh = mesh_block(world or st.mesh, st.cell_rgb(world), hatched=hatched, groups_axis=groups_axis,
                      title=mesh_title, text_extra=extra or None, max_w=min(4.2, max_w / 2))
    if mesh_w is not None and mesh_w > mesh.w:
        mesh = Block(mesh_w, mesh.h, mesh.paint, mesh.mid)
    gap = 0.3
    budget = max_w - mesh.w - gap
    labels = [_rank_list(st.blocks[b]) for b in st.order]
    if not st.is_partial:
        panel = tensor_block(st.shape, st.order, cols, values=st.dense(), labels=labels, note=_empty_note(st),
                             max_w=max(1.2, min(3.4, budget)), max_h=2.8)
        row = hstack([mesh, panel], gap=gap, align="mid")
        row.mesh_w = mesh.w  # type: ignore[attr-defined]
        return row
    k = len(st.summands)
    sym = _OP_SYMBOL.get(st.reduce or "", "⊕")
    sym_size = 12.0 if len(sym) == 1 else TITLE
    op = _slot(sym, sym_size)
    eq = _slot("=", 12.0)
    shown = min(k, MAX_SUMMAND_PANELS)
    while True:
        fixed = (shown - 1) * op.w + eq.w + (_more(sym, k, shown).w if k > shown else 0.0)
        pw = (budget - fixed) / (shown + 1)
        if pw >= 1.3 or shown <= 2:
            break
        shown -= 1
    pw = max(1.2, min(2.6, pw))
    title_w = 2.0
    row = _partial_row(st, mesh, gap, op, eq, sym, shown, pw, title_w)
    # the estimate above leaves out the panels' margins and titles: while the row is too wide, titles wrap to the
    # panels, then fewer summands are drawn, then the panels narrow
    while row.w > max_w + 1e-6:
        if title_w > pw:
            title_w = pw
        elif shown > 1:
            shown -= 1
        elif pw > 0.6:
            pw = title_w = max(0.6, pw - 0.2)
        else:
            break
        row = _partial_row(st, mesh, gap, op, eq, sym, shown, pw, title_w)
    return row


def _more(sym: str, k: int, shown: int) -> Block:
    return _slot(f"{sym} … {k - shown} more", TITLE)


def _partial_row(st: TensorState, mesh: Block, gap: float, op: Block, eq: Block, sym: str, shown: int, pw: float,
                 title_w: float) -> Block:
    """[mesh | summand 0 op summand 1 … = value], ``shown`` summands in panels of ``pw`` inches."""
    cols = st.colours
    k = len(st.summands)
    parts: list = [mesh, spacer(gap - 0.12)]
    for j in range(shown):
        holders = st.summand_ranks[j]
        faded = [i for i, b in enumerate(st.order)
                 if all(st.fills.get(r) != "value" for r in st.summands[j].get(b, ()))]
        slabels = [_rank_list(st.summands[j].get(b, ())) for b in st.order]
        parts.append(tensor_block(st.shape, st.order, cols, values=st.dense(set(holders)), labels=slabels,
                                  faded=faded, title=f"summand {j}: ranks {_rank_list(holders, 4)}", max_w=pw,
                                  max_h=2.6, title_w=title_w))
        if j < shown - 1:
            parts.append(op)
    if k > shown:
        parts.append(_more(sym, k, shown))
    parts.append(eq)
    title = f"{st.reduce} of the summands" if len(sym) > 1 else "reduced value"
    parts.append(tensor_block(st.shape, st.order, cols, values=st.value(), title=title, note=_empty_note(st),
                              max_w=pw, max_h=2.6, title_w=title_w))
    row = hstack(parts, gap=0.0, align="mid")
    row.mesh_w = mesh.w  # type: ignore[attr-defined]
    return row


class TensorView(View):
    """A tensor's blocks: ``TensorView(shape, mesh, placements, value=None)``, ``TensorView(dist_tensor)``, or
    ``TensorView(source=events)`` (follows the latest ``placed``/``reshard`` tensor, with the ranks' values).
    """

    def __init__(self, shape=None, mesh=None, placements=None, value=None, name: str | None = None, world=None,
                 source=None, tensor_id=None, interval=0.15):
        if shape is not None and hasattr(shape, "process_mesh") and hasattr(shape, "placements"):
            t = shape
            shape, mesh, placements = tuple(t.shape), t.process_mesh, list(t.placements)
            name = name or getattr(t, "name", None)
        self.name = name
        self.tensor_id = tensor_id
        self.world = as_mesh(world) if world is not None else None
        self.state: TensorState | None = None
        if shape is not None:
            if mesh is None or placements is None:
                raise ValueError("TensorView needs shape, mesh and placements (or a dist tensor, or source=)")
            self.state = tensor_state(shape, mesh, placements, value=value)
        self._rank_values: dict = {}
        super().__init__(source=source, interval=interval)

    # the data the picture is computed from
    @property
    def blocks(self) -> dict:
        return {} if self.state is None else dict(self.state.blocks)

    @property
    def summands(self) -> list:
        return [] if self.state is None else list(self.state.summands)

    def _ingest(self, events) -> None:
        super()._ingest(events)
        for e in events:
            if self.tensor_id is not None and e.tensor_id != self.tensor_id:
                continue
            if self.name is not None and e.name is not None and e.name != self.name and self.tensor_id is None:
                continue
            if e.kind == "placed" and e.mesh and e.placements_after is not None:
                self._set_layout(e.shape_after, e.mesh, e.placements_after, e.tensor_id)
                self._take_values(e)
            elif e.kind == "reshard" and e.mesh:
                tgt = target_mesh(e) or e.mesh
                self._set_layout(e.shape_after or e.shape_before, tgt, e.placements_after, e.tensor_id)
                self._pending_steps = len(plan_ops(e) or [])
            elif e.kind == "reshard_step" and self.state is not None and e.step is not None:
                if e.step == getattr(self, "_pending_steps", 0) - 1:
                    self._take_values(e)

    def _set_layout(self, shape, mesh, placements, tid):
        st = tensor_state(shape, ProcessMesh.from_dict(mesh) if isinstance(mesh, dict) else mesh, placements)
        if self.state is None or (st.shape, st.mesh, st.placements) != (self.state.shape, self.state.mesh,
                                                                        self.state.placements):
            self._rank_values = {}
        self.state = st
        self._tid = tid

    def _take_values(self, e):
        if e.values is None or e.local_shape is None or e.rank not in self.state.mesh.process_ids:
            return
        n = int(np.prod(e.local_shape)) if e.local_shape else 1
        if len(e.values) == n:
            self._rank_values[e.rank] = np.asarray(e.values, dtype=float).reshape(e.local_shape)
            self.state.locals = dict(self._rank_values)

    def _block(self) -> Block:
        if self.state is None:
            return text_block("waiting for a placed tensor…", TITLE)
        st = self.state
        head = f"{self.name + ' ' if self.name else ''}{list(st.shape)} {placements_str(st.placements)}"
        if st.is_partial:
            head += f"  — Partial: the tensor is {_reduction(st)}"
        row = tensor_state_block(st, world=self.world, mesh_title="mesh (cell colour = block)")
        return vstack([text_block(head, HEAD, width=max(row.w, min(text_width(head, HEAD), MAX_W))), row], gap=0.12)

    def __repr__(self) -> str:
        if self.state is None:
            return "<TensorView (waiting for a placed tensor)>"
        st = self.state
        extra = f", {_count(len(st.summands), 'summand')}" if st.is_partial else ""
        return (f"<TensorView {list(st.shape)} {placements_str(st.placements)} on mesh {st.mesh.shape}: "
                f"{len(st.order)} block{'s' if len(st.order) != 1 else ''}{extra}>")
