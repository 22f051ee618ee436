"""Drawing primitives as blocks of known size: a mesh as a grid of cells, a tensor's index space cut into blocks."""

from __future__ import annotations

import math

import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.lines import Line2D
from matplotlib.patches import PathPatch
from matplotlib.path import Path

from .marks import fit_label, index_labels, x_margin, y_margin
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
)
from .style import LABEL, TICK, TITLE
from .tensor_draw import MAX_SAMPLES, block_image, tensor_block

__all__ = ["mesh_panels", "mesh_block", "tensor_block", "legend_block", "block_image", "MAX_CELL_TEXT", "MAX_SAMPLES",
           "MAX_W", "ids_text"]

MAX_CELL_TEXT = 256  # above this many cells, ids are left out (the picture stays cheap)
MAX_FACETS = 16
MAX_W = 8.4  # inches of content (806 px, 826 with the margins): a notebook output area at 1280 px, file browser open
MIN_CELL = 0.06  # inches (6 px): a row of ranks whose cells would be narrower is wrapped into rows of _WRAP_CELL
MAX_GRID_H = 8.4  # inches a mesh's grid may take down the page at MIN_CELL before its columns are split
_WRAP_CELL = 0.1
_ROUND = (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 50, 64, 100, 128, 200, 256, 500, 512, 1000, 1024)


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


def _split_panels(mesh, cell_rgb, max_facets: int, max_w: float):
    """([(title, 2-D ids, rgb)], split, panels of the mesh shown): the mesh's panels; a panel whose cells would be
    under MIN_CELL along its long side (2 x 512: rows of 512 ranks; 512 x 2: columns) is split into one row of
    cells per line along that side (split 'wide' or 'tall'), which the caller wraps, while the panels stay few."""
    ids, names = mesh.ids, mesh.dim_names
    base = [(t, ids2, _panel_rgb(cell_rgb, idx, ids.ndim)) for t, idx, ids2 in mesh_panels(mesh, max_facets)]
    rows, cols = base[0][1].shape
    room = max_w - y_margin([str(rows - 1)]) - 0.06
    wide = rows > 1 and cols * MIN_CELL > room
    tall = not wide and rows * MIN_CELL > MAX_GRID_H
    n_lines = rows if wide else cols
    if ids.ndim < 2 or not (wide or tall) or len(base) * n_lines > max_facets:
        return base, None, len(base)
    out = []
    for t, ids2, rgb in base:
        for i in range(n_lines):
            name = f"{names[-2]}={i}" if wide else f"{names[-1]}={i}"
            title = ", ".join(x for x in (t, name if n_lines > 1 else "") if x)
            out.append((title, ids2[i][None, :], rgb[i][None, :]) if wide else
                       (title, ids2[:, i][None, :], rgb[:, i][None, :]))
    return out, "wide" if wide else "tall", len(base)


