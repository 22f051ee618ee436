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
from .tensor_draw import MAX_LABELLED

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
    index: np.ndarray | None = field(default=None, repr=False)  # each coordinate's position in ``order`` (mesh order)

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
        ranks = mesh.ids.ravel().tolist()
        if self.index is not None and mesh == self.mesh:
            rgb = cols[self.index] if len(cols) else np.broadcast_to(GREY, (len(ranks), 3)).copy()
            pale = np.fromiter((self.fills.get(r, "value") != "value" for r in ranks), bool, len(ranks))
            rgb[pale] = rgb[pale] * 0.3 + 0.7
            return rgb.reshape(tuple(mesh.shape) + (3,))
        idx = {b: i for i, b in enumerate(self.order)}
        of = self.rank_block()
        rgb = np.broadcast_to(GREY, (len(ranks), 3)).copy()
        for i, r in enumerate(ranks):
            if r in of:
                col = cols[idx[of[r]]]
                rgb[i] = col if self.fills.get(r, "value") == "value" else col * 0.3 + 0.7
        return rgb.reshape(tuple(mesh.shape) + (3,))

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


def _grouped(key: np.ndarray, ranks: np.ndarray) -> tuple[list, list]:
    """(the distinct keys in order of first appearance, the ranks of each in mesh order) for one key per rank."""
    if not len(key):
        return [], []
    perm = np.argsort(key, kind="stable")  # stable: a key's ranks stay in mesh order
    sk = key[perm]
    starts = np.flatnonzero(np.concatenate(([True], sk[1:] != sk[:-1])))
    seen = np.argsort(perm[starts], kind="stable")  # the keys by their first rank
    rs = ranks[perm].tolist()
    ends = np.append(starts[1:], len(sk))
    groups = [tuple(rs[a:b]) for a, b in zip(starts[seen].tolist(), ends[seen].tolist())]
    return sk[starts][seen].tolist(), groups


def _block_keys(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct rows of ``flat`` sorted as their tuples sort, each row's index among them)."""
    if not flat.shape[1]:
        return np.zeros((1, 0), dtype=np.int64), np.zeros(len(flat), dtype=np.int64)
    radix = flat.max(axis=0).astype(object) + 1  # one integer per row when they fit in 63 bits: a faster sort
    if np.prod(radix) < 2**62:
        key = np.zeros(len(flat), dtype=np.int64)
        for c in range(flat.shape[1]):
            key = key * int(radix[c]) + flat[:, c]
        _, first, index = np.unique(key, return_index=True, return_inverse=True)
        return flat[first], index.ravel()
    uniq, index = np.unique(flat, axis=0, return_inverse=True)
    return uniq, index.ravel()


def tensor_state(shape, mesh, placements, value=None, locals=None) -> TensorState:
    """Compute what to draw for ``shape`` laid out on ``mesh`` with ``placements`` (from the core's layout)."""
    mesh = as_mesh(mesh)
    placements = [parse_placement(p) for p in placements]
    lay = layout(shape, mesh, placements)
    paxes = [i for i, p in enumerate(lay.placements) if isinstance(p, Partial)]
    psizes = [mesh.shape[i] for i in paxes]
    k = int(np.prod(psizes)) if paxes else 1
    ids = mesh.ids.ravel()
    ranks = ids.tolist()
    n = len(ranks)
    # every coordinate at once, numpy-wide (a loop over the ranks took seconds per picture at 65,536 ranks)
    flat = lay.bounds().reshape(n, -1)
    uniq, index = _block_keys(flat)
    order = [tuple(zip(row[0::2], row[1::2])) for row in uniq.tolist()]
    firsts, owner_groups = _grouped(index, ids)
    blocks = {order[u]: g for u, g in zip(firsts, owner_groups)}
    coords = np.unravel_index(np.arange(n), tuple(mesh.shape)) if n else ()
    j = np.ravel_multi_index([coords[i] for i in paxes], psizes) if paxes else np.zeros(n, dtype=np.int64)
    summand_ranks: list = [[] for _ in range(k)]
    summands: list = [dict() for _ in range(k)]
    if k == 1:
        summand_ranks[0], summands[0] = list(ranks), dict(blocks)
    else:
        js, groups = _grouped(j, ids)
        for jj, g in zip(js, groups):
            summand_ranks[jj] = list(g)
        keys, groups = _grouped(j * len(order) + index, ids)
        for key, g in zip(keys, groups):
            summands[key // len(order)][order[key % len(order)]] = g
    # a dense tensor's fill depends only on which Partial axes a rank is off coordinate 0 of (partial_fill)
    off = sum(((coords[i] != 0).astype(np.int64) << t for t, i in enumerate(paxes)), np.zeros(n, dtype=np.int64))
    kinds_at, first_at = np.unique(off, return_index=True)
    fill_of = [""] * (1 << len(paxes))
    for kk, i in zip(kinds_at.tolist(), first_at.tolist()):
        fill_of[kk] = lay.fill(tuple(int(c[i]) for c in coords))
    fills = dict(zip(ranks, np.asarray(fill_of, dtype=object)[off].tolist()))
    b3 = flat.reshape(n, -1, 2)
    empty = ids[(b3[:, :, 0] >= b3[:, :, 1]).any(axis=1)].tolist()
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
    return TensorState(lay.shape, mesh, lay.placements, order, blocks, summands, summand_ranks, fills, locals,
                       reduce, empty, index)


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


def _pale_note(st: TensorState) -> str | None:
    """What the pale cells hold, said under a mesh whose cells are too small (or too many) to say it each."""
    kinds = list(st.fills.values())
    zeros, ones = kinds.count("zero"), kinds.count("one")
    if not zeros + ones:
        return None
    held = ", ".join(f"{_count(n, 'rank')} {'hold' if n != 1 else 'holds'} {what}"
                     for n, what in ((zeros, "zeros"), (ones, "ones")) if n)
    return f"pale cells: {held} (an identity of the reduction)"


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
    pale = _pale_note(st)
    told = next((r for r, f in st.fills.items() if f != "value"), None) if st.mesh.size <= 64 else None
    mesh = mesh_block(world or st.mesh, st.cell_rgb(world), hatched=hatched, groups_axis=groups_axis,
                      title=mesh_title, text_extra=extra or None, max_w=min(4.2, max_w / 2),
                      notes={told: pale} if pale else ())
    if mesh_w is not None and mesh_w > mesh.w:
        mesh = Block(mesh_w, mesh.h, mesh.paint, mesh.mid)
    gap = 0.3
    budget = max_w - mesh.w - gap
    labels = [_rank_list(st.blocks[b]) for b in st.order] if len(st.order) <= MAX_LABELLED else None
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
        slabels = [_rank_list(st.summands[j].get(b, ())) for b in st.order] if len(st.order) <= MAX_LABELLED else None
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
