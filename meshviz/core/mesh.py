"""ProcessMesh: an N-D grid of process ids with named axes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .. import rank_context
from ..rank_context import getenv

__all__ = ["ProcessMesh", "set_rank_getter", "current_rank", "set_group_getter"]

_group_getter: Callable | None = None
# Process-wide, not per rank: with ranks as threads a mesh made by one rank is used by the others, and its id keys
# their group caches.
_unique_ids: dict = {}  # (shape, process ids) -> unique id, in order of first creation
_unique_lock = threading.Lock()


@dataclass
class MeshState:
    rank_getter: Callable[[], int | None] | None = None  # the runtime's get_rank


MESH = rank_context.slot("mesh", MeshState)


def _state() -> MeshState:
    return MESH.get()


def set_rank_getter(fn: Callable[[], int | None] | None) -> None:
    """The runtime installs its ``get_rank`` here so the pure core can ask "which rank am I"."""
    _state().rank_getter = fn


def set_group_getter(fn: Callable | None) -> None:
    """The runtime installs ``fn(mesh, dim_name) -> Group`` here, for ``ProcessMesh.get_group``."""
    global _group_getter
    _group_getter = fn


def current_rank() -> int | None:
    getter = _state().rank_getter
    if getter is not None:
        r = getter()
        if r is not None:
            return r
    env = getenv("RANK") or getenv("PADDLE_TRAINER_ID")
    return int(env) if env is not None else None


_INT64 = 2**63


def _at(where: str, index) -> str:
    return where + "".join(f"[{i}]" for i in index)


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _listed(value, where: str):
    """``value`` as a list (a range, a generator, a torch tensor ...); ValueError for a single value."""
    if isinstance(value, (list, tuple)):
        return value
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"ProcessMesh: {where} must be a list of process ids, got {_short(value)}")
    return list(value)


def _scalar(value, where: str) -> ValueError:
    if isinstance(value, np.generic):
        value = value.item()
    hint = ""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        hint = f"; a mesh of one rank is ProcessMesh([{int(value)}])"
    return ValueError(f"ProcessMesh: {where} must be a list of process ids (nested, one level per mesh axis), got "
                      f"the single value {_short(value)}{hint}")


def _ids_array(value, where: str) -> np.ndarray:
    """``value`` (nested lists of ints, or an int numpy array) as an int64 array; ValueError naming the first entry
    that is no process id (a float, a bool, ...), the first row whose length differs, or a single number."""
    if isinstance(value, np.ndarray) and value.dtype != object:
        if value.ndim == 0:
            raise _scalar(value.item(), where)
        if value.size == 0:
            return value.astype(np.int64)
        if value.dtype.kind not in "iu":
            first = value.ravel()[0].item() if value.size else None
            raise ValueError(f"process ids must be ints, got a {value.dtype} array ({_short(first)} at "
                             f"{_at(where, [0] * value.ndim)})")
        if value.dtype.kind == "u" and value.size and int(value.max()) >= _INT64:
            raise ValueError(f"process id {int(value.max())} in {where} is too large")
        return value.astype(np.int64)
    if isinstance(value, np.ndarray):
        value = value.tolist()
    elif not isinstance(value, (list, tuple)):
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise _scalar(value, where)
        return _ids_array(np.asarray(value), where)  # another array (a torch tensor, a range)
    try:
        arr = np.asarray(value)
    except (ValueError, OverflowError):  # ragged, or an int past int64: the walk below names it
        arr = None
    if arr is not None and arr.dtype.kind in "iu" and arr.ndim > 0 and arr.size:
        if not {bool, np.bool_} & set(map(type, np.asarray(value, dtype=object).ravel())):  # True is an int too
            return _ids_array(arr, where)
    flat: list = []
    shape = _nested(value, where, (), flat)
    return np.asarray(flat, dtype=np.int64).reshape(shape)


def _extent(shape: tuple) -> str:
    if not shape:
        return "is one id"
    if len(shape) == 1:
        return f"has {shape[0]} entr{'y' if shape[0] == 1 else 'ies'}"
    return f"has shape {list(shape)}"


def _nested(rows, where: str, at: tuple, flat: list) -> tuple:
    """The shape of ``rows`` (nested lists), its ints appended to ``flat`` in order."""
    if isinstance(rows, np.ndarray):
        rows = rows.tolist()
    if isinstance(rows, (list, tuple)):
        shapes = [_nested(r, where, at + (i,), flat) for i, r in enumerate(rows)]
        for i, s in enumerate(shapes):
            if s != shapes[0]:
                said = [f"{_at(where, at + (j,))} = {_short(rows[j])} {_extent(shapes[j])}" for j in (0, i)]
                raise ValueError(f"ProcessMesh rows must all have the same length (a rectangular array of ids): "
                                 f"{said[0]}, but {said[1]}")
        return (len(rows),) + (shapes[0] if shapes else ())
    if isinstance(rows, (bool, np.bool_)) or not isinstance(rows, (int, np.integer)):
        raise ValueError(f"process ids must be ints, got {_short(rows)} ({type(rows).__name__}) at {_at(where, at)}")
    if not -_INT64 <= int(rows) < _INT64:
        raise ValueError(f"process id {int(rows)} at {_at(where, at)} is too large")
    flat.append(int(rows))
    return ()


class ProcessMesh:
    """An N-D array of distinct, non-negative process ids; axis i is named ``dim_names[i]``.

    As in Paddle, two meshes are equal when their shapes and process ids are (axis names do not count).
    """

    __slots__ = ("_ids", "_dim_names", "_index", "_hash", "_unique_id", "_subs")
    _ids: np.ndarray
    _dim_names: tuple[str, ...]
    _index: dict[int, tuple[int, ...]] | None
    _hash: int | None
    _unique_id: int

    def __init__(self, mesh=None, dim_names: Sequence[str] | None = None, shape=None, process_ids=None):
        if mesh is None:
            if shape is None or process_ids is None:
                raise ValueError("ProcessMesh needs `mesh`, or both `shape` and `process_ids`")
            if not isinstance(process_ids, np.ndarray):
                process_ids = _listed(process_ids, "process_ids")
            flat = _ids_array(process_ids, "process_ids").ravel()
            try:
                arr = flat.reshape(shape)
            except (TypeError, ValueError):
                raise ValueError(f"ProcessMesh: {flat.size} process_ids do not fill the shape {shape!r}") from None
            if arr.ndim == 0:
                raise ValueError(f"ProcessMesh needs a shape of at least one axis, got {shape!r}")
        elif isinstance(mesh, ProcessMesh):
            arr = mesh._ids
            dim_names = dim_names if dim_names is not None else mesh._dim_names
        else:
            arr = _ids_array(mesh, "mesh")
        if arr.size == 0:
            given = mesh if mesh is not None else process_ids
            raise ValueError(f"ProcessMesh needs a non-empty, rectangular array of ints, got {_short(given)}")
        arr = np.ascontiguousarray(arr, dtype=np.int64)
        flat = arr.ravel()
        if (flat < 0).any():
            raise ValueError(f"process ids must be non-negative, got {sorted(set(flat[flat < 0].tolist()))}")
        uniq, counts = np.unique(flat, return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"process ids must be distinct; repeated: {uniq[counts > 1].tolist()}")
        if dim_names is None:
            dim_names = [f"d{i}" for i in range(arr.ndim)]
        dim_names = [str(n) for n in dim_names]
        if len(dim_names) != arr.ndim:
            raise ValueError(f"{len(dim_names)} dim_names {dim_names} for a {arr.ndim}-D mesh")
        if len(set(dim_names)) != len(dim_names):
            raise ValueError(f"dim_names must be distinct, got {dim_names}")
        arr.setflags(write=False)
        self._ids = arr
        self._dim_names = tuple(dim_names)
        self._index = None
        self._hash = None
        self._subs: dict | None = None
        key = (arr.shape, tuple(flat.tolist()))
        with _unique_lock:
            self._unique_id = _unique_ids.setdefault(key, len(_unique_ids) + 1)

    # -- Paddle's surface -------------------------------------------------------------------------
    @property
    def mesh(self) -> np.ndarray:
        """The id array (numpy, read-only), as in Paddle."""
        return self._ids

    @property
    def shape(self) -> list[int]:
        return list(self._ids.shape)

    @property
    def ndim(self) -> int:
        return self._ids.ndim

    @property
    def process_ids(self) -> list[int]:
        return self._ids.ravel().tolist()

    @property
    def dim_names(self) -> list[str]:
        return list(self._dim_names)

    @property
    def size(self) -> int:
        return int(self._ids.size)

    @property
    def ids(self) -> np.ndarray:
        """The id array itself (read-only numpy)."""
        return self._ids

    @property
    def unique_id(self) -> int:
        """The same number for every mesh of this shape and these ids in this process (from 1, creation order)."""
        return self._unique_id

    def contains(self, rank: int) -> bool:
        return rank in self._rank_index()

    def empty(self) -> bool:
        return self.size == 0

    def get_dim_size(self, dim) -> int:
        return int(self._ids.shape[self.axis(dim)])

    dim_size = get_dim_size

    def get_rank_by_dim_and_process_id(self, dim, process_id: int) -> int:
        """The coordinate of ``process_id`` along axis ``dim``; -1 when it is not in the mesh, 0 for ``dim=None``."""
        coord = self.coordinate(process_id)
        if coord is None:
            return -1
        if dim is None:
            return 0
        return int(coord[self.axis(dim)])

    def get_group(self, dim_name=None):
        """The communication group along axis ``dim_name`` that holds the calling rank (a collective the first
        time: every rank of the world calls it). A 1-D mesh needs no name; an N-D one does."""
        if self.ndim > 1 and dim_name is None:
            raise ValueError("get_group: name the mesh dim (dim_name=...) of a mesh with more than one dimension")
        axis = self.axis(dim_name if dim_name is not None else 0)
        if _group_getter is None:
            raise RuntimeError("ProcessMesh.get_group needs the runtime: import meshviz.distributed")
        return _group_getter(self, axis)

    def axis(self, dim) -> int:
        """Mesh axis index for an axis name or (possibly negative) index."""
        if isinstance(dim, str):
            if dim not in self._dim_names:
                raise ValueError(f"unknown mesh dim name {dim!r}; this mesh has {list(self._dim_names)}")
            return self._dim_names.index(dim)
        if isinstance(dim, (int, np.integer)) and not isinstance(dim, bool):
            d = int(dim)
            if not -self.ndim <= d < self.ndim:
                raise ValueError(f"mesh axis {dim} out of range for a {self.ndim}-D mesh")
            return d % self.ndim
        raise ValueError(f"mesh dim must be a name or an int, got {dim!r}")

    def get_mesh_with_dim(self, dim_name, index=None) -> "ProcessMesh":
        """This mesh with axis ``dim_name`` moved to the front; with ``index``, the slice at that index."""
        key = (dim_name, index) if index is None or type(index) is int else None
        if key is not None and self._subs is not None and key in self._subs:
            return self._subs[key]  # a pipeline asks for its stages' meshes for every parameter
        sub = self._with_dim(dim_name, index)
        if key is not None:
            if self._subs is None:
                self._subs = {}
            self._subs[key] = sub
        return sub

    def _with_dim(self, dim_name, index) -> "ProcessMesh":
        ax = self.axis(dim_name)
        order = [ax] + [i for i in range(self.ndim) if i != ax]
        arr = self._ids.transpose(order)
        names = [self._dim_names[i] for i in order]
        if index is None:
            return ProcessMesh(arr, names)
        if self.ndim == 1:
            return ProcessMesh(arr[index : index + 1] if isinstance(index, int) else arr[index], names)
        return ProcessMesh(arr[index], names[1:])

    def get_submesh_with_dim(self, dim_name, rank: int | None = None) -> "ProcessMesh | None":
        """The 1-D sub-mesh along ``dim_name`` through ``rank`` (default: the calling rank)."""
        ax = self.axis(dim_name)
        rank = current_rank() if rank is None else rank
        if rank is None:
            raise ValueError("get_submesh_with_dim needs a rank: no process group and no RANK variable")
        coord = self.coordinate(rank)
        if coord is None:
            return None
        idx: list[int | slice] = list(coord)
        idx[ax] = slice(None)
        return ProcessMesh(self._ids[tuple(idx)], [self._dim_names[ax]])

    # -- coordinates ------------------------------------------------------------------------------
    def _rank_index(self) -> dict:
        if self._index is None:
            it = np.ndindex(*self._ids.shape)
            self._index = {int(self._ids[c]): c for c in it}
        return self._index

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        """Mesh coordinate of ``rank``, or None when the rank is not in the mesh."""
        return self._rank_index().get(int(rank))

    def rank_at(self, coord) -> int:
        return int(self._ids[tuple(coord)])

    def axis_groups(self, axis) -> list[tuple[int, ...]]:
        """Every line of the mesh along ``axis``: the ranks that talk in a collective on that axis, in mesh order."""
        ax = self.axis(axis)
        moved = np.moveaxis(self._ids, ax, -1).reshape(-1, self._ids.shape[ax])
        return [tuple(row) for row in moved.tolist()]

    def axis_group_of(self, rank: int, axis) -> tuple[int, ...] | None:
        coord = self.coordinate(rank)
        if coord is None:
            return None
        ax = self.axis(axis)
        idx: list[int | slice] = list(coord)
        idx[ax] = slice(None)
        return tuple(self._ids[tuple(idx)].tolist())

    # -- indexing, equality -----------------------------------------------------------------------
    def __getitem__(self, index) -> "ProcessMesh | None":
        if isinstance(index, str):  # Paddle: mesh["x"] is the calling rank's 1-D sub-mesh along x
            return self.get_submesh_with_dim(index)
        if not isinstance(index, tuple):
            index = (index,)
        kept = []
        pos = 0
        for item in index:
            if item is Ellipsis:
                raise ValueError("ProcessMesh indexing does not take ...")
            if not isinstance(item, (int, np.integer)):
                kept.append(pos)
            pos += 1
        kept += list(range(pos, self.ndim))
        sub = self._ids[index]
        if sub.ndim == 0:
            return ProcessMesh([int(sub)])
        return ProcessMesh(sub, [self._dim_names[i] for i in kept])

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, ProcessMesh):
            return NotImplemented
        return self._unique_id == other._unique_id  # one number per shape and ids in this process

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash((self._ids.shape, tuple(self._ids.ravel().tolist())))
        return self._hash

    def __repr__(self) -> str:
        if self.size <= 64:
            body = str(self._ids.tolist())
        else:
            body = f"<{self.size} ids {self.process_ids[0]}..{self.process_ids[-1]}>"
        return f"ProcessMesh(shape={self.shape}, mesh={body}, dim_names={self.dim_names})"

    def to_dict(self) -> dict:
        return {"shape": self.shape, "process_ids": self.process_ids, "dim_names": self.dim_names}

    @classmethod
    def from_dict(cls, d: dict) -> "ProcessMesh":
        return cls(shape=d["shape"], process_ids=d["process_ids"], dim_names=d.get("dim_names"))

    def __reduce__(self):
        return (ProcessMesh, (self._ids.tolist(), self.dim_names))
