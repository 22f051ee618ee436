"""The op layer: how an aten op runs on dist tensors, and which placements its outputs and gradients get."""

from __future__ import annotations

import time

import torch
import torch.distributed as tdist
from torch.distributed.tensor import DTensor

from .. import compat, trace
from ..compat import TorchDispatchMode
from ..compat import tree_map as _tree_map
from ..core.mesh import ProcessMesh
from ..core.partial import summed
from ..core.placements import Partial, Replicate, Shard
from ..core.traffic import received
from . import dtensor, groups, op_writes, rollcall
from .autograd import run_reshard
from .dtensor import (
    DistTensor,
    contiguous_stride,
    from_torch_placements,
    make_dist,
    new_dist,
    plain_layout,
    representable,
)
from .op_plan import (
    METADATA_OPS,
    Decision,
    call_key,
    decide,
    decisions,
    layout_number,
    name_of,
    probe,
    remember,
    tree_map,
    writes_self,
)
from .op_rules import CANONICAL_ARGS, RULES
from .op_writes import fresh, into_out, moved, out_variant, view_made, write_back, writing, written_args, wrote
from .torch_rule import as_replicate, ask_torch

__all__ = ["dispatch", "decisions", "redistribute", "grad_like"]

_DECISIONS = decisions()


def dispatch(func, args, kwargs):
    """Run ``func`` on ``args`` holding dist tensors; the single place meshviz decides an op's placements."""
    if kwargs and out_variant(func) is not None:
        out = into_out(func, args, kwargs, dispatch, probe, redistribute)
        if out is not NotImplemented:
            return out
    self = args[0] if args else None
    inplace = type(self) is DistTensor and writes_self(func)
    if inplace:
        op_writes.check_reshape(func, self, args, kwargs, probe)
    if fresh(args, kwargs, func if inplace else None):  # self read through an overlapping view: one process's order
        return op_writes.run_whole(func, args, kwargs, (self,), redistribute)
    before = (self._local, self._mpl) if inplace and self._mv_view is not None else None
    if written_args(func):  # batch norm's running statistics: written in place wherever the op layer moved them
        watched, token = writing(func, args, kwargs, lambda x: isinstance(x, DistTensor))
        try:
            out = _dispatch(func, args, kwargs)
        finally:
            write_back(watched, token, redistribute)
    else:
        out = _dispatch(func, args, kwargs)
    if inplace:  # counted; where self is a view of another dist tensor, the write reaches that too
        wrote(self, before, redistribute)
    return out


def _dispatch(func, args, kwargs):
    canon = CANONICAL_ARGS.get(id(func))
    if canon is not None:
        args, kwargs = canon(args, kwargs)
    dists: list = []
    key = call_key(func, args, kwargs, dists)
    try:
        d = _DECISIONS.get(key)
    except TypeError:  # an argument value that cannot be hashed: decided every call
        key, d = None, None
    if d is None:
        out = _decide_and_run(key, func, args, kwargs, dists)
        if _is_view(func) or func in METADATA_OPS:
            view_made(_DECISIONS.get(key) if key is not None else None, args, kwargs, func, out)
        return out
    if d.hooks and torch.is_grad_enabled():
        _grad_hooks(dists)
    out = _run_local(d, func, args, kwargs, dists) if d.how == "local" else _run(d, func, args, kwargs, dists)
    if d.view:
        view_made(d, args, kwargs, func, out)
    return out


def _grad_hooks(dists) -> None:
    for t in dists:
        if t._mv_grad_hook is None and t.requires_grad:
            t._mv_grad_hook = t.register_hook(_hook_for(t))


def _run(d: Decision, func, args, kwargs, dists, moved: bool = False):
    """Run a decision other than ``local`` (and ``local`` after its moves)."""
    how = d.how
    if how == "refuse":
        raise ValueError(d.why)
    if d.note is not None:
        _note(func, d.note[0], dists[0], d.note[1])
    if how == "random":
        out = RULES[func].fn(func, args, kwargs)
        if out is not None:
            return out
        if d.fallback is None:
            d.fallback = decide(func, args, kwargs, skip_random=True)
            if d.fallback.how == "torch":
                return _ask_and_run(None, d.fallback, func, args, kwargs, dists)
        return _run(d.fallback, func, args, kwargs, dists)
    if how == "decompose" and not d.torch_rule:
        return torch._decomp.decomposition_table[func](*args, **kwargs)
    if d.moves is not None and not moved:
        args, kwargs, dists = _moved(d, func, args, kwargs)
    if how == "local":
        return _run_local(d, func, args, kwargs, dists, moved=True)
    if how == "default":
        return _default_rule(d, func, args, kwargs, dists[0])
    if how == "decompose":
        return func.decompose(*args, **kwargs)
    if d.summed_first:
        args, kwargs = tree_map(lambda x: redistribute(x, summed(x._mpl), f"{name_of(func)} input")
                                if isinstance(x, DistTensor) else x, (args, kwargs))
    return _torch_rule(func, args, kwargs, dists[0])


