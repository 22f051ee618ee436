"""Figures laid out in inches: measured text, blocks in rows and columns, and the check that no two texts collide."""

from __future__ import annotations

import re
import threading
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.image import BboxImage
from matplotlib.text import Text
from matplotlib.transforms import Affine2D, Bbox, TransformedBbox, offset_copy

__all__ = ["DPI", "MIN_FONT", "Block", "Sheet", "Panel", "text_width", "line_height", "text_size", "wrap", "elide",
           "text_block", "hstack", "vstack", "spacer", "index_ticks", "new_figure", "text_boxes", "collisions"]

DPI = 96  # CSS pixels per inch: a figure w inches wide is shown w * 96 px wide at 100% zoom, never rescaled
MIN_FONT = 7.0  # points: 9.3 px at DPI, the smallest text a view draws
LINESPACING = 1.2

_lock = threading.Lock()
_WORD = re.compile(r" (?![^\[(]*[\])])")  # a space outside brackets: '[2, 2]' stays on one line
_renderer: RendererAgg | None = None


def new_figure(width: float, height: float) -> Figure:
    """A figure of its own (no pyplot state), safe to build on any thread."""
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


@lru_cache(maxsize=8192)
def _extent(s: str, size: float, family: str | None, weight: str) -> tuple[float, float, float]:
    global _renderer
    fp = FontProperties(size=size, family=family, weight=weight)
    with _lock:
        if _renderer is None:
            _renderer = RendererAgg(10, 10, DPI)
        w, h, d = _renderer.get_text_width_height_descent(s, fp, ismath=False)
    return w / DPI, h / DPI, d / DPI


def text_width(s: str, size: float, family: str | None = None, weight: str = "normal") -> float:
    """Inches the widest line of ``s`` takes at ``size`` points: the sum of its characters' advances (kerning
    only ever narrows a line, so this is never less than what matplotlib draws, and it is cheap to ask often)."""
    size = float(size)
    return max((sum(_extent(c, size, family, weight)[0] for c in line) for line in str(s).split("\n")), default=0.0)


def line_height(size: float, family: str | None = None) -> float:
    """Inches from one line of text to the next at ``size`` points."""
    return _extent("lp", float(size), family, "normal")[1] * LINESPACING


def text_size(s: str, size: float, family: str | None = None, weight: str = "normal") -> tuple[float, float]:
    """(width, height) in inches of ``s`` (lines split at newlines) as matplotlib lays it out."""
    n = str(s).count("\n") + 1
    h1 = _extent("lp", float(size), family, "normal")[1]
    return text_width(s, size, family, weight), h1 + (n - 1) * h1 * LINESPACING


def elide(s: str, size: float, width: float, family: str | None = None, weight: str = "normal") -> str:
    """``s`` cut at the end with '…' so that it fits ``width`` inches (whole when it fits)."""
    s = str(s)
    if text_width(s, size, family, weight) <= width:
        return s
    lo, hi = 0, len(s)
    while lo < hi:  # the longest prefix that fits with the ellipsis
        mid = (lo + hi + 1) // 2
        if text_width(s[:mid].rstrip() + "…", size, family, weight) <= width:
            lo = mid
        else:
            hi = mid - 1
    return s[:lo].rstrip() + "…"


