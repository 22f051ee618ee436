"""torch DTensor's sharding decisions, read in plain terms (what its propagation says for one op call, nothing run);
re-exported by :mod:`meshviz.compat`."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["NoDTensorRule", "DTensorDecision", "dtensor_special_ops", "dtensor_decision", "dtensor_layout"]


def dtensor_layout(spec_or_dtensor) -> tuple:
    """A DTensor's (or DTensorSpec's) layout in full: its placements and the order in which the shards of one
    tensor dim nest (``_StridedShard`` layouts need it to be rebuilt)."""
    spec = getattr(spec_or_dtensor, "_spec", spec_or_dtensor)
    return tuple(spec.placements), spec.shard_order, spec.use_strided_shard_as_shard_order


class NoDTensorRule(Exception):
    """torch DTensor's sharding propagation has no answer for an op on these inputs (no strategy registered, or
    its strategy raised); ``decomposes``: the op is CompositeImplicitAutograd, so DTensor would run its
    decomposition instead."""

    def __init__(self, op, cause: BaseException, decomposes: bool = False):
        super().__init__(f"{op}: {type(cause).__name__}: {cause}")
        self.op, self.cause, self.decomposes = op, cause, decomposes


class DTensorDecision:
    """What torch DTensor decides for one op call (its ``OutputSharding``, in plain terms).

    ``wanted``: the torch placements each DTensor input is redistributed to before the op (its own where it stays);
    ``op``: the op DTensor runs on the blocks (a rewrite, e.g. ``squeeze.dims``, or the op itself);
    ``local_args(tensors)``: the ``(args, kwargs)`` DTensor runs ``op`` with, given the blocks of the tensor
    arguments in order, or None where they are the call's own arguments with each tensor replaced by its block;
    ``outputs``: per output (a flat list in the op's return order), ``(torch placements, shape, stride, dtype,
    layout)`` (:func:`dtensor_layout`), or None for a non-tensor output; ``single``: the op returns one tensor
    (not a tuple)."""

    __slots__ = ("wanted", "op", "local_args", "outputs", "single")

    def __init__(self, wanted, op, local_args, outputs, single):
        self.wanted, self.op, self.local_args, self.outputs, self.single = wanted, op, local_args, outputs, single


def _stand_in(mesh):
    """A mesh like ``mesh`` seen from its member at the first coordinate, under other axis names so that no cache
    of torch's (keyed by mesh) mixes its entries with the real mesh's; None where torch cannot build one."""
    got = mesh.__dict__.get("_meshviz_stand_in", False)
    if got is not False:
        return got
    from torch.distributed.device_mesh import DeviceMesh

    names = tuple(f"_meshviz_{n if n is not None else i}" for i, n in enumerate(mesh.mesh_dim_names or
                                                                             (None,) * mesh.ndim))
    try:
        got = DeviceMesh(mesh.device_type, mesh.mesh, mesh_dim_names=names, _init_backend=False,
                         _rank=int(mesh.mesh.flatten()[0]))
    except Exception:
        got = None
    mesh.__dict__["_meshviz_stand_in"] = got
    return got


def _price_off_mesh() -> None:
    """torch prices every redistribution at 0 on a rank outside the mesh (it takes no part), so its sharding
    propagation there picks the first strategy, where the members pick the cheapest (``Shard(0) * Replicate``
    comes out Replicate off the mesh and Shard(0) on it; an embedding P(sum) off it and S(0) on it). A rank's dist
    tensors off a mesh must lie as the members' do (a pipeline stage's transfer sizes its buffers from them): off
    the mesh a redistribution is priced as the member at the mesh's first coordinate prices it, on a stand-in mesh
    (:func:`_stand_in`), so the same strategy wins; the real mesh and torch's caches of it are left untouched."""
    import dataclasses

    from torch.distributed.tensor import _collective_utils, _utils
    from torch.distributed.tensor._ops import utils as _ops_utils

    cost = getattr(_collective_utils, "redistribute_cost", None)
    if cost is None or getattr(cost, "_meshviz", False):
        return

    def priced(current_spec, target_spec) -> float:
        c = cost(current_spec, target_spec)
        if c != 0.0 or current_spec.is_replicated() or current_spec.mesh != target_spec.mesh:
            return c
        part = getattr(current_spec.mesh, "_is_current_rank_part_of_mesh", None)
        if part is None or part():
            return c
        mesh = _stand_in(current_spec.mesh)
        if mesh is not None:
            try:
                return cost(dataclasses.replace(current_spec, mesh=mesh), dataclasses.replace(target_spec, mesh=mesh))
            except Exception:
                pass
        return float(sum(a != b for a, b in zip(current_spec.placements, target_spec.placements)))

    priced._meshviz = True  # type: ignore[attr-defined]
    for module in (_collective_utils, _utils, _ops_utils):
        if getattr(module, "redistribute_cost", None) is cost:
            module.redistribute_cost = priced


