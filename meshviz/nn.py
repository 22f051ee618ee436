"""Paddle-style gradient clipping for torch parameters, correct on sharded gradients: ClipGradByGlobalNorm."""

from __future__ import annotations

import math

import torch
import torch.distributed as tdist

__all__ = ["ClipGradByGlobalNorm"]


def _sq_sum(grads, dev) -> torch.Tensor:
    """The sum of squares of ``grads`` (float64) on ``dev``: one sum per device the gradients live on, then one move
    each (offloaded shards sit on the CPU, the others on the rank's GPU)."""
    per: dict = {}
    for g in grads:
        if g is not None and g.numel():
            per.setdefault(g.device, []).append(g.detach())
    total = torch.zeros((), dtype=torch.float64, device=dev)
    for gs in per.values():
        total += torch.stack([g.double().pow(2).sum() for g in gs]).sum().to(dev)
    return total


def _norm_device(grads) -> torch.device:
    """Where the squared sums meet: this rank's device when a process group exists (the all-reduce over the
    sharding group needs it there: a GPU under NCCL), else the first gradient's device."""
    if tdist.is_initialized():
        from .runtime.devices import device

        return device()
    return next((g.device for g in grads if g is not None), torch.device("cpu"))


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _is_dist(t) -> bool:
    """A meshviz dist tensor (``DistTensor``: a torch.Tensor wrapping a torch DTensor, which torch's clipping does
    not know)."""
    return callable(getattr(t, "is_dist", None)) and t.is_dist()


@torch.no_grad()
def _dist_sq_share(grads, dev) -> torch.Tensor:
    """This rank's share of the squared 2-norm of dist ``grads``: summed over the world it is the exact total.

    A Partial gradient is first reduced on its mesh (its norm needs the value, not the summands); then every rank
    of the mesh adds its block's squared sum divided by how many ranks hold the same block (the product of the
    Replicate axes), so a Replicate gradient counts once and a Shard one adds its disjoint blocks.
    """
    from .core.partial import summed
    from .core.placements import Partial, Replicate
    from .distributed.api import reshard

    total = torch.zeros((), dtype=torch.float64, device=dev)
    for g in grads:
        mesh, pl = g.process_mesh, list(g.placements)
        if any(isinstance(p, Partial) for p in pl):
            pl = summed(pl)
            g = reshard(g.detach(), mesh, pl)
        local = g._local_value().detach()
        if not local.numel():
            continue
        copies = 1
        for axis, p in enumerate(pl):
            if isinstance(p, Replicate):
                copies *= mesh.shape[axis]
        total += local.double().pow(2).sum().to(dev) / copies
    return total


def _sum_over(sq: torch.Tensor, group) -> None:
    """Add ``sq`` in place over the process ``group`` (nothing for None or a group of one)."""
    if group is None or not tdist.is_initialized():
        return
    from .runtime.comm import Call, CollectiveOp, run
    from .runtime.groups import resolve

    if resolve(group).nranks <= 1:
        return

    run(Call(CollectiveOp.ALL_REDUCE, group, lambda g: tdist.all_reduce(sq, group=g.process_group, async_op=True),
             tensors=(sq,), traced=False))


def fleet_mp_group():
    """fleet's model-parallel group when ``fleet.init`` set one up with mp > 1 on this rank, else None."""
    from .distributed.fleet.state import current

    hcg = current()._hcg
    if hcg is None or hcg.get_model_parallel_world_size() <= 1:
        return None
    return hcg.get_model_parallel_group()


def _scale_(g, coef: float) -> None:
    if _is_dist(g):
        g._local.mul_(coef)  # every placement scales blockwise (Partial summands too)
    else:
        g.mul_(coef)