def wrap(s: str, size: float, width: float, family: str | None = None, indent: str = "",
         weight: str = "normal") -> list[str]:
    """``s`` broken at spaces into lines of at most ``width`` inches (a word longer than a line is broken too);
    continuation lines start with ``indent``. Widths are summed as they grow: a line of thousands of words is cheap."""
    size = float(size)

    def adv(c: str) -> float:
        return _extent(c, size, family, weight)[0]

    def grow(w: float, text: str) -> float:
        for c in text:
            w += adv(c)
        return w

    out: list[str] = []
    for para in str(s).split("\n"):
        line, lw = "", 0.0
        for word in _WORD.split(para):
            cand_w = grow(lw + adv(" "), word) if line else grow(0.0, word)
            if cand_w <= width or not line.strip():
                line, lw = (f"{line} {word}" if line else word), cand_w
            else:
                out.append(line)
                line = indent + word
                lw = grow(0.0, line)
            while lw > width and len(line.strip()) > 1:
                ends = list(accumulate(adv(c) for c in line))  # ends[k]: the width of line[:k + 1]
                cut = max(min(len(indent) + 1, len(line) - 1), min(len(line) - 1, bisect_right(ends, width)))
                out.append(line[:cut])
                line = indent + line[cut:]
                lw = grow(0.0, line)
        out.append(line)
    return out


def index_ticks(n: int, length: float, size: float, horizontal: bool) -> list[int]:
    """Indices 0..n-1 to label along ``length`` inches: every k-th, with k the smallest 'round' step whose labels
    do not touch (at ``size`` points; side by side when ``horizontal``, stacked otherwise)."""
    if n <= 0 or length <= 0:
        return []
    pitch = length / n
    widest = text_width(str(n - 1), size) if horizontal else _extent("0", float(size), None, "normal")[1]
    need = widest + (0.06 if horizontal else 0.03)
    for k in (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 50, 64, 100, 128, 200, 250, 256, 500, 512, 1000, 1024):
        if k * pitch >= need:
            return list(range(0, n, k))
    return [0]


class Sheet:
    """A figure whose positions are inches from its top-left corner."""

    def __init__(self, width: float, height: float):
        self.w, self.h = float(width), float(height)
        self.fig = new_figure(self.w, self.h)

    def axes(self, x: float, y: float, w: float, h: float):
        """Axes whose drawing area is ``w`` x ``h`` inches with its top-left corner at (x, y)."""
        return self.fig.add_axes((x / self.w, 1 - (y + h) / self.h, w / self.w, h / self.h))

    def text(self, x: float, y: float, s: str, size: float, va: str = "top", ha: str = "left", **kw):
        return self.fig.text(x / self.w, 1 - y / self.h, s, fontsize=size, va=va, ha=ha, **kw)

    def rect(self, x: float, y: float, w: float, h: float, **kw):
        """A rectangle with its top-left corner at (x, y), ``w`` x ``h`` inches."""
        from matplotlib.patches import Rectangle

        return self.fig.add_artist(Rectangle(self.point(x, y + h), w / self.w, h / self.h,
                                             transform=self.fig.transFigure, **kw))

    def line(self, x0: float, y0: float, x1: float, y1: float, **kw):
        from matplotlib.lines import Line2D

        (a, b), (c, d) = self.point(x0, y0), self.point(x1, y1)
        return self.fig.add_artist(Line2D([a, c], [b, d], transform=self.fig.transFigure, **kw))

    def point(self, x: float, y: float) -> tuple[float, float]:
        """Figure coordinates (0..1, from the bottom-left) of the point (x, y) inches from the top-left."""
        return x / self.w, 1 - y / self.h


