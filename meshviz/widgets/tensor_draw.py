"""A tensor's index space (leading dims as rows, the last dim as columns) cut into coloured blocks."""

from __future__ import annotations

import numpy as np
from matplotlib.collections import LineCollection

from .marks import fit_label, index_labels, x_margin, y_margin
from .sheet import DPI, MIN_FONT, Block, Panel, index_ticks, line_height, text_size, text_width, wrap
from .style import EMPTY, LABEL, TICK, TITLE

__all__ = ["tensor_block", "block_image", "MAX_SAMPLES", "MAX_LABELLED", "VALUE_FONT"]

MAX_SAMPLES = 384  # pixels per side a tensor picture samples at most
MAX_LABELLED = 24  # blocks a picture names (their ranks in them) at most


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
    if len(lead) <= 1:  # each block a rectangle of the sampled rows and columns: two searches per block
        blk = np.asarray(blocks, dtype=np.int64).reshape(len(blocks), len(shape), 2)
        (r0, r1) = (np.searchsorted(ri, blk[:, 0, 0]), np.searchsorted(ri, blk[:, 0, 1])) if lead else \
            (np.zeros(len(blk), dtype=np.int64), np.full(len(blk), len(ri)))
        c0, c1 = np.searchsorted(ci, blk[:, -1, 0]), np.searchsorted(ci, blk[:, -1, 1])
        live = (blk[:, :, 0] < blk[:, :, 1]).all(axis=1) & (r0 < r1) & (c0 < c1)
        for k in np.flatnonzero(live).tolist():
            img[r0[k]:r1[k], c0[k]:c1[k]] = k
        return img, xedges, yedges
    got = _cells_image(shape, blocks, ri, ci)
    if got is not None:
        return got, xedges, yedges
    rmulti = np.unravel_index(ri, lead)
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


def _cells_image(shape, blocks, ri, ci):
    """block_image's picture of a tensor of 3 or more dims, or None: the blocks cut each dim at their bounds into
    segments; a grid of those (block k in the segments it covers, the last block where they overlap) read at the
    sampled elements. None when that grid would be much larger than the blocks (their bounds all differ): one
    np.ix_ per block of 65,536 took most of a second."""
    blk = np.asarray(blocks, dtype=np.int64).reshape(len(blocks), len(shape), 2)
    live = np.flatnonzero((blk[:, :, 0] < blk[:, :, 1]).all(axis=1))
    blk = blk[live]
    cuts = [np.unique(blk[:, d, :]) for d in range(len(shape))]
    size = int(np.prod([max(len(c) - 1, 1) for c in cuts], dtype=float))
    if size > 4 * len(blk) + 4096:
        return None
    grid = np.full([max(len(c) - 1, 1) for c in cuts], -1, dtype=np.int32)
    lo = np.stack([np.searchsorted(c, blk[:, d, 0]) for d, c in enumerate(cuts)], 1)
    hi = np.stack([np.searchsorted(c, blk[:, d, 1]) for d, c in enumerate(cuts)], 1)
    one = (hi - lo == 1).all(axis=1)
    if len(blk):  # a block of one segment each dim: all at once, the last block in a segment kept (as one by one)
        np.maximum.at(grid, tuple(lo[one].T), live[one].astype(np.int32))
    for k in np.flatnonzero(~one).tolist():  # larger ones in order, each over the blocks before it
        cell = tuple(slice(a, b) for a, b in zip(lo[k], hi[k]))
        grid[cell] = np.maximum(grid[cell], live[k])
    at = list(np.unravel_index(ri, shape[:-1])) + [ci]
    seg = [np.searchsorted(c, x, side="right") - 1 for c, x in zip(cuts, at)]
    inside = [(s >= 0) & (s < len(c) - 1) for s, c in zip(seg, cuts)]
    rows_in = np.logical_and.reduce(inside[:-1])
    rsel = tuple(np.where(rows_in, s, 0)[:, None] for s in seg[:-1])
    csel = np.where(inside[-1], seg[-1], 0)[None, :]
    return np.where(rows_in[:, None] & inside[-1][None, :], grid[rsel + (csel,)], -1).astype(np.int32)


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


