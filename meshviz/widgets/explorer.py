"""The explorer: mesh, tensor shape and placements as controls -> mesh view, blocks, reshard plan (no cluster)."""

from __future__ import annotations

import html
import time

import numpy as np

from ..core import ProcessMesh, Replicate, plan_reshard
from ..core.layout import normalize_placements
from ..core.placements import placements_str
from .base import STATIC_DPI, fig_png, image_box, set_image
from .mesh_view import MeshView
from .reshard_view import ReshardView, _groups_text
from .style import _nesting, fmt_bytes, parse_ids, parse_ints, parse_placements

__all__ = ["Explorer", "explore", "plan_table", "target_mesh", "check_cross_mesh"]

_FIELDS = [  # (parameter, label, a hint under the field)
    ("mesh_shape", "mesh shape", ""),
    ("ids", "process ids", "blank: 0..n-1; 'reversed'; or a list"),
    ("dim_names", "axis names", ""),
    ("shape", "tensor shape", ""),
    ("src", "source", "e.g. S(0), R, P(sum): one per axis"),
    ("dst", "target", ""),
    ("target_ids", "target ids", "blank: the same mesh; else one of its shape, or a slice of it"),
]
_PLACEHOLDER = {"ids": "0..n-1", "target_ids": "same mesh"}
MESH_W = 5.4  # inches the explorer's mesh picture takes (518 px): beside the controls at 1280 px
RESHARD_W = 8.4
# what a bad input left is greyed; the hints sit under their fields
_CSS = """<style>
.meshviz-explorer-controls { padding-right: 12px; box-sizing: border-box; }
.meshviz-explorer-controls .widget-text { width: 100%; }
.meshviz-hint { font-size: 11px; line-height: 14px; color: #666; margin: -2px 0 4px 92px; }
.meshviz-error { color: #b00; font-size: 12px; line-height: 16px; margin: 4px 0; overflow-wrap: anywhere; }
.meshviz-plan { overflow-x: auto; max-width: 100%; }
.meshviz-stale { opacity: 0.35; filter: grayscale(1); pointer-events: none; }
</style>"""


def _x(shape) -> str:
    return " x ".join(map(str, shape))


def _slice_of(big: ProcessMesh, small: ProcessMesh) -> int | None:
    """The axis of ``big`` that ``small`` is one slice of (Paddle's sub mesh: the sliced axis kept as 1 or dropped),
    or None."""
    for ax in range(big.ndim):
        if big.shape[ax] == 1:
            continue
        for i in range(big.shape[ax]):
            cut = np.take(big.ids, [i], axis=ax)
            if small.ids.shape in (cut.shape, np.squeeze(cut, ax).shape) and np.array_equal(cut.ravel(),
                                                                                          small.ids.ravel()):
                return ax
    return None


def target_mesh(text, src: ProcessMesh) -> ProcessMesh:
    """The explorer's target mesh from its ids: 'reversed' or 'range', or a flat list of as many ids, take the
    source's shape; a nested list is its own shape, a flat list of another count a 1-D mesh. Axis names: the
    source's, less the one a slice of it drops (a new axis of a mesh the source is a slice of: 'd<i>')."""
    s = str(text).strip().lower() if not isinstance(text, (list, tuple, np.ndarray)) else None
    if s in ("range", "arange", "reversed"):
        return ProcessMesh(parse_ids(text, src.shape), src.dim_names)
    nested = _nesting(text)
    n = len(np.asarray(text).ravel()) if s is None else len(parse_ints(text))
    shape = nested if len(nested) > 1 else (list(src.shape) if n == src.size else [n])
    ids = parse_ids(text, shape)
    names = list(src.dim_names)
    if ids.ndim == src.ndim - 1:
        ax = _slice_of(src, ProcessMesh(ids))
        names = [d for i, d in enumerate(names) if i != ax] if ax is not None else None
    elif ids.ndim == src.ndim + 1:
        ax = _slice_of(ProcessMesh(ids), src)
        if ax is not None:
            fresh = next(f"d{ax}{'_' * k}" for k in range(len(names) + 1) if f"d{ax}{'_' * k}" not in names)
            names = names[:ax] + [fresh] + names[ax:]
        else:
            names = None
    elif ids.ndim != src.ndim:
        names = None
    return ProcessMesh(ids, names)


