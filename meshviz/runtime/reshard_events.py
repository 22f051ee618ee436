"""The events a reshard emits on a rank: each plan's fields made once, each run's stamped on them."""

from __future__ import annotations

import sys
import time
from array import array
from ctypes import c_char
from itertools import chain, count

import torch

from .. import trace
from ..core.planner import Plan
from ..core.traffic import step_received
from ..trace import recorder
from . import rollcall

__all__ = ["DeviceRead", "Traced", "UNKNOWN", "traced_plan", "plan_event", "step_event", "issued_now", "values_of",
           "snapshot", "run_traced"]


def values_of(t) -> list | torch.Tensor | DeviceRead | None:
    """``trace.small_values(t)``; of a small plain tensor of one or two dims, read with one tolist. Of a block on
    an accelerator, its leading values on their way to the host, read when the event is made (no wait for the
    device on the reshard's path)."""
    if type(t) is torch.Tensor:
        try:
            if t.is_cpu:
                n = t.dim()
                if n and not t.is_complex():
                    if t.numel() > trace.MAX_VALUES:
                        return _head(t).tolist()
                    if n == 1:
                        return t.tolist()
                    return list(chain.from_iterable(t.tolist())) if n == 2 else t.reshape(-1).tolist()
            elif not t.is_meta and not t.is_complex():
                head = _head(t) if t.numel() > trace.MAX_VALUES else t.detach().reshape(-1)
                return DeviceRead(head) if t.is_cuda else head.clone()
        except Exception:
            pass
    return trace.small_values(t)


def _head(t: torch.Tensor) -> torch.Tensor:
    """The leading ``MAX_VALUES`` elements of ``t``, flat (of a strided block, copied from its leading rows only)."""
    return trace.leading_rows(t.detach()).reshape(-1)[: trace.MAX_VALUES]


_TICKETS = count()  # DeviceRead's order of issue, across devices and threads (next() is atomic)
_SYNCED: dict = {}  # device -> every read whose ticket is below this has its copy done


class DeviceRead:
    """A block's leading values on an accelerator, on their way to the host: on CUDA copied to pinned host memory
    without waiting for the device (elsewhere a copy on the device). ``tolist`` waits for the device once for every
    read issued before it: a reshard's path queues the copy, the trace's flush reads a batch of them after one
    synchronize (``settle``), and the host copy is let go once read."""

    __slots__ = ("host", "device", "ticket", "values")

    def __init__(self, head: torch.Tensor):
        self.values: list | None = None
        if head.is_cuda:
            self.host = head.to("cpu", non_blocking=True)  # pinned, so the copy is queued, not waited for
            self.device = head.device
            self.ticket = next(_TICKETS)  # taken after the copy is queued
        else:
            self.host, self.device, self.ticket = head.clone(), head.device, -1

    def tolist(self) -> list:
        """The values, a new list each time."""
        v = self.values
        if v is None:
            host = self.host
            if self.ticket < 0:
                v = trace.small_values(host)
            else:
                if self.ticket >= _SYNCED.get(self.device, 0):
                    upto = next(_TICKETS)  # every ticket below it was taken after its copy was queued
                    torch.cuda.synchronize(self.device)
                    _SYNCED[self.device] = max(_SYNCED.get(self.device, 0), upto)
                v = host.tolist()
            self.values = v
            self.host = None
        return list(v)

    settle = tolist


class Traced:
    """What a plan's events carry on one rank that is the same at every run: the ``reshard`` event's fields, each
    step's group (None where the rank has no part), whether it keeps the block (a line of one rank: the block's
    values are those that went in), its ``reshard_step`` fields, its payloads per issuer, and the blocks' shapes as
    lists (events of the plan share them, as they share the templates' lists)."""

    __slots__ = ("plan", "head", "parts", "keeps", "steps", "issued", "shapes")

    def __init__(self, plan: Plan, rank: int):
        self.plan = plan  # held: the cache's key is its id
        placements = ([repr(p) for p in plan.src_placements], [repr(p) for p in plan.dst_placements])
        self.head = trace.EventTemplate(
            kind="reshard", mesh=plan.src_mesh.to_dict(), placements_before=placements[0],
            placements_after=placements[1], shape_before=list(plan.shape), shape_after=list(plan.shape),
            bytes=plan.total_bytes, payload=trace.ReshardPlan(target_mesh=plan.dst_mesh.to_dict(), ops=tuple(plan.ops)))
        self.parts = [step.group_of(rank) for step in plan.steps]
        self.keeps = [step.op != "send_recv" and step.mesh.shape[step.axis] == 1 for step in plan.steps]
        self.steps = [
            trace.EventTemplate(
                kind="reshard_step", op=step.op, step=i, mesh=step.mesh.to_dict(), axis=step.axis,
                group=None if part is None else [list(p) for p in part] if step.op == "send_recv" else list(part),
                bytes=step_received(step, rank, plan.itemsize), placements_before=[repr(p) for p in step.before],
                placements_after=[repr(p) for p in step.after], shape_before=list(plan.shape),
                shape_after=list(plan.shape), payload=trace.ReshardStep())
            for i, (step, part) in enumerate(zip(plan.steps, self.parts))]
        self.issued: list[dict] = [{} for _ in plan.steps]
        self.shapes: dict = {}

    def shape_of(self, local) -> list | None:
        """``list(local.shape)`` (None for no block), one list per shape: a run keeps no new object alive for it."""
        if local is None:
            return None
        shape = local.shape
        try:
            s = self.shapes.get(shape)
        except TypeError:  # a symbolic size hashes not
            return list(shape)
        if s is None:
            if len(self.shapes) >= 64:
                self.shapes.clear()
            s = self.shapes[shape] = list(shape)
        return s

    def step_payload(self, i: int, issued) -> trace.ReshardStep:
        known = self.issued[i]
        p = known.get(issued)
        if p is None:
            step = self.plan.steps[i]
            here, module, backward = issued
            if len(known) >= 64:
                known.clear()
            p = known[issued] = trace.ReshardStep(dim=step.dim, dst_dim=step.dst_dim,
                                                  reduce=None if step.reduce is None else step.reduce.short,
                                                  where=here, module=module, backward=backward)
        return p


