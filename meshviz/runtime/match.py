"""Collective matching: before a collective on a gloo group (or ranks as threads), the members compare what they run.

Gloo aborts the whole process when the members of a collective pass tensors of different sizes ("terminate
called after throwing an instance of 'gloo::EnforceNotMet'"), and silently pairs two different collectives of
the same size. With checking on, each member first all-gathers a small fixed-size fingerprint (the op, the
roll-call's sequence number, the shapes and dtypes), and every member raises :class:`CollectiveMismatch`,
naming both sides, before any data moves; the process group stays usable. It costs one small all-gather per
collective (bench/README.md); NCCL groups are not checked (a mismatch there hangs, and the roll-call names it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import zlib

import torch

from .. import rank_context
from ..trace import status
from ..trace.status import SHAPED_OPS, RankStatus, RollCall, name_ranks
from . import rollcall

__all__ = ["CollectiveMismatch", "checking", "set_checking", "check_match", "fingerprint", "called_as",
           "called_differently"]

_SLOTS = 16
_MAX_DIMS = 6
_REDUCES = ["sum", "max", "min", "prod", "avg"]  # ReduceType.short
_OPS = ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "gather", "scatter", "alltoall",
        "alltoall_single", "all_to_all", "barrier", "all_gather_object", "broadcast_object_list",
        "scatter_object_list"]
_DTYPES = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
           "complex64", "complex128"]


class CollectiveMismatch(RuntimeError):
    """The members of a group entered different collectives, or the same one with different shapes or dtypes.
    ``ranks``: the members that disagree with the majority (all of them when there is none); ``line``: what
    each one entered."""

    def __init__(self, line: str, ranks: list[int]):
        self.line = line
        self.ranks = list(ranks)
        super().__init__(line)

    def __reduce__(self):
        return (CollectiveMismatch, (self.line, self.ranks))


@dataclasses.dataclass
class MatchState:
    on: bool | None = None  # None: not chosen on this rank
    call: tuple[int, str] | None = None  # the API call whose collectives run now: (checksum, text), see called_as


MATCH = rank_context.slot("match", MatchState)


def called_differently(group, op: str, calls: dict) -> CollectiveMismatch:
    """The members of ``group`` called collective ``op`` with different dtypes, shapes, reduce ops or roots
    (``calls``: rank -> (reduce op, root, shapes, dtypes, what must agree)): the error each raises, numbered and
    named as the calling rank's roll-call knows the collective where meshviz issued it (the thread ranks' group
    compares the calls as they meet)."""
    rec = rollcall.current()
    ours = rec.op is not None and sorted(rec.group or ()) == sorted(group)
    seq, name = (rec.seq, rec.op) if ours else (None, op)
    return CollectiveMismatch(*status.called_differently(group, seq, name, calls))


def _state() -> MatchState:
    return MATCH.get()


def checking() -> bool:
    """Whether collectives on gloo (and thread) groups are checked first (``MESHVIZ_CHECK_COLLECTIVES=1``, or
    :func:`set_checking`)."""
    on = _state().on
    if on is None:  # a rank thread that never chose follows the process (where a threads Cluster sets it)
        proc = MATCH.get(rank_context.process())
        if proc.on is None:
            proc.on = os.environ.get("MESHVIZ_CHECK_COLLECTIVES", "0") not in ("", "0", "false", "False")
        on = proc.on
    return on


def set_checking(on: bool) -> bool:
    """Turn the check on or off on this rank (every rank of a group must agree); returns the old setting."""
    old = checking()
    _state().on = bool(on)
    return old


_FREE = contextlib.nullcontext()


def called_as(what):
    """While the block runs, the collectives this rank checks carry ``what()`` (the API call and the arguments every
    rank must pass alike, e.g. a reshard's mesh and placements), so ranks that pass different ones raise
    :class:`CollectiveMismatch` rather than run the same collectives to different ends. Free when checking is off."""
    return _Called(what) if checking() else _FREE


class _Called:
    def __init__(self, what):
        self.what, self.old = what, None

    def __enter__(self):
        state = _state()
        text = self.what()
        self.old, state.call = state.call, (zlib.crc32(text.encode()), text)

    def __exit__(self, *exc):
        _state().call = self.old


def _code(name, table) -> int:
    try:
        return table.index(name)
    except ValueError:
        return 1000 + zlib.crc32(str(name).encode()) % 1_000_000


def _dtype(t) -> str:
    return str(t.dtype).replace("torch.", "")


def fingerprint(op: str, seq: int, tensors=(), root=None, reduce: str | None = None) -> list[int]:
    """``_SLOTS`` integers saying what this rank is about to run (``reduce``: its reduce op's short name)."""
    ts = [t for t in tensors if isinstance(t, torch.Tensor)]
    fp = [0] * _SLOTS
    fp[0] = int(seq)
    fp[1] = _code(op, _OPS)
    fp[2] = len(ts)
    if ts:
        first = ts[0]
        fp[3] = _code(_dtype(first), _DTYPES)
        fp[4] = first.dim()
        for i, d in enumerate(list(first.shape)[:_MAX_DIMS]):
            fp[5 + i] = int(d)
    fp[11] = sum(t.numel() for t in ts)
    fp[12] = zlib.crc32(repr([(_dtype(t), tuple(t.shape)) for t in ts]).encode())
    fp[13] = -1 if root is None else int(root)
    fp[14] = -1 if reduce is None else _code(reduce, _REDUCES)
    call = _state().call
    fp[15] = 0 if call is None else call[0]
    return fp


def _status(rank: int, op: str, fp: list[int], reduce: bool = False, root: bool = False) -> RankStatus:
    n, ndim = fp[2], fp[4]
    shapes = dtypes = None
    if n:
        shape = tuple(fp[5 : 5 + min(ndim, _MAX_DIMS)])
        shapes = (shape,) + ((("...",),) if n > 1 else ())
        d = fp[3]
        dtypes = (_DTYPES[d] if d < len(_DTYPES) else f"dtype#{d}",) + (("",) if n > 1 else ())
    name = _OPS[fp[1]] if fp[1] < len(_OPS) else (op if fp[1] == _code(op, _OPS) else f"op#{fp[1]}")
    # the reduce op and the root (broadcast's src, reduce's dst) are named where they are what differs
    rop = (_REDUCES[fp[14]] if fp[14] < len(_REDUCES) else f"op#{fp[14]}") if reduce and fp[14] >= 0 else None
    name = status.call_name(name, rop, fp[13] if root and fp[13] >= 0 else None)
    return RankStatus(rank=rank, state="in_collective", op=name, seq=fp[0], shapes=shapes, dtypes=dtypes)


def _differs(op: str, a: list[int], b: list[int]) -> bool:
    if a[:2] != b[:2] or a[13:16] != b[13:16]:  # seq, op, root (an object broadcast's too), reduce op, API call
        return True
    if op in SHAPED_OPS:
        return a[12] != b[12]
    return a[3] != b[3] and a[2] and b[2]  # dtypes, where shapes may differ per rank (all-to-all pieces)


_CHECKED = frozenset({"gloo", "threads"})  # a mismatch kills a gloo process, and garbles ranks as threads


def check_match(g, op: str, seq: int, tensors=(), root=None, reduce: str | None = None) -> None:
    """All-gather this rank's fingerprint over group ``g`` (gloo or ranks as threads; others are left alone) and raise
    :class:`CollectiveMismatch` on every member when they differ."""
    pg = g.process_group
    if g.backend not in _CHECKED:
        return
    mine = torch.tensor(fingerprint(op, seq, tensors, root, reduce), dtype=torch.int64)
    out = torch.empty(g.nranks * _SLOTS, dtype=torch.int64)
    from .. import compat

    compat.all_gather_single(out, mine, group=pg)
    rows = out.view(g.nranks, _SLOTS).tolist()
    me = rows[g.rank]
    if not any(_differs(op, me, r) for r in rows):
        return
    calls = [r[:15] + [0] for r in rows]
    if not any(_differs(op, calls[g.rank], r) for r in calls):  # only the API calls' arguments differ
        raise CollectiveMismatch(_calls_differ(g, seq, rows), list(g.ranks))
    odd = status.odd_ones(g.ranks, [tuple(r) for r in rows])
    one_op = len({r[1] for r in rows}) == 1
    reduces = one_op and len({r[14] for r in rows}) > 1  # one op, reduced differently
    roots = one_op and len({r[13] for r in rows}) > 1  # one op, another root
    statuses = [_status(rank, op, r, reduces, roots) for rank, r in zip(g.ranks, rows)]
    statuses = [dataclasses.replace(s, group=tuple(g.ranks)) for s in statuses]
    found = RollCall(statuses).mismatches()
    if found:
        line = found[0].line()
    else:  # the same op with different sequence numbers: one side skipped an earlier collective on this group
        line = f"mismatch on group {list(g.ranks)}: " + "; ".join(
            f"rank {s.rank} entered {s.op} #{s.seq}" for s in statuses)
    raise CollectiveMismatch(line, odd)


def _calls_differ(g, seq: int, rows) -> str:
    """The line for members that run the same collective for API calls given different arguments."""
    mine = rows[g.rank][15]
    call = _state().call
    kinds: dict = {}
    for rank, r in zip(g.ranks, rows):
        kinds.setdefault(r[15], []).append(rank)
    parts = [f"{name_ranks(rs)}: " + (call[1] if code == mine and call else "a collective of no such call" if code == 0
                                      else "other arguments") for code, rs in kinds.items()]
    return (f"mismatch at #{seq} on group {list(g.ranks)}: the ranks made the same collective for calls given "
            f"different arguments (every rank needs the same): " + "; ".join(parts))
