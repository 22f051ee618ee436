"""PipelineView: one row per rank/stage, forward/backward blocks per micro-batch, transfers as arrows, bubble."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict

import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.ticker import MaxNLocator

from ..core.schedule import bubble_formula, ideal_replay, schedule_orders
from ..trace import Compute, Event, Recv, Send
from .base import View
from .draw import MAX_W, ids_text, legend_block
from .sheet import DPI, Block, line_height, text_block, text_width, vstack
from .style import LABEL, TICK, TITLE

__all__ = ["PipelineView", "synthetic_schedule"]

PHASE_COLOUR = {"F": (0.55, 0.75, 0.95), "B": (0.96, 0.63, 0.36), "W": (0.6, 0.82, 0.6)}
MAX_ARROWS = 2000
FANCY_ARROWS = 80  # above this many transfers, arrows become plain lines (annotations are slow to draw)
MAX_LABELS = 400
MAX_AXES_W = 16.0  # inches a timeline may grow to so its blocks can carry their micro-batch numbers (it scrolls)
MAX_ROWS = 32  # more ranks than this: only the first pipelines that fit are drawn
CLOCKS = (None, "schedule", "measured")


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

    ``clock``: ``"measured"`` lays the blocks out at their events' times; ``"schedule"`` replays each rank's blocks
    in their order on an ideal machine (forward 1, backward 2), as ``synthetic_schedule`` does; by default the
    schedule clock for a ``meshviz.what_if`` report's events (simulated ranks run one after another: their times
    are no schedule), else the measured one.
    """

    def __init__(self, events=None, source=None, schedule: str | None = None, interval: float = 0.15,
                 clock: str | None = None):
        if clock not in CLOCKS:
            raise ValueError(f"PipelineView: clock must be 'schedule', 'measured' or None, got {clock!r}")
        self.schedule = schedule
        self.asked_clock = clock
        self.simulated = False  # the events carry meshviz.what_if's marker
        self.world: int | None = None  # the ranks of that what-if, of which only the simulated have events
        self._laid: tuple | None = None
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
        self._laid = None
        for e in events:
            if e.kind == "compute":
                x = e.payload_as(Compute)
                ph = str(x.phase if x.phase is not None else (e.op if e.op in PHASE_COLOUR else "F"))
                self.blocks.append({"rank": e.rank, "stage": x.stage, "micro_batch": x.micro_batch,
                                    "phase": ph, "chunk": x.chunk or 0, "start": e.start,
                                    "end": e.end if e.end is not None else e.start, "name": e.name, "seq": e.seq})
            elif e.kind == "mark" and e.op == "what_if":
                self.simulated = True
                self.world = (getattr(e.payload, "fields", None) or {}).get("nranks")
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
                                   "end": e.end if e.end is not None else e.start, "seq": e.seq})

    def _add_transfer(self, s: Event, r: Event, how: str):
        self.transfers.append({"src": s.rank, "dst": r.rank, "start": s.start,
                               "end": r.end if r.end is not None else r.start, "bytes": s.bytes or r.bytes,
                               "how": how, "name": s.name, "src_seq": s.seq, "dst_seq": r.seq,
                               "micro_batch": getattr(s.payload, "micro_batch", None),
                               "phase": getattr(s.payload, "phase", None)})

    @property
    def clock(self) -> str:
        """'schedule' or 'measured': what the x axis is (see the class)."""
        return self.asked_clock or ("schedule" if self.simulated else "measured")

    def pipelines(self) -> list[list[int]]:
        """The ranks in groups joined by transfers (a rank with none alone), each sorted, by lowest rank."""
        parent = {r: r for r in self.ranks}

        def root(r):
            while parent[r] != r:
                parent[r] = parent[parent[r]]
                r = parent[r]
            return r

        for t in self.transfers:
            a, b = root(t["src"]), root(t["dst"])
            if a != b:
                parent[max(a, b)] = min(a, b)
        groups = defaultdict(list)
        for r in parent:
            groups[root(r)].append(r)
        return sorted((sorted(g) for g in groups.values()), key=lambda g: g[0])

    def laid_out(self) -> tuple[list[dict], list[dict], list[dict]]:
        """(blocks, transfers, collectives) with the times of :attr:`clock`."""
        key = (self.clock, len(self.blocks), len(self.transfers), len(self.comms))
        if self._laid is None or self._laid[0] != key:
            laid = (self.blocks, self.transfers, self.comms) if self.clock == "measured" else self._replayed()
            self._laid = (key, laid)
        return self._laid[1]

    def _replayed(self) -> tuple[list[dict], list[dict], list[dict]]:
        """The schedule clock: each rank's blocks in their order (seq) through ``ideal_replay``, per pipeline;
        a transfer from its sending block's end to its receiving block's start, a collective at the end of the
        block before it."""
        mine = defaultdict(list)
        for b in self.blocks:
            mine[b["rank"]].append(b)
        for bl in mine.values():
            bl.sort(key=lambda b: b["seq"])
        pipe = {r: g[0] for g in self.pipelines() for r in g}
        times = ideal_replay({r: [(b["phase"], b["stage"], b["micro_batch"]) for b in bl] for r, bl in mine.items()},
                             pipe, self.chunks)
        blocks = []
        for r, bl in mine.items():
            blocks += [{**b, "start": t0, "end": t1} for b, (t0, t1) in zip(bl, times[r])]
        seqs = {r: [b["seq"] for b in bl] for r, bl in mine.items()}

        def before(rank, seq):  # the end of the rank's last block before seq (0: none)
            i = bisect_left(seqs.get(rank, []), seq)
            return times[rank][i - 1][1] if i else 0.0

        def block(rank, seq, t, later: bool):
            """The nearest block before (later: after) seq on rank, of the transfer's micro-batch and phase
            where it names them (a recv may be posted blocks ahead of its use); (start, end) or None."""
            bl = mine.get(rank, [])
            at = seqs.get(rank, [])
            i = bisect_right(at, seq) if later else bisect_left(at, seq) - 1
            j, step = i, 1 if later else -1
            while t["micro_batch"] is not None and 0 <= j < len(bl):
                if (bl[j]["micro_batch"], bl[j]["phase"]) == (t["micro_batch"], t["phase"]):
                    return times[rank][j]
                j += step
            return times[rank][i] if 0 <= i < len(bl) else None

        transfers = []
        for t in self.transfers:
            sent, used = block(t["src"], t["src_seq"], t, False), block(t["dst"], t["dst_seq"], t, True)
            start = sent[1] if sent else 0.0
            transfers.append({**t, "start": start, "end": used[0] if used else start})
        comms = [{**c, "start": before(c["rank"], c["seq"]), "end": before(c["rank"], c["seq"])} for c in self.comms]
        return blocks, transfers, comms

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
    def stage_count(self) -> int:
        """Pipeline stages: the distinct stages of the blocks over the chunks a rank runs (without stages, the
        ranks that computed)."""
        stages = {b["stage"] for b in self.blocks if b["stage"] is not None}
        if stages:
            return -(-len(stages) // self.chunks)
        return len({b["rank"] for b in self.blocks})

    @property
    def bubble(self) -> float | None:
        """Idle fraction on :attr:`clock`: 1 - busy time / (ranks x makespan), over every rank that computed."""
        blocks = self.laid_out()[0]
        if not blocks:
            return None
        t0 = min(b["start"] for b in blocks)
        t1 = max(b["end"] for b in blocks)
        rows = {b["rank"] for b in blocks}
        if t1 <= t0:
            return None
        busy = sum(b["end"] - b["start"] for b in blocks)
        return 1.0 - busy / (len(rows) * (t1 - t0))

    @property
    def formula(self) -> float | None:
        p = self.stage_count
        m = self.micro_batches
        if not p or not m:
            return None
        return bubble_formula(p, m, self.chunks)

    def drawn(self) -> tuple[list[int], list[list[int]], int]:
        """(ranks drawn, the pipelines drawn, pipelines in all): every rank, or over MAX_ROWS ranks the first
        pipelines (by lowest rank) that fit in MAX_ROWS rows, the first at least."""
        ranks, groups = self.ranks, self.pipelines()
        if len(ranks) <= MAX_ROWS:
            return ranks, groups, len(groups)
        taken: list[list[int]] = []
        for g in groups:
            if taken and sum(map(len, taken)) + len(g) > MAX_ROWS:
                break
            taken.append(g)
        return sorted(r for g in taken for r in g), taken, len(groups)

    # -- drawing ----------------------------------------------------------------------------------
    def _legend(self, blocks, transfers, comms) -> list:
        entries = []
        chunks = max((b["chunk"] or 0 for b in blocks), default=0) + 1
        for k, lab in (("F", "forward"), ("B", "backward"), ("W", "weight grad")):
            if not any(b["phase"] == k for b in blocks):
                continue
            for c in range(chunks):
                name = lab if chunks == 1 else f"{lab}, chunk {c}"
                entries.append((name, dict(facecolor=_shade(PHASE_COLOUR[k], c), edgecolor="black")))
        k = _stride(transfers)
        drawn = f" (1 in {k} of {len(transfers)} drawn)" if k > 1 else ""
        if any(t["how"] == "reshard" for t in transfers):
            entries.append(("reshard send/recv" + drawn, {"line": "#c0392b"}))
        if any(t["how"] == "p2p" for t in transfers):
            entries.append(("send/recv" + drawn, {"line": "#444"}))
        if comms:
            entries.append(("collective", dict(facecolor="#555", edgecolor="#555")))
        return entries

    def _block(self) -> Block:
        ranks = self.drawn()[0]
        if not ranks:
            return text_block("waiting for pipeline events (compute, send/recv)…", TITLE)
        row = {r: i for i, r in enumerate(ranks)}
        blocks, transfers, comms = self.laid_out()
        if len(ranks) < len(self.ranks):
            blocks = [b for b in blocks if b["rank"] in row]
            transfers = [t for t in transfers if t["src"] in row and t["dst"] in row]
            comms = [c for c in comms if c["rank"] in row]
        times = [b["start"] for b in blocks] + [t["start"] for t in transfers] + [c["start"] for c in comms]
        t0 = min(times)
        t1 = max([b["end"] for b in blocks] + [t["end"] for t in transfers] + [c["end"] for c in comms])
        span = max(t1 - t0, 1e-9)
        unit, scale = ("s", 1.0) if span >= 1 else ("ms", 1e3) if span >= 1e-3 else ("µs", 1e6)
        if self.clock == "schedule":
            scale = 1.0
            xlabel = "schedule time (forward = 1" + ("; simulated ranks have no clock)" if self.simulated else ")")
        else:
            xlabel = f"time ({unit}, measured from the events)"
        st = self.stages
        labels = [f"rank {r}" + (f" · stage {','.join(map(str, st[r]))}" if st.get(r) else "") for r in ranks]
        left = max(text_width(s, TICK) for s in labels) + 3.5 / 72 + 0.06
        numbered = [b for b in blocks if b["micro_batch"] is not None and b["end"] > b["start"]]
        ax_w = min(7.2, MAX_W - left - 0.1)
        if numbered and len(blocks) <= MAX_LABELS:  # wide enough that most blocks can carry their number
            need = text_width(str(max(b["micro_batch"] for b in numbered)), TICK) + 0.05
            short = float(np.percentile([b["end"] - b["start"] for b in numbered], 10))
            ax_w = max(ax_w, min(MAX_AXES_W, need * span / short))
        row_h = 0.34
        ax_h = row_h * len(ranks)
        width = left + ax_w + 0.15
        head = text_block(self._headline(), TITLE, width=width)
        below = 3.5 / 72 + line_height(TICK) + 2 / 72 + line_height(LABEL) + 0.08
        legend = legend_block(self._legend(blocks, transfers, comms), LABEL, max_w=width)

        # blocks a few pixels wide: their black edges alone would fill the row, so they go (the colours stay)
        durations = [b["end"] - b["start"] for b in blocks]
        edge = 0.5 if not durations or float(np.median(durations)) / span * ax_w * DPI >= 4 else 0.0

        def paint(sheet, x, y):
            ax = sheet.axes(x + left, y, ax_w, ax_h)
            by = defaultdict(list)
            for b in blocks:
                col = _shade(PHASE_COLOUR.get(b["phase"], (0.7, 0.7, 0.7)), b["chunk"] or 0)
                by[(b["rank"], col)].append(((b["start"] - t0) * scale, (b["end"] - b["start"]) * scale))
            for (r, col), bars in by.items():
                ax.broken_barh(bars, (row[r] - 0.38, 0.76), facecolors=[col], edgecolors="black", linewidth=edge)
            if len(blocks) <= MAX_LABELS:
                for b in numbered:
                    s = str(b["micro_batch"])
                    if (b["end"] - b["start"]) / span * ax_w >= text_width(s, TICK) + 0.03:
                        ax.text(((b["start"] + b["end"]) / 2 - t0) * scale, row[b["rank"]], s, ha="center",
                                va="center", fontsize=TICK)
            for c in comms:
                ax.broken_barh([((c["start"] - t0) * scale, max((c["end"] - c["start"]) * scale,
                                                                 span * scale * 0.002))],
                               (row.get(c["rank"], 0) + 0.38, 0.12), facecolors=["#555"])
            _draw_transfers(ax, transfers, row, t0, scale)
            ax.set_yticks(range(len(ranks)), labels, fontsize=TICK)
            ax.set_ylim(len(ranks) - 0.5, -0.5)
            ax.set_xlim(0, span * scale * 1.01)
            ax.xaxis.set_major_locator(MaxNLocator(nbins=max(2, int(ax_w / 0.8))))
            ax.set_xlabel(xlabel, fontsize=LABEL, labelpad=2)
            ax.tick_params(labelsize=TICK, length=2, pad=1.5)
            ax.grid(axis="x", alpha=0.3)

        body = Block(width, ax_h + below, paint)
        return vstack([head, body, legend], gap=0.1)

    def _headline(self) -> str:
        n = len({b["rank"] for b in self.blocks})
        p = self.stage_count
        m = self.micro_batches
        v = self.chunks
        if n > p:
            who = f"{p} stage{'s' * (p != 1)} × {n // p} pipelines ({n} ranks)" if n % p == 0 else \
                f"{p} stage{'s' * (p != 1)}, {n} ranks"
        else:
            who = f"{n} stage rank{'s' * (n != 1)}"
        head = f"{self.schedule + ' · ' if self.schedule else ''}{who}, {m} micro-batch" + ("es" if m != 1 else "")
        if v > 1:
            head += f", {v} chunks each"
        if self.bubble is not None:
            f = "(p−1)/(v·m+p−1)" if v > 1 else "(p−1)/(m+p−1)"
            how = "of the schedule" if self.clock == "schedule" else "measured"
            head += f" · bubble {how} {self.bubble:.1%} vs formula {f} = {self.formula:.1%}"
        if self.transfers:
            head += f" · {len(self.transfers)} transfers"
        if self.world and self.world > len(self.ranks):
            head += f" · {len(self.ranks)} of {self.world} ranks simulated"
        ranks, taken, total = self.drawn()
        if len(taken) < total:
            head += f" · {len(taken)} of {total} pipelines drawn: ranks {ids_text(ranks)}"
        return head

    def __repr__(self) -> str:
        if not self.blocks and not self.transfers:
            return "<PipelineView (no pipeline events yet)>"
        return (f"<PipelineView {len(self.ranks)} ranks, {self.micro_batches} micro-batches: "
                f"{len(self.blocks)} blocks, {len(self.transfers)} transfers>")


def _stride(transfers) -> int:
    """Every k-th transfer is drawn: at most MAX_ARROWS, spread over the whole run (the legend says so)."""
    return max(1, -(-len(transfers) // MAX_ARROWS))


def _draw_transfers(ax, transfers, row, t0, scale):
    """Arrows from the sender's row at send time to the receiver's row at arrival; many: one line collection."""
    segs, colours = [], []
    for t in transfers[::_stride(transfers)]:
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