class Panel:
    """A ``w`` x ``h`` inch rectangle of a sheet, top-left at (x, y), with data coordinates: ``xlim`` left to right,
    ``ylim`` top to bottom. Draws pictures, lines, patches and text straight onto the figure (no Axes: a picture
    of many panels costs a fraction of what as many Axes would)."""

    def __init__(self, sheet: Sheet, x: float, y: float, w: float, h: float, xlim=(0.0, 1.0), ylim=(0.0, 1.0)):
        self.sheet, self.fig = sheet, sheet.fig
        self.x, self.y, self.w, self.h = x, y, w, h
        self.xlim, self.ylim = tuple(xlim), tuple(ylim)
        sx = w / (xlim[1] - xlim[0])
        sy = h / (ylim[1] - ylim[0])
        # data -> inches from the figure's bottom-left -> pixels
        self.trans = Affine2D().scale(sx, -sy).translate(x - xlim[0] * sx, sheet.h - y + ylim[0] * sy) \
            + self.fig.dpi_scale_trans
        self._offsets: dict = {}

    def image(self, rgb) -> None:
        bbox = TransformedBbox(Bbox.from_bounds(self.x, self.sheet.h - self.y - self.h, self.w, self.h),
                               self.fig.dpi_scale_trans)
        im = BboxImage(bbox, interpolation="nearest", origin="upper")
        im.set_data(np.asarray(rgb))
        self.fig.add_artist(im)

    def add(self, artist):
        """``artist`` (a collection, patch or line) in this panel's data coordinates."""
        artist.set_transform(self.trans)
        return self.fig.add_artist(artist)

    def text(self, x, y, s, size, dx: float = 0.0, dy: float = 0.0, **kw):
        """Text at (x, y) in data coordinates, moved ``dx``, ``dy`` points (right, up)."""
        key = (dx, dy)
        if key not in self._offsets:
            self._offsets[key] = offset_copy(self.trans, self.fig, x=dx, y=dy, units="points") if key != (0, 0) \
                else self.trans
        return self.fig.text(x, y, s, fontsize=size, transform=self._offsets[key], **kw)

    def frame(self, **kw) -> None:
        self.sheet.rect(self.x, self.y, self.w, self.h, fill=False, **kw)


@dataclass
class Block:
    """A rectangle of ``w`` x ``h`` inches that knows how to paint itself at (x, y) on a Sheet. ``mid``: the height
    (from the block's top) things beside it line up with, e.g. the middle of its axes."""

    w: float
    h: float
    paint: Callable[[Sheet, float, float], None] = field(repr=False)
    mid: float | None = None

    def figure(self, margin: float = 0.1) -> Figure:
        sheet = Sheet(self.w + 2 * margin, self.h + 2 * margin)
        self.paint(sheet, margin, margin)
        return sheet.fig


def spacer(w: float = 0.0, h: float = 0.0) -> Block:
    return Block(w, h, lambda sheet, x, y: None)


def text_block(lines, size: float, *, width: float | None = None, family: str | None = None,
               weight: str = "normal", ha: str = "left", indent: str = "", **kw) -> Block:
    """Lines of text; with ``width``, each is wrapped to it (never cut; continuation lines start with ``indent``)
    and the block is that wide."""
    if isinstance(lines, str):
        lines = [lines]
    out: list[str] = []
    for ln in lines:
        out += wrap(ln, size, width, family, indent, weight) if width is not None else str(ln).split("\n")
    lh = line_height(size, family)
    w = width if width is not None else max((text_width(ln, size, family, weight) for ln in out), default=0.0)
    h = lh * len(out)

    def paint(sheet, x, y):
        for i, ln in enumerate(out):
            if ln:
                sheet.text(x + (w / 2 if ha == "center" else 0), y + i * lh, ln, size, ha=ha, family=family,
                           fontweight=weight, **kw)

    return Block(w, h, paint, mid=h / 2)


def hstack(blocks, gap: float = 0.25, align: str = "top") -> Block:
    """Blocks side by side; ``align``: 'top', or 'mid' to line up their ``mid`` heights."""
    blocks = [b for b in blocks if b is not None]
    if align == "mid":
        above = max((b.mid if b.mid is not None else b.h / 2) for b in blocks)
        offs = [above - (b.mid if b.mid is not None else b.h / 2) for b in blocks]
    else:
        offs = [0.0] * len(blocks)
    w = sum(b.w for b in blocks) + gap * max(0, len(blocks) - 1)
    h = max((o + b.h for o, b in zip(offs, blocks)), default=0.0)

    def paint(sheet, x, y):
        for o, b in zip(offs, blocks):
            b.paint(sheet, x, y + o)
            x += b.w + gap

    mid = offs[0] + (blocks[0].mid if blocks and blocks[0].mid is not None else 0) if align == "mid" else None
    return Block(w, h, paint, mid=mid)


