"""The op layer's rules: one contract (the inputs' placements in, the placements to run them in and the outputs'
out), each declared where its op is registered."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.layout import local_block
from ..core.mesh import ProcessMesh
from ..core.partial import summed
from ..core.placements import Partial, Placement, Replicate, Shard
from .autograd import local_block_of, run_reshard
from .dtensor import DistTensor, make_dist

__all__ = ["TensorSpec", "Strategy", "Rule", "RULES", "CANONICAL_ARGS", "register", "canonical", "rule_of",
           "merged", "partial_meets_shard"]

aten = torch.ops.aten


class TensorSpec:
    """What a rule sees of a dist tensor: its mesh, placements and global shape (no data, no process group)."""

    __slots__ = ("mesh", "placements", "shape", "dtype")

    def __init__(self, mesh: ProcessMesh, placements, shape, dtype=None):
        self.mesh, self.placements, self.shape, self.dtype = mesh, list(placements), tuple(shape), dtype

    def dim(self) -> int:
        return len(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"TensorSpec({list(self.shape)}, [{', '.join(map(repr, self.placements))}])"


@dataclass(frozen=True)
class Strategy:
    """A rule's answer: the placements each dist input is resharded to first (None: left as it is) and, for a rule
    that runs the op on each rank's blocks, the placements of each output (None: torch DTensor's rule names them)."""

    inputs: tuple
    outputs: tuple | None = None

    def __repr__(self) -> str:
        def show(pls):
            return "-" if pls is None else "[" + ", ".join(map(repr, pls)) + "]"
        outs = "torch" if self.outputs is None else ", ".join(map(show, self.outputs))
        return f"Strategy({', '.join(map(show, self.inputs))} -> {outs})"


@dataclass(frozen=True)
class Rule:
    """How meshviz runs one op, otherwise than by torch DTensor's rule. ``kind``:

    * ``corrected``: torch's rule gives a wrong value; the op runs as torch's decomposition (``why`` says how);
    * ``random``: ``fn(func, args, kwargs)`` runs it: every rank draws what the dense op draws, keeps its block;
    * ``paddle``: ``fn(args, kwargs) -> Strategy`` with inputs only: Paddle's rule lays the inputs out, torch's
      rule then names the outputs;
    * ``local``: ``fn(args, kwargs) -> Strategy`` with outputs: every rank runs the op on its own blocks;
    * ``default``: Paddle's default rule: inputs Replicate, the op on whole tensors, outputs Replicate.

    ``fn`` sees each dist tensor as a :class:`TensorSpec`; it returns None where the op runs by torch's rule.
    """

    op: object
    kind: str
    fn: Callable | None = None
    why: str = ""


RULES: dict = {}  # aten op -> Rule
CANONICAL_ARGS: dict = {}  # id(aten op) -> (args, kwargs) -> (args, kwargs) in the one spelling every torch reads


def register(kind: str, *ops, why: str = ""):
    """Declare ``fn`` as the ``kind`` rule of ``ops`` (a decorator; with no function, as ``register(...)(None)``)."""

    def deco(fn):
        for op in ops:
            RULES[op] = Rule(op, kind, fn, why)
        return fn

    return deco


def canonical(*ops):
    """Declare ``fn(args, kwargs) -> (args, kwargs)`` as the spelling ``ops``' arguments are put in before anything
    reads them (every torch version reads that spelling alike)."""

    def deco(fn):
        for op in ops:
            CANONICAL_ARGS[id(op)] = fn
        return fn

    return deco


def rule_of(func) -> Rule | None:
    return RULES.get(func)


# -- corrected: torch's rule gives a wrong value (checked against the dense run); the why is in the README's op table

for _op, _why in {
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
}.items():
    register("corrected", _op, why=_why)(None)


# -- paddle: Paddle's SPMD rule lays the inputs out where torch's differs

def merged(tensors, skip_dim=None) -> list[Placement]:
    """Paddle's ShardingMergeForTensors: along each mesh axis the first input that shards a dim decides, and every
    input is made to shard that dim there (``skip_dim``, the dim an op joins along, is never kept sharded); an axis
    where every input is the same Partial stays Partial, one where only some are goes Replicate."""
    mesh_ndim = tensors[0].mesh.ndim
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
        dists = [t for t in args[0] if isinstance(t, TensorSpec)]
        if not dists or dists[0].dim() == 0:
            return None
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        want = merged(dists, dim % dists[0].dim() if joins_dim else None)
        if len(dists) < len(args[0]):  # a dense input joins as Replicate: a Partial axis would count it k times
            want = summed(want)
        return Strategy(tuple([want] * len(dists)))

    return rule


register("paddle", aten.stack.default)(_join_rule(joins_dim=False))
register("paddle", aten.cat.default)(_join_rule(joins_dim=True))


@register("paddle", aten.cumsum.default)
def _scan_rule(args, kwargs):
    """cumsum: Paddle's rule keeps the scanned dim whole (torch's scans each block on its own)."""
    x = args[0]
    dim = (args[1] if len(args) > 1 else kwargs["dim"]) % max(x.dim(), 1)
    if not any(isinstance(p, Shard) and p.dim == dim for p in x.placements):
        return None
    return Strategy(([Replicate() if isinstance(p, Shard) and p.dim == dim else p for p in x.placements],))


@register("paddle", aten.native_layer_norm_backward.default)
def _norm_backward_rule(args, kwargs):
    """native_layer_norm_backward, Paddle's layer_norm_grad rule: the scale and bias whole (a forward sees them
    gathered; the backward gets them as they lie, which torch before 2.13 takes for whole)."""
    weight, bias = args[5], args[6]
    want = [None for a in args[:5] if isinstance(a, TensorSpec)]
    for a in (weight, bias):
        if isinstance(a, TensorSpec):
            want.append([Replicate()] * a.mesh.ndim)
    return Strategy(tuple(want))


def partial_meets_shard(args, kwargs):
    """A pointwise op whose Partial input meets a sharded one on a mesh axis, Paddle's elementwise rule: the Partial
    input is reduce-scattered to that shard (to Replicate where its shape differs), so no input has to turn from
    Shard into Partial (torch before 2.13 cannot). None where no axis has both. (Every pointwise op without a rule
    of its own gets this one.)"""
    dists = [a for a in args if isinstance(a, TensorSpec)]
    if len(dists) < 2:
        return None
    want = [list(t.placements) for t in dists]
    changed = False
    for axis in range(dists[0].mesh.ndim):
        shard = next((t for t in dists if isinstance(t.placements[axis], Shard)), None)
        if shard is None:
            continue
        for t, w in zip(dists, want):
            if isinstance(w[axis], Partial):
                w[axis] = shard.placements[axis] if t.shape == shard.shape else Replicate()
                changed = True
    return Strategy(tuple(w if w != t.placements else None for t, w in zip(dists, want))) if changed else None


@register("paddle", aten.div.Tensor, aten.div.Tensor_mode, aten.div_.Tensor)
def _div_rule(args, kwargs):
    """div: the divisor summed first (a quotient is linear in the dividend only; torch 2.11 divides summand by
    summand), then the elementwise rule."""
    dists = [a for a in args if isinstance(a, TensorSpec)]
    got = partial_meets_shard(args, kwargs)
    want = list(got.inputs) if got is not None else [None] * len(dists)
    divisor = args[1] if len(args) > 1 else None
    if not isinstance(divisor, TensorSpec) or not any(isinstance(p, Partial) for p in divisor.placements):
        return Strategy(tuple(want)) if any(w is not None for w in want) else None
    i = 1 if isinstance(args[0], TensorSpec) else 0  # x / x: the same tensor twice, the second is the divisor
    want[i] = summed(want[i] or divisor.placements)
    return Strategy(tuple(want))


@canonical(aten.stack.default)
def _stack_dim(args, kwargs):
    """stack's dim counted from the front (torch 2.11's rule places the shards of a stack on dim -1 one dim off)."""
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if dim >= 0 or not tensors:
        return args, kwargs
    return (tensors, dim % (tensors[0].dim() + 1), *args[2:]), {k: v for k, v in kwargs.items() if k != "dim"}


@canonical(aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
def _mask_indices(args, kwargs):
    """A boolean mask among the indices (``x[mask]``, ``x[mask] = v``) spelled as the long indices of its nonzero
    elements, as torch's own kernel reads it: torch DTensor's rule takes a k-dim mask for an index of one dim and
    leaves the other k-1 dims sharded, which the mask's shape then does not fit."""
    indices = args[1] if len(args) > 1 else kwargs.get("indices")
    if not isinstance(indices, (list, tuple)) or not any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
        return args, kwargs
    out: list = []
    for i in indices:
        if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
            out.extend(i.nonzero().unbind(1) if i.dim() else [i])
        else:
            out.append(i)
    if len(args) > 1:
        return (args[0], out, *args[2:]), kwargs
    return args, {**kwargs, "indices": out}


