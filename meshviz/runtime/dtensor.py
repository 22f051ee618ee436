"""DistTensor: a torch.Tensor with Paddle's dist attributes, backed by a torch DTensor on a mesh-ordered DeviceMesh."""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

import torch
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

__all__ = ["DistTensor", "to_torch_placements", "from_torch_placements", "plain_layout", "PLAIN_PLACEMENTS",
           "paddle_placement", "make_dtensor", "make_dist", "new_dist", "contiguous_stride", "set_op_layer",
           "set_local_functions", "torch_only_axes"]

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
    return list(_torch_layout(tuple(placements)))


def _torch_layout(key: tuple) -> tuple:
    """:func:`from_torch_placements` of a tuple, as a tuple, remembered."""
    hit = _from_torch.get(key)
    if hit is None:
        hit = tuple(paddle_placement(p) or Replicate() for p in key)
        if len(_from_torch) < 4096:
            _from_torch[key] = hit
    return hit


PLAIN_PLACEMENTS = (TShard, TReplicate, TPartial)


def plain_layout(placements: tuple) -> tuple | None:
    """meshviz's placements for a tuple of torch's when each is a plain Shard, Replicate or Partial (no mask to
    apply, nothing only torch can name); None otherwise, unremembered (a ``_MaskPartial`` hashes by its buffer)."""
    for p in placements:
        if type(p) not in PLAIN_PLACEMENTS:
            return None
    return _torch_layout(placements)


def _torch_only(dt: DTensor) -> tuple | None:
    return compat.dtensor_layout(dt) if torch_only_axes(dt) else None


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


