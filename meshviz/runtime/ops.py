"""The op layer: how an aten op runs on dist tensors, and which placements its outputs and gradients get."""

from __future__ import annotations

import time

import torch
import torch.distributed as tdist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial as TPartial
from torch.distributed.tensor import Replicate as TReplicate

from .. import compat, trace
from ..compat import TorchDispatchMode
from ..compat import tree_map as _tree_map
from ..core.mesh import ProcessMesh
from ..core.partial import summed
from ..core.placements import Partial, Replicate, Shard
from ..core.traffic import received
from . import dtensor, rollcall
from .autograd import run_reshard
from .dtensor import DistTensor, make_dist, make_dtensor
from .op_rules import (
    CANONICAL_ARGS,
    CORRECTED,
    DEFAULT_RULE_OPS,
    LOCAL_RULES,
    PADDLE_RULES,
    RANDOM_RULES,
    partial_meets_shard,
)

__all__ = ["dispatch", "redistribute", "grad_like"]

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

_METADATA_OPS = {aten.detach.default, aten.alias.default}
# ops torch runs on each block as it lies, whatever the layout
_LOCAL_COPIES = _METADATA_OPS | {aten.clone.default, aten._to_copy.default}
# in-place ops that are linear in self, which torch runs right on each summand of a Partial self
_LINEAR_INPLACE = {aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Scalar, aten.mul_.Tensor, aten.div_.Scalar,
                   aten.neg_.default, aten.zero_.default, aten.copy_.default}
_VIEWS = {aten.view.default, aten._unsafe_view.default}
_NO_RULE = ("Sharding propagation failed", "does not have a sharding strategy", "no sharding strategy")


def _name(func) -> str:
    return str(getattr(func, "__name__", func))


def _rank() -> int:
    return tdist.get_rank() if tdist.is_initialized() else 0


def dispatch(func, args, kwargs):
    """Run ``func`` on ``args`` holding dist tensors; the single place meshviz decides an op's placements."""
    dists: list[DistTensor] = []
    tree_map(lambda x: dists.append(x) if isinstance(x, DistTensor) else None, (args, kwargs))
    ref = dists[0]
    if func is aten._local_scalar_dense.default and not all(isinstance(p, Replicate) for p in ref.placements):
        raise ValueError(
            f"item()/float() of a {ref.placements} dist tensor would give this rank's block or summand, not "
            f"the value; use dist.unshard_dtensor(t).item() on every rank (a collective)")
    meshes = {d._pmesh for d in dists}
    if len(meshes) > 1:
        raise ValueError(
            f"{func}: inputs live on different meshes {sorted(map(repr, meshes))}; "
            f"dist.reshard one of them onto the other's mesh first")
    if func not in _METADATA_OPS:
        for d in dists:
            if d._pl is not None:
                raise ValueError(f"{func}: a tensor with mixed Partial reductions {d._pl} cannot enter an op; "
                                 f"dist.reshard it first")
        if torch.is_grad_enabled():
            for d in dists:
                if d.requires_grad and d._mv_grad_hook is None:
                    d._mv_grad_hook = d.register_hook(_GradLike(d._pmesh, tuple(d.placements)))
    random = RANDOM_RULES.get(func)
    if random is not None:
        out = random(func, args, kwargs)
        if out is not None:
            return out
    if func in CORRECTED:
        _note(func, "corrected", ref, CORRECTED[func])
        return torch._decomp.decomposition_table[func](*args, **kwargs)
    canonical = CANONICAL_ARGS.get(func)
    if canonical is not None:
        args, kwargs = canonical(args, kwargs)
    rule = PADDLE_RULES.get(func)
    if rule is None and len(dists) > 1 and torch.Tag.pointwise in func.tags:
        rule = partial_meets_shard
    if rule is not None:
        want = rule(args, kwargs)
        if want is not None:
            args, kwargs = _reshard_inputs(func, args, kwargs, want)
    local = LOCAL_RULES.get(func)
    if local is not None:
        plan = local(args, kwargs)
        if plan is not None:
            return _local_rule(func, args, kwargs, ref, *plan)
    if func in DEFAULT_RULE_OPS:
        return _default_rule(func, args, kwargs, ref, DEFAULT_RULE_OPS[func])
    inplace = _writes_self(func) and isinstance(args[0], DistTensor)
    self = args[0] if inplace else None
    if func not in _LOCAL_COPIES and any(_uneven_nested(d) for d in dists):
        args, kwargs = tree_map(lambda x: _even_for_torch(x, func) if isinstance(x, DistTensor) else x,
                                (args, kwargs))
    if inplace and func not in _LINEAR_INPLACE and any(isinstance(p, Partial) for p in args[0].placements):
        # torch runs an in-place op on each summand of a Partial self (log_ of a sum is not the sum of logs)
        args = (redistribute(args[0], summed(args[0].placements), f"{_name(func)} self"), *args[1:])
    if inplace and args[0] is not self:
        # self was laid out anew for the op: the op writes into the caller's tensor, so it holds the new layout
        args = (self._hold(args[0]), *args[1:])
    try:
        out = _torch_rule(func, args, kwargs, ref)
    except (RuntimeError, NotImplementedError) as e:
        if not any(s in str(e) for s in _NO_RULE):
            raise
        return _default_rule(func, args, kwargs, ref, "torch DTensor has no sharding rule for it")
    return out