class ClipGradByGlobalNorm:
    """Scale all gradients by ``clip_norm / max(global_norm, clip_norm)`` (Paddle's formula, no epsilon).

    ``global_norm`` is the 2-norm of all gradients together. Call it on parameters (in place; returns the
    global norm as a 0-d tensor) or on Paddle-style ``[(param, grad), ...]`` pairs (returns clipped pairs).
    Gradients that are torch DTensors are measured through their placements, so sharded gradients count once;
    meshviz dist tensors (Shard, Replicate or Partial, on one mesh or several) too: a Replicate block counts once,
    a Partial one is reduced first. With dist gradients every rank of the world must call it (one all-reduce).
    ``group``: the local gradients are disjoint pieces spread over this process group (as in ZeRO); their
    squared sums are added over the group. After ``fleet.init`` with mp > 1, the gradients of split parameters
    (``is_distributed``, the ``fleet.meta_parallel`` layers') are added over the model-parallel group and the
    others counted once, as Paddle's ``HybridParallelClipGrad``: every mp rank must call it.
    Parameters with ``need_clip = False`` are left alone, like Paddle.
    Attach it to a sharded optimizer with ``group_sharded_parallel(..., grad_clip=clip)`` or
    ``optimizer._grad_clip = clip`` (also read by ``dist.shard_optimizer``: Paddle's ``AdamW(..., grad_clip=clip)``).
    """

    def __init__(self, clip_norm: float, group_name: str = "default_group", auto_skip_clip: bool = False):
        clip_norm = float(clip_norm)
        if not (clip_norm > 0) or math.isinf(clip_norm):
            raise ValueError(f"ClipGradByGlobalNorm: clip_norm must be a positive finite number, got {clip_norm}")
        self.clip_norm = clip_norm
        self.group_name = group_name
        self.auto_skip_clip = auto_skip_clip

    def __repr__(self) -> str:
        return f"ClipGradByGlobalNorm(clip_norm={self.clip_norm:g})"

    def coefficient(self, norm: float) -> float:
        return self.clip_norm / max(norm, self.clip_norm)

    def clip_pieces(self, sharded=(), replicated=(), group=None) -> torch.Tensor:
        """Clip in place: ``sharded`` grads are disjoint pieces over ``group``, ``replicated`` are whole here."""
        sharded = [g for g in sharded if g is not None]
        replicated = [g for g in replicated if g is not None]
        dists = [g for g in sharded + replicated if _is_dist(g)]
        dts = [g for g in sharded + replicated if _is_dtensor(g)]
        plain = [g for g in sharded + replicated if not _is_dist(g) and not _is_dtensor(g)]
        sharded = [g for g in sharded if not _is_dist(g)]
        replicated = [g for g in replicated if not _is_dist(g)]
        dev = _norm_device(plain + dts + dists)
        sq = _sq_sum([g for g in sharded if not _is_dtensor(g)], dev)
        _sum_over(sq, group)
        if dists:  # every rank of the world steps every dist parameter (empty off its mesh), as in Paddle
            share = _dist_sq_share(dists, dev)
            if tdist.is_initialized() and tdist.get_world_size() > 1:
                from .runtime.comm import Call, CollectiveOp, run

                run(Call(CollectiveOp.ALL_REDUCE, None,
                         lambda g: tdist.all_reduce(share, group=g.process_group, async_op=True), tensors=(share,),
                         traced=False))
            sq = sq + share
        sq = sq + _sq_sum([g for g in replicated if not _is_dtensor(g)], dev)
        from .runtime.devices import full_tensor

        for g in dts:
            n = torch.linalg.vector_norm(g.detach().float(), 2.0)
            sq = sq + full_tensor(n).double().to(dev) ** 2
        norm = float(sq.sqrt())
        coef = self.coefficient(norm)
        if coef < 1.0:
            for g in sharded + replicated + dists:
                _scale_(g, coef)
        return torch.tensor(norm)

    def clip_hybrid(self, parts) -> torch.Tensor:
        """Clip plain gradients in place, as Paddle's ``HybridParallelClipGrad``: ``parts`` is ``[(grads, groups),
        ...]``; each list's squared sum is added over every process group of ``groups`` in turn (groups along
        different axes of the hybrid topology, so over all the ranks they span). The model-parallel shards are added
        over the mp, pipeline and sharding groups; the other gradients, the same on every mp rank, only over the
        pipeline and sharding groups, so they count once. A list with ``groups`` None is scaled and not counted (the
        copies of a weight whose gradient another rank counts). Returns the global norm."""
        dev = _norm_device([g for grads, _ in parts for g in grads])
        sq = torch.zeros((), dtype=torch.float64, device=dev)
        for grads, groups in parts:
            if groups is None:
                continue
            part = _sq_sum(grads, dev)
            for group in groups:
                _sum_over(part, group)
            sq = sq + part
        norm = float(sq.sqrt())
        coef = self.coefficient(norm)
        if coef < 1.0:
            for grads, _ in parts:
                for g in grads:
                    _scale_(g, coef)
        return torch.tensor(norm)

    def __call__(self, parameters, group=None):
        items = list(parameters) if not isinstance(parameters, torch.Tensor) else [parameters]
        if items and isinstance(items[0], (tuple, list)):  # Paddle's params_grads form
            grads = [g for p, g in items if g is not None and getattr(p, "need_clip", True)]
            self.clip_pieces(replicated=grads, group=None) if group is None else self.clip_pieces(grads, (), group)
            return items
        kept = [p for p in items if p.grad is not None and getattr(p, "need_clip", True)]
        grads = [p.grad for p in kept]
        split = [p.grad for p in kept if getattr(p, "is_distributed", False) is True and not _is_dist(p.grad)
                 and not _is_dtensor(p.grad)]
        mp = fleet_mp_group() if group is None and split else None
        if mp is not None:  # fleet's tensor-parallel shards: their squares are added over the mp group
            ids = {id(g) for g in split}
            return self.clip_pieces(sharded=split, replicated=[g for g in grads if id(g) not in ids], group=mp)
        if group is None:
            return self.clip_pieces(replicated=grads)
        return self.clip_pieces(sharded=grads, group=group)
