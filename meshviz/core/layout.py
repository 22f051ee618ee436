"""Block layout: which slice of the global tensor each mesh coordinate holds."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .mesh import ProcessMesh
from .partial import partial_fill
from .placements import Partial, Placement, Replicate, Shard, parse_placement

__all__ = [
    "Block",
    "Layout",
    "chunk",
    "normalize_placements",
    "pad_placements",
    "with_nesting",
    "local_block",
    "local_shape",
    "layout",
    "shard_axes",
    "partial_fill",
    "dense_to_local",
]

Block = tuple  # tuple of (start, stop) per tensor dim


def chunk(n: int, k: int, i: int) -> tuple[int, int]:
    """Chunk ``i`` of ``n`` items split ``k`` ways: ceil-sized, the tail short or empty (5 on 4 → 2,2,1,0)."""
    size = -(-n // k) if n else 0
    start = min(i * size, n)
    return start, min(start + size, n)


def pad_placements(placements, mesh: ProcessMesh) -> list:
    """``placements`` as a list of one per mesh axis: a short list is padded with Replicate (as Paddle does); a long
    one drops trailing Replicates with a warning (Paddle drops them silently) and raises ``ValueError`` for any
    other placement past the mesh's axes."""
    if placements is None:
        raise ValueError("placements must be a list with at most one placement per mesh axis")
    try:
        placements = list(placements)
    except TypeError:
        raise ValueError(f"placements must be a list, got {placements!r}") from None
    if len(placements) > mesh.ndim:
        extra = placements[mesh.ndim:]
        if not all(isinstance(parse_placement(p) if isinstance(p, str) else p, Replicate) for p in extra):
            raise ValueError(
                f"got {len(placements)} placements {placements} for a {mesh.ndim}-D mesh {mesh.shape}; "
                f"give at most one per mesh axis (missing ones are Replicate; only trailing Replicates may be extra)"
            )
        warnings.warn(f"{len(placements)} placements {placements} for a {mesh.ndim}-D mesh {mesh.shape}: the "
                      f"{len(extra)} trailing Replicate{'s' if len(extra) > 1 else ''} past its axes are dropped",
                      stacklevel=3)
        return placements[:mesh.ndim]
    return placements + [Replicate()] * (mesh.ndim - len(placements))


_NORMALIZED: dict = {}  # (tensor ndim, mesh ndim, placements) -> what normalize_placements made of them


_MAX_NUMEL = 2**62  # the byte model counts elements in int64, up to twice a tensor's (a ring all-reduce)


def _check_numel(shape: Sequence[int]) -> None:
    """ValueError for a shape of 2**62 elements or more, or with a dim that long (the planner's and the byte model's
    counts are 64-bit integers; no machine holds such a tensor)."""
    dims = [int(s) for s in shape]
    if min(dims, default=0) < 0:
        return  # a negative size: the caller's own check names it
    numel = math.prod(dims)
    if numel >= _MAX_NUMEL or max(dims, default=0) >= _MAX_NUMEL:
        raise ValueError(f"a tensor of shape {dims} ({numel:.3g} elements) is too large: meshviz counts elements and "
                         f"bytes in 64-bit integers and takes shapes of fewer than 2**62 ({_MAX_NUMEL:.2g}) elements, "
                         f"every dim included")


def normalize_placements(shape: Sequence[int], mesh: ProcessMesh, placements) -> tuple[Placement, ...]:
    """Validate ``placements`` against ``shape`` and ``mesh``: short lists are padded with Replicate, negative Shard
    dims become positive, and co-shard orders are rewritten so one nesting has one spelling (``with_nesting``).
    A shape of 2**62 elements or more raises ``ValueError`` (counts are 64-bit)."""
    _check_numel(shape)
    key: tuple | None
    try:
        key = (len(shape), mesh.ndim, tuple(placements))
        done = _NORMALIZED.get(key)
    except TypeError:  # not a list, or an unhashable entry: its error comes below
        key = done = None
    if done is not None:
        return done
    out = _normalized(shape, mesh, placements)
    if key is not None and len(key[2]) <= mesh.ndim:  # (extra trailing Replicates warn each time)
        if len(_NORMALIZED) >= 4096:
            _NORMALIZED.clear()
        _NORMALIZED[key] = out
    return out


def _normalized(shape: Sequence[int], mesh: ProcessMesh, placements) -> tuple[Placement, ...]:
    placements = pad_placements(placements, mesh)
    ndim = len(shape)
    out = []
    for p in placements:
        if isinstance(p, str):
            p = parse_placement(p)
        if not isinstance(p, Placement):
            raise ValueError(f"{p!r} is not a placement; use Shard(d), Replicate() or Partial()")
        if isinstance(p, Shard):
            if not -ndim <= p.dim < ndim:
                raise ValueError(
                    f"Shard({p.dim}) is out of range for a {ndim}-D tensor of shape {list(shape)}; "
                    f"valid dims are {list(range(-ndim, ndim)) if ndim else 'none'}"
                )
            p = Shard(p.dim % ndim, p.co_shard_order)
        out.append(p)
    for d in {p.dim for p in out if isinstance(p, Shard)}:
        out = with_nesting(out, d, shard_axes(out, d))
    return tuple(out)


