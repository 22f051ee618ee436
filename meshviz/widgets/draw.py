"""Drawing primitives on matplotlib axes: a mesh as a grid of cells, a tensor's index space cut into blocks."""

from __future__ import annotations

import math

import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.patches import Rectangle

from .style import EMPTY

__all__ = ["mesh_panels", "draw_mesh", "draw_blocks", "MAX_CELL_TEXT", "MAX_SAMPLES"]

MAX_CELL_TEXT = 256  # above this many cells, ids are left out (the picture stays cheap)
MAX_SAMPLES = 384  # pixels per side a tensor picture samples at most
MAX_FACETS = 16


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
    if cell_rgb is None:
        return None
    if ndim == 1:
        return cell_rgb[None, :]
    return cell_rgb[idx] if idx else cell_rgb


def draw_mesh(fig, spec, mesh, cell_rgb=None, *, hatched=(), devices=None, groups_axis=None, title=None,
              text_extra=None, max_facets: int = MAX_FACETS):
    """Draw ``mesh`` into ``spec`` (a SubplotSpec); returns the axes. ``cell_rgb``: colours, shape mesh.shape+(3,)."""
    panels = mesh_panels(mesh, max_facets)
    n = len(panels)
    ncols = min(n, 4)
    nrows = math.ceil(n / ncols)
    gs = spec.subgridspec(nrows, ncols, wspace=0.25, hspace=0.45)
    ids = mesh.ids
    names = mesh.dim_names
    if cell_rgb is None:
        cell_rgb = np.broadcast_to(np.array([0.74, 0.84, 0.95]), ids.shape + (3,))
    total_cells = sum(p[2].size for p in panels)
    show_text = total_cells <= MAX_CELL_TEXT
    hatched = set(int(r) for r in hatched)
    axes = []
    for k, (ptitle, idx, ids2) in enumerate(panels):
        ax = fig.add_subplot(gs[k // ncols, k % ncols])
        axes.append(ax)
        rgb = _panel_rgb(cell_rgb, idx, ids.ndim)
        rows, cols = ids2.shape
        ax.imshow(rgb, interpolation="nearest", aspect="equal", extent=(-0.5, cols - 0.5, rows - 0.5, -0.5))
        if rows * cols <= 16384:  # cell borders as one collection: cheap for big meshes
            segs = [((j - 0.5, -0.5), (j - 0.5, rows - 0.5)) for j in range(1, cols)]
            segs += [((-0.5, i - 0.5), (cols - 0.5, i - 0.5)) for i in range(1, rows)]
            ax.add_collection(LineCollection(segs, colors="white", linewidths=1.5 if rows * cols <= 256 else 0.5))
        step_x = max(1, cols // 8)
        step_y = max(1, rows // 8)
        ax.set_xticks(np.arange(0, cols, step_x))
        ax.set_yticks(np.arange(0, rows, step_y))
        ax.tick_params(labelsize=7, length=2)
        if ids.ndim == 1:
            ax.set_yticks([])
            ax.set_xlabel(f"{names[0]} ({ids.shape[0]})", fontsize=8)
        else:
            ax.set_xlabel(f"{names[-1]} ({ids.shape[-1]})", fontsize=8)
            ax.set_ylabel(f"{names[-2]} ({ids.shape[-2]})", fontsize=8)
        if ptitle:
            ax.set_title(ptitle, fontsize=8)
        if show_text:
            fs = 10 if total_cells <= 16 else 8 if total_cells <= 64 else 6
            for (i, j), r in np.ndenumerate(ids2):
                r = int(r)
                label = str(r)
                if devices and r in devices:
                    label += "\n" + str(devices[r])
                if text_extra and r in text_extra:
                    label += "\n" + str(text_extra[r])
                ax.text(j, i, label, ha="center", va="center", fontsize=fs if "\n" not in label else fs - 2,
                        color="black")
        if hatched and total_cells <= 4096:
            for (i, j), r in np.ndenumerate(ids2):
                if int(r) in hatched:
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="xx", linewidth=0,
                                           edgecolor=(0.2, 0.2, 0.2, 0.5)))
        if groups_axis is not None:
            _draw_groups(ax, ids.ndim, groups_axis, rows, cols)
    if len(panels) < int(np.prod(ids.shape[:-2])) if ids.ndim > 2 else False:
        axes[-1].text(1.02, 0.5, f"... {int(np.prod(ids.shape[:-2])) - len(panels)} more panels",
                      transform=axes[-1].transAxes, fontsize=7, va="center")
    if title:
        if len(axes) == 1:
            axes[0].set_title(title, fontsize=9)
        else:
            fig.text(*_spec_top(fig, spec), title, ha="center", va="bottom", fontsize=9)
    return axes


def _spec_top(fig, spec):
    pos = spec.get_position(fig)
    return (pos.x0 + pos.x1) / 2, pos.y1 + 0.01


def _draw_groups(ax, ndim, axis, rows, cols):
    """Lines through the cells that talk: one per line of the mesh along ``axis`` (within this panel)."""
    kw = dict(color="black", alpha=0.55, linewidth=2.5, marker="o", markersize=3, solid_capstyle="round")
    off = 0.3  # beside the ids, not over them
    if ndim == 1 or axis == ndim - 1:
        if cols > 1:
            for i in range(rows):
                ax.plot([0, cols - 1], [i + off, i + off], **kw)
    elif axis == ndim - 2:
        if rows > 1:
            for j in range(cols):
                ax.plot([j + off, j + off], [0, rows - 1], **kw)
    else:
        ax.text(0.5, -0.02, "groups: the same cell across panels", transform=ax.transAxes, ha="center",
                va="top", fontsize=6)


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


def draw_blocks(ax, shape, blocks, colours, *, values=None, labels=None, faded=(), title=None,
                max_numbers: int = 144, maxs: int = MAX_SAMPLES):
    """Draw a tensor's index space with ``blocks[k]`` filled with ``colours[k]``; returns the index image.

    ``values``: a dense array of ``shape`` (NaN where unknown) whose numbers are written in the cells when the
    tensor is small. ``faded``: indices of blocks drawn pale (the identity summands of a Partial).
    """
    shape = tuple(int(s) for s in shape)
    img, xedges, yedges = block_image(shape, blocks, maxs)
    colours = np.asarray(colours, dtype=float).reshape(-1, 3)
    pal = np.vstack([colours, EMPTY[None, :]]) if len(colours) else EMPTY[None, :]
    pal = pal.copy()
    for k in faded:
        pal[k] = pal[k] * 0.3 + 0.7
    rgb = pal[img]  # -1 picks the last row: EMPTY
    rows, cols = _view_shape(shape)
    ax.imshow(rgb, interpolation="nearest", aspect="auto" if rows * 4 < cols or cols * 4 < rows else "equal",
              extent=(0, cols, rows, 0))
    segs = _boundaries(img, xedges, yedges)
    if segs:
        ax.add_collection(LineCollection(segs, colors="black", linewidths=1.2))
    ax.add_patch(Rectangle((0, 0), cols, rows, fill=False, edgecolor="black", linewidth=1.2))
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.tick_params(labelsize=7, length=2)
    nd = len(shape)
    ax.set_xlabel(f"dim {nd - 1} ({cols})" if nd else "scalar", fontsize=8)
    if nd >= 2:
        ax.set_ylabel(f"dim 0 ({shape[0]})" if nd == 2 else f"dims 0..{nd - 2} ({rows} rows)", fontsize=8)
    else:
        ax.set_yticks([])
    if cols <= 16:
        ax.set_xticks(np.arange(cols) + 0.5, [str(i) for i in range(cols)])
    if rows <= 16 and nd >= 2:
        ax.set_yticks(np.arange(rows) + 0.5, [str(i) for i in range(rows)])
    small = values is not None and rows * cols <= max_numbers and rows <= maxs and cols <= maxs
    if small:
        v2 = np.asarray(values).reshape(rows, cols)
        fs = 9 if rows * cols <= 36 else 7 if rows * cols <= 80 else 6
        for (i, j), v in np.ndenumerate(v2):
            ax.text(j + 0.5, i + 0.5, _fmt_value(v), ha="center", va="center", fontsize=fs)
    elif labels is not None and len(blocks) <= 24:
        ys = (yedges[:-1] + yedges[1:]) / 2
        xs = (xedges[:-1] + xedges[1:]) / 2
        for k, lab in enumerate(labels):
            where = np.argwhere(img == k)
            if lab and len(where):
                ax.text(xs[where[:, 1]].mean(), ys[where[:, 0]].mean(), lab, ha="center", va="center",
                        fontsize=7, bbox=dict(boxstyle="round,pad=0.15", fc=(1, 1, 1, 0.7), lw=0))
    if title:
        ax.set_title(title, fontsize=9)
    return img
