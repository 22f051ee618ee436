"""Autograd-aware model-parallel collectives (Megatron's f/g pairs) on plain local tensors."""

from __future__ import annotations

import torch
import torch.distributed as tdist
import torch.nn.functional as F

from ....runtime.groups import resolve
from ...collective import ReduceOp, all_gather, all_reduce

__all__ = ["mp_group_of", "group_index", "c_identity", "mp_allreduce", "c_split", "c_concat", "c_lookup_table",
           "parallel_cross_entropy", "_c_identity", "_c_concat", "_c_split", "_mp_allreduce", "_c_lookup_table",
           "_c_softmax_with_cross_entropy"]


def mp_group_of(mp_group):
    """The model-parallel group: the one given, else fleet's hybrid group's, else the world."""
    if mp_group is not None:
        return mp_group
    from .. import topology

    hcg = topology.hybrid_group()
    return None if hcg is None else hcg.get_model_parallel_group()


def group_index(group) -> tuple[int, int]:
    """(this rank's index in the group, group size)."""
    g = resolve(group)
    me = tdist.get_rank()
    if me not in g.ranks:
        raise ValueError(f"rank {me} is not in the model-parallel group {list(g.ranks)}")
    return g.ranks.index(me), g.nranks


class _CIdentity(torch.autograd.Function):
    """Forward: identity. Backward: sum the gradient over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        all_reduce(g, ReduceOp.SUM, group=ctx.group)
        return g, None


class _MpAllreduce(torch.autograd.Function):
    """Forward: sum over the group. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.contiguous().clone()
        all_reduce(y, ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


def _gather_last(x, group):
    parts = []
    all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _CSplit(torch.autograd.Function):
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather the chunks."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        i, n = group_index(group)
        if x.shape[-1] % n:
            raise ValueError(f"last dim {x.shape[-1]} is not divisible by the model-parallel size {n}")
        return x.chunk(n, dim=-1)[i].contiguous()

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g, ctx.group), None


class _CConcat(torch.autograd.Function):
    """Forward: all-gather chunks along the last dim. Backward: keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, g):
        i, n = group_index(ctx.group)
        return g.chunk(n, dim=-1)[i].contiguous(), None


def c_identity(x, group=None):
    return _CIdentity.apply(x, group)


def mp_allreduce(x, group=None):
    return _MpAllreduce.apply(x, group)


def c_split(x, group=None):
    return _CSplit.apply(x, group)


def c_concat(x, group=None):
    return _CConcat.apply(x, group)


class _ParallelCrossEntropy(torch.autograd.Function):
    """Softmax cross-entropy over logits split along the class dim; never builds the full logits."""

    @staticmethod
    def forward(ctx, logits, label, group, ignore_index, return_softmax):
        i, n = group_index(group)
        v = logits.shape[-1]
        start = i * v
        lmax = logits.detach().max(dim=-1, keepdim=True).values.clone()
        all_reduce(lmax, ReduceOp.MAX, group=group)
        shifted = logits.detach() - lmax
        exp = shifted.exp()
        sumexp = exp.sum(dim=-1, keepdim=True)
        all_reduce(sumexp, ReduceOp.SUM, group=group)
        in_range = (label >= start) & (label < start + v)
        local = torch.where(in_range, label - start, torch.zeros_like(label))
        picked = shifted.gather(-1, local.unsqueeze(-1)) * in_range.unsqueeze(-1).to(shifted.dtype)
        all_reduce(picked, ReduceOp.SUM, group=group)
        ignore = (label == ignore_index).unsqueeze(-1)
        loss = (sumexp.log() - picked).masked_fill(ignore, 0.0)
        softmax = exp / sumexp
        ctx.save_for_backward(softmax, local, in_range, ignore)
        out = softmax.clone() if return_softmax else softmax.new_empty(0)  # the caller's: safe to change in place
        ctx.mark_non_differentiable(out)
        return loss, out

    @staticmethod
    def backward(ctx, g, _):
        softmax, local, in_range, ignore = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -in_range.unsqueeze(-1).to(grad.dtype))
        grad = (grad * g).masked_fill(ignore, 0.0)
        return grad, None, None, None, None


def parallel_cross_entropy(logits, label, group=None, ignore_index=-100, return_softmax=False):
    """Loss per sample, shape ``label``'s with a trailing 1 (Paddle's [N, 1]); with ``return_softmax`` also this
    rank's block of the softmax over all the classes (not differentiable)."""
    if label.dim() == logits.dim():
        if label.shape[-1] != 1:
            raise ValueError(f"label shape {list(label.shape)} must be logits' without the class dim, or with 1")
        label = label.squeeze(-1)
    if label.shape != logits.shape[:-1]:
        raise ValueError(f"label shape {list(label.shape)} does not match logits {list(logits.shape)}")
    if label.is_floating_point() or label.is_complex() or label.dtype == torch.bool:
        raise TypeError(f"label must hold integer class ids (int32 or int64), got {label.dtype}")
    label = label.long()
    classes = logits.shape[-1] * group_index(group)[1]
    bad = (label != ignore_index) & ((label < 0) | (label >= classes))
    if bad.any():  # every rank holds every label: all raise, before any collective
        raise IndexError(f"label {int(label[bad][0])} is out of bounds for {classes} classes (labels must be in "
                         f"[0, {classes}) or ignore_index={ignore_index})")
    loss, softmax = _ParallelCrossEntropy.apply(logits, label, group, ignore_index, return_softmax)
    return (loss, softmax) if return_softmax else loss


def c_lookup_table(table, index, start_index=0, vocab_size=-1):
    """Rows ``index - start_index`` of this rank's ``table`` block, zeros for ids outside it (Paddle's
    ``c_embedding``). With ``vocab_size`` >= 0 an id outside ``[0, vocab_size)`` raises IndexError: every rank
    holds every id, so all raise, before the caller's all-reduce."""
    if index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"c_lookup_table: ids must be int32 or int64, got {index.dtype}")
    if vocab_size >= 0:
        bad = (index < 0) | (index >= vocab_size)
        if bad.any():
            raise IndexError(f"id {int(index[bad][0])} is out of bounds for a vocabulary of {vocab_size} (ids must "
                             f"be in [0, {vocab_size}))")
    outside = (index < start_index) | (index >= start_index + table.shape[0])
    local = (index - start_index).masked_fill(outside, 0)
    return F.embedding(local, table).masked_fill(outside.unsqueeze(-1), 0.0)


# Paddle's names and signatures (``paddle.distributed.fleet.layers.mpu.mp_ops``)

def _c_identity(tensor, group=None, skip_c_identity_dynamic=False):
    return tensor if skip_c_identity_dynamic else c_identity(tensor, group)


def _c_concat(tensor, group=None):
    return c_concat(tensor, group)


def _c_split(tensor, group=None):
    return c_split(tensor, group)


def _mp_allreduce(tensor, op=ReduceOp.SUM, group=None, use_calc_stream=True, use_model_parallel=True,
                  skip_c_identity_dynamic=False):
    if op != ReduceOp.SUM:
        raise ValueError(f"_mp_allreduce: only ReduceOp.SUM is supported, got {op}")
    return mp_allreduce(tensor, group)


def _c_lookup_table(table, index, start_index=0, vocab_size=-1, name=None):
    return c_lookup_table(table, index, start_index, vocab_size)


def _c_softmax_with_cross_entropy(logits, label, group=None, return_softmax=False, ignore_index=-100):
    return parallel_cross_entropy(logits, label, group, ignore_index, return_softmax)
