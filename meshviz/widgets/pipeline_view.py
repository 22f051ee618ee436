"""PipelineView: one row per rank/stage, forward/backward blocks per micro-batch, transfers as arrows, bubble."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.ticker import MaxNLocator

from ..core.schedule import bubble_formula, schedule_orders
from ..trace import Compute, Event, Recv, Send
from .base import View
from .draw import MAX_W, legend_block
from .sheet import DPI, Block, line_height, text_block, text_width, vstack
from .style import LABEL, TICK, TITLE

__all__ = ["PipelineView", "synthetic_schedule"]

PHASE_COLOUR = {"F": (0.55, 0.75, 0.95), "B": (0.96, 0.63, 0.36), "W": (0.6, 0.82, 0.6)}
MAX_ARROWS = 2000
FANCY_ARROWS = 80  # above this many transfers, arrows become plain lines (annotations are slow to draw)
MAX_LABELS = 400
MAX_AXES_W = 16.0  # inches a timeline may grow to so its blocks can carry their micro-batch numbers (it scrolls)


def _shade(colour, chunk: int) -> tuple:
    """A phase's colour for a virtual-stage chunk: darker for each later chunk."""
    k = 1.0 - 0.18 * chunk
    return tuple(min(1.0, c * k) for c in colour)


def synthetic_schedule(stages: int = 4, micro_batches: int = 8, schedule: str = "1F1B", chunks: int = 1,
                       forward: float = 1.0, backward: float = 2.0, comm: float = 0.0, ranks=None,
                       bytes_per_transfer: int = 0) -> list[Event]:
    """Events of a pipeline schedule run on an ideal machine: ``compute`` blocks and their ``send``/``recv``.

    Times are in seconds from 0; a forward (backward) of one micro-batch on one stage takes ``forward``
    (``backward``) split over ``chunks`` virtual stages per rank. Feeds ``PipelineView`` before a real run does.
    """
    p, m, v = int(stages), int(micro_batches), int(chunks)
    if p < 1 or m < 1 or v < 1:
        raise ValueError("stages, micro_batches and chunks must be >= 1")
    ranks = list(range(p)) if ranks is None else list(ranks)
    if len(ranks) != p:
        raise ValueError(f"{len(ranks)} ranks for {p} stages")
    nv = p * v
    dur = {"F": forward / v, "B": backward / v}
    orders = schedule_orders(schedule, p, m, v)
    done: dict = {}
    free = [0.0] * p
    pos = [0] * p
    events: list[Event] = []
    seq = 0
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for d in range(p):
            while pos[d] < len(orders[d]):
                ph, vs, mb = orders[d][pos[d]]
                deps = []
                if ph == "F" and vs > 0:
                    deps.append(("F", vs - 1, mb))
                if ph == "B":
                    deps.append(("F", vs, mb))
                    if vs < nv - 1:
                        deps.append(("B", vs + 1, mb))
                if any(dp not in done for dp in deps):
                    break
                ready = free[d]
                for dp in deps:
                    t = done[dp]
                    if dp[1] % p != d:  # comes from another rank
                        t += comm
                    ready = max(ready, t)
                end = ready + dur[ph]
                done[(ph, vs, mb)] = end
                free[d] = end
                events.append(Event(kind="compute", rank=ranks[d], seq=seq, start=ready, end=end, name=f"{ph}{mb}",
                                    op=ph, payload=Compute(stage=vs, micro_batch=mb, phase=ph, chunk=vs // p)))
                seq += 1
                nxt = vs + 1 if ph == "F" else vs - 1
                if 0 <= nxt < nv and nxt % p != d:
                    dst = nxt % p
                    events.append(Event(kind="send", rank=ranks[d], seq=seq, start=end, end=end, op="send",
                                        peer=ranks[dst], bytes=bytes_per_transfer,
                                        payload=Send(micro_batch=mb, phase=ph)))
                    events.append(Event(kind="recv", rank=ranks[dst], seq=seq + 1, start=end, end=end + comm,
                                        op="recv", peer=ranks[d], bytes=bytes_per_transfer,
                                        payload=Recv(micro_batch=mb, phase=ph)))
                    seq += 2
                pos[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule!r} deadlocks for p={p}, m={m}, v={v}")
    events.sort(key=lambda e: (e.start, e.rank, e.seq))
    return events


class PipelineView(View):
    """A timeline from events (``compute`` with a Compute payload: stage/micro_batch/phase, ``send``/``recv``,
    cross-mesh ``reshard_step`` send/recv, collectives): ``PipelineView(events)``, ``PipelineView(source=cluster)``, or
    ``PipelineView.synthetic(stages=4, micro_batches=8, schedule='1F1B')``.
    """

    def __init__(self, events=None, source=None, schedule: str | None = None, interval: float = 0.15):
        self.schedule = schedule
        self.blocks: list[dict] = []
        self.transfers: list[dict] = []
        self.comms: list[dict] = []
        self._sends = defaultdict(list)
        self._recvs = defaultdict(list)
        self._xmesh = defaultdict(dict)
        super().__init__(source=source if source is not None else events, interval=interval)

    @classmethod
    def synthetic(cls, stages=4, micro_batches=8, schedule="1F1B", chunks=1, **kw) -> "PipelineView":
        return cls(synthetic_schedule(stages, micro_batches, schedule, chunks, **kw), schedule=schedule)

    # -- data -------------------------------------------------------------------------------------
    def _ingest(self, events) -> None:
        super()._ingest(events)
        for e in events:
            if e.kind == "compute":
                x = e.payload_as(Compute)
                ph = str(x.phase if x.phase is not None else (e.op if e.op in PHASE_COLOUR else "F"))
                self.blocks.append({"rank": e.rank, "stage": x.stage, "micro_batch": x.micro_batch,
                                    "phase": ph, "chunk": x.chunk or 0, "start": e.start,
                                    "end": e.end if e.end is not None else e.start, "name": e.name})
            elif e.kind in ("send", "recv") and e.peer is not None:
                if e.kind == "send":
                    key = (e.rank, e.peer)
                    q = self._recvs[key]
                    if q:
                        self._add_transfer(e, q.pop(0), "p2p")
                    else:
                        self._sends[key].append(e)
                else:
                    key = (e.peer, e.rank)
                    q = self._sends[key]
                    if q:
                        self._add_transfer(q.pop(0), e, "p2p")
                    else:
                        self._recvs[key].append(e)
            elif e.kind == "reshard_step" and e.op == "send_recv" and e.group:
                for pair in e.group:
                    s, t = int(pair[0]), int(pair[1])
                    key = (e.plan_id, e.tensor_id, s, t)
                    side = "src" if e.rank == s else "dst" if e.rank == t else None
                    if side is None:
                        continue
                    slot = self._xmesh[key]
                    slot[side] = e
                    if "src" in slot and "dst" in slot and not slot.get("done"):
                        slot["done"] = True
                        self._add_transfer(slot["src"], slot["dst"], "reshard")
            elif e.kind in ("collective", "reshard_step"):
                self.comms.append({"rank": e.rank, "op": e.op, "start": e.start,
                                   "end": e.end if e.end is not None else e.start})

    def _add_transfer(self, s: Event, r: Event, how: str):
        self.transfers.append({"src": s.rank, "dst": r.rank, "start": s.start,
                               "end": r.end if r.end is not None else r.start, "bytes": s.bytes or r.bytes,
                               "how": how, "name": s.name})

    @property
    def ranks(self) -> list[int]:
        rs = {b["rank"] for b in self.blocks} | {t["src"] for t in self.transfers} | {t["dst"] for t in self.transfers}
        return sorted(rs)

    @property
    def stages(self) -> dict:
        """rank -> sorted stages it ran."""
        out = defaultdict(set)
        for b in self.blocks:
            if b["stage"] is not None:
                out[b["rank"]].add(b["stage"])
        return {r: sorted(s) for r, s in out.items()}

    @property
    def micro_batches(self) -> int:
        return len({b["micro_batch"] for b in self.blocks if b["micro_batch"] is not None})

    @property
    def chunks(self) -> int:
        st = self.stages
        return max((len(s) for s in st.values()), default=1) or 1

    @property
    def bubble(self) -> float | None:
        """Measured idle fraction: 1 - busy time / (ranks x makespan), over the ranks that computed."""
        if not self.blocks:
            return None
        t0 = min(b["start"] for b in self.blocks)
        t1 = max(b["end"] for b in self.blocks)
        rows = {b["rank"] for b in self.blocks}
        if t1 <= t0:
            return None
        busy = sum(b["end"] - b["start"] for b in self.blocks)
        return 1.0 - busy / (len(rows) * (t1 - t0))

    @property
    def formula(self) -> float | None:
        p = len({b["rank"] for b in self.blocks})
        m = self.micro_batches
        if not p or not m:
            return None
        return bubble_formula(p, m, self.chunks)

    # -- drawing ----------------------------------------------------------------------------------
    def _legend(self) -> list:
        entries = []
        chunks = max((b["chunk"] or 0 for b in self.blocks), default=0) + 1
        for k, lab in (("F", "forward"), ("B", "backward"), ("W", "weight grad")):
            if not any(b["phase"] == k for b in self.blocks):
                continue
            for c in range(chunks):
                name = lab if chunks == 1 else f"{lab}, chunk {c}"
                entries.append((name, dict(facecolor=_shade(PHASE_COLOUR[k], c), edgecolor="black")))
        k = self._stride()
        drawn = f" (1 in {k} of {len(self.transfers)} drawn)" if k > 1 else ""
        if any(t["how"] == "reshard" for t in self.transfers):
            entries.append(("reshard send/recv" + drawn, {"line": "#c0392b"}))
        if any(t["how"] == "p2p" for t in self.transfers):
            entries.append(("send/recv" + drawn, {"line": "#444"}))
        if self.comms:
            entries.append(("collective", dict(facecolor="#555", edgecolor="#555")))
        return entries

    def _block(self) -> Block:
        ranks = self.ranks
        if not ranks:
            return text_block("waiting for pipeline events (compute, send/recv)…", TITLE)
        row = {r: i for i, r in enumerate(ranks)}
        times = [b["start"] for b in self.blocks] + [t["start"] for t in self.transfers] + \
                [c["start"] for c in self.comms]
        t0 = min(times)
        t1 = max([b["end"] for b in self.blocks] + [t["end"] for t in self.transfers] + [c["end"] for c in self.comms])
        span = max(t1 - t0, 1e-9)
        unit, scale = ("s", 1.0) if span >= 1 else ("ms", 1e3) if span >= 1e-3 else ("µs", 1e6)
        st = self.stages
        labels = [f"rank {r}" + (f" · stage {','.join(map(str, st[r]))}" if st.get(r) else "") for r in ranks]
        left = max(text_width(s, TICK) for s in labels) + 3.5 / 72 + 0.06
        numbered = [b for b in self.blocks if b["micro_batch"] is not None and b["end"] > b["start"]]
        ax_w = min(7.2, MAX_W - left - 0.1)
        if numbered and len(self.blocks) <= MAX_LABELS:  # wide enough that most blocks can carry their number
            need = text_width(str(max(b["micro_batch"] for b in numbered)), TICK) + 0.05
            short = float(np.percentile([b["end"] - b["start"] for b in numbered], 10))
            ax_w = max(ax_w, min(MAX_AXES_W, need * span / short))
        row_h = 0.34
        ax_h = row_h * len(ranks)
        width = left + ax_w + 0.15
        head = text_block(self._headline(), TITLE, width=width)
        below = 3.5 / 72 + line_height(TICK) + 2 / 72 + line_height(LABEL) + 0.08
        legend = legend_block(self._legend(), LABEL, max_w=width)

        # blocks a few pixels wide: their black edges alone would fill the row, so they go (the colours stay)
        durations = [b["end"] - b["start"] for b in self.blocks]
        edge = 0.5 if not durations or float(np.median(durations)) / span * ax_w * DPI >= 4 else 0.0

        def paint(sheet, x, y):
            ax = sheet.axes(x + left, y, ax_w, ax_h)
            by = defaultdict(list)
            for b in self.blocks:
                col = _shade(PHASE_COLOUR.get(b["phase"], (0.7, 0.7, 0.7)), b["chunk"] or 0)
                by[(b["rank"], col)].append(((b["start"] - t0) * scale, (b["end"] - b["start"]) * scale))
            for (r, col), bars in by.items():
                ax.broken_barh(bars, (row[r] - 0.38, 0.76), facecolors=[col], edgecolors="black", linewidth=edge)
            if len(self.blocks) <= MAX_LABELS:
                for b in numbered:
                    s = str(b["micro_batch"])
                    if (b["end"] - b["start"]) / span * ax_w >= text_width(s, TICK) + 0.03:
                        ax.text(((b["start"] + b["end"]) / 2 - t0) * scale, row[b["rank"]], s, ha="center",
                                va="center", fontsize=TICK)
            for c in self.comms:
                ax.broken_barh([((c["start"] - t0) * scale, max((c["end"] - c["start"]) * scale,
                                                                 span * scale * 0.002))],
                               (row.get(c["rank"], 0) + 0.38, 0.12), facecolors=["#555"])
            self._draw_transfers(ax, row, t0, scale)
            ax.set_yticks(range(len(ranks)), labels, fontsize=TICK)
            ax.set_ylim(len(ranks) - 0.5, -0.5)
            ax.set_xlim(0, span * scale * 1.01)
            ax.xaxis.set_major_locator(MaxNLocator(nbins=max(2, int(ax_w / 0.8))))
            ax.set_xlabel(f"time ({unit}, measured from the events)", fontsize=LABEL, labelpad=2)
            ax.tick_params(labelsize=TICK, length=2, pad=1.5)
            ax.grid(axis="x", alpha=0.3)

        body = Block(width, ax_h + below, paint)
        return vstack([head, body, legend], gap=0.1)

    def _stride(self) -> int:
        """Every k-th transfer is drawn: at most MAX_ARROWS, spread over the whole run (the legend says so)."""
        return max(1, -(-len(self.transfers) // MAX_ARROWS))

    def _draw_transfers(self, ax, row, t0, scale):
        """Arrows from the sender's row at send time to the receiver's row at arrival; many: one line collection."""
        segs, colours = [], []
        for t in self.transfers[::self._stride()]:
            d = 1 if row[t["dst"]] >= row[t["src"]] else -1
            segs.append((((t["start"] - t0) * scale, row[t["src"]] + 0.4 * d),
                         ((t["end"] - t0) * scale, row[t["dst"]] - 0.4 * d)))
            colours.append("#c0392b" if t["how"] == "reshard" else "#444")
        if len(segs) <= FANCY_ARROWS:
            for (a, b), c in zip(segs, colours):
                ax.annotate("", xy=b, xytext=a, arrowprops=dict(arrowstyle="-|>", color=c, lw=0.8, alpha=0.8,
                                                                shrinkA=0, shrinkB=0))
        elif segs:
            ax.add_collection(LineCollection(segs, colors=colours, linewidths=0.7, alpha=0.7))
            ends = np.array([b for _, b in segs])
            ax.scatter(ends[:, 0], ends[:, 1], s=6, c=colours, marker="o", linewidths=0, alpha=0.8)

    def _headline(self) -> str:
        p = len({b["rank"] for b in self.blocks})
        m = self.micro_batches
        v = self.chunks
        head = f"{self.schedule + ' · ' if self.schedule else ''}{p} stage rank{'s' * (p != 1)}, {m} micro-batch" \
            + ("es" if m != 1 else "")
        if v > 1:
            head += f", {v} chunks each"
        if self.bubble is not None:
            f = "(p−1)/(v·m+p−1)" if v > 1 else "(p−1)/(m+p−1)"
            head += f" · bubble measured {self.bubble:.1%} vs formula {f} = {self.formula:.1%}"
        if self.transfers:
            head += f" · {len(self.transfers)} transfers"
        return head

    def __repr__(self) -> str:
        if not self.blocks and not self.transfers:
            return "<PipelineView (no pipeline events yet)>"
        return (f"<PipelineView {len(self.ranks)} ranks, {self.micro_batches} micro-batches: "
                f"{len(self.blocks)} blocks, {len(self.transfers)} transfers>")
