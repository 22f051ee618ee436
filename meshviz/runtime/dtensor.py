"""DistTensor: a torch.Tensor with Paddle's dist attributes, backed by a torch DTensor on a mesh-ordered DeviceMesh."""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial as TPartial
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard

from .. import compat, rank_context
from ..core.layout import local_block
from ..core.mesh import ProcessMesh
from ..core.partial import summed
from ..core.placements import Partial, Placement, Replicate, Shard
from . import groups
from .comm import dtensor_reduce_op, from_dtensor_reduce_op
from .devices import device

__all__ = ["DistTensor", "to_torch_placements", "from_torch_placements", "paddle_placement", "make_dtensor",
           "make_dist", "set_op_layer", "set_local_functions", "torch_only_axes"]

_pmesh_of: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # DeviceMesh -> ProcessMesh
@dataclass
class DTensorState:
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))  # tensor ids in events, numbered per rank


DTENSOR = rank_context.slot("dtensor", DTensorState)


def _state() -> DTensorState:
    return DTENSOR.get()


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
            if p.co_shard_order and not _mesh_order_nesting(placements, p.dim):
                raise ValueError(
                    f"placements {list(placements)} nest the co-shards of tensor dim {p.dim} in an order other than "
                    f"mesh order (co_shard_order); torch DTensor cannot hold that layout, so a dist tensor cannot "
                    f"have it (meshviz.core lays it out and plans reshards to and from it; at runtime use the "
                    f"default order)")
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


def _mesh_order_nesting(placements, dim) -> bool:
    axes = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim]
    return sorted(axes, key=lambda i: (placements[i].co_shard_order, i)) == axes


def paddle_placement(p) -> Placement | None:
    """The meshviz placement a torch one stands for; None for one Paddle has no name for (``_StridedShard``)."""
    kind = type(p)
    if kind is TShard:
        return Shard(p.dim)
    if kind is TReplicate:
        return Replicate()
    if p.is_partial():
        return Partial(from_dtensor_reduce_op(getattr(p, "reduce_op", "sum")))
    return None


def from_torch_placements(placements) -> list[Placement]:
    """meshviz's placements for torch's; a placement Paddle has no name for (``_StridedShard``, a view merging a
    sharded dim into one before it) reads as Replicate, which is what Paddle's rule for that view gives: the
    block becomes that once it is used (:meth:`DistTensor._resolved`)."""
    key = tuple(placements)
    hit = _from_torch.get(key)
    if hit is not None:
        return list(hit)
    out = [paddle_placement(p) or Replicate() for p in placements]
    if len(_from_torch) < 4096:
        _from_torch[key] = tuple(out)
    return out


def torch_only_axes(dt: DTensor) -> list[int]:
    """Mesh axes on which ``dt`` lies in a way only torch can name (``_StridedShard``)."""
    return [i for i, p in enumerate(dt.placements) if paddle_placement(p) is None]


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
    current device; so does a meta one (a model built on the meta device: its blocks are allocated later, by
    ``to_empty``, on the mesh the rest of the model uses)."""
    t = local.device.type
    return t if t not in ("cpu", "meta") else device().type


def make_dtensor(local: torch.Tensor, mesh: ProcessMesh, placements, shape, device_type: str | None = None) -> DTensor:
    """A DTensor (no autograd history) whose local value is ``local`` and global shape ``shape``, on a DeviceMesh of
    ``device_type`` (default :func:`block_device_type`; DTensor moves ``local`` there)."""
    dm = device_mesh_for(mesh, device_type or block_device_type(local))
    if not representable(placements):
        placements = summed(placements)
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
        r._mv_id = next(_state().ids)
        r._mv_name = None
        r._pl = placements  # set only when torch DTensor cannot hold them (mixed Partial reductions)
        r._mv_grad_hook = None  # the op layer's hook giving the gradient Paddle's placements
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
        return _local_functions[0](self)

    def to_local(self) -> torch.Tensor:
        return self._local_value()

    @property
    def local_shape(self) -> list[int]:
        if torch_only_axes(self._dtensor):
            coord = self._pmesh.coordinate(tdist.get_rank() if tdist.is_initialized() else 0)
            if coord is None:
                return [0]
            return [b - a for a, b in local_block(tuple(self.shape), self._pmesh, self.placements, coord)]
        return list(compat.dtensor_local(self._dtensor).shape)

    @property
    def _local_shape(self) -> list[int]:
        """Paddle's name for :attr:`local_shape`."""
        return self.local_shape

    def _hold(self, other: "DistTensor") -> "DistTensor":
        """This tensor, now holding ``other``'s block and layout: what an in-place op that ran on a re-laid-out
        copy (or a sharding stage) leaves in the caller's tensor."""
        self._dtensor, self._pl = other._dtensor, other._pl
        return self

    def _resolved(self) -> "DistTensor":
        """This tensor with a block that its :attr:`placements` describe: an axis only torch can name is
        all-gathered by torch (its collective is seen, as every one inside an op is). No autograd."""
        odd = torch_only_axes(self._dtensor)
        if not odd:
            return self
        dt = self._dtensor
        dt = dt.redistribute(dt.device_mesh, [TReplicate() if i in odd else p for i, p in enumerate(dt.placements)])
        out = DistTensor(dt, self._pmesh)
        out._mv_id, out._mv_name = self._mv_id, self._mv_name
        return out

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
        """The dense value (a collective: every rank of the mesh calls it); differentiable."""
        return _local_functions[1](self)

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
        return _op_layer(func, args, kwargs or {})


def _missing(*args, **kwargs):
    raise RuntimeError("import meshviz.distributed (it installs the op layer and the dist tensor's autograd)")


# the layers above install these (they import this module, so it cannot import them)
_op_layer = _missing
_local_functions = [_missing, _missing]  # to_local, unshard: meshviz.runtime.autograd


def set_op_layer(fn) -> None:
    """Install the function every op on a dist tensor goes through (``meshviz.runtime.ops.dispatch``)."""
    global _op_layer
    _op_layer = fn


def set_local_functions(to_local, unshard) -> None:
    """Install ``_local_value`` and ``full_tensor``'s implementations (``meshviz.runtime.autograd``)."""
    _local_functions[:] = [to_local, unshard]
