"""The op layer's rules: which ops meshviz runs otherwise than by torch DTensor's rule, and how."""

from __future__ import annotations

import torch

from .. import compat
from ..core.partial import summed
from ..core.placements import Partial, Replicate, Shard
from .autograd import local_block_of
from .dtensor import DistTensor, make_dtensor

__all__ = ["CORRECTED", "CANONICAL_ARGS", "PADDLE_RULES", "partial_meets_shard", "LOCAL_RULES", "RANDOM_RULES",
           "DEFAULT_RULE_OPS", "RULES"]

aten = torch.ops.aten
# torch DTensor's rule gives a wrong value for these (checked against the dense run): they run as torch's own
# decomposition into ops whose rules are right. The why, per op, is in the README's op table.
CORRECTED = {
    aten.mse_loss.default: "reduction='mean' averages each rank's block mean (Partial(avg)): wrong on uneven shards",
    aten.mse_loss_backward.default: "scales by the local element count, not the global one",
    aten.smooth_l1_loss.default: "reduction='mean' averages each rank's block mean: wrong on uneven shards",
    aten.smooth_l1_loss_backward.default: "reduction='mean' scales by the local element count, not the global one",
    aten.huber_loss.default: "reduction='mean' averages each rank's block mean: wrong on uneven shards",
    aten.huber_loss_backward.default: "reduction='mean' scales by the local element count, not the global one",
    aten.binary_cross_entropy.default: "reduction='mean' averages each rank's block mean: wrong on uneven shards",
    aten.binary_cross_entropy_backward.default: "reduction='mean' scales by the local element count",
    aten.binary_cross_entropy_with_logits.default: "reduction='mean' averages block means: wrong on uneven shards",
    aten.nll_loss_forward.default: "reduction='mean' averages block means (Partial(avg)): wrong where the ranks "
                                   "hold different counts of ignore_index labels",
    aten.linalg_vector_norm.default: "its norm-Partial output is read as Partial(sum): the blocks' norms get added",
}


def _merged(tensors, skip_dim=None) -> list:
    """Paddle's ShardingMergeForTensors: along each mesh axis the first input that shards a dim decides, and every
    input is made to shard that dim there (``skip_dim``, the dim an op joins along, is never kept sharded); an axis
    where every input is the same Partial stays Partial, one where only some are goes Replicate."""
    mesh_ndim = tensors[0]._pmesh.ndim
    out, used = [], set()
    for axis in range(mesh_ndim):
        pls = [t.placements[axis] for t in tensors]
        if any(isinstance(p, Partial) for p in pls):
            out.append(pls[0] if all(p == pls[0] for p in pls) else Replicate())
            continue
        pick = Replicate()
        for p in pls:
            if isinstance(p, Shard) and p.dim != skip_dim and p.dim not in used:
                pick = p
                used.add(p.dim)
                break
        out.append(pick)
    return out


def _join_rule(joins_dim: bool):
    """stack / cat: Paddle aligns every input to the merged placements (torch replicates inputs that disagree, and
    cannot turn a Shard into a Partial); cat never keeps the dim it joins along sharded."""

    def rule(args, kwargs):
        dists = [t for t in args[0] if isinstance(t, DistTensor)]
        if not dists or dists[0].dim() == 0:
            return None
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        want = _merged(dists, dim % dists[0].dim() if joins_dim else None)
        if len(dists) < len(args[0]):  # a dense input joins as Replicate: a Partial axis would count it k times
            want = summed(want)
        return [want] * len(dists)

    return rule


def _scan_rule(args, kwargs):
    """cumsum: Paddle's rule keeps the scanned dim whole (torch's scans each block on its own)."""
    x = args[0]
    dim = (args[1] if len(args) > 1 else kwargs["dim"]) % max(x.dim(), 1)
    if not any(isinstance(p, Shard) and p.dim == dim for p in x.placements):
        return None
    return [[Replicate() if isinstance(p, Shard) and p.dim == dim else p for p in x.placements]]


def _gather_local(args, kwargs):
    """gather (take_along_axis), Paddle's rule: the gathered dim whole, the index laid out as the input on the other
    dims, a Partial input giving a Partial output; then every rank gathers from its own block. (torch's rule may
    shard the gathered dim for a masked Partial whose mask lives on a cached placement: built for the whole index,
    shared by ranks that are threads.)"""
    x, dim, index = args[0], args[1], args[2]
    if not isinstance(x, DistTensor) or not isinstance(index, DistTensor) or kwargs.get("sparse_grad"):
        return None
    dim %= max(x.dim(), 1)
    want_x, want_i = [], []
    for p in x.placements:
        if isinstance(p, Shard) and p.dim != dim and index.shape[p.dim] == x.shape[p.dim]:
            want_x.append(p)
            want_i.append(p)
        else:
            want_x.append(p if isinstance(p, Partial) else Replicate())
            want_i.append(Replicate())
    return [want_x, want_i], want_x


