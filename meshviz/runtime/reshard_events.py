"""The events a reshard emits on a rank: each plan's fields made once, each run's stamped on them."""

from __future__ import annotations

import sys
import time
from itertools import chain, count

import torch

from .. import trace
from ..core.planner import Plan
from ..core.traffic import step_received
from . import rollcall

__all__ = ["DeviceRead", "Traced", "UNKNOWN", "traced_plan", "plan_event", "step_event", "issued_now", "values_of"]


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
    """A CUDA block's leading values copied to pinned host memory without waiting for the device. ``tolist``
    waits for the device once for every read issued before it: a reshard's path queues the copy, the trace's
    flush reads a batch of them after one synchronize."""

    __slots__ = ("host", "device", "ticket")

    def __init__(self, head: torch.Tensor):
        self.host = head.to("cpu", non_blocking=True)  # pinned, so the copy is queued, not waited for
        self.device = head.device
        self.ticket = next(_TICKETS)  # taken after the copy is queued

    def tolist(self) -> list:
        if self.ticket >= _SYNCED.get(self.device, 0):
            upto = next(_TICKETS)  # every ticket below it was taken after its copy was queued
            torch.cuda.synchronize(self.device)
            _SYNCED[self.device] = max(_SYNCED.get(self.device, 0), upto)
        return self.host.tolist()


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

# The hot path keeps one tuple per event until the flush (trace.defer_entry): its maker, then what the event says,
# each part a cached object where one serves (a shape's list, a step's payload) or the values read.


def plan_event(st, traced: Traced, me: int, local, name, tensor_id, plan_id) -> list | None:
    """Defer the ``reshard`` event (it is made at the trace's next flush, of what holds now); returns the values it
    read."""
    values = None if local is None else values_of(local)
    now = time.time()
    trace.defer_entry(st, (_plan_made, traced, next(st.seq), now, me, st.cell, name, tensor_id, plan_id,
                           traced.shape_of(local), values), now)
    return values


def _listed(values):
    if values is None or type(values) is list:
        return values
    if type(values) is DeviceRead:
        return values.tolist()
    return trace.small_values(values) if isinstance(values, torch.Tensor) else values


def _plan_made(entry):
    _, traced, seq, now, me, cell, name, tensor_id, plan_id, shape, values = entry
    return traced.head.stamp_run(seq, now, now, me, cell, name, tensor_id, plan_id, shape, _listed(values))


def step_event(st, traced: Traced, me: int, i: int, local, t0, name, tensor_id, plan_id, issued,
               known=UNKNOWN) -> list | None:
    """Defer step ``i``'s event; ``known``: the values of the block it made, where they are known (a step that keeps
    the block has the values that went in). Returns the values."""
    values = (None if local is None else values_of(local)) if known is UNKNOWN else known
    now = time.time()
    trace.defer_entry(st, (_step_made, traced, i, known is not UNKNOWN, next(st.seq), t0, now, me, st.cell, name,
                           tensor_id, plan_id, traced.shape_of(local), values, traced.step_payload(i, issued)), now)
    return values


def _step_made(entry):
    _, traced, i, shared, seq, t0, now, me, cell, name, tensor_id, plan_id, shape, values, payload = entry
    return traced.steps[i].stamp_run(
        seq, t0, now, me, cell, name, tensor_id, plan_id, shape,
        values.copy() if shared and type(values) is list else _listed(values),  # each event owns its values
        payload)


def issued_now() -> tuple:
    """(where the user's code is, the module whose forward or backward runs, whether it is the backward), for the
    reshard this module's caller runs."""
    module, backward = rollcall.issuer()
    return rollcall.where(sys._getframe(2)), module, backward  # from the caller's caller: both are meshviz's
