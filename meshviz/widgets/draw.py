"""Drawing primitives as blocks of known size: a mesh as a grid of cells, a tensor's index space cut into blocks."""

from __future__ import annotations

import math

import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from .sheet import (
    DPI,
    MIN_FONT,
    Block,
    Panel,
    elide,
    index_ticks,
    line_height,
    text_block,
    text_size,
    text_width,
    vstack,
    wrap,
)
from .style import EMPTY, LABEL, TICK, TITLE

__all__ = ["mesh_panels", "mesh_block", "tensor_block", "legend_block", "block_image", "MAX_CELL_TEXT", "MAX_SAMPLES",
           "MAX_W", "ids_text"]

MAX_CELL_TEXT = 256  # above this many cells, ids are left out (the picture stays cheap)
MAX_SAMPLES = 384  # pixels per side a tensor picture samples at most
MAX_FACETS = 16
MAX_W = 8.4  # inches of content (806 px, 826 with the margins): a notebook output area at 1280 px, file browser open
MIN_CELL = 0.06  # inches (6 px): a row of ranks whose cells would be narrower is wrapped into rows of _WRAP_CELL
_WRAP_CELL = 0.1
_ROUND = (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 50, 64, 100, 128, 200, 256, 500, 512, 1000, 1024)
_TICKPAD = 3.5 / 72  # tick length + pad, inches
_LABELPAD = 3 / 72


def ids_text(ids, limit: int = 8) -> str:
    """A list of process ids, the first and last few when it is long: '[0, 1, 2, …, 63] (64 ranks)'."""
    ids = [int(i) for i in ids]
    if len(ids) <= limit:
        return "[" + ", ".join(map(str, ids)) + "]"
    head = ", ".join(map(str, ids[: limit - 2]))
    return f"[{head}, …, {ids[-1]}] ({len(ids)} ranks)"


def mesh_panels(mesh, max_facets: int = MAX_FACETS):
    """(title, index into the id array, 2-D ids) per panel: meshes beyond 2 axes are faceted over leading axes."""
    ids = mesh.ids
    names = mesh.dim_names
    if ids.ndim == 1:
        return [("", (None,), ids[None, :])]
    if ids.ndim == 2:
        return [("", (), ids)]
    out = []
    for idx in np.ndindex(*ids.shape[:-2]):
        if len(out) >= max_facets:
            break
        title = ", ".join(f"{names[a]}={i}" for a, i in enumerate(idx))
        out.append((title, idx, ids[idx]))
    return out


def _panel_rgb(cell_rgb, idx, ndim):
    if ndim == 1:
        return cell_rgb[None, :]
    return cell_rgb[idx] if idx else cell_rgb


def _x_margin() -> float:
    """Below an axes: tick labels and the axis label."""
    return _TICKPAD + line_height(TICK) + _LABELPAD + line_height(LABEL)


def _y_margin(tick_labels) -> float:
    """Left of an axes: the axis label, then the widest tick label."""
    widest = max((text_width(t, TICK) for t in tick_labels), default=0.0)
    return line_height(LABEL) + _LABELPAD + widest + _TICKPAD + 0.02


def _fit_label(candidates, size, room):
    for c in candidates:
        if text_width(c, size) <= room:
            return c
    return candidates[-1]


def _index_labels(panel, xticks, yticks, xlabel, ylabel, centre=0.0, ystep: int = 1):
    """Tick labels (indices, at index + ``centre``) and axis labels beside a panel, where an Axes would put them;
    a y tick reads ``index * ystep`` (the first rank of a wrapped row)."""
    below, left = -_TICKPAD * 72, -_TICKPAD * 72
    y1 = panel.ylim[1]
    for i in xticks:
        panel.text(i + centre, y1, str(i), TICK, dy=below, ha="center", va="top")
    if xlabel:
        down = below - (line_height(TICK) * 72 if len(xticks) else 0) - _LABELPAD * 72
        panel.text((panel.xlim[0] + panel.xlim[1]) / 2, y1, xlabel, LABEL, dy=down, ha="center", va="top")
    x0 = panel.xlim[0]
    for i in yticks:
        panel.text(x0, i + centre, str(i * ystep), TICK, dx=left, ha="right", va="center")
    if ylabel:
        widest = max((text_width(str(i * ystep), TICK) for i in yticks), default=0.0)
        dx = left - (widest + _LABELPAD) * 72 if len(yticks) else -_LABELPAD * 72
        panel.text(x0, (panel.ylim[0] + panel.ylim[1]) / 2, ylabel, LABEL, dx=dx, ha="right", va="center",
                   rotation=90)