def _decide_and_run(key, func, args, kwargs, dists):
    d = decide(func, args, kwargs)
    if d.hooks and torch.is_grad_enabled():
        _grad_hooks(dists)
    if d.how == "torch":
        return _ask_and_run(key, d, func, args, kwargs, dists)
    out = _run_local(d, func, args, kwargs, dists) if d.how == "local" else _run(d, func, args, kwargs, dists)
    remember(key, d)
    return out


def _ask_and_run(key, d: Decision, func, args, kwargs, dists):
    """Ask torch's rule about the inputs as meshviz's rules would lay them out (nothing moves yet), then run the
    decision as a later call does: each input moved once, from its own layout to where both rules want it."""
    ask_torch(d, func, args, kwargs, dists)
    remember(key, d)
    return _run(d, func, args, kwargs, dists)


def _moved(d: Decision, func, args, kwargs):
    """The call with its dist inputs resharded to ``d.moves`` (an in-place op's self holding its new layout)."""
    moves = iter(d.moves)
    name = f"{name_of(func)} input"

    def move(x):
        if isinstance(x, DistTensor):
            target = next(moves, None)
            if target is not None:
                y = redistribute(x, target, name)
                moved(x, y)
                return y
        return x

    self = args[0] if d.inplace else None
    args, kwargs = tree_map(move, (args, kwargs))
    if self is not None and args[0] is not self:
        # self was laid out anew for the op: the op writes into the caller's tensor, so it holds the new layout
        args = (self._hold(args[0]), *args[1:])
    found: list = []
    tree_map(lambda x: found.append(x) if isinstance(x, DistTensor) else None, (args, kwargs))
    return args, kwargs, found


# -- running a decision ------------------------------------------------------------------------------------------