_TRACED: dict[tuple[int, int], Traced] = {}  # (id of plan, rank) -> its templates; plans come from a cache


def traced_plan(plan: Plan, rank: int) -> Traced:
    t = _TRACED.get((id(plan), rank))
    if t is None or t.plan is not plan:
        if len(_TRACED) >= 1024:
            _TRACED.clear()
        t = _TRACED[(id(plan), rank)] = Traced(plan, rank)
    return t


UNKNOWN = object()  # values not read yet

_ITEM = {torch.float32: 4, torch.float64: 8, torch.float16: 2, torch.bfloat16: 2, torch.int64: 8, torch.int32: 4,
         torch.int16: 2, torch.int8: 1, torch.uint8: 1, torch.bool: 1}  # what a snapshot may keep as bytes
_LIMIT = {dtype: size * trace.MAX_VALUES for dtype, size in _ITEM.items()}  # bytes of the leading values
_CHARS: dict = {}  # bytes -> its ctypes array type
_ARRAY = {torch.float32: "f", torch.float64: "d", torch.int64: "q", torch.int32: "i", torch.int16: "h",
          torch.int8: "b", torch.uint8: "B"}  # dtype -> the typecode of array.array that reads it


def snapshot(st, t) -> tuple:
    """``values_of(t)`` as the hot path keeps it, as (dtype, what): of a contiguous CPU block, the bytes of its
    leading values (read into numbers when the event is made: torch's own ``tolist`` of the same bytes); otherwise
    (None, ``values_of(t)``), a read from a device kept in ``st.reads`` for the trace's flush to settle."""
    if type(t) is torch.Tensor:
        try:
            if t.is_cpu:
                dtype = t.dtype
                limit = _LIMIT.get(dtype)
                # a negative view (the imaginary part of a conjugate) holds the values' negations
                if limit is not None and t.is_contiguous() and not (t._is_view() and t.is_neg()):
                    nbytes = t.nbytes
                    if nbytes:
                        if nbytes > limit:
                            nbytes = limit
                        chars = _CHARS.get(nbytes)
                        if chars is None:
                            chars = _CHARS[nbytes] = c_char * nbytes
                        return dtype, chars.from_address(t.data_ptr()).raw
            elif not t.is_meta and not t.is_complex():
                read = DeviceRead(_head(t) if t.numel() > _MAX else t.detach().reshape(-1))
                st.reads.append(read)
                return None, read
        except Exception:
            pass
    return None, None if t is None else values_of(t)


_MAX = trace.MAX_VALUES
_NONE = (None, None)


def _values(dtype, what):
    """The list of values a snapshot stands for, a new one for each event (events of a step that keeps the block
    share its snapshot)."""
    if dtype is not None:
        code = _ARRAY.get(dtype)
        if code is not None:  # the same Python numbers as torch's tolist, without a tensor
            return array(code, what).tolist()
        return torch.frombuffer(bytearray(what), dtype=dtype).tolist()
    if what is None:
        return None
    if type(what) is list:
        return what.copy()
    if type(what) is DeviceRead:
        return what.tolist()
    return trace.small_values(what) if isinstance(what, torch.Tensor) else what


# The hot path lays each event's record flat at the end of the rank's deferred records (trace.defer_record): its
# reader, then what the event says, each part a cached object where one serves (a shape's list) or a snapshot.


def plan_event(st, traced: Traced, me: int, local, name, tensor_id, plan_id) -> tuple:
    """Defer the ``reshard`` event; returns the snapshot of the values it read."""
    dtype, what = snap = _NONE if local is None else snapshot(st, local)
    now = time.time()
    trace.defer_record(st, (_plan_read, traced, next(st.seq), now, me, st.cell, name, tensor_id, plan_id,
                            traced.shape_of(local), dtype, what), now)
    return snap