def _border_widths(segs, sx: float, sy: float):
    """(segments, line width) for the block borders, vertical and horizontal apart: thinner where the borders run
    closer than 8 px (median), none closer than 3 px (a solid black patch): the colours alone tell the blocks."""
    out = []
    for vertical, scale in ((True, sx), (False, sy)):
        part = [sg for sg in segs if (sg[0][0] == sg[1][0]) == vertical]
        at = np.unique([sg[0][0] if vertical else sg[0][1] for sg in part])
        gap = float(np.median(np.diff(at))) * scale * DPI if len(at) > 1 else np.inf
        if part and gap >= 3:
            out.append((part, 1.2 if gap >= 8 else 0.5))
    return out


def _shorter(label: str):
    """A block's list of ranks, then shorter ones ('512,513,514,…', '512,513,…', '512,…') for a narrow block."""
    yield label
    parts = label.rstrip(",…").split(",")
    for k in range(len(parts) - 1, 0, -1):
        yield ",".join(parts[:k]) + ",…"


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
                 maxs: int = MAX_SAMPLES, title_w: float = 2.0) -> Block:
    """A tensor's index space (leading dims as rows, the last dim as columns) with ``blocks[k]`` filled with
    ``colours[k]``; its numbers in the cells when ``values`` (dense, NaN where unknown) is given and they fit,
    else ``labels[k]`` in block k where it fits. ``faded``: blocks drawn pale (the identity summands of a Partial).
    ``note``: a red line under it. ``title_w``: the inches a title may widen the block to (it wraps beyond). The
    block's ``mid`` is the middle of its axes."""
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
    left = y_margin([str(i) for i in yt]) if nd >= 2 else 0.04
    xlabel = f"dim {nd - 1} ({cols})" if nd else "scalar"
    ylabel = ""
    if nd >= 2:
        cands = [f"dim 0 ({shape[0]})", "dim 0", "d0"] if nd == 2 else \
            [f"dims 0..{nd - 2} ({rows} rows)", f"dims 0..{nd - 2}", f"d0..{nd - 2}"]
        ylabel = fit_label(cands, LABEL, h + 0.3)
    over = max(0.0, (text_width(ylabel, LABEL) - h) / 2) if ylabel else 0.0
    bw = left + max(w, text_width(xlabel, LABEL)) + 0.06
    tlines: list[str] = []
    if title:
        bw = max(bw, min(text_width(title, TITLE) + 0.02, max(bw, title_w)))
        tlines = wrap(title, TITLE, bw - 0.02)
    nlines = max(len(tlines), title_lines if title else 0)
    top = nlines * line_height(TITLE) + (0.06 if nlines else 0.0) + over
    bottom = max(x_margin(), over + 0.02)
    inset = max(0.0, (bw - 0.06 - left - max(w, text_width(xlabel, LABEL))) / 2)  # axes centred under the title
    nlines_note = wrap(note, MIN_FONT, bw - inset) if note else []  # from the axes' left to the block's right
    bh = top + h + bottom + len(nlines_note) * line_height(MIN_FONT)
    img, xedges, yedges = block_image(shape, blocks, maxs)

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
            for segs, lw in _border_widths(_boundaries(img, xedges, yedges), w / max(cols, 1), h / max(rows, 1)):
                panel.add(LineCollection(segs, colors="black", linewidths=lw))
        panel.frame(edgecolor="black", linewidth=1.2)
        index_labels(panel, xt, yt, xlabel, ylabel, centre=0.5)
        if strs is not None:
            for i, row in enumerate(strs):
                for j, s in enumerate(row):
                    if s:
                        panel.text(j + 0.5, i + 0.5, s, VALUE_FONT, ha="center", va="center")
        elif labels is not None and len(blocks) <= MAX_LABELLED:
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
                lab = next((c for c in _shorter(lab) if text_size(c, MIN_FONT)[0] + 0.06 <= bw_in), lab)
                tw, th = text_size(lab, MIN_FONT)
                if tw + 0.06 <= bw_in and th + 0.04 <= bh_in:
                    panel.text(xs[c0:c1].mean(), ys[r0:r1].mean(), lab, MIN_FONT, ha="center", va="center",
                               bbox=dict(boxstyle="round,pad=0.1", fc=(1, 1, 1, 0.7), lw=0))
        for i, ln in enumerate(nlines_note):
            sheet.text(x + inset, y + top + h + bottom + i * line_height(MIN_FONT), ln, MIN_FONT, color="#a00")

    return Block(bw, bh, paint, mid=top + h / 2)
