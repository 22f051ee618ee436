"""What an op call on dist tensors is (its call key: layouts, shapes, argument values) and how it runs (the plan of
meshviz's rules, then the decision with torch's rule), decided once per call key."""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor import DTensor

from .. import compat
from ..compat import tree_map as _tree_map
from ..core.partial import summed
from ..core.placements import Partial, Replicate, Shard
from . import dtensor, groups
from .dtensor import DistTensor, representable
from .op_rules import RULES, Strategy, TensorSpec, canonical, partial_meets_shard, register

__all__ = ["tree_map", "call_key", "Plan", "plan", "Decision", "decide", "remember", "decisions",
           "clear_decisions", "layout_number", "probe", "writes_self", "nests_tensors", "name_of", "METADATA_OPS"]

aten = torch.ops.aten

_FLAT = (list, tuple, torch.Size)


def tree_map(fn, tree):
    """torch's tree_map, without its cost for what an op's ``(args, kwargs)`` nearly always is: a tuple of leaves
    and lists of leaves, and a flat dict."""
    args, kwargs = tree
    if type(args) is not tuple or type(kwargs) is not dict:
        return _tree_map(fn, tree)
    out = []
    for a in args:
        kind = type(a)
        if kind in _FLAT:
            if any(isinstance(x, (*_FLAT, dict)) for x in a):
                return _tree_map(fn, tree)
            out.append(kind(fn(x) for x in a))
        elif isinstance(a, (*_FLAT, dict)):
            return _tree_map(fn, tree)
        else:
            out.append(fn(a))
    kw = {}
    for k, v in kwargs.items():
        if isinstance(v, (*_FLAT, dict)):
            return _tree_map(fn, tree)
        kw[k] = fn(v)
    return tuple(out), kw


register("default", aten.as_strided.default, why="strides name places in the whole tensor's storage")(None)


@register("local", aten.convolution.default, aten.convolution_backward.default)
def _conv_local(args, kwargs):
    """convolution and its backward, Paddle's conv rule without its ring convolution: the batch dim stays split
    (along the axes that split every batch input there), the rest made whole, the weight and bias whole; each rank
    convolves its own rows, the weight's and bias's gradients Partial along those axes. (torch's handler convolves
    the blocks of a split channel, height or width dim as if whole and calls the result whole; torch 2.11 calls the
    weight's gradient Partial on every axis, which doubles it for a whole input.)"""
    forward = len(args) == 9
    batch = args[:1] if forward else args[:2]
    dists = [(any(a is b for b in batch), a) for a in args[:3] if isinstance(a, TensorSpec)]
    if not dists:
        return None
    keep = [all(isinstance(a, TensorSpec) and a.placements[axis] == Shard(0) for a in batch)
            for axis in range(dists[0][1].mesh.ndim)]
    split = [Shard(0) if k else Replicate() for k in keep]
    want = tuple(split if is_batch else [Replicate()] * len(keep) for is_batch, _ in dists)
    if forward:
        return Strategy(want, (split,))
    summed_up = [Partial() if k else Replicate() for k in keep]
    return Strategy(want, (split, summed_up, summed_up))


@canonical(aten.as_strided.default)
def _strided_whole(args, kwargs):
    """``as_strided`` runs on the whole tensor (Paddle's default rule), where that is its storage: a tensor that is
    no view of another and lies contiguous; any other raises on every rank, before anything moves."""
    x = args[0]
    if type(x) is DistTensor and (x._mv_view is not None or not x.is_contiguous()):
        raise ValueError("as_strided of a dist tensor that is a view of another or not contiguous: its strides would "
                         "name places in a storage no rank holds; call it on a contiguous dist tensor (t.contiguous()"
                         " or t.clone()), or use view, narrow, transpose or slicing")
    return args, kwargs


