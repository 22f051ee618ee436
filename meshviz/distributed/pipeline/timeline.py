"""Pipeline timelines from events: measured bubble fraction, order of blocks, peak live activations, transfers."""

from __future__ import annotations

from collections import defaultdict

__all__ = ["measured_bubble", "compute_order", "peak_activation_bytes", "transfers"]


def _steps(events):
    by = defaultdict(list)
    for e in events:
        if e.kind == "compute" and (e.extra or {}).get("phase") is not None:
            by[(e.extra or {}).get("step")].append(e)
    return by


def measured_bubble(events, step=None) -> float:
    """1 - busy / (ranks x makespan) over the pipeline's compute blocks (kind 'compute' with extra 'phase').

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
    blocks = [e for e in events if e.kind == "compute" and e.rank == rank and (e.extra or {}).get("phase")
              and (step is None or e.extra.get("step") == step)]
    blocks.sort(key=lambda e: (e.start, e.seq))
    return [(e.extra["phase"], e.extra["stage"], e.extra["micro_batch"]) for e in blocks]


def peak_activation_bytes(events, rank: int | None = None, step=None) -> int:
    """Largest ``live_activation_bytes`` a compute block reported (per rank, or the max over ranks)."""
    vals = [e.extra.get("live_activation_bytes", 0) for e in events if e.kind == "compute" and e.extra
            and (rank is None or e.rank == rank) and (step is None or e.extra.get("step") == step)]
    return max(vals, default=0)


def transfers(events) -> list[tuple]:
    """Stage transfers matched across ranks: (transfer key, src rank, dst rank, bytes, sent at, received at)."""
    sends = {e.extra["transfer"]: e for e in events if e.kind == "send" and (e.extra or {}).get("transfer")}
    recvs = {e.extra["transfer"]: e for e in events if e.kind == "recv" and (e.extra or {}).get("transfer")}
    out = []
    for k in sorted(set(sends) & set(recvs)):
        s, r = sends[k], recvs[k]
        out.append((k, s.rank, r.rank, s.bytes, s.start, r.end))
    return out
