"""ReshardView: a reshard as its planned steps (before, each step, after), stepped with a slider, live from events."""

from __future__ import annotations

import io

import numpy as np

from ..core import ProcessMesh, parse_placement
from ..core.placements import placements_str
from ..core.planner import Plan, apply_step, initial_locals, plan_reshard
from .base import View, plan_ops, target_mesh
from .draw import MAX_W, ids_text
from .mesh_view import as_mesh
from .sheet import DPI, Block, spacer, text_block, text_width, vstack
from .style import HEAD, LABEL, TITLE, fmt_bytes
from .tensor_view import TensorState, tensor_state, tensor_state_block

__all__ = ["ReshardView", "step_caption", "step_verb"]

MAX_SIM = 200_000  # simulate values per rank only when numel x ranks stays below this
MAX_BOARD_STEPS = 8
ROW_W = 10.0  # inches a layout row may take before summands are counted instead of drawn
_BLUE = "#1f4e9a"
_VERB = {
    "all_reduce": "all-reduce: every rank of a group gets the {reduce} of the group",
    "all_gather": "all-gather: every rank of a group gets all blocks of dim {dim}",
    "reduce_scatter": "reduce-scatter: each rank gets its chunk (dim {dim}) of the {reduce}",
    "all_to_all": "all-to-all: dim {dim} gathered, dim {dst_dim} split",
    "slice": "slice: each rank keeps its chunk of dim {dim}, nothing moves",
    "zero_fill": "fill: coordinate 0 keeps the value, the others hold the {reduce} identity",
    "send_recv": "send/recv between meshes",
}


_EXACT = 192  # colours a picture keeps exactly; the rest of its palette of 256 goes to the edges of its text
_FASTOCTREE = 2  # Image.Quantize.FASTOCTREE (the name is Pillow 9.1's)