METADATA_OPS = {aten.detach.default, aten.alias.default}
# ops torch runs on each block as it lies, whatever the layout
_LOCAL_COPIES = METADATA_OPS | {aten.clone.default, aten._to_copy.default}
# views: a dim sharded by several mesh axes is made whole on the inner axes first
_VIEWS = {aten.view.default, aten._unsafe_view.default}
# in-place ops that are linear in self, which torch runs right on each summand of a Partial self
_LINEAR_INPLACE = {aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Scalar, aten.mul_.Tensor, aten.div_.Scalar,
                   aten.neg_.default, aten.zero_.default, aten.copy_.default}


def name_of(func) -> str:
    return str(getattr(func, "__name__", func))


# -- what an op call is: its layouts, shapes and argument values --------------------------------------------------

_LAYOUTS: dict = {}  # a dist tensor's layout (mesh, placements, shapes, strides, dtype, coordinate) -> its number
_layout_numbers = itertools.count(1)
_DECISIONS: dict = {}  # (op, each argument's layout number or value) -> Decision
_MAX_ENTRIES = 1 << 16


def layout_number(t: DistTensor) -> int:
    """The number of ``t``'s layout: what a decision about an op reading ``t`` depends on (this rank's coordinate
    included, so ranks that are threads of one process never share a decision made for another's block)."""
    local = t._local
    mesh = t._pmesh
    key = (mesh, t._mpl, t.shape, t.stride(), t.dtype, local.shape, local.stride(), local.device.type,
           t._tpl, mesh.coordinate(groups.rank()))
    n = _LAYOUTS.get(key)
    if n is None:
        if len(_LAYOUTS) >= _MAX_ENTRIES:
            clear_decisions()
        n = _LAYOUTS[key] = next(_layout_numbers)
    t._mv_key = n
    return n


_BY_TYPE: dict = {}  # op -> (positions, keyword names) whose numbers never change a decision (Scalar operands)


def _by_type(func):
    hit = _BY_TYPE.get(id(func))
    if hit is None:
        pos, kw = [], set()
        schema = getattr(func, "_schema", None)
        for a in schema.arguments if schema is not None else ():
            t = str(a.type)
            operand = "Scalar" in t or t in ("Tensor", "Optional[Tensor]", "Tensor?")
            if a.kwarg_only:
                if operand:
                    kw.add(a.name)
            else:
                pos.append(operand)
        hit = _BY_TYPE[id(func)] = (tuple(pos), frozenset(kw))
    return hit


def _value_key(a, operand: bool):
    if isinstance(a, torch.Tensor):
        return (a.shape, a.dtype, a.device)
    if operand and type(a) in (int, float, bool, complex):
        return type(a)
    if type(a) in _FLAT:
        return tuple(_arg_key(x, False, None) for x in a)
    return a


def _arg_key(a, operand: bool, dists):
    kind = type(a)
    if kind is DistTensor:
        if dists is not None:
            dists.append(a)
        k = a._mv_key
        return k if k is not None else layout_number(a)
    if kind is list or kind is tuple or kind is torch.Size:
        for x in a:
            if type(x) is not int:
                return tuple(_arg_key(x, False, dists) for x in a)
        return tuple(a)  # dims and sizes
    return _value_key(a, operand)


def call_key(func, args, kwargs, dists: list) -> tuple:
    """The op and, per argument, its layout number (dist tensors), shape and dtype (dense tensors), type (Scalar
    operands: their value never changes a decision) or value (dims, sizes, flags)."""
    pos, kw = _BY_TYPE.get(id(func)) or _by_type(func)
    key = [id(func)]  # an op is one object for the process's life; its own hash is a Python call
    n = len(pos)
    for i, a in enumerate(args):
        if type(a) is DistTensor:
            dists.append(a)
            k = a._mv_key
            key.append(k if k is not None else layout_number(a))
        else:
            key.append(_arg_key(a, i < n and pos[i], dists))
    if kwargs:
        for k, v in kwargs.items():
            key.append(k)
            key.append(_arg_key(v, k in kw, dists))
    return tuple(key)


# -- the plan: meshviz's own rules, on placements and shapes alone --------------------------------------------------

