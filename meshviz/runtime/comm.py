"""The comm layer: reduce ops, the gloo AVG rule, and ``run``, the one door every collective meshviz issues goes
through."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as tdist

from .. import compat, trace
from ..core.placements import ReduceType
from ..core.traffic import received
from ..trace.status import P2P_OPS
from . import closed, devices, rollcall
from .groups import Group, resolve
from .match import CollectiveMismatch, check_match, checking

__all__ = ["torch_reduce_op", "dtensor_reduce_op", "from_dtensor_reduce_op", "reduction", "divide_", "Task",
           "CollectiveOp", "Call", "Check", "membership", "on_devices", "matching", "CHECKS", "INSIDE", "run",
           "check_peer", "peer_names", "local", "tensor_bytes", "passed_sizes", "received_bytes", "all_to_all_flat",
           "all_reduce_mean_", "FUSE_BYTES", "check_reduce", "counts_agree"]

# -- reduce ops ------------------------------------------------------------------------------------------------

_TORCH_OPS = {
    ReduceType.kRedSum: tdist.ReduceOp.SUM,
    ReduceType.kRedMax: tdist.ReduceOp.MAX,
    ReduceType.kRedMin: tdist.ReduceOp.MIN,
    ReduceType.kRedProd: tdist.ReduceOp.PRODUCT,
    ReduceType.kRedAvg: tdist.ReduceOp.AVG,
}
_DTENSOR_OPS = {  # torch DTensor's Partial(reduce_op=...) strings
    ReduceType.kRedSum: "sum",
    ReduceType.kRedMax: "max",
    ReduceType.kRedMin: "min",
    ReduceType.kRedProd: "product",
    ReduceType.kRedAvg: "avg",
}
_FROM_DTENSOR = {v: k for k, v in _DTENSOR_OPS.items()}


def torch_reduce_op(rt) -> "tdist.ReduceOp":
    return _TORCH_OPS[ReduceType(rt)]


def dtensor_reduce_op(rt) -> str:
    return _DTENSOR_OPS[ReduceType(rt)]


def from_dtensor_reduce_op(name: str) -> ReduceType:
    """The ReduceType of a DTensor Partial's ``reduce_op`` string (sum for any other)."""
    return _FROM_DTENSOR.get(name, ReduceType.kRedSum)


def _native_avg(pg) -> bool:
    try:
        return tdist.get_backend(pg) == "nccl"
    except Exception:
        return False


