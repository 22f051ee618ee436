"""The dist tensor's autograd functions: placing a dense tensor, a block and back, and resharding."""

from __future__ import annotations

import torch

from .. import compat
from ..core.layout import local_block
from ..core.mesh import ProcessMesh
from ..core.partial import partial_fill, summed
from ..core.placements import Replicate
from ..core.planner import plan_reshard
from . import dtensor, groups
from .dtensor import DistTensor, make_dist
from .reshard import run_plan, run_plans

__all__ = ["place", "from_local", "to_local", "plan_of", "run_reshard", "run_reshards", "reshard", "unshard",
           "local_block_of"]


def local_block_of(dense: torch.Tensor, mesh: ProcessMesh, placements) -> torch.Tensor:
    coord = mesh.coordinate(groups.rank())
    if coord is None:
        return compat.empty_block(dense.dtype, dense.device)
    blk = local_block(dense.shape, mesh, placements, coord)
    local = dense.detach()[tuple(slice(a, b) for a, b in blk)]
    fill = partial_fill(placements, coord)
    if fill == "zero":
        return torch.zeros_like(local).contiguous()
    if fill == "one":
        return torch.ones_like(local).contiguous()
    return local.clone().contiguous()


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dense, mesh, placements):
        ctx.mesh, ctx.placements, ctx.shape = mesh, placements, dense.shape
        return make_dist(local_block_of(dense, mesh, placements), mesh, placements, dense.shape)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None, None
        full = reshard(grad, ctx.mesh, [Replicate()] * ctx.mesh.ndim)
        local = full._local
        if not ctx.mesh.contains(groups.rank()):
            local = torch.zeros(ctx.shape, dtype=grad.dtype, device=grad.device)
        return local, None, None


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, mesh, placements, shape):
        ctx.mesh, ctx.placements = mesh, placements
        return make_dist(local, mesh, placements, shape)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None, None, None
        want = summed(ctx.placements)
        if list(grad.placements) != want or grad.process_mesh != ctx.mesh:
            grad = reshard(grad, ctx.mesh, want)
        return grad._local, None, None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, mesh, placements):
        ctx.mesh, ctx.shape = t.process_mesh if mesh is None else mesh, t.shape
        ctx.placements = t.placements if placements is None else list(placements)
        local = t._resolved()._local
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None, None
        # the gradient of a block lies as the caller says, by default as the block did: a Partial input's gradient
        # stays Partial (Paddle 3.3.1)
        return make_dist(grad, ctx.mesh, ctx.placements, ctx.shape), None, None


_plans: dict = {}  # a plan is a pure, frozen function of its key: made once per layout pair


def plan_of(t: DistTensor, mesh: ProcessMesh, placements):
    """The plan ``reshard(t, mesh, placements)`` would run (no communication)."""
    src = t.process_mesh
    key = (tuple(t.shape), src.unique_id, tuple(src.dim_names), tuple(t.placements), mesh.unique_id,
           tuple(mesh.dim_names), tuple(placements), t.element_size())
    plan = _plans.get(key)
    if plan is None:
        plan = plan_reshard(key[0], src, key[3], mesh, placements, itemsize=key[7])
        if len(_plans) >= 1024:
            _plans.clear()
        _plans[key] = plan
    return plan


class _Reshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, mesh, placements, name):
        ctx.src_mesh, ctx.src_placements, ctx.name = t.process_mesh, t.placements, name
        return run_reshard(t, mesh, placements, name)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None, None, None
        if not isinstance(grad, DistTensor):
            raise RuntimeError("reshard backward expected a dist gradient")
        back = summed(ctx.src_placements)  # the source layout; a Partial source gets Replicate (Paddle 3.3.1)
        return run_reshard(grad, ctx.src_mesh, back, ctx.name and ctx.name + ".grad"), None, None, None


def run_reshard(t: DistTensor, mesh: ProcessMesh, placements, name=None) -> DistTensor:
    t = t._resolved()
    plan = plan_of(t, mesh, placements)
    local = t._local
    rank = groups.rank()
    src_has = t.process_mesh.contains(rank)
    new = run_plan(plan, local if src_has else None, rank, dtype=t.dtype, device=local.device,
                   name=name, tensor_id=t.tensor_id)
    if new is None or not mesh.contains(rank):
        new = compat.empty_block(local.dtype, local.device)
    out = make_dist(new, mesh, plan.dst_placements, t.shape)
    out.name = name
    return out


def run_reshards(ts, placements_list, names=None, into=None, own: bool = False) -> list:
    """``run_reshard(t, t.process_mesh, placements)`` for each tensor (no autograd), the all-reduces (and even
    all-gathers) along one mesh line coalesced into one collective per bucket, each tensor with its own events.
    ``into``: for each tensor, a dist tensor whose block the result is written into where it fits (its shape, dtype
    and device), so that whatever holds that block (a state_dict taken before) sees the result; there that entry of
    the result is None (the block holds it). ``own``: the caller gives the inputs' blocks up (gradients it
    replaces): a step that keeps a block (a line of one rank) hands it on uncopied."""
    rank = groups.rank()
    ts = [t._resolved() for t in ts]
    names = names if names is not None else [t.name for t in ts]
    plans = [plan_of(t, t.process_mesh, pl) for t, pl in zip(ts, placements_list)]
    locals_ = [t._local if t.process_mesh.contains(rank) else None for t in ts]
    news = run_plans(plans, locals_, rank, names, [t.tensor_id for t in ts], [t.dtype for t in ts],
                     [t._local.device for t in ts], None if into is None else [d._local for d in into], own)
    out = []
    for i, (t, plan, new, name) in enumerate(zip(ts, plans, news, names)):
        if into is not None and new is not None:
            dst = into[i]._local
            if new is not dst and into[i]._tpl is None and (new.shape, new.dtype, new.device) == (
                    dst.shape, dst.dtype, dst.device):
                new = dst.copy_(new)  # an all-gather not made straight into it (a bucket of one, an uneven split)
            if new is dst:
                out.append(None)
                continue
        mesh = plan.dst_mesh
        if new is None or not mesh.contains(rank):
            new = compat.empty_block(t._local.dtype, t._local.device)
        r = make_dist(new, mesh, plan.dst_placements, t.shape)
        r.name = name
        out.append(r)
    return out


def reshard(t, mesh, placements):
    return _Reshard.apply(t, mesh, list(placements), getattr(t, "name", None))




def place(dense: torch.Tensor, mesh: ProcessMesh, placements) -> DistTensor:
    """``dense`` placed on ``mesh``: this rank's block, differentiable back to ``dense``."""
    return _Shard.apply(dense, mesh, placements)


def from_local(local: torch.Tensor, mesh: ProcessMesh, placements, shape) -> DistTensor:
    return _FromLocal.apply(local, mesh, placements, tuple(shape))


def to_local(t: DistTensor, mesh: ProcessMesh | None = None, placements=None) -> torch.Tensor:
    """This rank's block of ``t`` (differentiable; its gradient lies as ``t`` does, or with ``placements``: the
    caller has checked they give each rank a block shaped as its block of ``t``, on ``t``'s mesh)."""
    return _ToLocal.apply(t, mesh, placements)


def unshard(t: DistTensor) -> torch.Tensor:
    """The dense value of ``t`` on every rank of its mesh (a collective; differentiable)."""
    mesh = t.process_mesh
    full = reshard(t, mesh, [Replicate()] * mesh.ndim) if t.requires_grad and torch.is_grad_enabled() \
        else run_reshard(t, mesh, [Replicate()] * mesh.ndim, t.name)
    return to_local(full)


dtensor.set_local_functions(to_local, unshard)