class Plan:
    """What meshviz's rules say about one op call, before torch's rule is asked (no data, no process group).

    ``how``: ``refuse`` (``why`` says why), ``random``, ``corrected``, ``local`` (``strategy`` gives the inputs'
    and outputs' placements), ``default``, or ``torch`` (torch DTensor's rule decides, after ``strategy.inputs``
    are laid out); ``note``: ``(rule, why)`` for the ``op`` event each call emits."""

    __slots__ = ("how", "strategy", "note", "why")

    def __init__(self, how: str, strategy: Strategy | None = None, note=None, why: str = ""):
        self.how, self.strategy, self.note, self.why = how, strategy, note, why

    def __repr__(self) -> str:
        return f"Plan({self.how}, {self.strategy})" if self.strategy is not None else f"Plan({self.how})"


def _specs(args, kwargs):
    def spec(x):
        if isinstance(x, DistTensor):
            return TensorSpec(x._pmesh, x._mpl, tuple(x.shape), x.dtype)
        return x

    return tree_map(spec, (args, kwargs))


def _spec_list(args, kwargs) -> list:
    found: list = []
    tree_map(lambda x: found.append(x) if isinstance(x, TensorSpec) else None, (args, kwargs))
    return found


def plan(func, args, kwargs) -> Plan:
    """meshviz's rules for ``func`` on ``args``/``kwargs``, where each dist tensor is a :class:`TensorSpec`.

    Precedence, first match wins:

    1. refused: ``item()`` of a tensor that is not Replicate, inputs on different meshes, a tensor with mixed
       Partial reductions entering any op but a metadata one;
    2. the op's ``random`` rule (every rank draws what the dense op draws), then its ``corrected`` rule (torch's
       decomposition);
    3. the op's ``local`` or ``paddle`` rule, when it answers; its ``default`` rule; a pointwise op without a rule
       of its own gets :func:`~meshviz.runtime.op_rules.partial_meets_shard`;
    4. the layouts torch needs: a dim sharded unevenly by several mesh axes has its inner axes made Replicate, and
       an in-place op that is not linear gets a Partial self summed first;
    5. torch DTensor's rule (``torch``): the op then runs on each rank's blocks where that rule moves nothing, by
       DTensor where it does, and by Paddle's default rule where torch has none.
    """
    dists = _spec_list(args, kwargs)
    ref = dists[0]
    if func is aten._local_scalar_dense.default and not all(isinstance(p, Replicate) for p in ref.placements):
        return Plan("refuse", why=(
            f"item()/float() of a {ref.placements} dist tensor would give this rank's block or summand, not "
            f"the value; use dist.unshard_dtensor(t).item() on every rank (a collective)"))
    meshes = {d.mesh for d in dists}
    if len(meshes) > 1:
        return Plan("refuse", why=(
            f"{func}: inputs live on different meshes {sorted(map(repr, meshes))}; "
            f"dist.reshard one of them onto the other's mesh first"))
    if func not in METADATA_OPS:
        for d in dists:
            if not representable(d.placements):
                return Plan("refuse", why=(f"{func}: a tensor with mixed Partial reductions {d.placements} cannot "
                                           f"enter an op; dist.reshard it first"))
    rule, got = RULES.get(func), None
    if rule is not None:
        if rule.kind == "random":
            return Plan("random")
        if rule.kind == "corrected":
            return Plan("corrected", note=("corrected", rule.why))
        if rule.kind == "default":
            return Plan("default", note=("default", rule.why or "Paddle's default rule"))
        got = rule.fn(args, kwargs)
        if got is not None and rule.kind == "local":
            return Plan("local", got)
    elif len(dists) > 1 and torch.Tag.pointwise in func.tags:
        got = partial_meets_shard(args, kwargs)
    # a paddle rule's layouts, then those torch needs on top of them
    moves = list(got.inputs) if got is not None else [None] * len(dists)
    changed = got is not None
    if func not in _LOCAL_COPIES:
        for i, d in enumerate(dists):
            even = _even_for_torch(d, func in _VIEWS, moves[i])
            if even is not None:
                moves[i], changed = even, True
    first = args[0] if args else None
    if isinstance(first, TensorSpec) and writes_self(func) and func not in _LINEAR_INPLACE:
        pl = moves[0] if moves[0] is not None else first.placements
        if any(isinstance(p, Partial) for p in pl):
            # torch runs an in-place op on each summand of a Partial self (log_ of a sum is not the sum of logs)
            moves[0], changed = summed(pl), True
    return Plan("torch", Strategy(tuple(moves)) if changed else None)