def mesh_block(mesh, cell_rgb=None, *, hatched=(), devices=None, groups_axis=None, title=None, text_extra=None,
               max_w: float = MAX_W, max_facets: int = MAX_FACETS) -> Block:
    """The mesh as a grid of cells (faceted over leading axes beyond two), ids (and ``devices``, ``text_extra``)
    in the cells when they fit, ``title`` above, wrapped; facets beyond ``max_facets`` summarized on a line below.
    A row of ranks too long for cells of ``MIN_CELL`` is wrapped into rows, each labelled with its first index."""
    panels = mesh_panels(mesh, max_facets)
    ids = mesh.ids
    names = mesh.dim_names
    n_all = int(np.prod(ids.shape[:-2])) if ids.ndim > 2 else 1
    if cell_rgb is None:
        cell_rgb = np.broadcast_to(np.array([0.74, 0.84, 0.95]), ids.shape + (3,))
    rows, cols = panels[0][2].shape
    total = sum(p[2].size for p in panels)
    labels: dict = {}
    if total <= MAX_CELL_TEXT:
        for _, _, ids2 in panels:
            for r in map(int, ids2.ravel()):
                labels[r] = "\n".join([str(r)] + [str(d[r]) for d in (devices, text_extra) if d and r in d])
    one_line = all("\n" not in s for s in labels.values())
    fs = (9.0 if total <= 16 else 8.0) if one_line else MIN_FONT
    one_d = ids.ndim == 1
    yticks_all = [] if one_d else [str(i) for i in range(rows)]
    left = 0.04 if one_d else _y_margin(yticks_all)
    bottom = _x_margin()
    top = line_height(TITLE) + 0.04 if ids.ndim > 2 else 0.0
    room = max_w - left - 0.06
    per = 0  # ranks to a row of a wrapped row of ranks; 0: not wrapped
    if rows == 1 and cols * MIN_CELL > room:
        left = _y_margin([str(cols - 1)])
        room = max_w - left - 0.06
        per = max(k for k in _ROUND if k == 1 or k * _WRAP_CELL <= room)
        labels = {}  # (cells that would have held them are not MIN_CELL wide)
    length = cols
    panel_rgb = [_panel_rgb(cell_rgb, idx, ids.ndim) for _, idx, _ in panels]
    if per:
        rows, cols = -(-cols // per), per
        panels = [(t, idx, _wrap(ids2, per, -1)) for t, idx, ids2 in panels]
        panel_rgb = [_wrap(rgb, per, 1.0) for rgb in panel_rgb]
    n = len(panels)
    facets = n > 1 and not per
    if labels:
        cw = max(text_size(s, fs)[0] for s in labels.values()) + 0.1
        ch = max(text_size(s, fs)[1] for s in labels.values()) + 0.08
        cell = max(cw, ch, 0.3)
        if cols * cell > room:
            labels = {}
    if per:
        cell = min(0.3 if one_d else 0.2, room / cols)
    elif not labels:  # a row of ranks may use the width; a grid stays about 3 inches
        cell = min(0.3, room / cols) if one_d else min(0.2, 3.2 / max(rows, cols))
    cell = min(cell, room / cols)
    xlabels = [f"{names[-1]} ({ids.shape[-1]})" + (f", {per} a row" if per else "")] + ([names[-1]] if facets else [])
    fgap, ncols = (0.1 if facets else 0.0), 1
    if facets:  # facets to a row: one per index of the second axis of a 4-D mesh (its rows are the first), else all
        pref = int(ids.shape[-3]) if ids.ndim >= 4 and n % ids.shape[-3] == 0 else n
        ncols, cell, fs, labels = _facet_columns(n, pref, cols, cell, fs, labels, room, fgap)
    gw, gh = cols * cell, rows * cell
    xlabel = _fit_label(xlabels, LABEL, max(gw, (room - (ncols - 1) * fgap) / ncols))
    ylabel = "" if one_d or per else _fit_label([f"{names[-2]} ({ids.shape[-2]})", names[-2]], LABEL, max(gh, 0.9))
    over = max(0.0, (text_width(ylabel, LABEL) - gh) / 2) if ylabel else 0.0
    col_w = max(gw, text_width(xlabel, LABEL))  # a facet's column: its grid, or its axis label when that is wider
    if not facets:  # one panel, or facets each with their own axes (a wrapped row of ranks), side by side
        col_w += left + 0.06
        fgap = 0.2
        ncols = max(1, min(n, int((max_w + fgap) // (col_w + fgap))))
    titles = [elide(t, TITLE, col_w + (fgap * 0.8 if facets else 0.0)) for t, _, _ in panels]
    nrows = math.ceil(n / ncols)
    row_h = top + over + gh
    vgap = 0.06 if facets else 0.1 + max(bottom, over + 0.02)
    grid_w = (left + 0.06 if facets else 0.0) + ncols * col_w + (ncols - 1) * fgap
    grid_h = nrows * row_h + (nrows - 1) * vgap + max(bottom, over + 0.02)
    more = n_all - len(panels)
    width = max(grid_w, min(text_width(title, TITLE), max(grid_w, 2.2), max_w)) if title else grid_w
    parts = [text_block(title, TITLE, width=width)] if title else []
    tx = np.asarray(index_ticks(cols, gw, TICK, True))
    ty = index_ticks(rows, gh, TICK, False) if per or not one_d else []
    hatched = set(int(r) for r in hatched)
    line = _group_line(labels, fs, cell) if groups_axis is not None else (0.3, 0.3, 2.5)

    def paint_grid(sheet, x0, y0):
        for k, (_, _, ids2) in enumerate(panels):
            c = k % ncols  # facets share their axes: index labels left of the first column, under each column's last
            px = x0 + left + c * (col_w + fgap) + ((col_w - gw) / 2 if facets else 0.0)
            show_x, show_y = (k + ncols >= n, c == 0) if facets else (True, True)
            py = y0 + (k // ncols) * (row_h + vgap) + top + over
            panel = Panel(sheet, px, py, gw, gh, (-0.5, cols - 0.5), (-0.5, rows - 0.5))
            panel.image(panel_rgb[k])
            if rows * cols <= 16384:  # cell borders as one collection: cheap for big meshes
                segs = [((j - 0.5, -0.5), (j - 0.5, rows - 0.5)) for j in range(1, cols)]
                segs += [((-0.5, i - 0.5), (cols - 0.5, i - 0.5)) for i in range(1, rows)]
                panel.add(LineCollection(segs, colors="white", linewidths=1.5 if cell >= 0.2 else 0.5))
            panel.frame(edgecolor="black", linewidth=0.8)
            _index_labels(panel, tx if show_x else tx[:0], ty if show_y else [], xlabel if show_x else "",
                          ylabel if show_y else "", ystep=per or 1)
            if titles[k]:
                sheet.text(px + gw / 2, py - 0.03, titles[k], TITLE, ha="center", va="bottom")
            for (i, j), r in np.ndenumerate(ids2):
                s = labels.get(int(r))
                if s is not None:
                    panel.text(j, i, s, fs, ha="center", va="center", color="black")
                if hatched and total <= 4096 and int(r) in hatched:
                    panel.add(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="xx", linewidth=0,
                                        edgecolor=(0.2, 0.2, 0.2, 0.5)))
            if groups_axis is not None and not per:
                _draw_groups(panel, ids.ndim, groups_axis, rows, cols, line=line)
            elif groups_axis is not None and groups_axis == ids.ndim - 1:  # one line, through each wrapped row
                _draw_groups(panel, 1, 0, rows - 1, cols, line=line)
                _draw_groups(panel, 1, 0, 1, length - per * (rows - 1), at=rows - 1, line=line)

    parts.append(Block(grid_w, grid_h, paint_grid, mid=None))
    notes = []
    if groups_axis is not None and ids.ndim > 2 and groups_axis < ids.ndim - 2:
        notes.append("groups: the same cell across panels")
    if more > 0:
        notes.append(f"… {more} more panels")
    if per:
        along = " × ".join(f"{a} ({n})" for a, n in zip(names[-2:], ids.shape[-2:]))
        notes.append(f"{along}: wrapped {per} ranks to a row; the left labels are each row's first index")
    elif cell < MIN_CELL:
        notes.append(f"squeezed: cells {cell * DPI:.1f} px wide")
    for note in notes:
        parts.append(text_block(note, MIN_FONT, width=max(width, text_width(note, MIN_FONT))))
    out = vstack(parts, gap=0.06)
    head = parts[0].h + 0.06 if title else 0.0
    out.mid = head + top + over + gh / 2 if nrows == 1 else out.h / 2
    return out


def _facet_columns(n: int, pref: int, cols: int, cell: float, fs: float, labels: dict, room: float, gap: float):
    """(columns, cell, font size, labels) for ``n`` facets of ``cols`` cells sharing their axes in ``room`` inches:
    the most columns up to ``pref`` whose cells still hold their labels (smaller cells first, then the smallest
    font); without labels, the most columns at ``cell``. The labels go only when one column cannot hold them."""
    tight = {f: max(max(w + 0.03, h + 0.02) for w, h in (text_size(s, f) for s in labels.values()))
             for f in dict.fromkeys((fs, MIN_FONT))} if labels else {}  # narrowest cells that hold the labels
    for c in range(min(n, pref), 0, -1):
        fit = min(cell, (room - (c - 1) * gap) / (c * cols))
        if not labels and (fit >= cell or c == 1):
            return c, fit, fs, labels
        for f, need in tight.items():
            if fit >= need:
                return c, fit, f, labels
    return 1, min(cell, room / cols), fs, {}


def _wrap(a, per: int, fill):
    """A one-row panel (1, n, ...) as rows of ``per`` cells, the last row padded with ``fill``."""
    n = a.shape[1]
    nrows = -(-n // per)
    out = np.full((nrows * per,) + a.shape[2:], fill, dtype=a.dtype)
    out[:n] = a[0]
    return out.reshape((nrows, per) + a.shape[2:])


def _group_line(labels: dict, fs: float, cell: float) -> tuple[float, float, float]:
    """(x offset, y offset, width in points) of the group lines in cells of ``cell`` inches: beside the ids (cell
    units from the centre: 0.3, further out for wide ids, at most on the cell's border), thinner in small cells."""
    lw = 2.5 if cell >= 0.28 else 1.5
    if not labels:
        return 0.3, 0.3, lw
    w, h = map(max, zip(*(text_size(s, fs) for s in labels.values())))
    clear = 0.01 + lw / 144  # a pixel, and half the line
    return (min(0.5, max(0.3, (w / 2 + clear) / cell)), min(0.5, max(0.3, (h / 2 + clear) / cell)), lw)


def _draw_groups(panel, ndim, axis, rows, cols, at: int = 0, line=(0.3, 0.3, 2.5)):
    """Lines through the cells that talk: one per line of the mesh along ``axis`` (within this panel), in the
    ``rows`` rows from row ``at``; ``line``: where beside the ids they run, and how wide (:func:`_group_line`)."""
    offx, offy, lw = line
    kw = dict(color="black", alpha=0.55, linewidth=lw, marker="o", markersize=3 if lw > 2 else 2.5,
              solid_capstyle="round")
    if (ndim == 1 or axis == ndim - 1) and cols > 1:
        for i in range(at, at + rows):
            panel.add(Line2D([0, cols - 1], [i + offy, i + offy], **kw))
    elif ndim > 1 and axis == ndim - 2 and rows > 1:
        for j in range(cols):
            panel.add(Line2D([j + offx, j + offx], [0, rows - 1], **kw))


def _samples(n: int, maxs: int):
    """Sampled indices and the (n_samples + 1) edges they cover, in tensor coordinates."""
    if n <= maxs:
        return np.arange(n), np.arange(n + 1, dtype=float)
    edges = np.linspace(0, n, maxs + 1)
    centres = np.floor((edges[:-1] + edges[1:]) / 2).astype(int)
    return centres, edges


def _view_shape(shape):
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return int(np.prod(shape[:-1])), shape[-1]


def block_image(shape, blocks, maxs: int = MAX_SAMPLES):
    """Index image (rows x cols, -1 where no block) of a tensor's blocks seen as 2-D: leading dims x last dim."""
    shape = tuple(int(s) for s in shape)
    rows, cols = _view_shape(shape)
    ri, yedges = _samples(rows, maxs)
    ci, xedges = _samples(cols, maxs)
    img = np.full((len(ri), len(ci)), -1, dtype=np.int32)
    if len(shape) == 0:
        if blocks:
            img[:] = 0
        return img, xedges, yedges
    lead = shape[:-1]
    rmulti = np.unravel_index(ri, lead) if lead else ()
    for k, blk in enumerate(blocks):
        if any(a >= b for a, b in blk):
            continue
        rin = np.ones(len(ri), dtype=bool)
        for d, arr in enumerate(rmulti):
            a, b = blk[d]
            rin &= (arr >= a) & (arr < b)
        a, b = blk[-1]
        cin = (ci >= a) & (ci < b)
        img[np.ix_(rin, cin)] = k
    return img, xedges, yedges


def _runs(mask):
    """(start, stop) of each run of True in a 1-D bool array."""
    m = np.concatenate([[0], mask.astype(np.int8), [0]])
    d = np.diff(m)
    return zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1))


def _boundaries(img, xedges, yedges):
    segs = []
    diff_v = img[:, 1:] != img[:, :-1]  # boundary between column c and c+1
    for c in np.flatnonzero(diff_v.any(axis=0)):
        x = xedges[c + 1]
        for a, b in _runs(diff_v[:, c]):
            segs.append(((x, yedges[a]), (x, yedges[b])))
    diff_h = img[1:, :] != img[:-1, :]
    for r in np.flatnonzero(diff_h.any(axis=1)):
        y = yedges[r + 1]
        for a, b in _runs(diff_h[r, :]):
            segs.append(((xedges[a], y), (xedges[b], y)))
    return segs


def _fmt_value(v) -> str:
    if isinstance(v, (float, np.floating)):
        if not np.isfinite(v):
            return ""
        if float(v).is_integer():
            return str(int(v))
        return f"{v:.2g}"
    return str(v)


VALUE_FONT = 7.5


def tensor_block(shape, blocks, colours, *, values=None, labels=None, faded=(), title=None, note=None,
                 max_w: float = 2.6, max_h: float = 2.6, title_lines: int = 1, max_numbers: int = 144,
                 maxs: int = MAX_SAMPLES) -> Block:
    """A tensor's index space (leading dims as rows, the last dim as columns) with ``blocks[k]`` filled with
    ``colours[k]``; its numbers in the cells when ``values`` (dense, NaN where unknown) is given and they fit,
    else ``labels[k]`` in block k where it fits. ``faded``: blocks drawn pale (the identity summands of a Partial).
    ``note``: a red line under it. The block's ``mid`` is the middle of its axes."""
    shape = tuple(int(s) for s in shape)
    rows, cols = _view_shape(shape)
    nd = len(shape)
    strs = None
    empty = rows * cols == 0  # a 0-size dim: the frame alone, and a note that says so
    if empty and not note:
        note = "no elements: a dim of size 0"
    if values is not None and not empty and rows * cols <= max_numbers:
        v2 = np.asarray(values, dtype=float).reshape(rows, cols)
        strs = [[_fmt_value(v) for v in row] for row in v2]
        cw = max(0.2, max(text_width(s, VALUE_FONT) for row in strs for s in row) + 0.08)
        ch = max(0.2, line_height(VALUE_FONT) + 0.04)
        if cols * cw > max_w or rows * ch > max_h:
            strs = None
        else:
            w, h = cols * cw, rows * ch
    if strs is None:
        side = min(max_w, max_h, 2.2)
        unit = min(0.28, side / max(rows, cols, 1))
        w, h = max(0.45, cols * unit), max(0.3, rows * unit)
        w, h = min(w, max_w), min(h, max_h)
    xt = index_ticks(cols, w, TICK, True)
    yt = index_ticks(rows, h, TICK, False) if nd >= 2 else []
    left = _y_margin([str(i) for i in yt]) if nd >= 2 else 0.04
    xlabel = f"dim {nd - 1} ({cols})" if nd else "scalar"
    ylabel = ""
    if nd >= 2:
        cands = [f"dim 0 ({shape[0]})", "dim 0", "d0"] if nd == 2 else \
            [f"dims 0..{nd - 2} ({rows} rows)", f"dims 0..{nd - 2}", f"d0..{nd - 2}"]
        ylabel = _fit_label(cands, LABEL, h + 0.3)
    over = max(0.0, (text_width(ylabel, LABEL) - h) / 2) if ylabel else 0.0
    bw = left + max(w, text_width(xlabel, LABEL)) + 0.06
    tlines: list[str] = []
    if title:
        bw = max(bw, min(text_width(title, TITLE) + 0.02, max(bw, 2.0)))
        tlines = wrap(title, TITLE, bw - 0.02)
    nlines = max(len(tlines), title_lines if title else 0)
    top = nlines * line_height(TITLE) + (0.06 if nlines else 0.0) + over
    bottom = max(_x_margin(), over + 0.02)
    nlines_note = wrap(note, MIN_FONT, bw) if note else []
    bh = top + h + bottom + len(nlines_note) * line_height(MIN_FONT)
    img, xedges, yedges = block_image(shape, blocks, maxs)

    inset = max(0.0, (bw - 0.06 - left - max(w, text_width(xlabel, LABEL))) / 2)  # axes centred under the title

    def paint(sheet, x, y):
        for i, ln in enumerate(tlines):
            sheet.text(x + bw / 2, y + i * line_height(TITLE), ln, TITLE, ha="center")
        panel = Panel(sheet, x + inset + left, y + top, w, h, (0, max(cols, 1)), (0, max(rows, 1)))
        if not empty:  # a 0-size tensor has no cells: its frame alone
            cols_ = np.asarray(colours, dtype=float).reshape(-1, 3)
            pal = np.vstack([cols_, EMPTY[None, :]]) if len(cols_) else EMPTY[None, :]
            pal = pal.copy()
            for k in faded:
                pal[k] = pal[k] * 0.3 + 0.7
            panel.image(pal[img])
            segs = _boundaries(img, xedges, yedges)
            if segs:
                panel.add(LineCollection(segs, colors="black", linewidths=1.2))
        panel.frame(edgecolor="black", linewidth=1.2)
        _index_labels(panel, xt, yt, xlabel, ylabel, centre=0.5)
        if strs is not None:
            for i, row in enumerate(strs):
                for j, s in enumerate(row):
                    if s:
                        panel.text(j + 0.5, i + 0.5, s, VALUE_FONT, ha="center", va="center")
        elif labels is not None and len(blocks) <= 24:
            ys = (yedges[:-1] + yedges[1:]) / 2
            xs = (xedges[:-1] + xedges[1:]) / 2
            for k, lab in enumerate(labels):
                where = np.argwhere(img == k)
                if not lab or not len(where):
                    continue
                r0, r1 = where[:, 0].min(), where[:, 0].max() + 1
                c0, c1 = where[:, 1].min(), where[:, 1].max() + 1
                if len(where) != (r1 - r0) * (c1 - c0):
                    continue  # not one rectangle (blocks interleaved in the flattened view): no room to say
                bw_in = (xedges[c1] - xedges[c0]) / cols * w
                bh_in = (yedges[r1] - yedges[r0]) / rows * h
                tw, th = text_size(lab, MIN_FONT)
                if tw + 0.06 <= bw_in and th + 0.04 <= bh_in:
                    panel.text(xs[c0:c1].mean(), ys[r0:r1].mean(), lab, MIN_FONT, ha="center", va="center",
                               bbox=dict(boxstyle="round,pad=0.1", fc=(1, 1, 1, 0.7), lw=0))
        for i, ln in enumerate(nlines_note):
            sheet.text(x + inset, y + top + h + bottom + i * line_height(MIN_FONT), ln, MIN_FONT, color="#a00")

    return Block(bw, bh, paint, mid=top + h / 2)


def legend_block(entries, size: float = LABEL, max_w: float | None = None) -> Block:
    """A legend: (label, style) entries, style a dict of patch keywords (facecolor, edgecolor, hatch) or
    ``{"line": colour}`` for a line; one column, or rows that wrap at ``max_w`` inches."""
    sw, lh = 0.22, line_height(size)
    items = [(label, style, sw + 0.06 + text_width(label, size)) for label, style in entries]
    rows: list[list] = [[]]
    x = 0.0
    for it in items:
        if max_w is None:
            rows.append([it])
            continue
        if rows[-1] and x + it[2] > max_w:
            rows.append([])
            x = 0.0
        rows[-1].append(it)
        x += it[2] + 0.2
    rows = [r for r in rows if r]
    w = max((sum(it[2] for it in r) + 0.2 * (len(r) - 1) for r in rows), default=0.0)
    h = lh * len(rows)

    def paint(sheet, x0, y0):
        for i, row in enumerate(rows):
            x = x0
            y = y0 + i * lh
            for label, style, width in row:
                if "line" in style:
                    sheet.line(x, y + lh / 2, x + sw, y + lh / 2, color=style["line"], linewidth=1.5)
                else:
                    sheet.rect(x, y + lh * 0.15, sw, lh * 0.7, linewidth=0.6, **style)
                sheet.text(x + sw + 0.06, y + lh / 2, label, size, va="center")
                x += width + 0.2

    return Block(w, h, paint, mid=h / 2)