def _uneven_nested(t: DistTensor) -> bool:
    if t._pmesh.ndim < 2:
        return False
    pl = t._dtensor.placements
    dims = [p.dim for p in pl if p.is_shard()]
    return len(dims) != len(set(dims))


def _even_for_torch(t: DistTensor, func) -> DistTensor:
    """A dim sharded by several mesh axes that does not split evenly over them: torch DTensor gathers such a
    tensor wrongly (its own ``full_tensor`` included), so the inner axes go Replicate first, by meshviz's planner.
    So too before a view of such a dim, even or not (torch 2.15 splits it into blocks of the wrong size)."""
    pl = t.placements
    want = list(pl)
    for dim in {p.dim for p in pl if isinstance(p, Shard)}:
        axes = [i for i, p in enumerate(pl) if isinstance(p, Shard) and p.dim == dim]
        ways = 1
        for i in axes:
            ways *= t._pmesh.shape[i]
        if len(axes) > 1 and (t.shape[dim] % ways or func in _VIEWS):
            for i in axes[1:]:
                want[i] = Replicate()
    return t if want == pl else redistribute(t, want, f"{_name(func)} input")


def _torch_rule(func, args, kwargs, ref: DistTensor):
    by_id = {}
    dm = ref._dtensor.device_mesh

    def unwrap(x):
        if isinstance(x, DistTensor):
            by_id[id(x._dtensor)] = x
            return x._dtensor
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.dim() > 0 and x.numel() > 1:
            # a dense tensor meeting a dist one is replicated on its mesh, as in Paddle
            return make_dtensor(_local_for_replicate(x, ref._pmesh), ref._pmesh, [Replicate()] * ref._pmesh.ndim,
                                x.shape, dm.device_type)
        return x

    uargs, ukwargs = tree_map(unwrap, (args, kwargs))
    if trace.active():
        with _CommObserver(_name(func)):
            out = _call(func, uargs, ukwargs)
    else:
        out = _call(func, uargs, ukwargs)

    def wrap(x):
        if isinstance(x, DTensor):
            hit = by_id.get(id(x))
            if hit is not None:
                return hit
            x = _masks_applied(x)
            keep = ref._pl if func in _METADATA_OPS else None
            return DistTensor(x, ref._pmesh if x.device_mesh is dm else None, placements=keep)
        return x

    return _tree_map(wrap, out)


def _masks_applied(x: DTensor) -> DTensor:
    """torch's row-sharded embedding leaves a ``_MaskPartial`` whose blocks still hold the rows of indices
    another rank owns (torch zeroes them only when it reduces); meshviz reads it as Partial(sum), so zero them
    now: the Partial(sum) output Paddle's vocab-parallel embedding gives."""
    masks = [p for p in x.placements if type(p).__name__ == "_MaskPartial"]
    if not masks:
        return x
    local = compat.dtensor_local(x).clone()
    for p in masks:
        if p.mask_buffer.data is not None:
            p.mask_buffer.apply_mask(local)
            p.mask_buffer.release_mask()
    pl = [TPartial(p.reduce_op) if type(p).__name__ == "_MaskPartial" else p for p in x.placements]
    return compat.dtensor_from_local(local, x.device_mesh, tuple(pl), x.shape, x.stride())


def _local_rule(func, args, kwargs, ref: DistTensor, want, out_placements):
    """Reshard the inputs to ``want``, run ``func`` on this rank's blocks, and name the result ``out_placements``."""
    probe = _probe(func, args, kwargs)
    args, kwargs = _reshard_inputs(func, args, kwargs, want)
    mesh = ref._pmesh
    if not mesh.contains(_rank()):
        return make_dist(torch.empty(0, dtype=probe.dtype, device=ref.device), mesh, out_placements, probe.shape)
    largs, lkwargs = tree_map(lambda x: compat.dtensor_local(x._dtensor) if isinstance(x, DistTensor) else x,
                              (args, kwargs))
    with compat.no_dispatch_modes():
        out = func(*largs, **lkwargs)
    return make_dist(out, mesh, out_placements, probe.shape)


def _writes_self(func) -> bool:
    hit = _WRITES_SELF.get(func)
    if hit is None:
        hit = _WRITES_SELF[func] = _schema_writes_self(func)
    return hit


_WRITES_SELF: dict = {}


def _schema_writes_self(func) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    info = schema.arguments[0].alias_info
    return info is not None and info.is_write


