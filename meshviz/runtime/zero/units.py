"""ZeRO-3 over dist tensors as FSDP2 runs it: a unit's sharded parameters (a block of a ModuleList, or what the root
keeps) are gathered in one collective before the unit's forward, and their gradients reduce-scattered in one once
its backward is done."""

from __future__ import annotations

import torch
from torch import nn

from ..autograd import run_reshards
from ..dtensor import DistTensor

__all__ = ["Unit", "gather_per_unit"]


class Unit:
    """One module whose forward uses ``params`` (sharded dist parameters) gathered to ``full`` placements;
    ``holders[i]``: every ``(module, name)`` that holds ``params[i]``."""

    __slots__ = ("module", "params", "full", "holders", "handles", "live")

    def __init__(self, module: nn.Module, params: list, full: list, holders: list):
        self.module, self.params, self.full, self.holders = module, params, full, holders
        self.handles: list = []
        self.live = None  # the gathered parameters while the unit's forward runs

    def __repr__(self) -> str:
        return f"Unit({type(self.module).__name__}, {len(self.params)} parameters)"

    def gather(self, module, args) -> None:
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.params):
            full = _Gather.apply(self, *self.params)
        else:
            with torch.no_grad():
                full = run_reshards(self.params, self.full)
        self.live = full
        for whole, holders in zip(full, self.holders):
            for owner, name in holders:
                owner._parameters[name] = whole

    def release(self, module, args, output) -> None:
        for p, holders in zip(self.params, self.holders):
            for owner, name in holders:
                owner._parameters[name] = p
        self.live = None


class _Gather(torch.autograd.Function):
    """A unit's parameters gathered (one collective for all); their gradients moved back to the parameters' own
    layout (a reduce-scatter, one for all) once every one of them is computed."""

    @staticmethod
    def forward(ctx, unit: Unit, *params):
        ctx.unit = unit
        return tuple(run_reshards(params, unit.full))

    @staticmethod
    def backward(ctx, *grads):
        unit = ctx.unit
        todo = [i for i, g in enumerate(grads) if isinstance(g, DistTensor)]
        moved = run_reshards([grads[i] for i in todo], [unit.params[i].placements for i in todo], own=True)
        # an output the forward left unused gets autograd's plain zeros: its parameter took no gradient (None, as
        # in one process, so the optimizer skips it), not a plain tensor the step cannot lay out
        out: list = [None] * len(grads)
        for i, g in zip(todo, moved):
            out[i] = g
        return (None, *out)


def _units_of(model: nn.Module) -> list[nn.Module]:
    """FSDP2's units: every block of a ModuleList, then the root (torchtitan wraps each transformer block, then
    the model)."""
    out = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            out.extend(m)
    return out + [model]


def gather_per_unit(model: nn.Module, full_of: dict) -> list[Unit]:
    """Hook ``model`` so each unit gathers its parameters found in ``full_of`` (parameter -> the placements it is
    used in) once before its forward; a parameter held in two units goes to the root."""
    holders: dict = {}
    for owner in model.modules():
        for name, p in owner._parameters.items():
            if p is not None and p in full_of:
                holders.setdefault(p, []).append((owner, name))
    unit_of: dict = {}
    modules = _units_of(model)
    for m in modules[:-1]:
        inside = {id(o) for o in m.modules()}
        for p, hold in holders.items():
            if all(id(o) in inside for o, _ in hold) and p not in unit_of:
                unit_of[p] = m
    for p in holders:
        unit_of.setdefault(p, model)
    units = []
    for m in modules:
        params = [p for p in holders if unit_of[p] is m]
        if not params:
            continue
        u = Unit(m, params, [full_of[p] for p in params], [holders[p] for p in params])
        u.handles = [m.register_forward_pre_hook(u.gather), m.register_forward_hook(u.release, always_call=True)]
        units.append(u)
    return units