def _png(fig) -> bytes:
    """``fig`` as a PNG of 256 colours, about a third of the full-colour file: its 192 commonest colours exactly
    (cells, blocks, lines, most of the text), each other pixel (the edges of text) the nearest of the palette.
    Full colour when more than 192 colours each cover 0.1% of it (so many blocks keep every colour exact)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    size = canvas.get_width_height()
    rgba = np.frombuffer(canvas.buffer_rgba(), dtype="<u4")  # R, G, B, A bytes: R the low byte
    key = ((rgba & 0xFF) << 16) | (rgba & 0xFF00) | ((rgba >> 16) & 0xFF)  # 0xRRGGBB
    # counted by a sort of the pixels: an inverse index per pixel (np.unique's return_inverse, an argsort of
    # millions of pixels) was most of a 65,536-rank picture's time; a table from colour to palette index maps them
    colours, counts = np.unique(key, return_counts=True)
    order = np.argsort(-counts, kind="stable")
    out = io.BytesIO()
    big = len(colours) > 256
    if big and counts[order[_EXACT]] * 1000 >= counts.sum():
        _rgb_image(canvas, size).save(out, "PNG")
        return out.getvalue()
    unpacked = np.stack([colours >> 16, (colours >> 8) & 255, colours & 255], 1).astype(np.int64)
    palette = unpacked[order[:_EXACT]] if big else unpacked
    if big:  # the text's edges: the octree's colours for them, each pixel its nearest in the palette
        im = _rgb_image(canvas, size)
        rest = np.asarray((im.quantize(256 - _EXACT, method=_FASTOCTREE).getpalette() or [])[: 3 * (256 - _EXACT)])
        palette = np.concatenate([palette, rest.reshape(-1, 3)])
    u, q = unpacked.astype(np.float32), palette.astype(np.float32)  # squared distances, exact ones 0
    nearest = np.argmin((q * q).sum(1)[None, :] - 2 * u @ q.T, axis=1)  # (|u|^2 is the same along a row)
    table = np.empty(1 << 24, dtype=np.uint8)  # (pages never written are never touched)
    table[colours] = nearest
    picture = Image.frombytes("P", size, table[key].tobytes())
    picture.putpalette(palette.astype(np.uint8).ravel().tolist())
    picture.save(out, "PNG")
    return out.getvalue()


def _rgb_image(canvas, size):
    from PIL import Image

    return Image.frombuffer("RGBA", size, canvas.buffer_rgba(), "raw", "RGBA", 0, 1).convert("RGB")


def _line(g) -> str:
    g = list(g)
    if len(g) > 8:
        return "[" + ",".join(map(str, g[:4])) + ",…," + ",".join(map(str, g[-2:])) + f"] ({len(g)} ranks)"
    return "[" + ",".join(map(str, g)) + "]"


def _groups_text(step, limit=4) -> str:
    gs = list(step.groups)
    if step.op == "send_recv":
        body = ", ".join(f"{s}→{t}" for s, t in gs[:limit * 2])
        return body + (f", … ({len(gs)} pairs)" if len(gs) > limit * 2 else "")
    if gs and len(gs[0]) > 8:
        limit = min(limit, 2)
    body = " ".join(_line(g) for g in gs[:limit])
    return body + (f" … ({len(gs)} groups)" if len(gs) > limit else "")


def step_caption(step, i: int | None = None, n: int | None = None) -> str:
    """One line for a step: op, mesh axis, groups, bytes per rank."""
    where = f"along axis {step.axis_name}" if step.axis is not None else "between meshes"
    head = f"step {i + 1}/{n}: " if i is not None else ""
    return f"{head}{step.op} {where} · groups {_groups_text(step)} · {fmt_bytes(step.bytes)}/rank"


def step_verb(step) -> str:
    """What a step does, in words ('all-reduce: every rank of a group gets the sum of the group')."""
    return _VERB.get(step.op, step.op).format(reduce=step.reduce.short if step.reduce is not None else "",
                                              dim=step.dim, dst_dim=step.dst_dim)


def _nothing(plan) -> str:
    if plan.src_placements == plan.dst_placements:
        return "  nothing to do: the layouts are the same"
    return "  no communication: the layouts differ only along mesh axes of one rank"


class ReshardView(View):
    """``ReshardView(shape, src_mesh, src_placements, dst_mesh=None, dst_placements=..., value=None)``, or
    ``ReshardView(plan)``, or ``ReshardView(source=events_or_cluster)`` (follows ``reshard``/``reshard_step``).

    ``steps`` are the planner's steps and ``states`` the layout (and, for small tensors, every rank's values,
    simulated with the planner's own ``apply_step`` or taken from the events) before and after each step.
    ``max_width``: the inches a row of pictures may take; a Partial shows as many summands as fit, the rest counted.
    """

    def __init__(self, shape=None, src_mesh=None, src_placements=None, dst_mesh=None, dst_placements=None,
                 value=None, plan: Plan | None = None, itemsize: int = 4, name: str | None = None, source=None,
                 plan_id=None, interval=0.15, max_width: float = ROW_W):
        if isinstance(shape, Plan):
            plan, shape = shape, None
        if plan is None and shape is not None:
            src_mesh = as_mesh(src_mesh)
            dst_mesh = as_mesh(dst_mesh) if dst_mesh is not None else src_mesh
            if dst_placements is None:
                raise ValueError("ReshardView needs dst_placements")
            plan = plan_reshard(shape, src_mesh, [parse_placement(p) for p in src_placements], dst_mesh,
                                [parse_placement(p) for p in dst_placements], itemsize)
        self.name = self._given_name = name
        self.max_width = max_width
        self.plan: Plan | None = None
        self.states: list[TensorState] = []
        self.frame = 0
        self.follow = True
        self.plan_id = plan_id
        self.ran: set = set()
        self.mismatch: list[str] = []
        self._cache: dict = {}
        self._slider = None
        self._value = value
        if plan is not None:
            self._set_plan(plan, value)
            self.frame = self.opening_frame()
        super().__init__(source=source, interval=interval)

    # -- data -------------------------------------------------------------------------------------
    @property
    def steps(self) -> list:
        return [] if self.plan is None else list(self.plan.steps)

    @property
    def n_frames(self) -> int:
        return len(self.steps) + 1

    def opening_frame(self) -> int:
        """The frame that tells most: a transfer between meshes, the only step of a one-step plan, else the
        overview (frame 0: the source layout and every step listed)."""
        steps = self.steps
        for i, s in enumerate(steps):
            if s.op == "send_recv":
                return i + 1
        return 1 if len(steps) == 1 else 0

    def _set_plan(self, plan: Plan, value=None, locals0: dict | None = None, ran: bool = False):
        self.plan = plan
        self._cache = {}
        shape = tuple(plan.shape)
        numel = int(np.prod(shape)) if shape else 1
        sim = numel * max(plan.src_mesh.size, plan.dst_mesh.size) <= MAX_SIM and numel <= 4096
        locals_ = None
        if locals0 is not None:
            locals_ = dict(locals0)  # the ranks' real blocks: every later state follows exactly
        elif sim and not ran:  # a reshard that ran shows the ranks' own numbers, or none (never made-up ones)
            if value is None:
                value = np.arange(1, numel + 1, dtype=float).reshape(shape)
            locals_ = initial_locals(np.asarray(value, dtype=float), plan.src_mesh, plan.src_placements)
        self.states = [tensor_state(shape, plan.src_mesh, plan.src_placements, locals=locals_)]
        for step in plan.steps:
            if locals_ is not None:
                locals_ = apply_step(step, locals_)
            mesh = step.target_mesh if step.op == "send_recv" else step.mesh
            self.states.append(tensor_state(shape, mesh, step.after, locals=locals_))
        if ran or locals0 is not None:
            # a reshard that ran: its Partial summands are whatever the ranks computed (a row-parallel output has
            # one on every rank), not the zero fill of a Partial made from a dense tensor
            for st in self.states:
                st.fills = {r: "value" for r in st.fills}
        self.frame = min(self.frame, len(plan.steps))

    def _ingest(self, events) -> None:
        super()._ingest(events)
        for e in events:
            if e.kind == "reshard" and (self.plan_id is None or e.plan_id == self.plan_id) and e.mesh:
                cur = getattr(self, "_cur_id", (None, None))[0]
                if self.plan is not None and cur is not None and e.plan_id is not None:
                    if e.plan_id == cur:  # another rank's record of the reshard on show
                        self._take_before(e)
                        continue
                    if e.plan_id < cur:  # a slower rank's record of an earlier reshard: never step back
                        continue
                src = ProcessMesh.from_dict(e.mesh)
                dst = ProcessMesh.from_dict(target_mesh(e) or e.mesh)
                plan = plan_reshard(e.shape_before, src, e.placements_before, dst, e.placements_after, 1)
                if not plan.steps and self.plan is not None and self.plan.steps and self.plan_id is None:
                    continue  # a reshard with nothing to do: the last one that moved data stays on show
                itemsize = max(1, round(e.bytes / plan.total_bytes)) if plan.total_bytes and e.bytes else 4
                if itemsize != 1:
                    plan = plan_reshard(e.shape_before, src, e.placements_before, dst, e.placements_after, itemsize)
                self._cur_id = (e.plan_id, e.tensor_id)
                self.name = e.name or self._given_name  # an unnamed reshard does not keep the last one's name
                self._set_plan(plan, ran=True)
                self._before = {}
                self._take_before(e)
                self.ran = set()
                self.mismatch = []
                ops = plan_ops(e)
                if ops is not None and list(ops) != plan.ops:
                    self.mismatch.append(f"event lists {ops}, planner says {plan.ops}")
                if self.follow:
                    self.frame = self.opening_frame()
            elif e.kind == "reshard_step" and self.plan is not None and e.step is not None:
                if getattr(self, "_cur_id", (None, None))[0] != e.plan_id:
                    continue
                i = int(e.step)
                if i >= len(self.plan.steps):
                    continue
                if e.op != self.plan.steps[i].op:
                    self.mismatch.append(f"step {i} ran {e.op}, planner says {self.plan.steps[i].op}")
                self.ran.add(i)
                self._take_values(i + 1, e)
                if self.follow:
                    self.frame = max(self.ran) + 1
        self._cache = {}

    def _take_before(self, e) -> None:
        """Collect each rank's block before the reshard; once every source rank's is in, re-run the plan on
        them, so the pictures show the real numbers at every step (not made-up ones)."""
        if e.values is None or e.local_shape is None or self.plan is None:
            return
        n = int(np.prod(e.local_shape)) if e.local_shape else 1
        if len(e.values) != n:
            return
        self._before[e.rank] = np.asarray(e.values, dtype=float).reshape(e.local_shape)
        if set(self.plan.src_mesh.process_ids) <= set(self._before):
            frame = self.frame
            self._set_plan(self.plan, locals0={r: self._before[r] for r in self.plan.src_mesh.process_ids})
            self.frame = frame

    def _take_values(self, state_i, e):
        st = self.states[state_i]
        if e.values is None or e.local_shape is None:
            return
        n = int(np.prod(e.local_shape)) if e.local_shape else 1
        if len(e.values) != n:
            return
        if st.locals is None:
            st.locals = {}
        st.locals[e.rank] = np.asarray(e.values, dtype=float).reshape(e.local_shape)

    # -- drawing ----------------------------------------------------------------------------------
    def _heading(self) -> str:
        p = self.plan
        head = f"reshard {self.name + ' ' if self.name else ''}{list(p.shape)}: {placements_str(p.src_placements)}"
        head += f" → {placements_str(p.dst_placements)}"
        if p.cross_mesh:
            head += f"  (mesh {ids_text(p.src_mesh.process_ids)} → {ids_text(p.dst_mesh.process_ids)})"
        return head + f" · {len(p.steps)} step{'s' if len(p.steps) != 1 else ''}, {fmt_bytes(p.total_bytes)}/rank"

    def _state_title(self, i) -> str:
        st = self.states[i]
        where = "before" if i == 0 else ("after" if i == len(self.steps) else f"after step {i}")
        return f"{where}: {placements_str(st.placements)} on mesh {st.mesh.shape}"

    @staticmethod
    def _transfer_labels(step):
        """send_recv: each source cell says where its block goes, each target cell where it came from."""
        if step is None or step.op != "send_recv" or len(step.groups) > 64:
            return None, None
        out, inn = {}, {}
        for s, t in step.groups:
            out[s] = (out[s] + "," if s in out else "→") + str(t)
            inn[t] = f"←{s}"
        return out, inn

    def _rows(self, pairs) -> list[Block]:
        """One layout row per (state index, text_extra, groups_axis), their meshes given one width so they line up."""
        def build(mesh_w=None):
            return [tensor_state_block(self.states[i], groups_axis=g, mesh_title=self._state_title(i), text_extra=x,
                                       max_w=self.max_width, mesh_w=mesh_w) for i, x, g in pairs]
        rows = build()
        widest = max(r.mesh_w for r in rows)
        if any(abs(r.mesh_w - widest) > 1e-6 for r in rows):
            rows = build(widest)
        return rows

    @staticmethod
    def _width(rows, texts) -> float:
        """The picture's width: its widest row, or its text up to MAX_W (text wraps to it)."""
        w = max(r.w for r in rows)
        return max(w, min(MAX_W, max(text_width(t, s, f) for t, s, f in texts)))

    def _frame_block(self, f: int) -> Block:
        f = max(0, min(int(f), len(self.steps)))
        if self.plan is None:
            return text_block("waiting for a reshard…", TITLE)
        head = self._heading()
        if f == 0:
            lines = [("✓ " if i in self.ran else "  ") + step_caption(s, i, len(self.steps))
                     for i, s in enumerate(self.steps)] or [_nothing(self.plan)]
            rows = self._rows([(0, None, None)])
            w = self._width(rows, [(head, HEAD, None)] + [(ln, LABEL, "monospace") for ln in lines])
            steps = text_block(lines, LABEL, width=w, family="monospace", indent="      ")
            return vstack([text_block(head, HEAD, width=w), steps, spacer(0, 0.05)] + rows, gap=0.08)
        step = self.steps[f - 1]
        ran = " ✓ ran" if (f - 1) in self.ran else ""
        caption = step_caption(step, f - 1, len(self.steps)) + ran
        out, inn = self._transfer_labels(step)
        rows = self._rows([(f - 1, out, step.axis), (f, inn, None)])
        verb = step_verb(step)
        w = self._width(rows, [(head, HEAD, None), (caption, TITLE, None), (verb, LABEL, None)])
        return vstack([text_block(head, HEAD, width=w),
                       text_block(caption, TITLE, width=w, color=_BLUE, weight="bold"),
                       text_block(verb, LABEL, width=w, style="italic"), spacer(0, 0.05), rows[0],
                       spacer(0, 0.05), rows[1]], gap=0.08)

    def frame_figure(self, f: int):
        """The picture of frame ``f``: 0 is the source layout, f > 0 shows step f with the layout before and after."""
        with self._lock:
            return self._frame_block(f).figure()

    def _block(self) -> Block:
        """The storyboard: the source layout, then each step with the layout after it."""
        if self.plan is None:
            return self._frame_block(0)
        steps = self.steps[:MAX_BOARD_STEPS]
        caps = ["before"] + [step_caption(s, i, len(self.steps)) for i, s in enumerate(steps)]
        rows = self._rows([(i, self._transfer_labels(self.steps[i - 1] if i else None)[1], None)
                           for i in range(len(steps) + 1)])
        head = self._heading()
        w = self._width(rows, [(head, HEAD, None)] + [(c, TITLE, None) for c in caps])
        parts = [text_block(head, HEAD, width=w)]
        for i, (cap, row) in enumerate(zip(caps, rows)):
            parts += [spacer(0, 0.1), text_block(cap, TITLE, width=w, weight="bold", color=_BLUE if i else "black"),
                      row]
        if len(self.steps) > MAX_BOARD_STEPS:
            parts.append(text_block(f"… {len(self.steps) - MAX_BOARD_STEPS} more steps", LABEL, width=w))
        return vstack(parts, gap=0.08)

    def frame_png(self, f: int) -> bytes:
        if f not in self._cache:
            self._cache[f] = _png(self.frame_figure(f))
        return self._cache[f]

    def png(self, dpi: int = DPI) -> bytes:
        return _png(self.figure()) if dpi == DPI else super().png(dpi)

    # -- widget -----------------------------------------------------------------------------------
    def _widget_png(self) -> bytes:
        return self.frame_png(self.frame)

    def _controls(self):
        import ipywidgets as w

        n = len(self.steps)
        self._play = w.Play(value=self.frame, min=0, max=n, interval=1200, description="play")
        self._slider = w.IntSlider(value=self.frame, min=0, max=n, description="step", continuous_update=True)
        w.jslink((self._play, "value"), (self._slider, "value"))
        self._slider.observe(self._on_slider, names="value")
        return [w.HBox([self._play, self._slider])]

    def _on_slider(self, change):
        self.follow = change["new"] >= len(self.steps)
        self.show_frame(change["new"])

    def show_frame(self, f: int) -> None:
        self.frame = max(0, min(int(f), len(self.steps)))
        self._refresh()

    def _refresh(self) -> None:
        with self._lock:
            if self._slider is not None:
                n = len(self.steps)
                if self._slider.max != n:
                    self._slider.max = n
                    self._play.max = n
                if self._slider.value != self.frame:
                    self._slider.unobserve(self._on_slider, names="value")
                    self._slider.value = self.frame
                    self._slider.observe(self._on_slider, names="value")
        super()._refresh()

    def _status_html(self) -> str:
        base = super()._status_html()
        if self.mismatch:
            base += '<br><span style="color:#b00">' + "; ".join(self.mismatch) + "</span>"
        return base

    def __repr__(self) -> str:
        if self.plan is None:
            return "<ReshardView (waiting for a reshard)>"
        p = self.plan
        n = len(p.steps)
        mesh = f" mesh {p.src_mesh.shape} -> {p.dst_mesh.shape}" if p.cross_mesh else ""
        ran = f", ran {len(self.ran)}/{n}" if self.events else ""
        return (f"<ReshardView {placements_str(p.src_placements)} -> {placements_str(p.dst_placements)}{mesh}: "
                f"{n} step{'s' if n != 1 else ''}{ran}>")