def _even_for_torch(t: TensorSpec, view: bool = False, pl=None):
    """A dim sharded by several mesh axes that does not split evenly over them: torch DTensor gathers such a
    tensor wrongly (its own ``full_tensor`` included), so the inner axes go Replicate first, by meshviz's planner.
    So too before a ``view`` of such a dim, even or not (torch 2.15 splits it into blocks of the wrong size).
    ``pl``: the placements a rule gave it (else its own)."""
    pl = t.placements if pl is None else pl
    if t.mesh.ndim < 2:
        return None
    dims = [p.dim for p in pl if isinstance(p, Shard)]
    if len(dims) == len(set(dims)):
        return None
    want = list(pl)
    for dim in set(dims):
        axes = [i for i, p in enumerate(pl) if isinstance(p, Shard) and p.dim == dim]
        ways = 1
        for i in axes:
            ways *= t.mesh.shape[i]
        if len(axes) > 1 and (t.shape[dim] % ways or view):
            for i in axes[1:]:
                want[i] = Replicate()
    return None if want == list(pl) else want


_WRITES_SELF: dict = {}


def writes_self(func) -> bool:
    """Whether ``func`` writes its first argument (its schema says so), cached per op."""
    hit = _WRITES_SELF.get(func)
    if hit is None:
        schema = getattr(func, "_schema", None)
        info = schema.arguments[0].alias_info if schema is not None and schema.arguments else None
        hit = _WRITES_SELF[func] = info is not None and info.is_write
    return hit


# -- the decision: the plan and torch's rule, made once per call key --------------------------------------------------

class Decision:
    """How one op call runs, decided once per call key (the op, the inputs' layouts and shapes, the values of its
    other arguments) and reused, as DTensor caches its sharding propagation per op schema.

    ``how``: ``local`` (each rank runs ``op`` on its blocks: the outputs' placements, shapes and strides are
    known), ``torch`` (DTensor runs it, moving data as its rule says), ``default``, ``decompose``, ``random`` or
    ``refuse``; ``moves``: the placements each dist input is resharded to first (by meshviz's planner: reshard
    events), those torch's rule asks for included, or None."""

    __slots__ = ("how", "moves", "op", "call", "local_args", "outputs", "out_keys", "single", "note", "inplace",
                 "whole", "nested", "hooks", "why", "fallback", "torch_rule", "summed_first", "member",
                 "torch_moves", "view")

    def __init__(self, how, moves=None, note=None, inplace=False, hooks=True, why=""):
        self.how, self.moves, self.note, self.inplace, self.hooks, self.why = how, moves, note, inplace, hooks, why
        self.op = self.call = self.local_args = self.outputs = self.out_keys = self.fallback = None
        self.torch_moves = None  # the layouts torch's rule asks for on top of meshviz's (folded into ``moves``)
        self.single = True
        self.whole = self.nested = False
        self.torch_rule = self.summed_first = False
        self.member = True  # this rank is in the inputs' mesh (the call key holds its coordinate)
        self.view = False  # a view op: its outputs are marked as views of its input (``op_writes.ViewOf``)

    def __repr__(self) -> str:
        return f"Decision({self.how}, moves={self.moves}, outputs={self.outputs})"


def decisions() -> dict:
    """The cache: call key -> Decision (read it to see what the layer decided; tests count its misses)."""
    return _DECISIONS


def clear_decisions() -> None:
    _DECISIONS.clear()
    _LAYOUTS.clear()


def remember(key, d: Decision) -> None:
    if key is not None:
        if len(_DECISIONS) >= _MAX_ENTRIES:
            clear_decisions()
        _DECISIONS[key] = d