def _default_rule(func, args, kwargs, ref: DistTensor, why: str):
    """Paddle's default SPMD rule: every dist input made Replicate, the op run on whole tensors, outputs
    Replicate."""
    mesh = ref._pmesh
    probe = _probe(func, args, kwargs)
    _note(func, "default", ref, why)
    if not mesh.contains(_rank()):
        return _into_self(func, args, _tree_map(
            lambda x: make_dist(torch.empty(0, dtype=x.dtype, device=ref.device), mesh, [Replicate()] * mesh.ndim,
                                x.shape) if isinstance(x, torch.Tensor) else x, probe))

    def whole(x):
        if isinstance(x, DistTensor):
            r = redistribute(x, [Replicate()] * mesh.ndim, f"{_name(func)} input")
            return compat.dtensor_local(r._dtensor)
        if isinstance(x, DTensor):
            raise ValueError(f"{func}: a torch DTensor cannot meet a meshviz dist tensor; use dist.shard_tensor")
        return x

    dargs, dkwargs = tree_map(whole, (args, kwargs))
    with compat.no_dispatch_modes():
        out = func(*dargs, **dkwargs)
    out = _tree_map(lambda x: make_dist(x, mesh, [Replicate()] * mesh.ndim, x.shape)
                   if isinstance(x, torch.Tensor) else x, out)
    return _into_self(func, args, out)


def _into_self(func, args, out):
    """An in-place op run on a whole copy of self (``add_`` on a Partial self: torch has no rule) writes the
    result into self, or the write would be lost on the tensor the caller holds."""
    if _writes_self(func) and isinstance(args[0], DistTensor) and isinstance(out, DistTensor):
        return args[0]._hold(out)
    return out


def _meta_of(x: DistTensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="meta")


def _probe(func, args, kwargs):
    """The op run on stand-ins of the global shapes (meta tensors; zeros where the output's shape depends on the
    values), so a bad input raises on every rank before any data moves."""
    for fill in ("meta", "zeros"):
        def stand_in(x):
            if isinstance(x, DistTensor):
                return _meta_of(x) if fill == "meta" else torch.zeros(x.shape, dtype=x.dtype)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                return x.to("meta") if fill == "meta" else x.detach().cpu()
            return x

        pargs, pkwargs = tree_map(stand_in, (args, kwargs))
        try:
            with compat.no_dispatch_modes():
                return func(*pargs, **pkwargs)
        except (NotImplementedError, RuntimeError) as e:
            msg = str(e)
            if fill == "meta" and ("meta" in msg.lower() or "data-dependent" in msg or "data dependent" in msg
                                   or "DynamicOutputShape" in type(e).__name__ or "symbolic" in msg):
                continue
            raise ValueError(f"{func}: {msg.splitlines()[0] if msg else type(e).__name__}") from e
    return None


def _reshard_inputs(func, args, kwargs, want):
    """Reshard the dist inputs (in the order tree_map meets them) to ``want`` (one placement list or None each)."""
    it = iter(want)

    def move(x):
        if isinstance(x, DistTensor):
            target = next(it, None)
            if target is not None:
                return redistribute(x, target, f"{_name(func)} input")
        return x

    return tree_map(move, (args, kwargs))


def redistribute(t: DistTensor, placements, name: str | None = None) -> DistTensor:
    """``t`` on its own mesh with ``placements``, by meshviz's planner (events, no autograd): the implicit
    reshards the op layer makes."""
    t = t._resolved()
    if list(placements) == t.placements:
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
        if not isinstance(grad, DistTensor) or grad._pmesh != self.mesh or grad._pl is not None:
            return grad
        want = grad_like(self.placements, grad.placements)
        if want == grad.placements:
            return grad
        out = redistribute(grad, want, "grad")
        out._mv_grad_hook = grad._mv_grad_hook
        return out


def _note(func, rule: str, ref: DistTensor, why: str) -> None:
    if trace.active():
        trace.emit(trace.Event(kind="op", op=_name(func), mesh=ref._pmesh.to_dict(),
                               placements_before=[repr(p) for p in ref.placements],
                               payload=trace.OpRule(rule=rule, why=why)))


def _call(func, args, kwargs):
    try:
        return func(*args, **kwargs)
    except RuntimeError as e:
        # a block laid out transposed (a gradient through ``transpose``) that the global strides would let view
        if "view size is not compatible" not in str(e):
            raise
        args, kwargs = tree_map(_contiguous, (args, kwargs))
        return func(*args, **kwargs)
    except AssertionError as e:
        # torch 2.11's DTensor cannot turn one Partial reduction into another inside an op (P(avg) + P(sum));
        # 2.13 can. Reduce the Partial inputs first, then run the op again.
        if "from one partial type" not in str(e):
            raise
        args, kwargs = tree_map(_reduce_partials, (args, kwargs))
        return func(*args, **kwargs)


def _contiguous(x):
    if isinstance(x, DTensor) and not compat.dtensor_local(x).is_contiguous():
        return compat.dtensor_from_local(compat.dtensor_local(x).contiguous(), x.device_mesh, x.placements, x.shape,
                                         x.stride())
    return x


def _reduce_partials(x):
    if isinstance(x, DTensor) and any(p.is_partial() for p in x.placements):
        return x.redistribute(x.device_mesh, [TReplicate() if p.is_partial() else p for p in x.placements])
    return x


def _local_for_replicate(x: torch.Tensor, mesh: ProcessMesh) -> torch.Tensor:
    return x.detach() if mesh.contains(_rank()) else x.detach().new_empty(0)


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
                me = group.index(_rank()) if _rank() in group else 0
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