# -- local: every rank runs the op on its own blocks

@register("local", aten.gather.default)
def _gather_local(args, kwargs):
    """gather (take_along_axis), Paddle's rule: the gathered dim whole, the index laid out as the input on the other
    dims, a Partial input giving a Partial output; then every rank gathers from its own block. (torch's rule may
    shard the gathered dim for a masked Partial whose mask lives on a cached placement: built for the whole index,
    shared by ranks that are threads.)"""
    x, dim, index = args[0], args[1], args[2]
    if not isinstance(x, TensorSpec) or not isinstance(index, TensorSpec) or kwargs.get("sparse_grad"):
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
    return Strategy((want_x, want_i), (want_x,))


@register("local", aten.index_select.default)
def _index_select_local(args, kwargs):
    """index_select, Paddle's rule: the input's selected dim whole; on a mesh axis where the input is whole and the
    index split, the output's selected dim is split alike; the input's other shards and Partials pass through.
    Each rank selects from its own block. (torch 2.11's rule gives a wrong value for a Partial input.)"""
    x, dim, index = args[0], args[1], args[2]
    if not isinstance(x, TensorSpec):
        return None
    dim %= max(x.dim(), 1)
    idx_pl = index.placements if isinstance(index, TensorSpec) else [Replicate()] * x.mesh.ndim
    want_x, want_i, out = [], [], []
    for p, q in zip(x.placements, idx_pl):
        p = Replicate() if isinstance(p, Shard) and p.dim == dim else p
        keep = isinstance(p, Replicate) and isinstance(q, Shard)
        want_x.append(p)
        want_i.append(q if keep else Replicate())
        out.append(Shard(dim) if keep else p)
    return Strategy((want_x, want_i) if isinstance(index, TensorSpec) else (want_x,), (out,))