def _run_local(d: Decision, func, args, kwargs, dists, moved: bool = False, first: bool = False):
    """Every rank runs the op on its own blocks; the outputs get the decided placements (no data moves)."""
    if d.moves is not None and not moved:
        args, kwargs, dists = _moved(d, func, args, kwargs)
    ref = dists[0]
    mesh = ref._pmesh
    if not d.member:
        return _empty_outputs(d, args, kwargs, mesh, ref)
    if d.local_args is not None:
        tensors: list = []
        tree_map(lambda x: tensors.append(x._local if type(x) is DistTensor else x)
                 if isinstance(x, torch.Tensor) else None, (args, {}))
        tensors += [v._local if type(v) is DistTensor else v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        largs, lkwargs = d.local_args(tensors)
    elif d.nested:
        largs, lkwargs = tree_map(lambda x: x._local if type(x) is DistTensor else x, (args, kwargs))
    else:
        largs = [a._local if type(a) is DistTensor else a for a in args]
        lkwargs = kwargs
    call = d.call
    if call is None:  # the op's Tensor method or torch function where it is the same op: no schema match per call
        call = d.call = compat.fast_call(d.op, largs, lkwargs)
    if call is not d.op and compat.torch_function_modes():
        call = d.op  # a binding would hand the call to the mode first
    if d.whole and compat.dispatch_modes_active():
        with compat.no_dispatch_modes():
            out = call(*largs, **lkwargs)
    else:
        out = call(*largs, **lkwargs)
    if d.inplace:
        self = args[0]
        spec = d.outputs[0]
        if spec is not None and (spec[0] != self._mpl or spec[4] != self._tpl):
            self._mpl, self._tpl, self._dt, self._mv_key = spec[0], spec[4], None, None
        return self
    keys = d.out_keys
    if d.single:
        spec = d.outputs[0]
        if spec is None or not isinstance(out, torch.Tensor):
            return out
        r = new_dist(out, mesh, spec[0], spec[1], spec[2], tpl=spec[4])
        if keys is not None:
            r._mv_key = keys[0]
        else:
            d.out_keys = (layout_number(r),)
        return r
    res = []
    for i, (o, spec) in enumerate(zip(out, d.outputs)):
        if spec is None or not isinstance(o, torch.Tensor):
            res.append(o)
            continue
        r = new_dist(o, mesh, spec[0], spec[1], spec[2], tpl=spec[4])
        if keys is not None:
            r._mv_key = keys[i]
        res.append(r)
    if keys is None:
        d.out_keys = tuple(layout_number(r) if isinstance(r, DistTensor) else None for r in res)
    return type(out)(res) if isinstance(out, tuple) else res


def _empty_outputs(d: Decision, args, kwargs, mesh, ref):
    """A rank outside the mesh holds an empty block of each output (on the device the op names, as ``to_empty``'s
    ``empty_like(p, device=...)`` does), laid out as the members' (the next op decides from it)."""
    device = kwargs.get("device") or ref.device

    def empty(spec):
        if spec is None:
            return None
        return new_dist(compat.empty_block(spec[3], device), mesh, spec[0], spec[1],
                        contiguous_stride(spec[1]), tpl=spec[4])

    if d.inplace:
        return args[0]
    if d.single:
        return empty(d.outputs[0])
    return tuple(empty(s) for s in d.outputs)


def _torch_rule(func, args, kwargs, ref: DistTensor):
    """DTensor runs the op (moving data as its rule says; each collective it issues is seen)."""
    by_id = {}
    dm = ref._dtensor.device_mesh

    def unwrap(x):
        if isinstance(x, DistTensor):
            dt = x._dtensor
            by_id[id(dt)] = x
            return dt
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            return as_replicate(x, ref, dm)
        return x

    uargs, ukwargs = tree_map(unwrap, (args, kwargs))
    if _is_view(func):
        uargs, ukwargs = tree_map(_contiguous, (uargs, ukwargs))
    if trace.active():
        with _CommObserver(name_of(func)):
            out = func(*uargs, **ukwargs)
    else:
        out = func(*uargs, **ukwargs)

    def wrap(x):
        if isinstance(x, DTensor):
            hit = by_id.get(id(x))
            if hit is not None:
                if tuple(from_torch_placements(x.placements)) != hit._mpl:
                    hit._dtensor = x  # an in-place op that changed the layout
                return hit
            mpl = plain_layout(x.placements) if func not in METADATA_OPS else None
            if mpl is not None and x.device_mesh is dm:
                return new_dist(compat.dtensor_local(x), ref._pmesh, mpl, x.shape, x.stride(), dt=x)
            keep = ref._pl if func in METADATA_OPS else None
            return DistTensor(x, ref._pmesh if x.device_mesh is dm else None, placements=keep)
        return x

    return wrap(out) if type(out) is DTensor else _tree_map(wrap, out)


def _is_view(func) -> bool:
    hit = _VIEWS.get(func)
    if hit is None:
        schema = getattr(func, "_schema", None)
        hit = _VIEWS[func] = bool(schema is not None and func not in METADATA_OPS and schema.returns
                                  and schema.returns[0].alias_info is not None
                                  and not schema.returns[0].alias_info.is_write)
    return hit


_VIEWS: dict = {}


def _contiguous(x):
    """A block laid out transposed (a gradient through ``transpose``) that the global strides would let view: torch
    views the block, so it is made contiguous first."""
    if isinstance(x, DTensor) and not compat.dtensor_local(x).is_contiguous() and x.is_contiguous():
        return compat.dtensor_from_local(compat.dtensor_local(x).contiguous(), x.device_mesh, x.placements, x.shape,
                                         x.stride())
    return x


def _default_rule(d: Decision, func, args, kwargs, ref: DistTensor):
    """Paddle's default SPMD rule: every dist input made Replicate, the op run on whole tensors, outputs
    Replicate."""
    mesh = ref._pmesh
    rep = (Replicate(),) * mesh.ndim
    if not mesh.contains(groups.rank()):
        stand_in = probe(func, args, kwargs)
        return _into_self(func, args, _tree_map(
            lambda x: make_dist(compat.empty_block(x.dtype, ref.device), mesh, rep, x.shape)
            if isinstance(x, torch.Tensor) else x, stand_in))

    def whole(x):
        if isinstance(x, DistTensor):
            return redistribute(x, rep, f"{name_of(func)} input")._local
        if isinstance(x, DTensor):
            raise ValueError(f"{func}: a torch DTensor cannot meet a meshviz dist tensor; use dist.shard_tensor")
        return x

    dargs, dkwargs = tree_map(whole, (args, kwargs))
    if d.outputs is None:
        probe(func, args, kwargs)  # a bad input raises on every rank, before the op runs (first call only)
        d.outputs = ()
    with compat.no_dispatch_modes():
        out = func(*dargs, **dkwargs)
    out = _tree_map(lambda x: make_dist(x, mesh, rep, x.shape) if isinstance(x, torch.Tensor) else x, out)
    return _into_self(func, args, out)


def _into_self(func, args, out):
    """An in-place op run on a whole copy of self (``add_`` on a Partial self: torch has no rule) writes the
    result into self, or the write would be lost on the tensor the caller holds."""
    if writes_self(func) and isinstance(args[0], DistTensor) and isinstance(out, DistTensor):
        return args[0]._hold(out)
    return out


def redistribute(t: DistTensor, placements, name: str | None = None) -> DistTensor:
    """``t`` on its own mesh with ``placements``, by meshviz's planner (events, no autograd): the implicit
    reshards the op layer makes."""
    t = t._resolved()
    if tuple(placements) == t._mpl:
        return t
    out = run_reshard(t, t._pmesh, list(placements), name or t.name)
    out.name = t.name
    return out


def grad_like(placements, grad_placements) -> list:
    """Paddle's rule for the gradient reaching a tensor: it lies as the tensor does; where the tensor is
    Replicate a Partial gradient stays Partial (its sum is pending), and on a Partial axis the gradient is left
    as it came."""
    out = []
    for p, g in zip(placements, grad_placements):
        if isinstance(p, Shard):
            out.append(p)
        elif isinstance(p, Replicate):
            out.append(g if isinstance(g, Partial) else Replicate())
        else:
            out.append(g)
    return out


class _GradLike:
    """A tensor hook reshards the gradient reaching the tensor to :func:`grad_like`."""

    __slots__ = ("mesh", "placements")

    def __init__(self, mesh: ProcessMesh, placements: tuple):
        self.mesh, self.placements = mesh, placements

    def __call__(self, grad):
        if type(grad) is not DistTensor:
            return grad
        have = grad._mpl
        if have == self.placements or grad._pmesh != self.mesh or not representable(have):
            return grad
        want = grad_like(self.placements, have)
        if tuple(want) == have:
            return grad
        out = redistribute(grad, want, "grad")
        out._mv_grad_hook = grad._mv_grad_hook
        return out


_HOOKS: dict = {}  # (mesh, placements) -> its hook (one object per layout)


def _hook_for(t: DistTensor) -> _GradLike:
    key = (t._pmesh, t._mpl)
    h = _HOOKS.get(key)
    if h is None:
        if len(_HOOKS) >= 4096:
            _HOOKS.clear()
        h = _HOOKS[key] = _GradLike(t._pmesh, t._mpl)
    return h


def _note(func, rule: str, ref: DistTensor, why: str) -> None:
    if trace.active():
        trace.emit(trace.Event(kind="op", op=name_of(func), mesh=ref._pmesh.to_dict(),
                               placements_before=[repr(p) for p in ref.placements],
                               payload=trace.OpRule(rule=rule, why=why)))


_COLLECTIVES = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}


