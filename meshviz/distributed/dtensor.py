"""DistTensor: a torch.Tensor with Paddle's dist attributes, backed by a torch DTensor on a mesh-ordered DeviceMesh."""

from __future__ import annotations

import itertools
import time
import weakref

import torch
import torch.distributed as tdist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial as TPartial
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard

from .. import compat, trace
from ..compat import TorchDispatchMode, tree_map
from ..core.mesh import ProcessMesh
from ..core.placements import Partial, Placement, Replicate, Shard
from ..rank_context import per_rank
from . import groups, rollcall
from .comm import dtensor_reduce_op, from_dtensor_reduce_op
from .devices import device

__all__ = ["DistTensor", "to_torch_placements", "from_torch_placements", "make_dtensor", "make_dist"]

_pmesh_of: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # DeviceMesh -> ProcessMesh
_ids = per_rank(lambda: itertools.count(1))  # tensor ids in events, numbered per rank


_to_torch: dict = {}  # placements (both kinds are frozen, hashable values) -> converted, asked on every call
_from_torch: dict = {}


def to_torch_placements(placements) -> tuple:
    key = tuple(placements)
    hit = _to_torch.get(key)
    if hit is not None:
        return hit
    out = []
    for p in placements:
        if isinstance(p, Shard):
            out.append(TShard(p.dim))
        elif isinstance(p, Replicate):
            out.append(TReplicate())
        elif isinstance(p, Partial):
            out.append(TPartial(dtensor_reduce_op(p.reduce_type)))
        else:
            raise ValueError(f"not a placement: {p!r}")
    if len(_to_torch) < 4096:
        _to_torch[key] = tuple(out)
    return tuple(out)


def from_torch_placements(placements) -> list[Placement]:
    key = tuple(placements)
    hit = _from_torch.get(key)
    if hit is not None:
        return list(hit)
    out: list[Placement] = []
    for p in placements:
        if p.is_shard():
            out.append(Shard(p.dim))
        elif p.is_replicate():
            out.append(Replicate())
        elif p.is_partial():
            out.append(Partial(from_dtensor_reduce_op(getattr(p, "reduce_op", "sum"))))
        else:
            raise ValueError(f"unsupported torch placement {p!r}")
    if len(_from_torch) < 4096:
        _from_torch[key] = tuple(out)
    return out


def device_mesh_for(mesh: ProcessMesh, device_type: str | None = None):
    dm = groups.device_mesh(mesh, device_type)
    if dm not in _pmesh_of:
        _pmesh_of[dm] = mesh
    return dm


def process_mesh_of(dm) -> ProcessMesh:
    pm = _pmesh_of.get(dm)
    if pm is None:
        names = dm.mesh_dim_names or [f"d{i}" for i in range(dm.ndim)]
        pm = ProcessMesh(dm.mesh.tolist(), list(names))
        _pmesh_of[dm] = pm
    return pm


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for s in reversed(list(shape)):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


def representable(placements) -> bool:
    """torch DTensor holds one Partial reduction per tensor; mixed ones live only in meshviz."""
    return len({p.reduce_type for p in placements if isinstance(p, Partial)}) <= 1


def block_device_type(local: torch.Tensor) -> str:
    """Where a dist tensor's blocks live: a CUDA block stays on CUDA (gloo carries CUDA tensors for its main
    collectives); a CPU one goes to this rank's device (its GPU under NCCL), as Paddle places tensors on the
    current device."""
    t = local.device.type
    return t if t != "cpu" else device().type


def make_dtensor(local: torch.Tensor, mesh: ProcessMesh, placements, shape, device_type: str | None = None) -> DTensor:
    """A DTensor (no autograd history) whose local value is ``local`` and global shape ``shape``, on a DeviceMesh of
    ``device_type`` (default :func:`block_device_type`; DTensor moves ``local`` there)."""
    dm = device_mesh_for(mesh, device_type or block_device_type(local))
    if not representable(placements):
        placements = [Replicate() if isinstance(p, Partial) else p for p in placements]
    return compat.dtensor_from_local(local.detach(), dm, to_torch_placements(placements), shape,
                                     _contiguous_stride(shape))


def make_dist(local: torch.Tensor, mesh: ProcessMesh, placements, shape, requires_grad: bool = False):
    pl = list(placements)
    return DistTensor(make_dtensor(local, mesh, pl, shape), mesh, requires_grad=requires_grad,
                      placements=None if representable(pl) else pl)