def _norm_backward_rule(args, kwargs):
    """native_layer_norm_backward, Paddle's layer_norm_grad rule: the scale and bias whole (a forward sees them
    gathered; the backward gets them as they lie, which torch before 2.13 takes for whole)."""
    weight, bias = args[5], args[6]
    want = [None for a in args[:5] if isinstance(a, DistTensor)]
    for a in (weight, bias):
        if isinstance(a, DistTensor):
            want.append([Replicate()] * a._pmesh.ndim)
    return want


def _index_select_local(args, kwargs):
    """index_select, Paddle's rule: the input's selected dim whole; on a mesh axis where the input is whole and the
    index split, the output's selected dim is split alike; the input's other shards and Partials pass through.
    Each rank selects from its own block. (torch 2.11's rule gives a wrong value for a Partial input.)"""
    x, dim, index = args[0], args[1], args[2]
    if not isinstance(x, DistTensor):
        return None
    dim %= max(x.dim(), 1)
    idx_pl = index.placements if isinstance(index, DistTensor) else [Replicate()] * x._pmesh.ndim
    want_x, want_i, out = [], [], []
    for p, q in zip(x.placements, idx_pl):
        p = Replicate() if isinstance(p, Shard) and p.dim == dim else p
        keep = isinstance(p, Replicate) and isinstance(q, Shard)
        want_x.append(p)
        want_i.append(q if keep else Replicate())
        out.append(Shard(dim) if keep else p)
    want = [want_x, want_i] if isinstance(index, DistTensor) else [want_x]
    return want, out


def _index_add_local(args, kwargs):
    """index_add (index_select's backward): the index whole and the source's indexed dim whole; where the source
    is split on another dim, self is split alike, where both are the same Partial the sum stays pending; else both
    go whole. Each rank adds its source block into its self block. (torch 2.11's rule leaves the source split.)"""
    self, dim, index, source = args[0], args[1], args[2], args[3]
    if not isinstance(self, DistTensor) or not isinstance(source, DistTensor) or kwargs.get("alpha", 1) != 1:
        return None
    dim %= max(self.dim(), 1)
    want_self, want_src = [], []
    for p, q in zip(self.placements, source.placements):
        if isinstance(q, Shard) and q.dim != dim:
            want_self.append(q)
            want_src.append(q)
        elif isinstance(q, Partial) and p == q:
            want_self.append(p)
            want_src.append(q)
        else:
            want_self.append(Replicate())
            want_src.append(Replicate())
    want = [want_self] + ([[Replicate()] * self._pmesh.ndim] if isinstance(index, DistTensor) else []) + [want_src]
    return want, want_self


def _arg_reduce_local(args, kwargs):
    """argmax / argmin, Paddle's reduction rule: the reduced dim whole (a Partial input summed first: the index of
    a sum is not found from its summands), every other dim kept as it lies; each rank runs on its own block.
    (torch 2.14+'s rule names a sharded output for an input it gathered whole.)"""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if not isinstance(x, DistTensor):
        return None
    if dim is None or x.dim() == 0:
        whole = [Replicate()] * x._pmesh.ndim
        return [whole], whole
    dim %= x.dim()
    want = [Replicate() if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim == dim) else p
            for p in x.placements]
    out = [Shard(p.dim - 1) if isinstance(p, Shard) and p.dim > dim and not keepdim else p for p in want]
    return [want], out


def partial_meets_shard(args, kwargs):
    """A pointwise op whose Partial input meets a sharded one on a mesh axis, Paddle's elementwise rule: the Partial
    input is reduce-scattered to that shard (to Replicate where its shape differs), so no input has to turn from
    Shard into Partial (torch before 2.13 cannot). None where no axis has both."""
    dists = [a for a in args if isinstance(a, DistTensor)]
    if len(dists) < 2:
        return None
    want = [list(t.placements) for t in dists]
    changed = False
    for axis in range(dists[0]._pmesh.ndim):
        shard = next((t for t in dists if isinstance(t.placements[axis], Shard)), None)
        if shard is None:
            continue
        for t, w in zip(dists, want):
            if isinstance(w[axis], Partial):
                w[axis] = shard.placements[axis] if t.shape == shard.shape else Replicate()
                changed = True
    return [w if w != t.placements else None for t, w in zip(dists, want)] if changed else None


