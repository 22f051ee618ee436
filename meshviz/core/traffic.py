"""What a rank receives in one communication: the byte model behind every event's ``bytes``."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from .layout import shard_axes

__all__ = ["RECEIVED", "received", "step_received", "step_most"]

# op -> what a rank receives (k ranks, ``me`` this rank's index in the group, the root's index for rooted ops):
# the symmetric collectives by the bandwidth-optimal ring over k chunks of ceil(n / k) elements (the same on every
# rank: which chunk a rank misses depends on the ring's order, which no rank chooses), the rooted ones directly
RECEIVED = {
    "all_reduce": "2 (k-1) chunks, at most 2n: the ring's reduce-scatter, then its all-gather",
    "reduce_scatter": "k-1 chunks of the input",
    "all_gather": "the other k-1 ranks' inputs",
    "all_to_all": "k-1 chunks of the input",
    "broadcast": "the tensor, except on the root (nothing)",
    "reduce": "the other k-1 ranks' tensors on the root, nothing elsewhere",
    "gather": "the other k-1 ranks' tensors on the root, nothing elsewhere",
    "scatter": "this rank's piece, except on the root (nothing)",
    "recv": "the tensor",
    "send_recv": "the tensors it receives",
    "send": "nothing",
    "barrier": "nothing",
}
_ALIASES = {"alltoall": "all_to_all", "alltoall_single": "all_to_all", "batch_isend_irecv": "send_recv",
            "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}

Sizes = Sequence[tuple[int, int]]  # (numel, itemsize) of each tensor the rank passes


def _chunks(n: int, k: int) -> int:
    """Elements of the k-1 chunks of ``n`` a rank of a ring of ``k`` receives (chunks of ceil(n / k))."""
    return (k - 1) * -(-n // k)


def _ring(n, k: int):
    """Elements a rank receives in one phase of a ring all-reduce over ``k`` ranks: k-1 chunks of ceil(n / k), those
    past the tensor's end empty, so never more than ``n`` (the k-1 largest chunks of the layout's split)."""
    got = np.minimum(n, (k - 1) * -(-n // k))
    return int(got) if np.ndim(got) == 0 else got


def received(op: str, sizes: Sizes, k: int, me: int, root: int | None = None) -> int:
    """Bytes this rank (index ``me`` of ``k``) receives in ``op`` over tensors of ``sizes``.

    ``sizes`` are the tensors this rank passes: the reduced / broadcast tensor(s); for all_gather and gather this
    rank's input; for reduce_scatter and all_to_all either this rank's whole input (one flat tensor per entry) or
    its ``k`` pieces (taken as one input); for scatter and recv the buffer it receives into. ``root`` is the root's
    index (rooted ops). An op without a model (object collectives: their size is not known before pickling)
    receives 0.
    """
    op = _ALIASES.get(op, op)
    total = sum(int(n) * int(s) for n, s in sizes)
    if op in ("recv", "send_recv"):
        return total
    if k <= 1:
        return 0
    if op == "all_reduce":
        return sum(2 * _ring(int(n), k) * int(s) for n, s in sizes)
    if op in ("reduce_scatter", "all_to_all"):
        if len(sizes) == k and len({s for _, s in sizes}) == 1:
            sizes = [(sum(int(n) for n, _ in sizes), sizes[0][1])]
        return sum(_chunks(int(n), k) * int(s) for n, s in sizes)
    if op == "all_gather":
        return (k - 1) * total
    if op in ("reduce", "gather"):
        return (k - 1) * total if me == root else 0
    if op in ("broadcast", "scatter"):
        return 0 if me == root else total
    return 0


def _chunk_len(length, k: int, i):
    """Length of chunk ``i`` of ``length`` items split ``k`` ways (:func:`~meshviz.core.layout.chunk`), elementwise."""
    size = -(-length // k)
    start = np.minimum(i * size, length)
    return np.minimum(start + size, length) - start


def _along(mesh, axis: int) -> np.ndarray:
    """The coordinate along ``axis``, shaped to broadcast over the mesh."""
    k = mesh.shape[axis]
    return np.arange(k, dtype=np.int64).reshape([k if a == axis else 1 for a in range(mesh.ndim)])


def _lengths(shape, mesh, placements) -> list:
    """Per tensor dim, the block's length at every mesh coordinate (arrays that broadcast to the mesh's shape): the
    nested ceil chunks of :func:`~meshviz.core.layout.local_block`, a whole mesh axis at once."""
    out = []
    for d, n in enumerate(shape):
        length = np.full([1] * mesh.ndim, int(n), dtype=np.int64)
        for axis in shard_axes(placements, d):
            length = _chunk_len(length, mesh.shape[axis], _along(mesh, axis))
        out.append(length)
    return out


def _product(lengths, mesh, skip=None) -> np.ndarray:
    out = np.ones(mesh.shape, dtype=np.int64)
    for d, length in enumerate(lengths):
        if d != skip:
            out = out * length
    return out


@lru_cache(maxsize=256)
def _line_table(op: str, mesh, axis: int, shape: tuple, before: tuple, dim, dst_dim) -> np.ndarray:
    """Elements the rank at each coordinate of ``mesh`` receives in a step along ``axis`` (an array of the mesh's
    shape): every line of the axis is laid out once for all its ranks."""
    k = mesh.shape[axis]
    lengths = _lengths(shape, mesh, before)
    if k == 1:
        table = np.zeros(mesh.shape, dtype=np.int64)
    elif op == "all_gather":  # the other blocks of the line, whole
        numel = _product(lengths, mesh)
        table = numel.sum(axis=axis, keepdims=True) - numel
    elif op == "all_reduce":
        table = 2 * _ring(_product(lengths, mesh), k)
    elif op == "reduce_scatter":  # k-1 chunks of the scattered dim, times the rest of the block
        table = _product(lengths, mesh, dim) * _chunks(lengths[dim], k)
    elif op == "all_to_all":  # from each partner, the part of its block that this rank's chunk of dst_dim covers
        # (``axis`` shards ``dim`` alone, so dst_dim's length is the same along the line)
        part = _product(lengths, mesh, dst_dim)
        table = (part.sum(axis=axis, keepdims=True) - part) * _chunk_len(lengths[dst_dim], k, _along(mesh, axis))
    else:  # slice, zero_fill: nothing moves
        table = np.zeros(mesh.shape, dtype=np.int64)
    table = np.broadcast_to(table, mesh.shape).copy()
    table.setflags(write=False)
    return table


_SENT: dict = {}  # id(step) -> (step, {target rank: elements it receives}) for transfers between meshes


def _send_recv_table(step) -> dict:
    hit = _SENT.get(id(step))
    if hit is not None and hit[0] is step:
        return hit[1]
    moved = [j for j, (s, t) in enumerate(step.groups) if s != t]  # (a local copy receives nothing)
    to = [step.groups[j][1] for j in moved]
    if step.blocks is None:  # whole blocks: each target's, at its place in the target mesh
        at = {r: i for i, r in enumerate(step.target_mesh.process_ids)}
        numel = _product(_lengths(step.shape, step.target_mesh, step.after), step.target_mesh).ravel()
        counts = numel[[at[t] for t in to]].tolist() if to else []
    else:  # each pair's slice (an empty shape: one element)
        sizes = np.asarray([step.blocks[j] for j in moved], dtype=np.int64).reshape(len(to), len(step.shape), 2)
        counts = np.prod(sizes[..., 1] - sizes[..., 0], axis=1, dtype=np.int64).tolist()
    if len(set(to)) == len(to):  # (each target from one source)
        got: dict = dict(zip(to, counts))
    else:
        got = {}
        for t, n in zip(to, counts):
            got[t] = got.get(t, 0) + n
    if len(_SENT) >= 256:
        _SENT.clear()
    _SENT[id(step)] = (step, got)
    return got


def _table(step) -> np.ndarray:
    return _line_table(step.op, step.mesh, step.axis, tuple(step.shape), tuple(step.before), step.dim, step.dst_dim)


def step_received(step, rank: int, itemsize: int) -> int:
    """Bytes ``rank`` receives in one reshard step (a :class:`~meshviz.core.planner.Step`); 0 when it has no part.

    The same model as :func:`received`, with the rank's own block; an all-gather, an all-to-all and a transfer
    between meshes move blocks whole, so the rank receives exactly the elements its block gains, which differ
    between ranks where the blocks split unevenly (``Step.bytes`` is the largest, :func:`step_most`). Each step's
    figures are worked out once, for all ranks together."""
    if step.op == "send_recv":
        return _send_recv_table(step).get(rank, 0) * itemsize
    if step.op in ("slice", "zero_fill"):
        return 0
    coord = step.mesh.coordinate(rank)
    if coord is None:
        return 0
    return int(_table(step)[coord]) * itemsize


def step_most(step, itemsize: int) -> int:
    """The most bytes any rank receives in ``step``: the largest :func:`step_received` over its ranks."""
    if step.op == "send_recv":
        return max(_send_recv_table(step).values(), default=0) * itemsize
    if step.op in ("slice", "zero_fill"):
        return 0
    return int(_table(step).max()) * itemsize