def shard_axes(placements: Sequence[Placement], dim: int) -> list[int]:
    """Mesh axes that shard tensor dim ``dim``, outer first: by ``co_shard_order``, ties by mesh axis (Paddle's
    order; all orders 0 nests mesh axis 0 outermost)."""
    shards = [(p.co_shard_order, i) for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim]
    return [i for _, i in sorted(shards)]


def with_nesting(placements: Sequence[Placement], dim: int, axes: Sequence[int]) -> list[Placement]:
    """``placements`` with tensor dim ``dim`` sharded by mesh ``axes`` (outer first) and no other axis: orders all 0
    when the nesting is mesh order (the default spelling), else each axis's position in ``axes``."""
    out = [Replicate() if isinstance(p, Shard) and p.dim == dim and i not in axes else p
           for i, p in enumerate(placements)]
    default = list(axes) == sorted(axes)
    for pos, i in enumerate(axes):
        out[i] = Shard(dim, 0 if default else pos)
    return out


def local_block(shape, mesh: ProcessMesh, placements, coord) -> Block:
    """The (start, stop) per tensor dim held at mesh coordinate ``coord`` (nested ceil chunks, outer first)."""
    bounds = [[0, int(n)] for n in shape]
    for d in {p.dim for p in placements if isinstance(p, Shard)}:
        for axis in shard_axes(placements, d):
            lo, hi = bounds[d]
            a, b = chunk(hi - lo, mesh.shape[axis], coord[axis])
            bounds[d] = [lo + a, lo + b]
    return tuple((a, b) for a, b in bounds)


def local_shape(shape, mesh: ProcessMesh, placements, coord) -> tuple[int, ...]:
    return tuple(b - a for a, b in local_block(shape, mesh, placements, coord))


@dataclass(frozen=True)
class Layout:
    """Blocks of every mesh coordinate for one (shape, mesh, placements)."""

    shape: tuple
    mesh: ProcessMesh
    placements: tuple

    def coords(self):
        return np.ndindex(*self.mesh.shape)

    def block(self, coord) -> Block:
        return local_block(self.shape, self.mesh, self.placements, coord)

    def block_of(self, rank: int) -> Block | None:
        c = self.mesh.coordinate(rank)
        return None if c is None else self.block(c)

    def fill(self, coord) -> str:
        return partial_fill(self.placements, coord)

    def bounds(self) -> np.ndarray:
        """Every coordinate's block as an int64 array (mesh size, tensor ndim, 2) of (start, stop), in ``coords()``
        order: the nested ceil chunks of :func:`local_block`, worked out a mesh axis at a time for all coordinates
        together (a 65,536-rank mesh in a fraction of a second)."""
        mshape = tuple(self.mesh.shape)
        n = int(np.prod(mshape))
        out = np.zeros((n, len(self.shape), 2), dtype=np.int64)
        for d, size_d in enumerate(self.shape):
            lo, hi = np.zeros(mshape, dtype=np.int64), np.full(mshape, size_d, dtype=np.int64)
            for axis in shard_axes(self.placements, d):
                k = mshape[axis]
                at = np.arange(k, dtype=np.int64).reshape([k if a == axis else 1 for a in range(len(mshape))])
                length = hi - lo
                size = -(-length // k)
                a = np.minimum(at * size, length)
                lo, hi = lo + a, lo + np.minimum(a + size, length)
            out[:, d, 0] = np.broadcast_to(lo, mshape).ravel()
            out[:, d, 1] = np.broadcast_to(hi, mshape).ravel()
        return out

    def block_list(self) -> list:
        """Every coordinate's block, in ``coords()`` order (:meth:`bounds` as tuples)."""
        b = self.bounds()
        if not self.shape:
            return [()] * len(b)
        return list(zip(*(list(zip(b[:, d, 0].tolist(), b[:, d, 1].tolist())) for d in range(len(self.shape)))))

    def blocks(self) -> dict:
        """rank -> block, for every rank of the mesh."""
        return dict(zip(self.mesh.ids.ravel().tolist(), self.block_list()))

    def owners(self) -> dict:
        """block -> ranks holding it (mesh order); Partial summands share a block with their partners."""
        out: dict = {}
        for r, blk in zip(self.mesh.ids.ravel().tolist(), self.block_list()):
            out.setdefault(blk, []).append(r)
        return out

    def is_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)


def layout(shape, mesh: ProcessMesh, placements) -> Layout:
    shape = tuple(int(s) for s in shape)
    return Layout(shape, mesh, normalize_placements(shape, mesh, placements))


def dense_to_local(value: np.ndarray, mesh: ProcessMesh, placements, coord) -> np.ndarray:
    """The local value ``shard_tensor`` gives coordinate ``coord`` for a dense ``value`` (numpy)."""
    block = local_block(value.shape, mesh, placements, coord)
    local = np.array(value[tuple(slice(a, b) for a, b in block)], copy=True)  # a 0-D value stays an array
    fill = partial_fill(placements, coord)
    if fill == "zero":
        local[...] = 0
    elif fill == "one":
        local[...] = 1
    return local
