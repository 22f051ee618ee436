"""Pipeline timelines from events: measured bubble fraction, order of blocks, peak live activations, transfers."""

from __future__ import annotations

from collections import defaultdict

from ...trace import Compute, Recv, Send

__all__ = ["measured_bubble", "compute_order", "peak_activation_bytes", "transfers"]


def _block(e) -> Compute | None:
    """The Compute payload of a pipeline block event (None for any other event)."""
    if e.kind != "compute":
        return None
    p = e.payload_as(Compute)
    return p if p.phase is not None else None


def _steps(events):
    by = defaultdict(list)
    for e in events:
        b = _block(e)
        if b is not None:
            by[b.step].append(e)
    return by


def measured_bubble(events, step=None) -> float:
    """1 - busy / (ranks x makespan) over the pipeline's compute blocks (kind 'compute' with a Compute payload).

    The makespan runs from the first block's start to the last block's end over all ranks. Blocks carry their
    ``step``; ``step=None`` averages over the steps present, an int picks one.
    """
    by = _steps(events)
    if step is not None:
        by = {step: by.get(step, [])}
    out = []
    for blocks in by.values():
        if not blocks:
            continue
        t0 = min(e.start for e in blocks)
        t1 = max(e.end for e in blocks)
        ranks = {e.rank for e in blocks}
        if t1 <= t0:
            continue
        busy = sum(e.end - e.start for e in blocks)
        out.append(1.0 - busy / (len(ranks) * (t1 - t0)))
    if not out:
        raise ValueError("measured_bubble: no pipeline compute events")
    return sum(out) / len(out)


def compute_order(events, rank: int, step=None) -> list[tuple[str, int, int]]:
    """The (phase, stage, micro-batch) blocks a rank ran, in time order."""
    blocks = [(e, b) for e in events if e.rank == rank and (b := _block(e)) is not None
              and (step is None or b.step == step)]
    blocks.sort(key=lambda eb: (eb[0].start, eb[0].seq))
    return [(b.phase, b.stage, b.micro_batch) for _, b in blocks]


def peak_activation_bytes(events, rank: int | None = None, step=None) -> int:
    """Largest ``live_activation_bytes`` a compute block reported (per rank, or the max over ranks)."""
    blocks = [(e, e.payload_as(Compute)) for e in events if e.kind == "compute"]
    vals = [c.live_activation_bytes or 0 for e, c in blocks
            if (rank is None or e.rank == rank) and (step is None or c.step == step)]
    return max(vals, default=0)


def transfers(events) -> list[tuple]:
    """Stage transfers matched across ranks: (transfer key, src rank, dst rank, bytes received, sent at, received
    at)."""
    def keyed(cls):
        return {key: e for e in events if e.kind == cls.KIND and (key := e.payload_as(cls).transfer)}

    sends, recvs = keyed(Send), keyed(Recv)
    out = []
    for k in sorted(set(sends) & set(recvs)):
        s, r = sends[k], recvs[k]
        out.append((k, s.rank, r.rank, r.bytes, s.start, r.end))
    return out