@register("local", aten.index_add.default)
def _index_add_local(args, kwargs):
    """index_add (index_select's backward): the index whole and the source's indexed dim whole; where the source
    is split on another dim, self is split alike, where both are the same Partial the sum stays pending; else both
    go whole. Each rank adds its source block into its self block. (torch 2.11's rule leaves the source split.)"""
    self, dim, index, source = args[0], args[1], args[2], args[3]
    if not isinstance(self, TensorSpec) or not isinstance(source, TensorSpec) or kwargs.get("alpha", 1) != 1:
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
    index_want = ([Replicate()] * self.mesh.ndim,) if isinstance(index, TensorSpec) else ()
    return Strategy((want_self, *index_want, want_src), (want_self,))


def _empty_somewhere(x: TensorSpec, dims) -> bool:
    """Whether some rank's block of ``x`` holds none of one of ``dims`` (an uneven split's empty tail: 6 rows on 4
    ranks are 2, 2, 2 and 0) though the tensor has some."""
    if any(x.shape[d] == 0 for d in dims) or not any(isinstance(p, Shard) and p.dim in dims for p in x.placements):
        return False
    pls = [p if isinstance(p, Shard) else Replicate() for p in x.placements]
    return any(any(b - a == 0 for a, b in (local_block(x.shape, x.mesh, pls, c)[d] for d in dims))
               for c in itertools.product(*map(range, x.mesh.shape)))


@register("paddle", aten.max.default, aten.min.default, aten.amax.default, aten.amin.default,
          aten.aminmax.default)
def _extremum_rule(args, kwargs):
    """max / min / amax / amin / aminmax over a dim a rank holds none of: that dim made whole first. torch's rule
    reduces each block (Partial(max)), and an empty block has no extremum: torch raises on that rank alone."""
    x = args[0]
    if not isinstance(x, TensorSpec) or x.dim() == 0:
        return None
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    dims = range(x.dim()) if dim is None or dim == [] else [d % x.dim() for d in
                                                            (dim if isinstance(dim, (list, tuple)) else [dim])]
    if not _empty_somewhere(x, dims):
        return None
    return Strategy(([Replicate() if isinstance(p, Shard) and p.dim in dims else p for p in x.placements],))