class DistTensor(torch.Tensor):
    """A distributed tensor: global ``shape``, ``placements`` on ``process_mesh``, this rank's block locally."""

    _dtensor: DTensor
    _pmesh: ProcessMesh
    __torch_function__ = compat.disabled_torch_function_impl

    @staticmethod
    def __new__(cls, dtensor: DTensor, process_mesh: ProcessMesh | None = None, requires_grad: bool = False,
                placements=None):
        r = compat.make_wrapper_subclass(
            cls, dtensor.shape, strides=dtensor.stride(), dtype=dtensor.dtype,
            device=dtensor.device, requires_grad=requires_grad,
        )
        r._dtensor = dtensor
        r._pmesh = process_mesh if process_mesh is not None else process_mesh_of(dtensor.device_mesh)
        r._mv_id = next(_ids)
        r._mv_name = None
        r._pl = placements  # set only when torch DTensor cannot hold them (mixed Partial reductions)
        return r

    # -- Paddle's dist attributes -----------------------------------------------------------------
    @property
    def placements(self) -> list[Placement]:
        if self._pl is not None:
            return list(self._pl)
        return from_torch_placements(self._dtensor.placements)

    @property
    def process_mesh(self) -> ProcessMesh:
        return self._pmesh

    def is_dist(self) -> bool:
        return True

    def _local_value(self) -> torch.Tensor:
        """This rank's block (a differentiable view; empty on ranks outside the mesh)."""
        from .api import dtensor_to_local

        return dtensor_to_local(self)

    def to_local(self) -> torch.Tensor:
        return self._local_value()

    @property
    def local_shape(self) -> list[int]:
        return list(compat.dtensor_local(self._dtensor).shape)

    @property
    def name(self) -> str | None:
        return self._mv_name

    @name.setter
    def name(self, value):
        self._mv_name = value

    @property
    def tensor_id(self) -> int:
        """This process's number for the tensor (its events carry it: a view follows one tensor by it)."""
        return self._mv_id

    def full_tensor(self) -> torch.Tensor:
        from .api import unshard_dtensor

        return unshard_dtensor(self)

    def numpy(self):
        raise RuntimeError(
            "a DistTensor has no single numpy value on one rank; use dist.unshard_dtensor(t).numpy() "
            "for the global value (a collective: every rank must call it) or t._local_value().numpy()"
        )

    def __repr__(self, *, tensor_contents=None) -> str:  # never communicates
        local = compat.dtensor_local(self._dtensor)
        rank = tdist.get_rank() if tdist.is_initialized() else 0
        where = "" if self._pmesh.contains(rank) else " (not in mesh)"
        return (
            f"DistTensor(shape={list(self.shape)}, dtype={str(self.dtype).replace('torch.', '')}, "
            f"process_mesh={self._pmesh}, placements=[{', '.join(map(repr, self.placements))}], "
            f"rank {rank}{where} local_value=\n{local.detach()})"
        )

    # -- dispatch ---------------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first: list[DistTensor] = []

        def find(x):
            if isinstance(x, DistTensor) and not first:
                first.append(x)
            return x

        tree_map(find, (args, kwargs))
        ref = first[0]
        if func is torch.ops.aten._local_scalar_dense.default and not all(
                isinstance(p, Replicate) for p in ref.placements):
            raise ValueError(
                f"item()/float() of a {ref.placements} dist tensor would give this rank's block or summand, not "
                f"the value; use dist.unshard_dtensor(t).item() on every rank (a collective)")
        meshes = set()
        by_id = {}

        def unwrap(x):
            if isinstance(x, DistTensor):
                if x._pl is not None and func not in _METADATA_OPS:
                    raise ValueError(
                        f"{func}: a tensor with mixed Partial reductions {x._pl} cannot enter an op; "
                        f"dist.reshard it first")
                meshes.add(x._pmesh)
                by_id[id(x._dtensor)] = x
                return x._dtensor
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.dim() > 0 and x.numel() > 1:
                # a dense tensor meeting a dist one is replicated on its mesh, as in Paddle
                return make_dtensor(_local_for_replicate(x, ref._pmesh), ref._pmesh,
                                    [Replicate()] * ref._pmesh.ndim, x.shape, ref._dtensor.device_mesh.device_type)
            return x

        uargs, ukwargs = tree_map(unwrap, (args, kwargs))
        if len(meshes) > 1:
            raise ValueError(
                f"{func}: inputs live on different meshes {sorted(map(repr, meshes))}; "
                f"dist.reshard one of them onto the other's mesh first"
            )
        if trace.active():
            with _CommObserver(str(func.__name__ if hasattr(func, "__name__") else func)):
                out = _call(func, uargs, ukwargs)
        else:
            out = _call(func, uargs, ukwargs)

        def wrap_out(x):
            if isinstance(x, DTensor):
                hit = by_id.get(id(x))
                if hit is not None:
                    return hit
                keep = ref._pl if func in _METADATA_OPS else None
                return DistTensor(x, ref._pmesh if x.device_mesh is ref._dtensor.device_mesh else None,
                                  placements=keep)
            return x

        return tree_map(wrap_out, out)


def _call(func, args, kwargs):
    try:
        return func(*args, **kwargs)
    except AssertionError as e:
        # torch 2.11's DTensor cannot turn one Partial reduction into another inside an op (P(avg) + P(sum));
        # 2.13 can. Reduce the Partial inputs first, then run the op again.
        if "from one partial type" not in str(e):
            raise
        args, kwargs = tree_map(_reduce_partials, (args, kwargs))
        return func(*args, **kwargs)


def _reduce_partials(x):
    if isinstance(x, DTensor) and any(p.is_partial() for p in x.placements):
        return x.redistribute(x.device_mesh, [TReplicate() if p.is_partial() else p for p in x.placements])
    return x


_METADATA_OPS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}


def _local_for_replicate(x: torch.Tensor, mesh: ProcessMesh) -> torch.Tensor:
    rank = tdist.get_rank() if tdist.is_initialized() else 0
    return x.detach() if mesh.contains(rank) else x.detach().new_empty(0)


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
            nbytes = inp.numel() * inp.element_size() if isinstance(inp, torch.Tensor) else 0
            group = None
            gname = args[-1] if args and isinstance(args[-1], str) else kwargs.get("group_name")
            if gname:
                try:
                    group = tdist.get_process_group_ranks(compat.resolve_process_group(gname))
                except Exception:
                    group = None
            module, backward = rollcall.issuer()
            trace.emit(trace.Event(
                kind="collective", op=_COLLECTIVES[name], start=t0, group=group, bytes=int(nbytes),
                payload=trace.Collective(implicit=True, inside=self.context, module=module, backward=backward),
            ))
            return out
        return func(*args, **kwargs)