def check_cross_mesh(shape, src_mesh: ProcessMesh, src, dst_mesh: ProcessMesh, dst) -> None:
    """ValueError unless Paddle reshards between these meshes of different shapes: from a mesh to one slice of it
    (Replicate along the sliced axis), from a slice to the whole (Replicate along that axis on the target), or
    between a 1-D mesh and a single rank (Replicate on the single rank's side)."""
    src = normalize_placements(shape, src_mesh, src)
    dst = normalize_placements(shape, dst_mesh, dst)
    one_d = src_mesh.ndim == 1 and dst_mesh.ndim == 1
    if one_d and dst_mesh.size == 1 and all(isinstance(p, Replicate) for p in dst):
        return  # a 1-D mesh gathered onto one rank
    if one_d and src_mesh.size == 1 and all(isinstance(p, Replicate) for p in src):
        return  # one rank's tensor spread over a 1-D mesh
    ax = _slice_of(src_mesh, dst_mesh)
    if ax is not None:
        if isinstance(src[ax], Replicate):
            return
        raise ValueError(f"Paddle reshards to a slice of the mesh only from Replicate along the sliced axis "
                         f"{src_mesh.dim_names[ax]}; the source is {placements_str([src[ax]])} there: "
                         f"make it R first")
    ax = _slice_of(dst_mesh, src_mesh)
    if ax is not None:
        if isinstance(dst[ax], Replicate):
            return
        raise ValueError(f"Paddle reshards from a slice of the mesh only to Replicate along the axis it grows "
                         f"{dst_mesh.dim_names[ax]}; the target is {placements_str([dst[ax]])} there")
    if one_d and 1 in (src_mesh.size, dst_mesh.size):
        side = "target" if dst_mesh.size == 1 else "source"
        raise ValueError(f"Paddle reshards between a 1-D mesh and a single rank only with the single rank's "
                         f"placements Replicate; the {side} is {placements_str(dst if side == 'target' else src)}")
    example = str(src_mesh.ids[0].tolist()).replace(" ", "") if src_mesh.ndim > 1 else f"[{src_mesh.process_ids[0]}]"
    raise ValueError(f"process ids {str(dst_mesh.ids.tolist()).replace(' ', '')} are {_x(dst_mesh.shape)}, the "
                     f"mesh shape is {_x(src_mesh.shape)}: Paddle reshards between meshes of one shape, from a mesh "
                     f"to one slice of it along an axis (such as {example}) and back, or between a 1-D mesh and a "
                     f"single rank")


def plan_table(plan) -> str:
    """The plan as an HTML table: step, operation, mesh axis, groups, bytes per rank."""
    rows = []
    for i, s in enumerate(plan.steps):
        where = s.axis_name if s.axis is not None else "between meshes"
        extra = f"dim {s.dim}→{s.dst_dim}" if s.op == "all_to_all" else (f"dim {s.dim}" if s.dim is not None else "")
        if s.reduce is not None:
            extra += f" {s.reduce.short}"
        rows.append(f"<tr><td>{i + 1}</td><td><b>{s.op}</b> {html.escape(extra)}</td><td>{html.escape(where)}</td>"
                    f"<td>{html.escape(placements_str(s.before))} → {html.escape(placements_str(s.after))}</td>"
                    f"<td><code>{html.escape(_groups_text(s, 3))}</code></td><td>{fmt_bytes(s.bytes)}</td></tr>")
    if not rows:
        why = ("the layouts are the same" if plan.src_placements == plan.dst_placements else
               "the layouts differ only along mesh axes of one rank, where every block stays as it is")
        rows.append(f'<tr><td colspan="6">nothing to do, no communication: {why}</td></tr>')
    head = ("<tr><th>#</th><th>operation</th><th>mesh axis</th><th>placements</th><th>groups that talk</th>"
            "<th>bytes/rank</th></tr>")
    total = f"<p>total {fmt_bytes(plan.total_bytes)} received per rank (the busiest rank of each step)</p>"
    return f'<table style="font-size:12px">{head}{"".join(rows)}</table>{total}'


