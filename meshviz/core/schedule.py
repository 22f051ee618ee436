"""Pipeline schedule orders (FThenB, 1F1B, interleaved 1F1B) and the bubble formula, shared by runtime and views."""

from __future__ import annotations

__all__ = ["bubble_formula", "fthenb_order", "one_f_one_b_order", "interleaved_order", "schedule_orders"]


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of an ideal pipeline: (p-1)/(m+p-1); with v chunks per rank the bubble term (p-1) shrinks
    v-fold: ((p-1)/v) / (m + (p-1)/v) = (p-1)/(v*m + p-1)."""
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"bubble_formula: p, m, v must be >= 1, got {p}, {m}, {v}")
    return (p - 1) / (v * m + p - 1)


def _check(p: int, m: int, v: int, d: int) -> None:
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline schedule: stages, micro-batches and chunks must be >= 1, got {p}, {m}, {v}")
    if not 0 <= d < p:
        raise ValueError(f"pipeline schedule: pipe position {d} out of range for {p} stages")


def fthenb_order(p: int, m: int, d: int, v: int = 1) -> list[tuple[str, int, int]]:
    """FThenB (GPipe) on pipe position ``d``: every forward, chunk by chunk, then every backward, last chunk first.

    Blocks are ``(phase, virtual stage, micro-batch)``; chunk c of position d is virtual stage ``c * p + d``.
    """
    _check(p, m, v, d)
    out = [("F", c * p + d, i) for c in range(v) for i in range(m)]
    return out + [("B", c * p + d, i) for c in reversed(range(v)) for i in range(m)]


def one_f_one_b_order(p: int, m: int, d: int) -> list[tuple[str, int, int]]:
    """1F1B on pipe position ``d``: ``min(p - d, m)`` warm-up forwards (as torch's Schedule1F1B runs them; the
    last of them pairs with the first backward), then backward/forward pairs, then the remaining backwards."""
    _check(p, m, 1, d)
    warm = min(p - d, m)
    out = [("F", d, i) for i in range(warm)]
    for i in range(warm, m):
        out += [("B", d, i - warm), ("F", d, i)]
    return out + [("B", d, i) for i in range(m - warm, m)]


def interleaved_order(p: int, m: int, v: int, d: int) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B (VPP, Megatron's) with ``v`` chunks per rank on pipe position ``d``; ``m`` a multiple of p.

    Micro-batches go through the chunks in rounds of p; backwards visit the chunks in reverse.
    """
    _check(p, m, v, d)
    if m % p:
        raise ValueError(f"the interleaved schedule needs micro_batches ({m}) divisible by stages ({p})")
    total = m * v

    def unit(k, forward):
        c = (k // p) % v
        if not forward:
            c = v - 1 - c
        return c * p + d, (k // (p * v)) * p + k % p

    warm = min((p - d - 1) * 2 + (v - 1) * p, total)
    out = [("F", *unit(k, True)) for k in range(warm)]
    for k in range(warm, total):
        out += [("F", *unit(k, True)), ("B", *unit(k - warm, False))]
    return out + [("B", *unit(k, False)) for k in range(total - warm, total)]


def schedule_orders(schedule: str, p: int, m: int, v: int = 1) -> list[list[tuple[str, int, int]]]:
    """Per pipe position, the ordered ``(phase, virtual stage, micro-batch)`` blocks of ``schedule``.

    Names, case and ``-``/``_`` ignored: 'FThenB' / 'GPipe'; '1F1B' (interleaved when v > 1); 'VPP' /
    'Interleaved' / 'Interleaved1F1B'.
    """
    sched = str(schedule).upper().replace("-", "").replace("_", "")
    if v == 1 and sched in ("1F1B", "ONEFONEB"):
        return [one_f_one_b_order(p, m, d) for d in range(p)]
    if sched in ("FTHENB", "GPIPE"):
        return [fthenb_order(p, m, d, v) for d in range(p)]
    if sched in ("1F1B", "VPP", "INTERLEAVED", "INTERLEAVED1F1B"):
        return [interleaved_order(p, m, v, d) for d in range(p)]
    raise ValueError(f"unknown schedule {schedule!r}; use 'FThenB', '1F1B' or 'VPP'")
