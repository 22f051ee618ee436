"""What a rank receives in one communication: the byte model behind every event's ``bytes``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .layout import chunk, local_block
from .placements import Shard

__all__ = ["RECEIVED", "received", "step_received"]

# op -> what a rank receives (k ranks, ``me`` this rank's index in the group, the root's index for rooted ops):
# the symmetric collectives by the bandwidth-optimal ring over k chunks of ceil(n / k) elements (the same on every
# rank: which chunk a rank misses depends on the ring's order, which no rank chooses), the rooted ones directly
RECEIVED = {
    "all_reduce": "2 (k-1) chunks: the ring's reduce-scatter, then its all-gather",
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
        return sum(2 * _chunks(int(n), k) * int(s) for n, s in sizes)
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


def _numel(shape) -> int:
    return int(np.prod(shape, dtype=np.int64)) if len(shape) else 1


def _block_numel(shape, mesh, placements, coord) -> int:
    return _numel([b - a for a, b in local_block(shape, mesh, placements, coord)])


def _even(shape, mesh, placements) -> bool:
    """Every coordinate's block has the same shape: each sharded dim divides by the product of its mesh axes."""
    ways: dict[int, int] = {}
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            ways[p.dim] = ways.get(p.dim, 1) * mesh.shape[axis]
    return all(int(shape[d]) % k == 0 for d, k in ways.items())


def step_received(step, rank: int, itemsize: int) -> int:
    """Bytes ``rank`` receives in one reshard step (a :class:`~meshviz.core.planner.Step`); 0 when it has no part.

    The same model as :func:`received`, with the rank's own block; an all-gather, an all-to-all and a transfer
    between meshes move blocks whole, so the rank receives exactly the elements its block gains, which differ
    between ranks where the blocks split unevenly (``Step.bytes`` is the largest)."""
    if step.op == "send_recv":
        got = 0
        for j, (s, t) in enumerate(step.groups):
            if t == rank and s != rank:
                if step.blocks is not None:
                    got += _numel([b - a for a, b in step.blocks[j]])
                else:
                    got += _block_numel(step.shape, step.target_mesh, step.after, step.target_mesh.coordinate(t))
        return got * itemsize
    if step.op in ("slice", "zero_fill") or not step.mesh.contains(rank):
        return 0
    coord = step.mesh.coordinate(rank)
    k = step.mesh.shape[step.axis]
    if k == 1:
        return 0
    me = coord[step.axis]
    line = [tuple(coord[:step.axis]) + (j,) + tuple(coord[step.axis + 1:]) for j in range(k)]
    shape, mesh, before = step.shape, step.mesh, step.before
    if step.op == "all_gather":
        if _even(shape, mesh, before):  # every block the same size: no need to lay out the whole line
            return (k - 1) * _block_numel(shape, mesh, before, coord) * itemsize
        return sum(_block_numel(shape, mesh, before, c) for j, c in enumerate(line) if j != me) * itemsize
    mine = [b - a for a, b in local_block(shape, mesh, before, coord)]
    n = _numel(mine)
    if step.op == "all_reduce":
        return 2 * _chunks(n, k) * itemsize
    if step.op == "reduce_scatter":
        length = mine[step.dim]
        return (n // length * _chunks(length, k) if length else 0) * itemsize
    if step.op == "all_to_all":
        got = 0
        for j, c in enumerate(line):
            if j == me:
                continue
            blk = [b - a for a, b in local_block(shape, mesh, before, c)]
            length = blk[step.dst_dim]
            lo, hi = chunk(length, k, me)
            got += _numel(blk) // length * (hi - lo) if length else 0
        return got * itemsize
    return 0