def decide(func, args, kwargs, skip_random: bool = False) -> Decision:
    """The decision as far as meshviz's own rules go (:func:`plan`); ``torch`` ones are completed by
    :func:`~meshviz.runtime.torch_rule.ask_torch`, asked about the inputs as ``moves`` would lay them out."""
    sargs, skwargs = _specs(args, kwargs)
    p = plan(func, sargs, skwargs)
    inplace = bool(args) and writes_self(func) and isinstance(args[0], DistTensor)
    hooks = func not in METADATA_OPS
    if p.how == "random" and skip_random:
        p = Plan("torch")
    if p.how in ("refuse", "random"):
        return Decision(p.how, why=p.why, hooks=hooks and p.how != "refuse")
    if p.how == "corrected":
        return Decision("decompose", note=p.note, hooks=hooks)
    if p.how == "default":
        return Decision("default", note=p.note, inplace=inplace, hooks=hooks)
    moves = None
    if p.strategy is not None and any(m is not None for m in p.strategy.inputs):
        moves = tuple(None if m is None else tuple(m) for m in p.strategy.inputs)
    d = Decision(p.how, moves=moves, inplace=inplace, hooks=hooks)
    d.member = _spec_list(sargs, skwargs)[0].mesh.contains(groups.rank())
    if func in METADATA_OPS and isinstance(args[0], DistTensor):
        t = args[0]  # the output is the input's block, laid out as it is (mixed Partials, torch's own layouts)
        d.how, d.op, d.single, d.outputs = "local", func, True, [(t._mpl, tuple(t.shape), t.stride(), t.dtype,
                                                                   t._tpl)]
    elif p.how == "local":
        d.whole, d.op, d.nested = True, func, nests_tensors(args, kwargs)
        d.outputs, d.single = _out_specs_of(probe(func, args, kwargs), p.strategy.outputs)
    return d


def nests_tensors(args, kwargs) -> bool:
    """Whether a tensor sits anywhere but at the top level of ``args`` (a list of tensors, a keyword tensor)."""
    for a in args:
        if type(a) in _FLAT and any(isinstance(x, torch.Tensor) for x in a):
            return True
    return any(isinstance(v, torch.Tensor) or type(v) in _FLAT for v in kwargs.values())


def _out_specs_of(stand_in, placements) -> tuple:
    """Output specs ``(placements, shape, stride, dtype)`` for a meshviz local rule: shapes from the probe."""
    single = isinstance(stand_in, torch.Tensor)
    outs = [stand_in] if single else list(stand_in)
    specs = []
    for i, o in enumerate(outs):
        if isinstance(o, torch.Tensor):
            pl = tuple(placements[min(i, len(placements) - 1)])
            specs.append((pl, tuple(o.shape), dtensor.contiguous_stride(o.shape), o.dtype, None))
        else:
            specs.append(None)
    return specs, single


def _meta_of(x: DistTensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="meta")


_META_FAILS = (NotImplementedError, RuntimeError)


def probe(func, args, kwargs):
    """The op run on stand-ins of the global shapes (meta tensors; zeros where meta cannot run it, e.g. an output
    shape that depends on the values), so a bad input raises on every rank before any data moves."""
    def stand_in(fill):
        def f(x):
            if isinstance(x, DistTensor):
                return _meta_of(x) if fill == "meta" else torch.zeros(x.shape, dtype=x.dtype)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                return x.to("meta") if fill == "meta" else x.detach().cpu()
            return x
        return f

    with compat.no_dispatch_modes():
        try:
            pargs, pkwargs = tree_map(stand_in("meta"), (args, kwargs))
            return func(*pargs, **pkwargs)
        except _META_FAILS:
            pass
        pargs, pkwargs = tree_map(stand_in("zeros"), (args, kwargs))
        try:
            return func(*pargs, **pkwargs)
        except _META_FAILS as e:
            msg = str(e)
            raise ValueError(f"{func}: {msg.splitlines()[0] if msg else type(e).__name__}") from e