def divide_(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t /= n`` in place, keeping the dtype: integers round toward zero, as Paddle's divide and NCCL's AVG do.
    Autograd does not record it, as it records no collective: a parameter is averaged in place as Paddle's."""
    d = t.detach()
    if d.is_floating_point() or d.is_complex():
        d.div_(n)
    else:
        d.div_(n, rounding_mode="trunc")
    return t


def reduction(rt, group: Group):
    """(torch's op, finish) for reducing with ``rt`` over ``group``: ``finish(t)`` completes a result in place,
    or is None. Backends without AVG (gloo) run SUM, then divide by the group size (toward zero for integers)."""
    rt = ReduceType(rt)
    if rt is ReduceType.kRedAvg and not _native_avg(group.process_group):
        n = group.nranks
        return tdist.ReduceOp.SUM, (lambda t: divide_(t, n))
    return _TORCH_OPS[rt], None


def check_reduce(what: str, rt, t: torch.Tensor) -> None:
    """Refuse, on every rank before communicating, a reduction the dtype has no value for."""
    rt = ReduceType(rt)
    if rt is ReduceType.kRedAvg and t.dtype is torch.bool:
        raise ValueError(f"{what}: ReduceOp.AVG of a bool tensor has no value; use MIN (all) or MAX (any), or a "
                         f"number dtype")
    if t.is_complex() and rt in (ReduceType.kRedMax, ReduceType.kRedMin, ReduceType.kRedProd):
        # complex numbers have no order, and the backends reduce a complex tensor as its real and imaginary parts
        raise ValueError(f"{what}: ReduceOp.{rt.short.upper()} of a {str(t.dtype).replace('torch.', '')} tensor is "
                         f"not supported (the backends reduce its real and imaginary parts apart); use SUM or AVG")


# -- tasks -----------------------------------------------------------------------------------------------------

class Task:
    """What an ``sync_op=False`` call returns: ``wait()`` blocks until the result is in place."""

    __slots__ = ("_works", "_then", "_done", "_call")

    def __init__(self, works=(), then=None, done: bool = False, call=None):
        self._works = [w for w in works if w is not None]
        self._then = then
        self._done = done
        self._call = call  # (op, group, seq, tensors): what the roll-call shows while wait() blocks

    def wait(self, timeout=None) -> bool:
        if not self._done:
            call = self._call
            rec = prev = None
            if call is not None:
                rec = rollcall.current()
                if rec.op is None or rec.seq != call[2] or rec.group != call[1]:
                    prev = rec.resume(*call)
                else:
                    rec = None  # the collective's own run() is waiting: it is shown already
            try:
                for w in self._works:
                    w.wait()
            except BaseException as e:
                if rec is not None:
                    rec.fail(e)
                raise
            finally:
                if rec is not None:
                    rec.leave(prev)
            if self._then is not None:
                self._then()
            self._done = True
        return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        if all(w.is_completed() for w in self._works):
            self.wait()
        return self._done

    def __repr__(self) -> str:
        return f"Task(done={self._done})"


def _finish(works, sync_op: bool, then, call) -> Task:
    if works is None:
        works = ()
    elif not isinstance(works, (list, tuple)):
        works = (works,)
    task = Task(works, then, call=call)
    if sync_op:
        task.wait()
    return task


# -- the door --------------------------------------------------------------------------------------------------

def local(t) -> torch.Tensor:
    """The local torch tensor behind a tensor (a dist tensor's local block)."""
    if type(t) is torch.Tensor:
        return t
    if hasattr(t, "_local_value"):
        return t._local_value()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    return t


def tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def passed_sizes(call: "Call") -> tuple:
    """(elements, bytes per element) of each tensor this rank passes in ``call`` (``nbytes`` bytes without them)."""
    if call.tensors:
        return tuple((t.numel(), t.element_size()) for t in call.tensors if t is not None)
    return ((int(call.nbytes or 0), 1),)


def received_bytes(call: "Call", g: Group, sizes: tuple | None = None) -> int:
    """The bytes this rank receives in ``call`` on ``g`` (the model of :mod:`meshviz.core.traffic`): what its
    event reports, so that a rank's events add up to what it received."""
    root = call.src if call.src is not None else call.dst
    if root is None and call.peers:
        root = call.peers.get("src", call.peers.get("dst"))
    at = g.ranks.index(root) if root in g.ranks else None
    return received(call.op.value, passed_sizes(call) if sizes is None else sizes, g.nranks, g.rank, at)


def check_peer(what: str, rank, ranks) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ValueError(f"{what} must be an int global rank, got {rank!r}")
    if rank not in ranks:
        raise ValueError(f"{what}={rank} is not in the group {list(ranks)} ({what} is a global rank, as in Paddle)")
    return rank


class CollectiveOp(str, Enum):
    """A collective (or point-to-point) operation ``run`` issues; equal to (and printed as) its name, e.g.
    ``"all_reduce"``."""

    ALL_REDUCE = "all_reduce"
    REDUCE = "reduce"
    BROADCAST = "broadcast"
    ALL_GATHER = "all_gather"
    ALL_GATHER_OBJECT = "all_gather_object"
    BROADCAST_OBJECT_LIST = "broadcast_object_list"
    SCATTER = "scatter"
    SCATTER_OBJECT_LIST = "scatter_object_list"
    GATHER = "gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALLTOALL = "alltoall"
    ALLTOALL_SINGLE = "alltoall_single"
    ALL_TO_ALL = "all_to_all"
    BARRIER = "barrier"
    SEND = "send"
    RECV = "recv"
    SEND_RECV = "send_recv"
    BATCH_ISEND_IRECV = "batch_isend_irecv"

    __str__ = str.__str__
    __format__ = str.__format__


_P2P = frozenset(op for op in CollectiveOp if op.value in P2P_OPS)
_KIND = {CollectiveOp.SEND: "send", CollectiveOp.RECV: "recv"}  # the trace event's kind; "collective" for the rest


@dataclass(frozen=True)
class Call:
    """One collective to issue: ``op`` on ``group`` (whatever :func:`groups.resolve` reads) with ``tensors``, the
    ones this rank passes (``nbytes`` in all, their sum by default; without tensors, ``nbytes`` is the size of what
    the op moves). ``start(g)`` starts the torch call(s) on the resolved Group and
    returns their work handle(s), or None when it blocked until done; ``then()`` runs once the works are done (at
    once when ``sync_op``, else in ``Task.wait``). ``peers``: ``{"src": rank, ...}``, global ranks that must be in
    the group. ``traced``: False when the caller traces the step itself; else the event (kind "send"/"recv" for
    those ops, "collective" for the rest) reports the bytes this rank receives (:func:`received_bytes`), has
    ``peer`` and ``name``, and ``reduce_op``, ``src``, ``dst`` and
    ``bucket`` go into its payload. ``recv_bytes``: the bytes this rank receives where the byte model cannot count
    them (an all-to-all whose pieces differ in size)."""

    op: CollectiveOp
    group: Any
    start: Callable[[Group], Any]
    tensors: Sequence = ()
    nbytes: int | None = None
    peers: Mapping[str, int] | None = None
    sync_op: bool = True
    then: Callable[[], Any] | None = None
    traced: bool = True
    peer: int | None = None
    name: str | None = None
    reduce_op: str | None = None
    src: int | None = None
    dst: int | None = None
    bucket: int | None = None
    recv_bytes: int | None = None

    def __post_init__(self) -> None:
        if type(self.op) is not CollectiveOp:
            object.__setattr__(self, "op", CollectiveOp(self.op))  # a name ("all_reduce") reads as its op

    @property
    def kind(self) -> str:
        return _KIND.get(self.op, "collective")

    def payload(self, seq: int | None, where: str | None, module: str | None, backward: bool,
                sizes: tuple | None = None) -> trace.Payload:
        issued = dict(seq=seq, where=where, module=module, backward=backward)
        if self.op is CollectiveOp.SEND:
            return trace.Send(src=self.src, dst=self.dst, **issued)
        if self.op is CollectiveOp.RECV:
            return trace.Recv(src=self.src, dst=self.dst, **issued)
        return trace.Collective(reduce_op=self.reduce_op, src=self.src, dst=self.dst, bucket=self.bucket, sizes=sizes,
                                **issued)


# -- the checks: each ``check(call, g, seq) -> bool`` raises on a bad call, or returns False when this rank takes
# no part; ``seq`` is the rank's number of this collective on the group once it shows as inside it, else None.

Check = Callable[[Call, Group, "int | None"], bool]


def membership(call: Call, g: Group, seq: int | None) -> bool:
    """Every peer is a global rank of the group and every rank of the group is in the world (ValueError on members
    and non-members alike, before any communication); a non-member takes no part."""
    if g.missing:
        raise ValueError(f"{call.op.value} on group {g.ranks}: the world has no rank{'s' if len(g.missing) > 1 else ''}"
                         f" {', '.join(map(str, g.missing))} (a mesh naming more ranks than were started gives such "
                         f"a group; it cannot communicate)")
    for what, r in (call.peers or {}).items():
        check_peer(what, r, g.ranks)
    if g.rank >= 0:
        closed.check(call.op.value, g.ranks, g.ranks[g.rank])  # connections shut after a pipeline stage failed
    return g.rank >= 0


def on_devices(call: Call, g: Group, seq: int | None) -> bool:
    """The tensors are where the group's backend needs them (ValueError naming the fix, before any communication)."""
    if call.tensors:
        devices.check(call.op.value, g, call.tensors)
    return True


def matching(call: Call, g: Group, seq: int | None) -> bool:
    """With :func:`match.checking` on, the members compare what they are about to run (CollectiveMismatch on every
    member when they differ)."""
    if checking() and call.op not in _P2P and g.nranks > 1:
        check_match(g, call.op.value, seq, call.tensors, call.src if call.src is not None else call.dst,
                    call.reduce_op)
    return True


def counts_agree(what: str, sends, recvs, unit: str) -> Check:
    """A check for an all-to-all (appended to CHECKS): with :func:`match.checking` on, every member's ``sends[j]``
    (the ``unit``s it sends the group's j-th member) is what that member's ``recvs`` expects from it; else each
    member raises CollectiveMismatch naming both, before any data moves (gloo would abort the process)."""

    def check(call: Call, g: Group, seq: int | None) -> bool:
        n = g.nranks
        if not checking() or n < 2 or g.backend not in ("gloo", "threads"):
            return True
        out = torch.empty(n * 2 * n, dtype=torch.int64)
        compat.all_gather_single(out, torch.tensor([*sends, *recvs], dtype=torch.int64), group=g.process_group)
        rows = out.view(n, 2 * n).tolist()
        bad = [(i, j) for i in range(n) for j in range(n) if rows[i][j] != rows[j][n + i]]
        if bad:
            i, j = bad[0]
            a, b = g.ranks[i], g.ranks[j]
            more = f" (and {len(bad) - 1} more pair{'s' * (len(bad) > 2)})" if len(bad) > 1 else ""
            raise CollectiveMismatch(
                f"mismatch at #{seq} on group {list(g.ranks)}: in {what}, rank {a} sends rank {b} {rows[i][j]} {unit}, "
                f"but rank {b} expects {rows[j][n + i]} from it{more}", sorted({g.ranks[k] for p in bad for k in p}))
        return True

    return check


CHECKS: tuple[Check, ...] = (membership, on_devices, matching)
INSIDE = frozenset({matching})  # from the first of these on, the rank shows as inside the collective (they may block)
_FIRST_INSIDE = next(i for i, c in enumerate(CHECKS) if c in INSIDE)


def peer_names(ranks) -> dict[str, int]:
    """``Call.peers`` for a call with several peers (a batch of sends and receives): ``{"peer 0": rank, ...}``."""
    return {f"peer {i}": r for i, r in enumerate(sorted(set(ranks)))}


def _p2p_ranks(call: Call, g: Group) -> tuple:
    """The global ranks a point-to-point call waits on, this one included (the group's when it names no peer)."""
    ranks = {g.ranks[g.rank], *(call.peers or {}).values()}
    if call.peer is not None:
        ranks.add(call.peer)
    return tuple(sorted(ranks)) if len(ranks) > 1 else g.key


def run(call: Call, checks: Sequence[Check] = CHECKS) -> Task:
    """Issue one collective: resolve its group, apply ``checks`` in order, trace, start, finish.

    Every collective meshviz issues passes through here (the wrappers of ``dist.*``, reshard steps,
    DataParallel, the gradient mean, clipping), so what a rank is doing — ``call.op`` on the group's ranks, with
    its tensors — is known in one place: the rank's roll-call record (:mod:`~meshviz.runtime.rollcall`) says
    so while the call runs (and while the checks of ``INSIDE`` run). A rank a check leaves out (a non-member) gets
    a finished Task and ``call.start`` is not called.
    """
    g = call.group if type(call.group) is Group else resolve(call.group)
    op = call.op.value
    first_inside = _FIRST_INSIDE if checks is CHECKS else \
        next((i for i, c in enumerate(checks) if c in INSIDE), len(checks))
    for check in checks[:first_inside]:
        if not check(call, g, None):
            return Task(done=True)
    rec = rollcall.current()
    # a send or recv waits on its peers alone: the roll-call shows it on them, with no number of the group's
    p2p = call.op in _P2P
    prev = rec.enter(op, _p2p_ranks(call, g) if p2p else g.key, call.tensors, call.nbytes, counted=not p2p)
    task = None
    try:
        for check in checks[first_inside:]:
            if not check(call, g, rec.seq):
                task = Task(done=True)
                return task
        key = (op, rec.group, rec.seq, call.tensors)
        if not call.traced or not trace.active():
            task = _finish(call.start(g), call.sync_op, call.then, key)
            return task
        sizes = passed_sizes(call)
        got = call.recv_bytes if call.recv_bytes is not None else received_bytes(call, g, sizes)
        fields: dict[str, Any] = {"op": op, "group": list(g.ranks), "bytes": got}
        if call.peer is not None:
            fields["peer"] = call.peer
        if call.name is not None:
            fields["name"] = call.name
        mod, bwd = rollcall.issuer(rec)
        fields["payload"] = call.payload(rec.seq, rollcall.where(), mod, bwd, sizes)
        with trace.span(call.kind, **fields):
            task = _finish(call.start(g), call.sync_op, call.then, key)
        return task
    except CollectiveMismatch:
        raise  # raised on every member before any data moved: no collective failed
    except BaseException as e:
        rec.fail(e)
        raise
    finally:
        rec.leave(prev, task._works if task is not None else None)


# -- packed forms -----------------------------------------------------------------------------------------------

def all_to_all_flat(outs: list, ins: list, pg):
    """All-to-all of tensor lists as one ``all_to_all_single`` over packed buffers: gloo has no list form on torch
    2.11, and on 2.13 the two cost the same within noise (bench/bench_collective.py). Returns (work, unpack): call
    ``unpack()`` once the work is done to copy the received pieces into ``outs``."""
    packed = torch.cat([x.reshape(-1) for x in ins])
    recv = packed.new_empty(sum(o.numel() for o in outs))
    work = tdist.all_to_all_single(recv, packed, [o.numel() for o in outs], [x.numel() for x in ins], group=pg,
                                   async_op=True)

    def unpack():
        off = 0
        for o in outs:
            n = o.numel()
            o.copy_(recv[off : off + n].view_as(o))
            off += n

    return work, unpack


# -- the gradient mean -----------------------------------------------------------------------------------------

FUSE_BYTES = 128 << 20  # per all-reduce, as Paddle's 128 MB gradient groups


def all_reduce_mean_(tensors, group=None, *, bucket_bytes: int = FUSE_BYTES, name: str | None = None) -> None:
    """Replace every tensor by its mean over ``group``, in place.

    Per dtype, tensors are packed into flat buffers of about ``bucket_bytes`` (a buffer closes once it reaches the
    budget), each buffer all-reduced once (SUM), then divided by the group size (toward zero for integers) and copied
    back. Every rank must pass tensors of the same shapes in the same order. A non-member returns at once.
    """
    g = group if type(group) is Group else resolve(group)
    if g.rank < 0 or g.nranks == 1:
        return
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    pg = g.process_group
    for dtype in sorted(by_dtype, key=str):
        bucket, size = [], 0
        for t in by_dtype[dtype] + [None]:
            if t is not None:
                bucket.append(t)
                size += t.numel() * t.element_size()
            if bucket and (t is None or size >= bucket_bytes):
                flat = compat.flatten_dense_tensors([b.detach() for b in bucket])
                run(Call(CollectiveOp.ALL_REDUCE, g, lambda g: tdist.all_reduce(flat, group=pg, async_op=True),
                         tensors=(flat,), name=name, reduce_op="sum"))
                divide_(flat, g.nranks)
                with torch.no_grad():
                    for b, v in zip(bucket, compat.unflatten_dense_tensors(flat, bucket)):
                        b.copy_(v)
                bucket, size = [], 0
