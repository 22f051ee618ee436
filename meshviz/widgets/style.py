"""Colours, number formats and small parsers shared by the views."""

from __future__ import annotations

import ast
import colorsys
import re

import numpy as np
from matplotlib import colormaps

from ..core.planner import fmt_bytes

__all__ = ["GREY", "EMPTY", "TICK", "LABEL", "TITLE", "HEAD", "block_colours", "fmt_bytes", "parse_ints",
           "parse_placements", "parse_ids"]

TICK = 7.0  # points, at 96 px per inch: tick labels (9.3 px)
LABEL = 7.5  # axis labels, legends, captions
TITLE = 8.5  # panel titles
HEAD = 9.5  # a picture's heading
GREY = np.array([0.86, 0.86, 0.86])  # ranks outside the mesh of interest
EMPTY = np.array([1.0, 1.0, 1.0])
_TAB = np.array(colormaps["tab20"].colors)[[0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19]]


_HUES = _TAB.copy()  # the colours made so far (making 65,536 took a fifth of a second each picture)


def block_colours(n: int) -> np.ndarray:
    """``n`` distinct RGB colours (tab20 first, then golden-ratio hues); block i of a picture gets colour i."""
    global _HUES
    hues = _HUES  # (a view drawing on another thread may replace it meanwhile)
    if n > len(hues):
        more = [colorsys.hsv_to_rgb((i * 0.6180339887) % 1.0, 0.45 + 0.25 * ((i // 7) % 2),
                                    0.92 - 0.12 * ((i // 3) % 2)) for i in range(len(hues), n)]
        hues = _HUES = np.concatenate([hues, np.array(more)])
    return hues[:n].copy()


def parse_ints(text) -> list[int]:
    """``"2,4"``, ``"2x4"``, ``"[2, 4]"`` or a sequence -> [2, 4]; ``""`` -> []."""
    if isinstance(text, (list, tuple)):
        return [int(v) for v in text]
    parts = [p for p in re.split(r"[\s,x×*\[\]()]+", str(text).strip()) if p]
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"expected integers such as '2,4', got {text!r}") from None


# a module before a placement's name, as Paddle code writes it: "dist.", "paddle.distributed."
_MODULE = re.compile(r"(?<![\w.])(?:[A-Za-z_]\w*\.)+(?=(?:Shard|Replicate|Partial)\b)")


def parse_placements(text) -> list:
    """``"S(0), R"`` or ``"[P(sum), S(1)]"`` or a sequence -> placements; Paddle's code spelling
    ``"[dist.Shard(0), dist.Replicate()]"`` reads as well."""
    from ..core import parse_placement

    if isinstance(text, (list, tuple)):
        return [parse_placement(p) for p in text]
    s = _MODULE.sub("", str(text)).strip().strip("[]")
    items = [t for t in re.findall(r"[A-Za-z]+(?:\([^)]*\))?", s)]
    if not items:
        raise ValueError(f"no placements in {text!r}; write e.g. 'S(0), R'")
    return [parse_placement(t) for t in items]


def parse_ids(text, shape) -> np.ndarray:
    """Process ids for a mesh of ``shape``: blank or 'range' -> 0..n-1, 'reversed', or an explicit list."""
    n = int(np.prod(shape)) if len(shape) else 1
    s = str(text).strip().lower() if not isinstance(text, (list, tuple, np.ndarray)) else None
    if s in ("", "range", "arange", None) and not isinstance(text, (list, tuple, np.ndarray)):
        return np.arange(n).reshape(shape)
    if s == "reversed":
        return np.arange(n)[::-1].reshape(shape)
    ids = np.asarray(text).ravel().tolist() if s is None else parse_ints(text)
    if len(ids) != n:
        raise ValueError(f"{len(ids)} process ids for a mesh of shape {list(shape)} ({n} ranks)")
    nested = _nesting(text)
    if len(nested) > 1 and nested != list(shape):  # '[[2,4,5],[0,1,3]]' is 2 x 3: never re-cut into 3 x 2
        given = str(text).strip() if s is not None else np.asarray(text).tolist()
        raise ValueError(f"process ids {given} are {' x '.join(map(str, nested))}, the mesh shape is "
                         f"{' x '.join(map(str, shape))}; give a flat list to reshape them")
    return np.asarray(ids).reshape(shape)


def _nesting(text) -> list[int]:
    """The shape of ids given as nested lists ('[[2,4,5],[0,1,3]]': [2, 3]); [] for a flat or ragged list."""
    if isinstance(text, str):
        try:
            text = ast.literal_eval(text.strip())
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return []
    try:
        return list(np.asarray(text, dtype=float).shape)
    except (ValueError, TypeError):
        return []
