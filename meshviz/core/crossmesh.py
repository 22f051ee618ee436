"""Between meshes: which source rank sends each target rank its block, and which Partial axes travel as they are."""

from __future__ import annotations

import numpy as np

from .layout import Layout, shard_axes, with_nesting
from .partial import commutes
from .placements import Partial, Shard

__all__ = ["kept_partials", "cross_moves", "midway"]


def kept_partials(src_mesh, src, dst_mesh, dst) -> list[tuple[int, int]]:
    """(source axis, target axis) pairs of Partial axes that travel unreduced: the target rank at index j of the
    target axis receives the summand of a source rank at index j of the source axis, so each target line sums to
    the tensor (Paddle's GlobalToSubMesh and SubMeshToGlobal keep the Partial, with no reduction). A target axis
    pairs with the first unpaired source axis of its size and reduction; none pair where the reductions of both
    layouts do not all commute (reducing some axes first would change the value)."""
    ps = [(i, p.reduce_type) for i, p in enumerate(src) if isinstance(p, Partial)]
    pd = [(i, p.reduce_type) for i, p in enumerate(dst) if isinstance(p, Partial)]
    kinds = {r for _, r in ps + pd}
    if not all(commutes(a, b) for a in kinds for b in kinds):
        return []
    pairs: list[tuple[int, int]] = []
    for t, rt in pd:
        for s, rs in ps:
            if rs == rt and src_mesh.shape[s] == dst_mesh.shape[t] and all(s != u for u, _ in pairs):
                pairs.append((s, t))
                break
    return pairs


def midway(shape, src, dst) -> list:
    """The layout a same-shaped target mesh receives when the source does only what shrinks the blocks (slices and
    reduce-scatters into the target's new shards) and the target does the rest (gathers, all-to-alls, reductions,
    fills): the order of Paddle's 1-D functions (``SToRReshardFunctionCrossMesh`` sends, then gathers)."""
    mid = list(src)
    for d in range(len(shape)):
        new = [i for i in shard_axes(dst, d) if not isinstance(src[i], Shard)]
        if new:
            for i in new:
                mid[i] = Shard(d)
            mid = with_nesting(mid, d, shard_axes(src, d) + new)
    return mid


def _virtual(placements, axes, ndim) -> list:
    """``placements`` with Partial ``axes`` as Shards of new tensor dims ``ndim``, ``ndim + 1``, ...: the summand's
    index along the axis, so a target rank's block holds it only where a source block holds the same summand."""
    out = list(placements)
    for k, a in enumerate(axes):
        out[a] = Shard(ndim + k)
    return out


def cross_moves(shape, src_mesh, pre, dst_mesh, want, pairs=()):
    """For each target coordinate (mesh order), a source rank whose block under ``pre`` holds its whole block under
    ``want`` (and the same summand along each kept Partial pair ``pairs``), and that block's slice of the source's
    block: ((src, dst) pairs, slices), or None when some target block lies in no single source block. Taken first:
    the target itself (a local copy); then a source one target axis away (Paddle's pairing from a slice of the
    target mesh); then the next source in turn (spreading the sends); then the first that holds it. Each choice is
    made for every target at once."""
    ndim = len(shape)
    vshape = tuple(shape) + tuple(src_mesh.shape[s] for s, _ in pairs)
    pre = _virtual(pre, [s for s, _ in pairs], ndim)
    want = _virtual(want, [t for _, t in pairs], ndim)
    src_ids, dst_ids = np.asarray(src_mesh.process_ids), dst_mesh.ids
    have = Layout(vshape, src_mesh, tuple(pre)).bounds()  # (source, dim, (start, stop)), in src_ids order
    want = Layout(vshape, dst_mesh, tuple(want)).bounds()  # (target, dim, (start, stop)), in dst_mesh order
    full = want[:, :, 1] > want[:, :, 0]  # an empty dim is a slice of any block
    order = np.argsort(src_ids)
    pos = np.minimum(np.searchsorted(src_ids, dst_ids, sorter=order), len(src_ids) - 1)
    idx = np.where(src_ids[order[pos]] == dst_ids, order[pos], -1)  # target mesh coordinate -> its source index
    pick = np.full(len(want), -1)
    for cand in _tries(idx, len(src_ids)):  # cand: a source index per target (-1: none)
        h = have[np.maximum(cand, 0)]
        ok = (pick < 0) & (cand >= 0) & np.all(~full | ((h[..., 0] <= want[..., 0]) & (want[..., 1] <= h[..., 1])), 1)
        pick[ok] = cand[ok]
        if (pick >= 0).all():
            break
    rest = np.flatnonzero(pick < 0)  # the first source that holds it, some targets at a time, replicas once
    blocks, first = np.unique(have.reshape(len(have), -1), axis=0, return_index=True) if rest.size else (have, 0)
    b, step = blocks.reshape(len(blocks), -1, 2)[None], max(1, (1 << 22) // max(1, blocks.size))
    for js in (rest[at:at + step] for at in range(0, len(rest), step)):
        held = np.all(~full[js, None] | ((b[..., 0] <= want[js, None, :, 0]) & (want[js, None, :, 1] <= b[..., 1])), 2)
        if not held.any(axis=1).all():
            return None
        pick[js] = np.where(held, first[None, :], len(have)).min(axis=1)
    rel = np.where(full[:, :, None], want - have[pick][:, :, :1], 0)[:, :ndim]  # the summand dims are no slices
    pairs_ = tuple(zip(src_ids[pick].tolist(), dst_ids.ravel().tolist()))
    return pairs_, tuple(tuple(map(tuple, r)) for r in rel.tolist())


def _tries(idx, n):
    """The sources :func:`cross_moves` tries in turn, each an array of a source index per target (-1: none): the
    target itself; along each axis, the ranks of every slice of the target mesh wholly in the source; the next in
    turn."""
    yield idx.ravel()
    inside = idx >= 0
    for a in range(idx.ndim if idx.ndim > 1 else 0):  # (a 1-D mesh's slices are single ranks)
        whole = inside.all(axis=tuple(b for b in range(idx.ndim) if b != a))
        for k in np.flatnonzero(whole) if not whole.all() else ():
            yield np.broadcast_to(np.take(idx, [k], axis=a), idx.shape).ravel()
    yield np.arange(idx.size) % n
