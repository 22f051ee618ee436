"""Pipeline schedule orders (FThenB, 1F1B, interleaved 1F1B), their ideal replay and the bubble formula."""

from __future__ import annotations

__all__ = ["bubble_formula", "fthenb_order", "one_f_one_b_order", "interleaved_order", "schedule_orders",
           "ideal_replay"]


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


def ideal_replay(rows: dict, pipe: dict | None = None, chunks: int = 1) -> dict:
    """Start and end of each block when every rank runs its ``rows[rank]`` blocks ``(phase, virtual stage,
    micro-batch)`` in that order on an ideal machine: a forward takes 1, a backward 2 (1 and a weight-gradient
    ``W`` 1 when any block is a ``W``), each split over ``chunks``. A block starts when its rank is free and its
    dependencies are done: F of stage s after F of s-1, B of s after F of s and B of s+1, W after B of s, of the
    same micro-batch, its n-th repeat after their n-th, within one pipeline (``pipe[rank]``; default: one for
    all). A dependency not among the blocks counts as done at 0; where none can go on, the next block goes
    anyway. Returns rank -> [(start, end)] in the order of ``rows[rank]``."""
    pipe = pipe or {}
    v = max(1, int(chunks))
    split = any(b[0] == "W" for bl in rows.values() for b in bl)
    dur = {"F": 1 / v, "B": (1 if split else 2) / v, "W": 1 / v}
    keys: dict = {}
    for r, bl in rows.items():
        seen: dict = {}
        ks = keys[r] = []
        for ph, s, mb in bl:
            base = (pipe.get(r), ph, s, mb)
            ks.append(base + (seen.get(base, 0),))
            seen[base] = seen.get(base, 0) + 1
    present = {k for ks in keys.values() for k in ks}

    def deps(k):
        p, ph, s, mb, n = k
        if s is None:
            return []
        want = {"F": [("F", s - 1)], "B": [("F", s), ("B", s + 1)], "W": [("B", s)]}.get(ph, [])
        return [d for d in ((p, q, t, mb, n) for q, t in want) if d in present]

    done: dict = {}
    out: dict = {r: [] for r in rows}
    free = dict.fromkeys(rows, 0.0)
    order = sorted(rows)
    left = sum(len(bl) for bl in rows.values())

    def place(r, k, ds):
        start = max([free[r]] + [done[d] for d in ds if d in done])
        end = start + dur.get(k[1], 1 / v)
        done[k] = max(done.get(k, 0.0), end)
        free[r] = end
        out[r].append((start, end))

    while left:
        moved = False
        for r in order:
            while len(out[r]) < len(rows[r]):
                k = keys[r][len(out[r])]
                ds = deps(k)
                if any(d not in done for d in ds):
                    break
                place(r, k, ds)
                left -= 1
                moved = True
        if not moved:  # the order asks for a block not yet done (it cannot come): go on without it
            r = next(r for r in order if len(out[r]) < len(rows[r]))
            k = keys[r][len(out[r])]
            place(r, k, deps(k))
            left -= 1
    return out