@trace.lazy_reader(12)
def _plan_read(p: list, i: int):
    traced, seq, now, me, cell, name, tensor_id, plan_id, shape, dtype, what = p[i + 1:i + 12]
    return traced.head.stamp_run(seq, now, now, me, cell, name, tensor_id, plan_id, shape,
                                 _values(dtype, what))


def step_event(st, traced: Traced, me: int, i: int, local, t0, name, tensor_id, plan_id, issued,
               known=UNKNOWN) -> tuple:
    """Defer step ``i``'s event; ``known``: the snapshot of the block it made, where it is known (a step that keeps
    the block has the values that went in). Returns the snapshot."""
    if known is UNKNOWN:
        dtype, what = snap = _NONE if local is None else snapshot(st, local)
    else:
        dtype, what = snap = known
    now = time.time()
    trace.defer_record(st, (_step_read, traced, i, next(st.seq), t0, now, me, st.cell, name, tensor_id, plan_id,
                            traced.shape_of(local), dtype, what) + issued, now)
    return snap


@trace.lazy_reader(18)
def _step_read(p: list, k: int):
    traced, i, seq, t0, now, me, cell, name, tensor_id, plan_id, shape, dtype, what, code, lasti, module, backward \
        = p[k + 1:k + 18]
    where = None if code is None else rollcall.place(code.co_filename, code.co_name, _line(code, lasti))
    return traced.steps[i].stamp_run(seq, t0, now, me, cell, name, tensor_id, plan_id, shape,
                                     _values(dtype, what), traced.step_payload(i, (where, module, backward)))


def run_traced(plan: Plan, local, rank: int, dtype, device, own: bool, name, tensor_id, plan_id: int, st, ctx,
               run_step) -> torch.Tensor | None:
    """``reshard.run_plan`` while tracing (its steps run by ``run_step``): the events :func:`plan_event` and
    :func:`step_event` defer, laid down inline (a traced reshard's cost is its Python's)."""
    traced = _TRACED.get((id(plan), rank))
    if traced is None or traced.plan is not plan:
        traced = traced_plan(plan, rank)
    me = st.rank
    if me is None:
        me = trace.my_rank(st)
    cell = st.cell
    code, lasti, module, backward = _issued(sys._getframe(2), rollcall.ROLLCALL.get(ctx).record)
    snap = _NONE if local is None else snapshot(st, local)
    p = st.pending
    now = time.time()
    if not p:
        st.since = now
    shape = traced.shape_of(local)
    p += (_plan_read, traced, next(st.seq), now, me, cell, name, tensor_id, plan_id, shape, snap[0], snap[1])
    keeps, parts = traced.keeps, traced.parts
    for i, step in enumerate(plan.steps):
        t0 = time.time()
        local = run_step(step, local, rank, dtype, device, own or i > 0)
        if parts[i] is None:
            snap = None
            continue
        if snap is None or not keeps[i]:  # a step that keeps the block has the values (and shape) that went in
            snap = _NONE if local is None else snapshot(st, local)
            shape = traced.shape_of(local)
        now = time.time()
        if not p:
            st.since = now
        p += (_step_read, traced, i, next(st.seq), t0, now, me, cell, name, tensor_id, plan_id, shape, snap[0], snap[1],
              code, lasti, module, backward)
    if p and (now - st.since > recorder.FLUSH_AFTER or len(p) >= recorder.FLUSH_FIELDS):
        trace.flush(st)
    return local


_LINES: dict = {}  # (id of a code, offset) -> (the code, its line there)


def _line(code, lasti: int):
    """The line of ``code`` at instruction offset ``lasti``: a frame's ``f_lineno`` (which decodes the line table
    from its start on every read: microseconds in a long function or cell)."""
    hit = _LINES.get((id(code), lasti))
    if hit is not None and hit[0] is code:
        return hit[1]
    line = next((n for a, b, n in code.co_lines() if a <= lasti < b), None)
    if len(_LINES) >= 4096:
        _LINES.clear()
    _LINES[(id(code), lasti)] = (code, line)
    return line


_INTERNAL: dict = {}  # file name -> whether rollcall.where looks past its frames (rollcall's answer, kept)


def issued_now() -> tuple:
    """(the code and instruction offset where the user's code is, the module whose forward or backward runs,
    whether it is the backward), for the reshard this module's caller runs: ``rollcall.where`` of the caller's
    caller (both are meshviz's), its text made when the event is."""
    return _issued(sys._getframe(2), None)


def _issued(f, rec) -> tuple:
    """:func:`issued_now` from frame ``f`` on (``rec``: the rank's roll-call record, where the caller has it)."""
    if rec is None:
        rec = rollcall.current()
    module, backward = (rec.modules[-1][0], False) if rec.modules else rollcall.backward_issuer(rec)
    known = _INTERNAL
    while f is not None:
        code = f.f_code
        name = code.co_filename
        internal = known.get(name)
        if internal is None:
            if len(known) >= 4096:
                known.clear()
            internal = known[name] = rollcall.internal(name)
        if not internal:
            return code, f.f_lasti, module, backward  # its line is read when the event is made: that costs
        f = f.f_back
    return None, 0, module, backward
