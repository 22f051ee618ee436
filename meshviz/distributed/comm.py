"""The comm layer: reduce ops, the gloo AVG rule, and ``run``, the one door every collective meshviz issues goes
through."""

from __future__ import annotations

import torch
import torch.distributed as tdist

from .. import compat, trace
from ..core.placements import ReduceType
from . import devices, rollcall
from .groups import Group, resolve
from .match import CollectiveMismatch, check_match, checking

__all__ = ["torch_reduce_op", "dtensor_reduce_op", "from_dtensor_reduce_op", "reduction", "divide_", "Task",
           "run", "check_peer", "local", "tensor_bytes", "all_to_all_flat", "all_reduce_mean_", "FUSE_BYTES"]

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
    """``t /= n`` in place, keeping the dtype: integer tensors floor-divide."""
    if t.is_floating_point() or t.is_complex():
        return t.div_(n)
    return t.floor_divide_(n)


def reduction(rt, group: Group):
    """(torch's op, finish) for reducing with ``rt`` over ``group``: ``finish(t)`` completes a result in place,
    or is None. Backends without AVG (gloo) run SUM, then divide by the group size (floor for integers)."""
    rt = ReduceType(rt)
    if rt is ReduceType.kRedAvg and not _native_avg(group.process_group):
        n = group.nranks
        return tdist.ReduceOp.SUM, (lambda t: divide_(t, n))
    return _TORCH_OPS[rt], None


# -- tasks -----------------------------------------------------------------------------------------------------

class Task:
    """What an ``sync_op=False`` call returns: ``wait()`` blocks until the result is in place."""

    __slots__ = ("_works", "_then", "_done", "_call")

    def __init__(self, works=(), then=None, done: bool = False, call=None):
        self._works = [w for w in works if w is not None]
        self._then = then
        self._done = done
        self._call = call  # (op, group key, seq, tensors): what the roll-call shows while wait() blocks

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


def check_peer(what: str, rank, ranks) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ValueError(f"{what} must be an int global rank, got {rank!r}")
    if rank not in ranks:
        raise ValueError(f"{what}={rank} is not in the group {list(ranks)} ({what} is a global rank, as in Paddle)")
    return rank


def run(op: str, group, start, *, tensors=(), nbytes: int | None = None, peers: dict | None = None,
        sync_op: bool = True, then=None, kind: str | None = "collective", peer: int | None = None,
        name: str | None = None, reduce_op: str | None = None, src: int | None = None, dst: int | None = None,
        bucket: int | None = None) -> Task:
    """Issue one collective: resolve ``group``, check ``peers``, skip non-members, trace, start, finish.

    Every collective meshviz issues passes through here (the wrappers of ``dist.*``, reshard steps,
    DataParallel, the gradient mean, clipping), so what a rank is doing — ``op`` on the group's ranks, with
    ``tensors`` (``nbytes`` in all, their sum by default) — is known in one place: the rank's roll-call record
    (:mod:`~meshviz.distributed.rollcall`) says so while the call runs, and with :func:`match.checking` on,
    the members first compare what they are about to run (:func:`match.check_match`).

    ``tensors`` must be where the group's backend needs them (NCCL: on the GPU; strict device mode: on this
    rank's device), else ValueError before any communication. ``group``: whatever :func:`groups.resolve` reads.
    ``peers``: ``{"src": rank, ...}``, global ranks that must be in the group (ValueError before any communication,
    on members and non-members alike). A non-member gets a finished Task and ``start`` is not called. ``start(g)``
    starts the torch call(s) on the resolved Group and returns their work handle(s), or None when it blocked until
    done. ``then()`` runs once the works are done (at once when ``sync_op``, else in ``Task.wait``). ``kind``: the
    trace event's kind ("collective", "send", "recv"), or None when the caller traces the step itself;
    ``reduce_op``, ``src``, ``dst`` and ``bucket`` go into the event's :class:`~meshviz.trace.Collective` payload.
    """
    g = group if type(group) is Group else resolve(group)
    if peers:
        for what, r in peers.items():
            check_peer(what, r, g.ranks)
    if g.rank < 0:
        return Task(done=True)
    if tensors:
        devices.check(op, g, tensors)  # ValueError naming the fix, before any communication
    rec = rollcall.current()
    prev = rec.enter(op, g.key, tensors, nbytes)
    task = None
    try:
        if checking() and op not in _P2P and g.nranks > 1:
            check_match(g, op, rec.seq, tensors, src if src is not None else dst)
        call = (op, g.key, rec.seq, tensors)
        if kind is None or not trace.active():
            task = _finish(start(g), sync_op, then, call)
            return task
        fields = {"op": op, "group": list(g.ranks),
                  "bytes": int(tensor_bytes(*tensors) if nbytes is None else nbytes)}
        if peer is not None:
            fields["peer"] = peer
        if name is not None:
            fields["name"] = name
        mod, bwd = rollcall.issuer(rec)
        fields["payload"] = trace.Collective(reduce_op=reduce_op, src=src, dst=dst, bucket=bucket, seq=rec.seq,
                                             where=rollcall.where(), module=mod, backward=bwd)
        with trace.span(kind, **fields):
            task = _finish(start(g), sync_op, then, call)
        return task
    except CollectiveMismatch:
        raise  # raised on every member before any data moved: no collective failed
    except BaseException as e:
        rec.fail(e)
        raise
    finally:
        rec.leave(prev, task._works if task is not None else None)


_P2P = frozenset({"send", "recv", "send_recv", "batch_isend_irecv"})  # not every rank of the group takes part


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
    budget), each buffer all-reduced once (SUM), then divided by the group size (floor for integers) and copied
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
                run("all_reduce", g, lambda g: tdist.all_reduce(flat, group=pg, async_op=True), tensors=(flat,),
                    name=name, reduce_op="sum")
                divide_(flat, g.nranks)
                with torch.no_grad():
                    for b, v in zip(bucket, compat.unflatten_dense_tensors(flat, bucket)):
                        b.copy_(v)
                bucket, size = [], 0
