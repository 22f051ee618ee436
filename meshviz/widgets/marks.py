"""Where an Axes would put index labels beside a panel, and the margins they take."""

from __future__ import annotations

from .sheet import line_height, text_width
from .style import LABEL, TICK

__all__ = ["x_margin", "y_margin", "fit_label", "index_labels", "TICKPAD", "LABELPAD"]

TICKPAD = 3.5 / 72  # tick length + pad, inches
LABELPAD = 3 / 72


def x_margin() -> float:
    """Below an axes: tick labels and the axis label."""
    return TICKPAD + line_height(TICK) + LABELPAD + line_height(LABEL)


def y_margin(tick_labels) -> float:
    """Left of an axes: the axis label, then the widest tick label."""
    widest = max((text_width(t, TICK) for t in tick_labels), default=0.0)
    return line_height(LABEL) + LABELPAD + widest + TICKPAD + 0.02


def fit_label(candidates, size, room):
    for c in candidates:
        if text_width(c, size) <= room:
            return c
    return candidates[-1]


def index_labels(panel, xticks, yticks, xlabel, ylabel, centre=0.0, ystep: int = 1):
    """Tick labels (indices, at index + ``centre``) and axis labels beside a panel, where an Axes would put them;
    a y tick reads ``index * ystep`` (the first rank of a wrapped row)."""
    below, left = -TICKPAD * 72, -TICKPAD * 72
    y1 = panel.ylim[1]
    for i in xticks:
        panel.text(i + centre, y1, str(i), TICK, dy=below, ha="center", va="top")
    if xlabel:
        down = below - (line_height(TICK) * 72 if len(xticks) else 0) - LABELPAD * 72
        panel.text((panel.xlim[0] + panel.xlim[1]) / 2, y1, xlabel, LABEL, dy=down, ha="center", va="top")
    x0 = panel.xlim[0]
    for i in yticks:
        panel.text(x0, i + centre, str(i * ystep), TICK, dx=left, ha="right", va="center")
    if ylabel:
        widest = max((text_width(str(i * ystep), TICK) for i in yticks), default=0.0)
        dx = left - (widest + LABELPAD) * 72 if len(yticks) else -LABELPAD * 72
        panel.text(x0, (panel.ylim[0] + panel.ylim[1]) / 2, ylabel, LABEL, dx=dx, ha="right", va="center",
                   rotation=90)