def contiguous_stride(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape``."""
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
    return compat.dtensor_from_local(local.detach().contiguous(), dm, to_torch_placements(placements), shape,
                                     contiguous_stride(shape))


def _on_block_device(local: torch.Tensor) -> torch.Tensor:
    want = block_device_type(local)
    if local.device.type != want and local.device.type != "meta":
        return local.to(want)
    return local


def make_dist(local: torch.Tensor, mesh: ProcessMesh, placements, shape, requires_grad: bool = False):
    """A dist tensor holding ``local`` (no autograd history) as this rank's block of a ``shape`` tensor."""
    shape = tuple(shape)
    to_torch_placements(placements)  # raises for a layout torch DTensor cannot hold
    if local.requires_grad or isinstance(local, torch.nn.Parameter):  # a fresh block needs no detach (a fake op)
        local = local.detach()
    local = _on_block_device(local)
    # the mesh's groups (collectives every rank joins) are made when its first tensor is, in program order
    kind = local.device.type if local.device.type != "meta" else block_device_type(local)
    if not groups.has_device_mesh(mesh, kind):
        device_mesh_for(mesh, kind)
    # the global strides are contiguous on every rank (a block's own layout can differ per rank: an empty block is
    # contiguous), so a block laid out otherwise (a transposed one a reshard passed on) is made contiguous to match
    return new_dist(local.contiguous(), mesh, tuple(placements), shape, contiguous_stride(shape), requires_grad)


def new_dist(local: torch.Tensor, mesh: ProcessMesh, placements: tuple, shape, stride, requires_grad: bool = False,
             dt: DTensor | None = None, tpl: tuple | None = None, device=None) -> "DistTensor":
    """The dist tensor whose block is ``local`` (used as is), laid out as meshviz ``placements`` (a tuple) on
    ``mesh``, with global ``shape`` and ``stride``; ``dt``: the DTensor it stands for, when there is one already;
    ``tpl``: a layout only torch can name (``compat.dtensor_layout``)."""
    r = compat.make_wrapper_subclass(DistTensor, shape, strides=stride, dtype=local.dtype,
                                     device=local.device if device is None else device, requires_grad=requires_grad)
    r._local = local
    r._mpl = placements
    r._pmesh = mesh
    if dt is not None:
        r._dt = dt
    if tpl is not None:
        r._tpl = tpl
    return r


class DistTensor(torch.Tensor):
    """A distributed tensor: global ``shape``, ``placements`` on ``process_mesh``, this rank's block locally.

    It holds the block (``_local``) and meshviz's placements itself; the torch DTensor it stands for is built when
    something asks for it (``_dtensor``), or kept when torch made the tensor with a layout only torch can name."""

    _pmesh: ProcessMesh
    _local: torch.Tensor
    _mpl: tuple
    # what most tensors never set (an instance sets its own)
    _dt: DTensor | None = None  # the DTensor it stands for, once built or when torch made it
    _tpl: tuple | None = None  # a layout only torch can name (``_StridedShard``): ``compat.dtensor_layout``
    _mv_id_: int | None = None  # numbered when first asked (:attr:`tensor_id`)
    _mv_name: str | None = None
    _mv_grad_hook = None  # the op layer's hook giving the gradient Paddle's placements
    _mv_key: int | None = None  # the layout's number in the op layer's decision cache, made on first use
    _mv_view = None  # ``op_writes.ViewOf``: how it is a view of another dist tensor (an in-place op writes that too)
    _mv_writes = 0  # in-place ops on it and blocks it took so far (a view whose block is not its block reads it anew)
    __torch_function__ = compat.disabled_torch_function_impl

    @staticmethod
    def __new__(cls, dtensor: DTensor, process_mesh: ProcessMesh | None = None, requires_grad: bool = False,
                placements=None):
        mesh = process_mesh if process_mesh is not None else process_mesh_of(dtensor.device_mesh)
        pl = tuple(placements) if placements is not None else _torch_layout(tuple(dtensor.placements))
        return new_dist(compat.dtensor_local(dtensor), mesh, pl, dtensor.shape, dtensor.stride(), requires_grad,
                        dt=dtensor if placements is None or representable(pl) else None, tpl=_torch_only(dtensor))

    @property
    def _torch_only(self) -> bool:
        """Laid out in a way only torch can name (``_StridedShard``: a view merging a sharded dim into one before
        it); its placements read as Paddle's rule for that view reads them."""
        return self._tpl is not None

    @property
    def _dtensor(self) -> DTensor:
        dt = self._dt
        if dt is None:
            local = self._local
            kind = local.device.type if local.device.type != "meta" else block_device_type(local)
            own = self._tpl
            tpl = own[0] if own is not None else to_torch_placements(
                self._mpl if representable(self._mpl) else summed(self._mpl))
            dt = self._dt = compat.dtensor_from_local(local, device_mesh_for(self._pmesh, kind), tpl, self.shape,
                                                      self.stride(), layout=own)
        return dt

    @_dtensor.setter
    def _dtensor(self, dt: DTensor) -> None:
        self._dt, self._local = dt, compat.dtensor_local(dt)
        self._mpl = _torch_layout(tuple(dt.placements))
        self._tpl = _torch_only(dt)
        self._mv_key = None

    @property
    def _pl(self):
        """The placements when torch DTensor cannot hold them (mixed Partial reductions), else None."""
        return None if representable(self._mpl) else list(self._mpl)

    # -- Paddle's dist attributes -----------------------------------------------------------------
    @property
    def placements(self) -> list[Placement]:
        return list(self._mpl)

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
        if self._torch_only:
            coord = self._pmesh.coordinate(groups.rank())
            if coord is None:
                return [0]
            return [b - a for a, b in local_block(tuple(self.shape), self._pmesh, self.placements, coord)]
        return list(self._local.shape)

    @property
    def _local_shape(self) -> list[int]:
        """Paddle's name for :attr:`local_shape`."""
        return self.local_shape

    def _hold(self, other: "DistTensor") -> "DistTensor":
        """This tensor, now holding ``other``'s block and layout: what an in-place op that ran on a re-laid-out
        copy (or a sharding stage) leaves in the caller's tensor. A write: a view of this tensor whose block is not
        the new one reads it anew."""
        self._local, self._mpl, self._dt, self._tpl = other._local, other._mpl, other._dt, other._tpl
        self._mv_key = None
        self._mv_writes += 1
        return self

    def _resolved(self) -> "DistTensor":
        """This tensor with a block that its :attr:`placements` describe: an axis only torch can name is
        all-gathered by torch (its collective is seen, as every one inside an op is). No autograd. A view whose
        base was written since its block was made reads the base anew first (``op_writes.ViewOf``)."""
        rec = self._mv_view
        if rec is not None and rec.stale():
            rec.refresh(self)
        if self._tpl is None:
            return self
        dt = self._dtensor
        odd = torch_only_axes(dt)
        dt = dt.redistribute(dt.device_mesh, [TReplicate() if i in odd else p for i, p in enumerate(dt.placements)])
        out = DistTensor(dt, self._pmesh)
        out._mv_id, out._mv_name = self._mv_id, self._mv_name
        return out

    @property
    def _mv_id(self) -> int:
        n = self._mv_id_
        if n is None:
            n = self._mv_id_ = next(_state().ids)
        return n

    @_mv_id.setter
    def _mv_id(self, n: int) -> None:
        self._mv_id_ = n

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

    def tolist(self):
        """The value of a Replicate tensor on a rank of its mesh (its block, as ``item()``); else raises."""
        if self._tpl is None and all(isinstance(p, Replicate) for p in self._mpl) \
                and self._pmesh.contains(groups.rank()):
            return self._local.tolist()
        raise RuntimeError(
            f"tolist() of a {self.placements} dist tensor would give this rank's block or summand, not the value; "
            "use dist.unshard_dtensor(t).tolist() on every rank (a collective) or t._local_value().tolist()"
        )

    def __repr__(self, *, tensor_contents=None) -> str:  # never communicates
        local = self._local
        rank = groups.rank()
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