def mesh_block(mesh, cell_rgb=None, *, hatched=(), devices=None, groups_axis=None, title=None, text_extra=None,
               max_w: float = MAX_W, max_facets: int = MAX_FACETS, notes=()) -> Block:
    """The mesh as a grid of cells (faceted over leading axes beyond two), ids (and ``devices``, ``text_extra``)
    in the cells when they fit, ``title`` above, wrapped; facets beyond ``max_facets`` summarized on a line below.
    A row of ranks too long for cells of ``MIN_CELL`` is wrapped into rows, each labelled with its first index.
    ``notes``: {rank or None: a line said below}; a line keyed by a rank is left out where that rank's cell shows
    its ``text_extra`` (the line says for every cell what the cells, too small or too many, cannot)."""
    ids = mesh.ids
    names = mesh.dim_names
    n_all = int(np.prod(ids.shape[:-2])) if ids.ndim > 2 else 1
    if cell_rgb is None:
        cell_rgb = np.broadcast_to(np.array([0.74, 0.84, 0.95]), ids.shape + (3,))
    panels, split, shown = _split_panels(mesh, cell_rgb, max_facets, max_w)
    rows, cols = panels[0][1].shape
    total = sum(p[1].size for p in panels)
    labels: dict = {}
    if total <= MAX_CELL_TEXT:
        for _, ids2, _ in panels:
            for r in map(int, ids2.ravel()):
                labels[r] = "\n".join([str(r)] + [str(d[r]) for d in (devices, text_extra) if d and r in d])
    one_line = all("\n" not in s for s in labels.values())
    fs = (9.0 if total <= 16 else 8.0) if one_line else MIN_FONT
    one_d = ids.ndim == 1
    # a split panel is one line of the mesh, its index in the panel's title: no y axis of its own
    no_y = one_d or split is not None
    yticks_all = [] if no_y else [str(i) for i in range(rows)]
    left = 0.04 if no_y else y_margin(yticks_all)
    bottom = x_margin()
    top = line_height(TITLE) + 0.04 if any(t for t, _, _ in panels) else 0.0
    room = max_w - left - 0.06
    per = 0  # ranks to a row of a wrapped row of ranks; 0: not wrapped
    if rows == 1 and cols * MIN_CELL > room:
        left = y_margin([str(cols - 1)])
        room = max_w - left - 0.06
        per = _wrap_width(cols, room, 0.3 if ids.ndim == 1 else 0.2, MAX_GRID_H / len(panels))
        labels = {}  # (cells that would have held them are not MIN_CELL wide)
    length = cols
    along = ids.ndim - 2 if split == "tall" else ids.ndim - 1  # the mesh axis a panel's row of cells runs along
    panel_rgb = [rgb for _, _, rgb in panels]
    if per:
        rows, cols = -(-cols // per), per
        panels = [(t, _wrap(ids2, per, -1), rgb) for t, ids2, rgb in panels]
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
    elif not labels:  # a row of ranks may use the width; a grid stays about 3 inches, unless its cells go too small
        cell = min(0.3, room / cols) if one_d else min(0.2, 3.2 / max(rows, cols))
        if cell < MIN_CELL and cols * MIN_CELL <= room and rows * MIN_CELL <= MAX_GRID_H:
            cell = MIN_CELL
    cell = min(cell, room / cols)
    xlabels = [f"{names[along]} ({ids.shape[along]})" + (f", {per} a row" if per else "")] + \
        ([names[-1]] if facets else [])
    fgap, ncols = (0.1 if facets else 0.0), 1
    if facets:  # facets to a row: one per index of the second axis of a 4-D mesh (its rows are the first), else all
        pref = int(ids.shape[-3]) if ids.ndim >= 4 and n % ids.shape[-3] == 0 else n
        ncols, cell, fs, labels = _facet_columns(n, pref, cols, cell, fs, labels, room, fgap)
    gw, gh = cols * cell, rows * cell
    x_room = max(gw, (room - (ncols - 1) * fgap) / ncols)
    xlabel = elide(fit_label(xlabels, LABEL, x_room), LABEL, x_room)
    # a y label reaches at most 0.2 in above and below its grid: clear of the x label and the next row's
    ylabel = "" if no_y or per else elide(fit_label([f"{names[-2]} ({ids.shape[-2]})", names[-2]], LABEL,
                                                     max(gh, 0.9)), LABEL, gh + 0.4)
    over = max(0.0, (text_width(ylabel, LABEL) - gh) / 2) if ylabel else 0.0
    col_w = max(gw, text_width(xlabel, LABEL))  # a facet's column: its grid, or its axis label when that is wider
    shift = 0.0 if facets else (col_w - gw) / 2  # one panel's grid sits over the middle of a wider x label
    if not facets:  # one panel, or facets each with their own axes (a wrapped row of ranks), side by side
        col_w += left + 0.06
        fgap = 0.2
        ncols = max(1, min(n, int((max_w + fgap) // (col_w + fgap))))
    titles, common = _facet_titles([t for t, _, _ in panels], col_w + (fgap * 0.8 if facets else 0.0))
    nrows = math.ceil(n / ncols)
    row_h = top + over + gh
    vgap = 0.06 if facets else 0.1 + max(bottom, over + 0.02)
    grid_w = (left + 0.06 if facets else 0.0) + ncols * col_w + (ncols - 1) * fgap
    grid_h = nrows * row_h + (nrows - 1) * vgap + max(bottom, over + 0.02)
    more = n_all - shown
    width = max(grid_w, min(text_width(title, TITLE), max(grid_w, 2.2), max_w)) if title else grid_w
    parts = [text_block(title, TITLE, width=width)] if title else []
    tx = np.asarray(index_ticks(cols, gw, TICK, True))
    ty = index_ticks(rows, gh, TICK, False) if per or not no_y else []
    hatched = set(int(r) for r in hatched)
    line = _group_line(labels, fs, cell) if groups_axis is not None else (0.3, 0.3, 2.5)

    def paint_grid(sheet, x0, y0):
        for k, (_, ids2, _) in enumerate(panels):
            c = k % ncols  # facets share their axes: index labels left of the first column, under each column's last
            px = x0 + left + c * (col_w + fgap) + ((col_w - gw) / 2 if facets else shift)
            show_x, show_y = (k + ncols >= n, c == 0) if facets else (True, True)
            py = y0 + (k // ncols) * (row_h + vgap) + top + over
            panel = Panel(sheet, px, py, gw, gh, (-0.5, cols - 0.5), (-0.5, rows - 0.5))
            panel.image(panel_rgb[k])
            if rows * cols <= 16384:  # cell borders as one collection: cheap for big meshes
                segs = [((j - 0.5, -0.5), (j - 0.5, rows - 0.5)) for j in range(1, cols)]
                segs += [((-0.5, i - 0.5), (cols - 0.5, i - 0.5)) for i in range(1, rows)]
                panel.add(LineCollection(segs, colors="white", linewidths=1.5 if cell >= 0.2 else 0.5))
            panel.frame(edgecolor="black", linewidth=0.8)
            index_labels(panel, tx if show_x else tx[:0], ty if show_y else [], xlabel if show_x else "",
                          ylabel if show_y else "", ystep=per or 1)
            if titles[k]:
                # above the reach of the y label, which a title wider than its grid would cross
                sheet.text(px + gw / 2, py - over - 0.03, titles[k], TITLE, ha="center", va="bottom")
            cross = []
            for (i, j), r in np.ndenumerate(ids2) if labels or (hatched and total <= 4096) else ():
                s = labels.get(int(r))
                if s is not None:
                    panel.text(j, i, s, fs, ha="center", va="center", color="black")
                if hatched and total <= 4096 and int(r) in hatched:
                    cross.append((j, i))
            if cross:  # one path for them all: a patch per cell took seconds per thousand cells to render
                panel.add(PathPatch(_cells_path(cross), fill=False, hatch="xx", linewidth=0,
                                    edgecolor=(0.2, 0.2, 0.2, 0.5)))
            if groups_axis is not None and not per:
                _draw_groups(panel, ids.ndim, groups_axis, rows, cols, line=line)
            elif groups_axis is not None and groups_axis == along:  # one line, through each wrapped row
                _draw_groups(panel, 1, 0, rows - 1, cols, line=line)
                _draw_groups(panel, 1, 0, 1, length - per * (rows - 1), at=rows - 1, line=line)

    parts.append(Block(grid_w, grid_h, paint_grid, mid=None))
    notes = [line for r, line in dict(notes).items() if r is None or r not in labels or r not in (text_extra or ())]
    if groups_axis is not None and ((ids.ndim > 2 and groups_axis < ids.ndim - 2) or (split and groups_axis != along)):
        notes.append("groups: the same cell across panels")
    if common:
        notes.append(common)
    if more > 0:
        notes.append(f"… {more} more panels")
    if per:
        line_of = f"each panel: {names[along]} ({ids.shape[along]})" if split else \
            " × ".join(f"{a} ({n})" for a, n in zip(names[-2:], ids.shape[-2:]))
        notes.append(f"{line_of}: wrapped {per} ranks to a row; the left labels are each row's first index")
    if cell < MIN_CELL:
        notes.append(f"squeezed: cells {cell * DPI:.1f} px wide")
    for note in notes:
        parts.append(text_block(note, MIN_FONT, width=max(width, text_width(note, MIN_FONT))))
    out = vstack(parts, gap=0.06)
    head = parts[0].h + 0.06 if title else 0.0
    out.mid = head + top + over + gh / 2 if nrows == 1 else out.h / 2
    return out


def _cells_path(cells) -> Path:
    """One compound path of the unit squares centred on the (x, y) ``cells`` (a panel's data coordinates)."""
    xy = np.asarray(cells, dtype=float).reshape(-1, 1, 2)
    corners = np.array([[-0.5, -0.5], [0.5, -0.5], [0.5, 0.5], [-0.5, 0.5], [-0.5, -0.5]])
    codes = np.tile([Path.MOVETO, Path.LINETO, Path.LINETO, Path.LINETO, Path.CLOSEPOLY], len(xy))
    return Path((xy + corners).reshape(-1, 2), codes)


def _facet_titles(titles: list, room: float) -> tuple[list, str]:
    """(titles, a note) for panels ``room`` inches wide. When a title does not fit, the leading 'axis=index' parts
    every panel shares are said once in the note; then, if needed, titles keep only the indices ('0,1,0') and the
    note names their axes; what still does not fit loses its leading indices (the last ones tell panels apart)."""
    if all(text_width(t, TITLE) <= room for t in titles):
        return titles, ""
    parts = [t.split(", ") for t in titles]
    k = 0
    while len(parts) > 1 and all(len(p) > k + 1 and p[k] == parts[0][k] for p in parts):
        k += 1
    note = [f"every panel shown: {', '.join(parts[0][:k])}"] if k else []
    rest = [", ".join(p[k:]) for p in parts]
    if all(text_width(t, TITLE) <= room for t in rest):
        return rest, "; ".join(note)
    note.append(f"panel titles: ({', '.join(q.split('=')[0] for q in parts[0][k:])})")
    out = []
    for p in parts:
        idx = [q.split("=")[-1] for q in p[k:]]
        fits = [i for i in range(len(idx)) if text_width(("…" if i else "") + ",".join(idx[i:]), TITLE) <= room]
        out.append(("…" if fits[0] else "") + ",".join(idx[fits[0]:]) if fits else elide(idx[-1], TITLE, room))
    return out, "; ".join(note)


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


def _wrap_width(length: int, room: float, cap: float, budget: float) -> int:
    """Ranks to a row when a row of ``length`` ranks is wrapped into ``room`` inches: a round number giving cells
    of about _WRAP_CELL, or more to a row (smaller cells, under MIN_CELL at last) while the rows would run longer
    than ``budget`` inches down the page: a picture of 65,536 ranks stays as tall as one of 4,096."""
    per = max(k for k in _ROUND if k == 1 or k * _WRAP_CELL <= room)
    wider = [k for k in _ROUND if per < k < length] + [2 ** e for e in range(11, 17) if per < 2 ** e < length]
    for k in [per] + wider + [length]:
        if -(-length // k) * min(cap, room / k) <= budget:
            return k
    return length


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