_price_off_mesh()

_DTENSOR_SPECIAL: set = set()


def dtensor_special_ops() -> set:
    """The ops torch DTensor runs by a handler of its own or with its RNG tracker rather than by sharding
    propagation (``equal`` also all-reduces its answer): only DTensor itself runs them as DTensor would."""
    if not _DTENSOR_SPECIAL:
        from torch.distributed.tensor import DTensor

        d = DTensor._op_dispatcher
        _DTENSOR_SPECIAL.update(d._custom_op_handlers, d._random_ops, {torch.ops.aten.equal.default})
    return _DTENSOR_SPECIAL


def dtensor_decision(op, args, kwargs) -> DTensorDecision:
    """torch DTensor's sharding decision for ``op`` on ``args``/``kwargs`` (DTensors, plain tensors, values); one
    that rewrites shape arguments to this rank's block is computed afresh (DTensor's own cache is keyed without the
    rank, and ranks that are threads share it); raises
    :class:`NoDTensorRule` where its propagation has no answer. Nothing runs, nothing moves."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    disp = DTensor._op_dispatcher
    info = disp.unwrap_to_op_info(op, args, kwargs)
    prop = disp.sharding_propagator
    try:
        sharding = prop.propagate_op_sharding(info.schema)
        if sharding.use_val_from_redistribute_schema:  # local shapes: this rank's, not the cache's
            sharding = prop.propagate_op_sharding_non_cached(info.schema)
    except NotImplementedError as e:
        raise NoDTensorRule(op, e, torch._C._dispatch_has_kernel_for_dispatch_key(
            op.name(), torch._C.DispatchKey.CompositeImplicitAutograd)) from e
    except Exception as e:
        raise NoDTensorRule(op, e) from e
    flat = info.flat_args_schema
    suggested = sharding.redistribute_schema
    sflat = None
    if suggested is not None:
        sflat = tuple(tree_flatten(suggested.args_schema)[0]) if info.args_tree_spec is not None \
            else tuple(suggested.args_schema)
    wanted = []  # per tensor argument (DTensors, and plain tensors DTensor takes for replicated), in order
    for i, spec in enumerate(flat):
        if isinstance(spec, DTensorSpec):
            want = sflat[i] if sflat is not None and sharding.needs_redistribute else spec
            wanted.append(tuple(want.placements))
        elif isinstance(info.local_args[i], torch.Tensor):
            wanted.append(None)
    run_op = suggested.op if (suggested is not None and sharding.needs_redistribute) else op
    local_args = None
    if sharding.use_val_from_redistribute_schema and sflat is not None:
        # the tensor positions numbered in order; every other value comes from the rewritten schema
        template, n = [], 0
        for i, s in enumerate(flat):
            if isinstance(s, DTensorSpec) or isinstance(info.local_args[i], torch.Tensor):
                template.append(("t", n))
                n += 1
            else:
                template.append(("v", sflat[i]))
        extra = list(sflat[len(flat):])
        tree, local_kwargs = info.args_tree_spec, dict(info.local_kwargs)
        kw_tensors = [k for k, v in local_kwargs.items() if isinstance(v, torch.Tensor)]

        def local_args(tensors, template=template, extra=extra, tree=tree, kw=local_kwargs, kw_tensors=kw_tensors):
            flat_args = [tensors[x] if kind == "t" else x for kind, x in template] + extra
            args = tree_unflatten(flat_args, tree) if tree is not None else tuple(flat_args)
            kwargs = dict(kw)
            for j, k in enumerate(kw_tensors):
                kwargs[k] = tensors[n + j]
            return tuple(args), kwargs

    spec = sharding.output_spec
    single = not isinstance(spec, (tuple, list))
    outputs = []
    for s in ([spec] if single else spec):
        if isinstance(s, DTensorSpec) and s.tensor_meta is not None:
            m = s.tensor_meta
            outputs.append((tuple(s.placements), tuple(m.shape), tuple(m.stride), m.dtype, dtensor_layout(s)))
        else:
            outputs.append(None)
    return DTensorDecision(wanted, run_op, local_args, outputs, single)