def _div_rule(args, kwargs):
    """div: the divisor summed first (a quotient is linear in the dividend only; torch 2.11 divides summand by
    summand), then the elementwise rule."""
    dists = [a for a in args if isinstance(a, DistTensor)]
    want = partial_meets_shard(args, kwargs) or [None] * len(dists)
    divisor = args[1] if len(args) > 1 else None
    if not isinstance(divisor, DistTensor) or not any(isinstance(p, Partial) for p in divisor.placements):
        return want if any(w is not None for w in want) else None
    i = 1 if isinstance(args[0], DistTensor) else 0  # x / x: the same tensor twice, the second is the divisor
    want[i] = summed(want[i] or divisor.placements)
    return want


def _stack_dim(args, kwargs):
    """stack's dim counted from the front (torch 2.11's rule places the shards of a stack on dim -1 one dim off)."""
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if dim >= 0 or not tensors:
        return args, kwargs
    return (tensors, dim % (tensors[0].dim() + 1), *args[2:]), {k: v for k, v in kwargs.items() if k != "dim"}


# ops whose arguments are put in the one spelling every torch reads alike: op -> (args, kwargs) -> (args, kwargs)
CANONICAL_ARGS: dict = {
    aten.stack.default: _stack_dim,
}

# ops whose output placements follow Paddle's SPMD rule where torch's differ: op -> the rule's input placements
PADDLE_RULES: dict = {
    aten.stack.default: _join_rule(joins_dim=False),
    aten.cat.default: _join_rule(joins_dim=True),
    aten.cumsum.default: _scan_rule,
    aten.native_layer_norm_backward.default: _norm_backward_rule,
    aten.div.Tensor: _div_rule,
    aten.div.Tensor_mode: _div_rule,
    aten.div_.Tensor: _div_rule,
}

# ops Paddle's rule lets every rank run on its own blocks: op -> (the inputs' placements, the output's)
LOCAL_RULES: dict = {
    aten.gather.default: _gather_local,
    aten.index_select.default: _index_select_local,
    aten.index_add.default: _index_add_local,
    aten.argmax.default: _arg_reduce_local,
    aten.argmin.default: _arg_reduce_local,
}

def _dropout(func, args, kwargs):
    """native_dropout: every rank draws the whole mask, as the dense op draws it, and keeps its block. Replicas get
    one mask, the blocks of a sharded tensor are blocks of the dense run's mask, and the ranks' generators move
    alike (a per-block draw would leave them apart after an uneven block)."""
    x, p, train = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("train")
    x = x._resolved()
    local = compat.dtensor_local(x._dtensor)
    if train is False:
        return None
    p1m = 1.0 - p
    mask = torch.empty(tuple(x.shape), dtype=x.dtype, device=local.device).bernoulli_(p1m)
    blk = local_block_of(mask, x._pmesh, summed(x.placements))  # every summand is scaled by the same mask
    out = local * blk * (0.0 if p1m == 0 else 1.0 / p1m)
    pl = x.placements
    return (DistTensor(make_dtensor(out, x._pmesh, pl, tuple(x.shape)), x._pmesh),
            DistTensor(make_dtensor(blk.bool(), x._pmesh, pl, tuple(x.shape)), x._pmesh))


def _fill(func, args, kwargs):
    """An in-place random fill (normal_, uniform_, bernoulli_): the whole tensor drawn on every rank as the dense
    op draws it, each rank keeping its block; a Partial axis becomes Replicate (the fill replaces the value)."""
    t = args[0]._resolved()
    pl = summed(t.placements)
    local = compat.dtensor_local(t._dtensor)
    full = func(torch.empty(tuple(t.shape), dtype=t.dtype, device=local.device), *args[1:], **kwargs)
    return args[0]._hold(DistTensor(make_dtensor(local_block_of(full, t._pmesh, pl), t._pmesh, pl, tuple(t.shape)),
                                    t._pmesh))


# random ops: the dense op's draw on every rank, each keeping its block
RANDOM_RULES: dict = {
    aten.native_dropout.default: _dropout,
    aten.normal_.default: _fill,
    aten.uniform_.default: _fill,
    aten.bernoulli_.float: _fill,
}

# ops meshviz runs by Paddle's default rule (inputs made Replicate, output Replicate) on purpose
DEFAULT_RULE_OPS: dict = {}

RULES = {"corrected": CORRECTED, "paddle": PADDLE_RULES, "local": LOCAL_RULES, "random": RANDOM_RULES,
         "default": DEFAULT_RULE_OPS}

