"""While a Cluster waits for a cell: take the roll-call once a rank has waited ``hang_after`` seconds in a
collective, show it (updated until the cell ends), and spot mismatches and waits nothing can end before the timeout."""

from __future__ import annotations

import base64
import html
import sys
import time

from ..trace.status import RollCall

__all__ = ["HangWatch", "RollCallDisplay"]

FIRST_EVERY = 0.5  # seconds between roll-calls until a hang is seen
THEN_EVERY = 1.0  # ... and while it is shown
ANSWER_WITHIN = 1.0  # seconds the ranks have to answer one roll-call


class RollCallDisplay:
    """Where a roll-call is shown: an IPython display updated in place (the picture and the lines) in a notebook,
    else the lines on stderr, printed again only when the situation changes."""

    def __init__(self):
        self.handle = None
        self._said = None
        self.rich = _kernel()

    def show(self, rc: RollCall) -> None:
        if self.rich:
            bundle = _bundle(rc)
            try:
                if self.handle is None:
                    from IPython.display import display

                    self.handle = display(bundle, raw=True, display_id=True)
                else:
                    self.handle.update(bundle, raw=True)
                return
            except Exception:
                self.rich = False
        said = rc.gist()
        if said != self._said:
            self._said = said
            print(rc.text(), file=sys.stderr, flush=True)

    def close(self, text: str | None) -> None:
        """The cell ended: leave ``text`` in place of a live roll-call (or leave it as it is)."""
        if self.handle is not None and text:
            try:
                self.handle.update({"text/plain": text}, raw=True)
            except Exception:
                pass


def _kernel() -> bool:
    try:
        from IPython import get_ipython

        ip = get_ipython()
    except Exception:
        return False
    return ip is not None and getattr(ip, "kernel", None) is not None


def _bundle(rc: RollCall) -> dict:
    text = rc.text()
    lines = "".join(f"<li>{html.escape(ln)}</li>" for ln in rc.lines())
    img = ""
    try:
        from ..widgets.rollcall_view import RollCallView  # drawing is the widgets' job; text alone without them

        png = RollCallView(rc).png(dpi=72)
        img = f'<img src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}" alt="roll-call"/>'
    except Exception:
        pass
    body = f"<div><b>{html.escape(rc.title or 'roll-call')}</b>{img}<ul>{lines}</ul></div>"
    return {"text/plain": text, "text/html": body}


class HangWatch:
    """Called from a Cluster's wait loop: takes the roll-call (``FIRST_EVERY`` s apart once the cell has run
    ``hang_after`` s), shows it as soon as a rank has waited ``hang_after`` s in a collective, and keeps it
    up to date. ``shown``: every roll-call shown; ``mismatch``: the first one that found a mismatch; ``stuck``: the
    first one where ranks wait for members that cannot come (idle or dead, and done with the execution)."""

    def __init__(self, cluster, hang_after: float | None, display: RollCallDisplay | None = None):
        self.cluster = cluster
        self.hang_after = hang_after
        self.t0 = time.monotonic()
        self.display = display
        self.shown: list[RollCall] = []
        self.last: RollCall | None = None
        self.mismatch: RollCall | None = None
        self.stuck: RollCall | None = None
        self._suspects: dict = {}  # the waits the last roll-call found nothing could end, and how long they waited
        self._rid = None
        self._asked = 0.0
        self._next = self.t0 + (hang_after or 0.0)

    def tick(self, pending=None) -> RollCall | None:
        """One look (cheap when nothing is due); returns a roll-call that found a mismatch, or (with ``pending()``,
        the ranks still running the execution waited for) a wait of that execution nothing can end, once, seen in
        two roll-calls in a row: every member missing from the collective is idle (or dead, or passed it) and runs
        nothing of the execution, and nothing else can be sent to it while the caller waits."""
        if self.hang_after is None:
            return None
        now = time.monotonic()
        control = self.cluster._control
        if self._rid is None:
            if now >= self._next:
                self._rid = control.request_status()
                self._asked = now
            return None
        got = control.replies(self._rid)
        ranks = self.cluster.ranks
        if not (set(ranks) - set(control.dead) <= set(got)) and now - self._asked < ANSWER_WITHIN:
            return None
        rc = control.collect_status(self._rid, ranks, 0.0)
        self._rid = None
        self._next = now + (THEN_EVERY if self.shown else FIRST_EVERY)
        if not rc.hung(self.hang_after):
            self._suspects = {}
            return None
        rc.title = f"roll-call after {now - self.t0:.1f} s"
        self.last = rc
        self.shown.append(rc)
        if self.display is None:
            self.display = RollCallDisplay()
        self.display.show(rc)
        if rc.mismatches() and self.mismatch is None:
            self.mismatch = rc
            return rc
        if pending is not None and self.stuck is None and self.mismatch is None and self._stuck(rc, pending):
            self.stuck = rc
            return rc
        return None

    def _stuck(self, rc: RollCall, pending) -> bool:
        """Is a wait of this execution one nothing can end, in this roll-call and, still going, in the one before
        (a rank's answer may be a moment old: a late rank answers idle, then runs its cell at once)?"""
        running = set(pending())  # a wait of another execution (a --noblock cell) may still be joined
        now = {(x.op, x.group, x.seq, x.waiting): x.waited_s for x in rc.stuck()
               if set(x.waiting) & running and not set(x.culprits) & running}
        before, self._suspects = self._suspects, now
        return any(key in before and waited > before[key] for key, waited in now.items())

    def close(self, ok: bool) -> None:
        if self.display is not None and self.shown and ok:
            last = self.shown[-1]
            waited = last.waiting()
            what = f"in {waited[0].collective}" if waited else "for the turn" if last.held_back() else "in a collective"
            self.display.close(f"the wait {what} ended; every rank went on")