def vstack(blocks, gap: float = 0.12, align: str = "left") -> Block:
    blocks = [b for b in blocks if b is not None]
    w = max((b.w for b in blocks), default=0.0)
    h = sum(b.h for b in blocks) + gap * max(0, len(blocks) - 1)

    def paint(sheet, x, y):
        for b in blocks:
            b.paint(sheet, x + ((w - b.w) / 2 if align == "center" else 0), y)
            y += b.h + gap

    return Block(w, h, paint)


# -- the check ---------------------------------------------------------------------------------------------------

def _tick_labels(ax):
    out = []
    for axis in (ax.xaxis, ax.yaxis):
        if not axis.get_visible():
            continue
        lo, hi = sorted(axis.get_view_interval())
        for tick, loc in zip(axis.get_major_ticks(), axis.get_majorticklocs()):
            if lo - 1e-9 <= loc <= hi + 1e-9:
                out += [t for t in (tick.label1, tick.label2) if t.get_visible()]
    return out


def text_boxes(fig: Figure) -> list[tuple[Text, object]]:
    """(text, window extent in pixels) of every visible, non-empty text a draw of ``fig`` puts on the canvas."""
    global _renderer
    if fig.legends or any(len(ax.get_xticks()) or len(ax.get_yticks()) or ax.get_legend() for ax in fig.axes):
        fig.draw_without_rendering()  # places matplotlib's own tick labels and legends, rasterizing nothing
    if fig.dpi == DPI:  # one renderer for every figure: matplotlib caches text metrics per renderer
        with _lock:
            if _renderer is None:
                _renderer = RendererAgg(10, 10, DPI)
        renderer = _renderer
    else:
        renderer = fig.canvas.get_renderer()
    texts: list[Text] = list(fig.texts)
    for leg in fig.legends:
        texts += list(leg.get_texts())
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        texts += list(ax.texts) + [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label]
        texts += _tick_labels(ax)
        leg = ax.get_legend()
        if leg is not None:
            texts += list(leg.get_texts())
    out = []
    seen = set()
    for t in texts:
        if id(t) in seen or not t.get_visible() or not t.get_text().strip():
            continue
        seen.add(id(t))
        out.append((t, t.get_window_extent(renderer)))
    return out


def collisions(fig: Figure, min_font: float = MIN_FONT, tol: float = 0.5) -> list[str]:
    """What is wrong with the text of ``fig``: two texts that overlap (by more than ``tol`` px), a text that leaves
    the figure, a text smaller than ``min_font`` points. Empty when the picture is legible."""
    boxes = text_boxes(fig)
    W, H = fig.bbox.width, fig.bbox.height
    problems = []
    for t, b in boxes:
        if b.x0 < -tol or b.y0 < -tol or b.x1 > W + tol or b.y1 > H + tol:
            problems.append(f"leaves the figure ({W:.0f}x{H:.0f} px): {t.get_text()!r} at "
                            f"[{b.x0:.0f}, {b.y0:.0f}, {b.x1:.0f}, {b.y1:.0f}]")
        if t.get_fontsize() < min_font - 1e-6:
            problems.append(f"{t.get_fontsize():.1f} pt, below {min_font} pt: {t.get_text()!r}")
    if len(boxes) > 1:
        a = np.array([[b.x0, b.y0, b.x1, b.y1] for _, b in boxes])
        ox = np.minimum(a[:, None, 2], a[None, :, 2]) - np.maximum(a[:, None, 0], a[None, :, 0])
        oy = np.minimum(a[:, None, 3], a[None, :, 3]) - np.maximum(a[:, None, 1], a[None, :, 1])
        hit = np.triu((ox > tol) & (oy > tol), k=1)
        for i, j in zip(*np.nonzero(hit)):
            problems.append(f"overlap: {boxes[i][0].get_text()!r} and {boxes[j][0].get_text()!r}")
    return problems