class _CommObserver(TorchDispatchMode):
    """Sees the collectives DTensor issues inside an op, so nothing moves unseen."""

    def __init__(self, context: str):
        super().__init__()
        self.context = context

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, (DTensor, DistTensor)) for t in types):
            return NotImplemented  # let DTensor desugar the op into collectives first, then see those
        ns = getattr(func, "namespace", "")
        name = getattr(func, "_opname", "")
        if ns in ("_c10d_functional", "c10d_functional") and name in _COLLECTIVES:
            t0 = time.time()
            out = func(*args, **kwargs)
            inp = args[0] if args else None
            group = None
            gname = args[-1] if args and isinstance(args[-1], str) else kwargs.get("group_name")
            if gname:
                try:
                    group = tdist.get_process_group_ranks(compat.resolve_process_group(gname))
                except Exception:
                    group = None
            op = _COLLECTIVES[name]
            nbytes, sizes, root = 0, None, None
            if isinstance(inp, torch.Tensor) and group:
                sizes = ((inp.numel(), inp.element_size()),)
                me = group.index(groups.rank()) if groups.rank() in group else 0
                root = args[1] if op == "broadcast" and len(args) > 1 and args[1] in group else None
                nbytes = received(op, sizes, len(group), me, None if root is None else group.index(root))
            module, backward = rollcall.issuer()
            trace.emit(trace.Event(
                kind="collective", op=op, start=t0, group=group, bytes=int(nbytes),
                payload=trace.Collective(implicit=True, inside=self.context, module=module, backward=backward,
                                         sizes=sizes, src=root),
            ))
            return out
        return func(*args, **kwargs)


dtensor.set_op_layer(dispatch)
