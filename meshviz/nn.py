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
        from .distributed.devices import device

        return device()
    return next((g.device for g in grads if g is not None), torch.device("cpu"))


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class ClipGradByGlobalNorm:
    """Scale all gradients by ``clip_norm / max(global_norm, clip_norm)`` (Paddle's formula, no epsilon).

    ``global_norm`` is the 2-norm of all gradients together. Call it on parameters (in place; returns the
    global norm as a 0-d tensor) or on Paddle-style ``[(param, grad), ...]`` pairs (returns clipped pairs).
    Gradients that are torch DTensors are measured through their placements, so sharded gradients count once.
    ``group``: the local gradients are disjoint pieces spread over this process group (as in ZeRO); their
    squared sums are added over the group. Parameters with ``need_clip = False`` are left alone, like Paddle.
    Attach it to a sharded optimizer with ``group_sharded_parallel(..., grad_clip=clip)`` or
    ``optimizer._grad_clip = clip``.
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
        dts = [g for g in sharded + replicated if _is_dtensor(g)]
        dev = _norm_device(sharded + replicated)
        sq = _sq_sum([g for g in sharded if not _is_dtensor(g)], dev)
        if group is not None and tdist.is_initialized() and tdist.get_world_size(group) > 1:
            from .distributed.comm import run

            run("all_reduce", group, lambda g: tdist.all_reduce(sq, group=g.process_group, async_op=True),
                tensors=(sq,), kind=None)
        sq = sq + _sq_sum([g for g in replicated if not _is_dtensor(g)], dev)
        from .distributed.devices import full_tensor

        for g in dts:
            n = torch.linalg.vector_norm(g.detach().float(), 2.0)
            sq = sq + full_tensor(n).double().to(dev) ** 2
        norm = float(sq.sqrt())
        coef = self.coefficient(norm)
        if coef < 1.0:
            for g in sharded + replicated:
                g.mul_(coef)
        return torch.tensor(norm)

    def __call__(self, parameters, group=None):
        items = list(parameters) if not isinstance(parameters, torch.Tensor) else [parameters]
        if items and isinstance(items[0], (tuple, list)):  # Paddle's params_grads form
            grads = [g for p, g in items if g is not None and getattr(p, "need_clip", True)]
            self.clip_pieces(replicated=grads, group=None) if group is None else self.clip_pieces(grads, (), group)
            return items
        grads = [p.grad for p in items if p.grad is not None and getattr(p, "need_clip", True)]
        if group is None:
            return self.clip_pieces(replicated=grads)
        return self.clip_pieces(sharded=grads, group=group)