class Explorer:
    """``meshviz.explore()``: what-if for any mesh, pure planner only (no cluster, no torch.distributed)."""

    def __init__(self, mesh_shape="2,3", ids="[[2,4,5],[0,1,3]]", dim_names="x,y", shape="4,6",
                 src="P(sum), S(1)", dst="R, R", target_ids="", itemsize: int = 4):
        self.params = dict(mesh_shape=mesh_shape, ids=ids, dim_names=dim_names, shape=shape, src=src, dst=dst,
                           target_ids=target_ids, itemsize=itemsize)
        self.error: str | None = None
        self.mesh_view: MeshView | None = None
        self.reshard_view: ReshardView | None = None
        self.plan = None
        self.last_redraw_s = 0.0
        self._w = None
        self.update()

    # -- the model --------------------------------------------------------------------------------
    def update(self, **params) -> "Explorer":
        """Change parameters (same names as the constructor) and recompute; errors land in ``self.error``."""
        self.params.update(params)
        t0 = time.perf_counter()
        try:
            p = self.params
            mshape = parse_ints(p["mesh_shape"])
            if not mshape or any(s < 1 for s in mshape):
                raise ValueError(f"mesh shape must be positive integers, got {p['mesh_shape']!r}")
            if int(np.prod(mshape)) > 65536:
                raise ValueError("the explorer draws meshes of up to 65536 ranks")
            given = p["dim_names"]
            if isinstance(given, (list, tuple)):
                given = ",".join(map(str, given))
            names = [n for n in str(given or "").replace(" ", ",").split(",") if n] or None
            if names is not None and len(names) != len(mshape):
                raise ValueError(f"dim names: {len(names)} ({', '.join(names)}) for a mesh of {len(mshape)} axes")
            mesh = ProcessMesh(parse_ids(p["ids"], mshape), names)
            tgt = mesh
            if str(p.get("target_ids") or "").strip():
                tgt = target_mesh(p["target_ids"], mesh)
            shape = parse_ints(p["shape"])
            if any(n < 0 for n in shape):
                raise ValueError(f"tensor shape must be sizes of 0 or more, got {p['shape']!r}")
            if int(p["itemsize"]) < 1:
                raise ValueError(f"bytes per element must be 1 or more, got {p['itemsize']!r}")
            src, dst = parse_placements(p["src"]), parse_placements(p["dst"])
            if tgt.shape != mesh.shape:
                check_cross_mesh(shape, mesh, src, tgt, dst)
            plan = plan_reshard(shape, mesh, src, tgt, dst, int(p["itemsize"]))
        except (ValueError, TypeError, OverflowError) as exc:
            self.error = str(exc)
            self._show()
            return self
        self.error = None
        self.plan = plan
        self.mesh_view = MeshView(mesh, title=f"mesh {mesh.shape} {mesh.dim_names}", max_width=MESH_W)
        if tgt != mesh:
            self.mesh_view.set_within(mesh.process_ids)
        self.reshard_view = ReshardView(plan, max_width=RESHARD_W)
        self._show()
        self.last_redraw_s = time.perf_counter() - t0
        return self

    def redraw(self) -> float:
        """Recompute and render every picture the widget shows; returns the seconds it took."""
        t0 = time.perf_counter()
        self.update()
        if self.error is None and self._w is None:
            self.mesh_view.png()
            self.reshard_view.frame_png(self.reshard_view.frame)
        self.last_redraw_s = time.perf_counter() - t0
        return self.last_redraw_s

    # -- the widget -------------------------------------------------------------------------------
    @property
    def widget(self):
        if self._w is None:
            import ipywidgets as w

            self._inputs = {}
            rows = []
            for key, label, hint in _FIELDS:
                box = w.Text(value=str(self.params[key]), description=label, continuous_update=False,
                             placeholder=_PLACEHOLDER.get(key, ""),
                             layout=w.Layout(width="100%"), style={"description_width": "88px"})
                box.observe(self._on_change(key), names="value")
                self._inputs[key] = box
                rows.append(box)
                if hint:
                    rows.append(w.HTML(f'<div class="meshviz-hint">{html.escape(hint)}</div>'))
            self._err = w.HTML()
            controls = w.VBox(rows + [self._err], layout=w.Layout(flex="0 0 270px", width="270px"))
            controls.add_class("meshviz-explorer-controls")
            self._mesh_box, self._mesh_img = image_box(b"")
            self._plan_html = w.HTML(layout=w.Layout(flex="0 0 auto"))
            self._rv_box = w.VBox(layout=w.Layout(max_width="100%", flex="0 0 auto"))
            # the pictures scroll inside a column at most 85% of the window high: looking through them never
            # scrolls the controls away (an output area cannot keep them in view by itself)
            self._pictures = w.VBox([self._mesh_box, self._plan_html, self._rv_box],
                                    layout=w.Layout(flex="1 1 480px", min_width="0", max_width="100%",
                                                    max_height="85vh", overflow="auto"))
            self._pictures.add_class("meshviz-explorer-pictures")
            body = w.Box([controls, self._pictures],
                          layout=w.Layout(display="flex", flex_flow="row wrap", align_items="flex-start",
                                          width="100%"))
            self._w = w.VBox([w.HTML(_CSS), body], layout=w.Layout(width="100%"))
            self._w.add_class("meshviz-explorer")
            self._show()
        return self._w

    def _on_change(self, key):
        def cb(change):
            self.update(**{key: change["new"]})
        return cb

    def _show(self):
        if self._w is None:
            return
        if self.error is not None:
            self._err.value = (f'<div class="meshviz-error">{html.escape(self.error)}</div>'
                               '<div class="meshviz-hint">the pictures show the last input that worked</div>')
            self._pictures.add_class("meshviz-stale")
            return
        self._err.value = ""
        self._pictures.remove_class("meshviz-stale")
        set_image(self._mesh_img, self.mesh_view.png())
        self._plan_html.value = f'<div class="meshviz-plan">{plan_table(self.plan)}</div>'
        self._rv_box.children = [self.reshard_view.widget]

    def _ipython_display_(self):
        from IPython.display import display

        bundle = {"text/plain": repr(self)}
        try:
            bundle.update(self.widget._repr_mimebundle_() or {})
            bundle["text/plain"] = repr(self)
        except Exception:
            pass
        if self.reshard_view is not None:
            bundle["image/png"] = fig_png(self.reshard_view.frame_figure(0), STATIC_DPI)
        display(bundle, raw=True)

    def _repr_png_(self):
        return None if self.reshard_view is None else self.reshard_view.png()

    def save(self, path):
        """Write the reshard's picture to ``path``; ValueError while no input has worked yet."""
        if self.reshard_view is None:
            raise ValueError(f"nothing to save: no input has worked yet ({self.error})")
        return self.reshard_view.save(path)

    def __repr__(self) -> str:
        if self.error is not None:
            return f"<Explorer error: {self.error}>"
        p = self.plan
        m = p.src_mesh
        n = len(p.steps)
        return (f"<Explorer mesh {m.shape} {','.join(m.dim_names)}: {list(p.shape)} "
                f"{placements_str(p.src_placements)} -> {placements_str(p.dst_placements)}: {n} step"
                f"{'s' if n != 1 else ''}, {fmt_bytes(p.total_bytes)}/rank>")


def explore(**params) -> Explorer:
    """Open the explorer (see :class:`Explorer` for the parameters)."""
    return Explorer(**params)
