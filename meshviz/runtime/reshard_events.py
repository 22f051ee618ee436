"""The events a reshard emits on a rank: each plan's fields made once, each run's stamped on them."""

from __future__ import annotations

from itertools import chain

import torch

from .. import trace
from ..core.planner import Plan
from ..core.traffic import step_received
from . import rollcall

__all__ = ["Traced", "UNKNOWN", "traced_plan", "plan_event", "step_event", "issued_now", "values_of"]


def values_of(t) -> list | None:
    """``trace.small_values(t)``; of a small plain tensor of one or two dims, read with one tolist."""
    if type(t) is torch.Tensor and not t.dtype.is_complex:
        try:
            n = t.dim()
            if n and t.numel() <= trace.MAX_VALUES:
                if n == 1:
                    return t.tolist()
                return list(chain.from_iterable(t.tolist())) if n == 2 else t.reshape(-1).tolist()
        except Exception:
            pass
    return trace.small_values(t)


class Traced:
    """What a plan's events carry on one rank that is the same at every run: the ``reshard`` event's fields, each
    step's group (None where the rank has no part), whether it keeps the block (a line of one rank: the block's
    values are those that went in), its ``reshard_step`` fields, and its payloads per issuer."""

    __slots__ = ("plan", "head", "parts", "keeps", "steps", "issued")

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


def plan_event(st, traced: Traced, me: int, local, name, tensor_id, plan_id) -> list | None:
    """Emit the ``reshard`` event; returns the values it read."""
    values = None if local is None else values_of(local)
    trace.emit(traced.head.stamp(
        next(st.seq), rank=me, name=name, tensor_id=tensor_id, plan_id=plan_id,
        local_shape=None if local is None else list(local.shape), values=values,
    ), st)
    return values


def step_event(st, traced: Traced, me: int, i: int, local, t0, name, tensor_id, plan_id, issued,
               known=UNKNOWN) -> list | None:
    """Emit step ``i``'s event; ``known``: the values of the block it made, where they are known (a step that keeps
    the block has the values that went in). Returns the values."""
    if known is UNKNOWN:
        values = None if local is None else values_of(local)
    else:
        values = None if known is None else known.copy()
    trace.emit(traced.steps[i].stamp(
        next(st.seq), rank=me, name=name, tensor_id=tensor_id, plan_id=plan_id, start=t0,
        local_shape=None if local is None else list(local.shape), values=values,
        payload=traced.step_payload(i, issued),
    ), st)
    return values


def issued_now() -> tuple:
    module, backward = rollcall.issuer()
    return rollcall.where(), module, backward