@register("paddle", aten.embedding.default)
def _embedding_rule(args, kwargs):
    """embedding with a vocab-split weight: the weight's vocab dim made whole first, the output laid out as the
    indices, as Paddle's eager ``F.embedding`` (its rule takes no vocab-parallel lookup; that is ``c_embedding``)."""
    weight, indices = args[0], args[1]
    if not isinstance(weight, TensorSpec) or weight.dim() != 2 or not any(
            isinstance(p, Shard) and p.dim == 0 for p in weight.placements):
        return None
    want = [Replicate() if isinstance(p, Shard) and p.dim == 0 else p for p in weight.placements]
    return Strategy((want, None) if isinstance(indices, TensorSpec) else (want,))


@register("local", aten.argmax.default, aten.argmin.default)
def _arg_reduce_local(args, kwargs):
    """argmax / argmin, Paddle's reduction rule: the reduced dim whole (a Partial input summed first: the index of
    a sum is not found from its summands), every other dim kept as it lies; each rank runs on its own block.
    (torch 2.14+'s rule names a sharded output for an input it gathered whole.)"""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if not isinstance(x, TensorSpec):
        return None
    if dim is None or x.dim() == 0:
        whole = [Replicate()] * x.mesh.ndim
        return Strategy((whole,), (whole,))
    dim %= x.dim()
    want = [Replicate() if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim == dim) else p
            for p in x.placements]
    out = [Shard(p.dim - 1) if isinstance(p, Shard) and p.dim > dim and not keepdim else p for p in want]
    return Strategy((want,), (out,))


@register("local", aten.triu.default, aten.tril.default)
def _triangle_local(args, kwargs):
    """triu / tril, Paddle's tril_triu rule: the last two dims whole (which elements are kept depends on their global
    row and column), the batch dims kept as they lie, a Partial kept (the op is linear); then every rank keeps the
    triangle of its own block. (torch's rule gathers the whole tensor.)"""
    x = args[0]
    if not isinstance(x, TensorSpec) or x.dim() < 2:
        return None
    last = {x.dim() - 2, x.dim() - 1}
    want = [Replicate() if isinstance(p, Shard) and p.dim in last else p for p in x.placements]
    return Strategy((want,), (want,))


