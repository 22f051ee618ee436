"""%px output in rank order: each rank's stdout and stderr so far, shown in one place, rank by rank."""

from __future__ import annotations

import time

__all__ = ["RankOrderedOutput"]

LIVE_TAIL = 20_000  # characters of each rank's stream a live update shows: the whole text is sent when the cell ends


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _labels(result, cluster) -> list[int]:
    """The rank of each of ``result``'s outputs (ipyparallel keeps them in target order)."""
    ranks = getattr(result, "ranks", None)  # thread ranks
    if ranks is not None:
        return list(ranks)
    targets = getattr(result, "_targets", None) or []
    rank_of = {eid: r for r, eid in enumerate(getattr(cluster, "engine_ids", None) or [])}
    return [rank_of.get(eid, eid) for eid in targets]


def _per_rank(result, field: str) -> list[str]:
    vals = getattr(result, field)
    return [vals] if isinstance(vals, str) else [v or "" for v in vals]


class RankOrderedOutput:
    """What the ranks of a running cell printed, always in rank order: in a notebook one display updated in place
    while the cell runs (ranks print whenever they like; engines' output arrives in any order), in a terminal
    printed once when the cell ends. ``finish`` then shows the ranks' displays and results, in rank order too."""

    def __init__(self, result, cluster=None, interval: float = 0.1):
        self.result = result
        self.ranks = _labels(result, cluster)
        self.interval = interval
        self.live = _in_kernel()
        self._handle = None
        self._text = ""
        self._last = 0.0

    def text(self, tail: int | None = None) -> str:
        """stdout of every rank in rank order, then stderr likewise, each under its '[stdout:r]' line; ``tail``:
        only each stream's last lines within that many characters."""
        parts = []
        for name in ("stdout", "stderr"):
            for r, text in zip(self.ranks, _per_rank(self.result, name)):
                if tail is not None and len(text) > tail:
                    cut = text.find("\n", len(text) - tail) + 1 or len(text) - tail
                    text = f"[... {cut} characters above; all of it when the cell ends]\n{text[cut:]}"
                if text:
                    parts.append(f"[{name}:{r}] \n{text}" + ("" if text.endswith("\n") else "\n"))
        return "".join(parts)

    def update(self, force: bool = False) -> None:
        """Show what arrived since the last update (at most every ``interval`` s; a notebook only). A live update
        shows each stream's last ``LIVE_TAIL`` characters (each update sends all it shows; a cell printing megabytes
        would send them ten times a second); ``force``: all of it."""
        if not self.live or (not force and time.monotonic() - self._last < self.interval):
            return
        self._last = time.monotonic()
        text = self.text(None if force else LIVE_TAIL)
        if text == self._text:
            return
        self._text = text
        from IPython.display import display

        bundle = {"text/plain": text.rstrip("\n")}
        if self._handle is None:
            self._handle = display(bundle, raw=True, display_id=True)
        else:
            self._handle.update(bundle, raw=True)

    def finish(self, groupby: str = "type") -> None:
        """The final text (printed now in a terminal), then the ranks' displays and results in rank order."""
        if self.live:
            self.update(force=True)
        else:
            text = self.text()
            if text:
                print(text, end="")
        # the streams are shown above: display_outputs adds only the displays and results, in target order
        self.result._display_stream = lambda *args, **kwargs: None
        try:
            self.result.display_outputs(groupby)
        finally:
            del self.result._display_stream