_ATTENTION = (aten._scaled_dot_product_flash_attention_for_cpu.default,
              aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


def _mask_layout(mask, pl) -> list:
    """An attention mask's placements beside q's ``pl``: split as q's batch or heads dim where it has that dim
    (of size above 1), else whole."""
    dims = [p.dim - 4 + mask.dim() if isinstance(p, Shard) and p.dim <= 1 else -1 for p in pl]
    return [Shard(d) if d >= 0 and mask.shape[d] > 1 else Replicate() for d in dims]


@canonical(*_ATTENTION)
def _attention_mask(args, kwargs):
    """A dense attn_mask with a batch or heads dim that q splits: a Replicate dist tensor, which the attention rule
    lays out as each rank's rows and heads (a slice of the block every rank holds: nothing moves)."""
    mask = kwargs.get("attn_mask")
    q = next((a for a in args if type(a) is DistTensor), None) if type(mask) is torch.Tensor else None
    if q is None or not any(isinstance(p, Shard) for p in _mask_layout(mask, q._mpl)):
        return args, kwargs
    return args, {**kwargs, "attn_mask": make_dist(mask, q._pmesh, (Replicate(),) * q._pmesh.ndim, mask.shape)}


@register("local", *_ATTENTION)
def _attention_local(args, kwargs):
    """The CPU attention kernel and its backward with every dist input laid out alike along the batch or heads dim:
    each rank attends over its own rows and heads, the mask laid out alike where it has such a dim, else whole.
    (torch's rule, given a mask, propagates through the kernel's decomposition: minutes on a CPU.)"""
    specs = [a for a in args if isinstance(a, TensorSpec)]
    mask = kwargs.get("attn_mask")
    if len(specs) not in (3, 6):  # q, k, v (and the backward's grad, out, lse)
        return None
    pl = specs[0].placements
    if any(s.placements != pl for s in specs) or any(
            not isinstance(p, (Replicate, Shard)) or (isinstance(p, Shard) and p.dim > 1) for p in pl):
        return None
    if any(_empty_somewhere(s, sorted({p.dim for p in pl if isinstance(p, Shard)})) for s in specs):
        return None
    want = [None] * len(specs)
    if isinstance(mask, TensorSpec):
        lay = _mask_layout(mask, pl)
        want.append(None if lay == mask.placements else lay)
    elif isinstance(mask, torch.Tensor) and any(isinstance(p, Shard) for p in _mask_layout(mask, pl)):
        return None  # a dense mask per batch row or head (not made a dist one): each rank would need its part
    return Strategy(tuple(want), (pl,) * (2 if len(specs) == 3 else 3))  # (out, lse) or (dq, dk, dv)


# -- random: the dense op's draw on every rank, each keeping its block

@register("random", aten.native_dropout.default)
def _dropout(func, args, kwargs):
    """native_dropout: every rank draws the whole mask, as the dense op draws it, and keeps its block. Replicas get
    one mask, the blocks of a sharded tensor are blocks of the dense run's mask, and the ranks' generators move
    alike (a per-block draw would leave them apart after an uneven block)."""
    x, p, train = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("train")
    x = x._resolved()
    local = x._local
    if train is False:
        return None
    p1m = 1.0 - p
    mask = torch.empty(tuple(x.shape), dtype=x.dtype, device=local.device).bernoulli_(p1m)
    blk = local_block_of(mask, x._pmesh, summed(x.placements))  # every summand is scaled by the same mask
    out = local * blk * (0.0 if p1m == 0 else 1.0 / p1m)
    pl = x.placements
    return make_dist(out, x._pmesh, pl, tuple(x.shape)), make_dist(blk.bool(), x._pmesh, pl, tuple(x.shape))


@register("random", aten.normal_.default, aten.uniform_.default, aten.bernoulli_.float, aten.exponential_.default,
          aten.random_.default, getattr(aten.random_, "from"), aten.random_.to, aten.cauchy_.default,
          aten.log_normal_.default, aten.geometric_.default)
def _fill(func, args, kwargs):
    """An in-place random fill (normal_, uniform_, bernoulli_): the whole tensor drawn on every rank as the dense
    op draws it, each rank keeping its block; a Partial axis becomes Replicate (the fill replaces the value)."""
    t = args[0]._resolved()
    pl = summed(t.placements)
    local = t._local
    full = func(torch.empty(tuple(t.shape), dtype=t.dtype, device=local.device), *args[1:], **kwargs)
    return args[0]._hold(make_dist(local_block_of(full, t._pmesh, pl), t._pmesh, pl, tuple(t.shape)))


@register("random", aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
          aten.randint_like.low_dtype, aten.bernoulli.default, aten.bernoulli.p)
def _draw_like(func, args, kwargs):
    """rand_like / randn_like / randint_like / bernoulli: the whole tensor drawn on every rank as the dense op draws
    it, each rank keeping its block, laid out as the input (a Partial axis Replicate). bernoulli reads its
    probabilities whole (an all-gather) where they are split. (torch draws each block on its own: the blocks are not
    the dense run's, and replicas disagree.)"""
    t = args[0]._resolved()
    pl = summed(t.placements)
    if func in (aten.bernoulli.default, aten.bernoulli.p):
        whole = run_reshard(t, t._pmesh, [Replicate()] * t._pmesh.ndim)._local if t._pmesh.ndim else t._local
        if whole.numel() != t.numel():  # a rank outside the mesh: draw as the others do
            whole = torch.full(tuple(t.shape), 0.5, dtype=t.dtype, device=t._local.device)
        full = func(whole, *args[1:], **kwargs)
    else:
        full = func(torch.empty(tuple(t.shape), dtype=t.dtype, device=t._local.device), *args[1:], **kwargs)
    return make_dist(local_block_of(full, t._pmesh, pl), t._pmesh, pl, tuple(t.shape))


# -- default: ops meshviz runs by Paddle's default rule on purpose (ops torch has no rule for join them as met)

