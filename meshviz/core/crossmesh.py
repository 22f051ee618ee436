"""Between meshes: which source rank sends each target rank its block, and which Partial axes travel as they are."""

from __future__ import annotations

import itertools

import numpy as np

from .layout import Layout, local_block, shard_axes, with_nesting
from .partial import commutes
from .placements import Partial, Replicate, Shard

__all__ = ["kept_partials", "cross_moves", "landing", "midway", "cross_choices", "scattered"]


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


def cross_moves(shape, src_mesh, pre, dst_mesh, want, pairs=(), pieces=False):
    """For each target coordinate (mesh order), a source rank whose block under ``pre`` holds its whole block under
    ``want`` (and the same summand along each kept Partial pair ``pairs``), and that block's slice of the source's
    block: ((src, dst) pairs, slices), or None when some target block lies in no single source block (``pieces``: such
    a target gets the part of each distinct source block it needs, pairs of its own, in turn). Taken first:
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
        if not held.any(axis=1).all() and not pieces:
            return None
        pick[js] = np.where(held, first[None, :], len(have)).min(axis=1)
    pick[pick >= len(have)] = -1  # (pieces: from several blocks)
    rel = np.where(full[:, :, None], want - have[pick][:, :, :1], 0)[:, :ndim]  # the summand dims are no slices
    pairs_, rels = [], []
    for j, (p, t) in enumerate(zip(pick.tolist(), dst_ids.ravel().tolist())):
        if p >= 0 or not full[j].all():  # (an empty block: an empty piece of any source, its own where it is one)
            pairs_.append((int(src_ids[p]) if p >= 0 else t if t in src_ids else int(src_ids[0]), t))
            rels.append(tuple(map(tuple, rel[j].tolist())) if p >= 0 else ((0, 0),) * ndim)
            continue
        for u in range(len(blocks)):  # each distinct source block's part of the target's block: the target's own
            lo = np.maximum(b[0, u, :, 0], want[j, :, 0])  # copy where it holds one, else the first holder's
            hi = np.minimum(b[0, u, :, 1], want[j, :, 1])
            if (hi > lo).all():
                mine = np.flatnonzero((src_ids == t) & np.all(have == b[0, u], axis=(1, 2)))
                src = int(mine[0]) if mine.size else int(first[u])
                pairs_.append((int(src_ids[src]), t))
                rels.append(tuple(zip((lo - have[src, :, 0])[:ndim].tolist(), (hi - have[src, :, 0])[:ndim].tolist())))
    return tuple(pairs_), tuple(rels)


def landing(step, j) -> tuple:
    """Where pair ``j`` of a transfer between meshes (a ``send_recv`` step with ``blocks``) lands in its target's
    block: slices of the target's block (the whole of it unless the target gets pieces from several sources)."""
    s, t = step.groups[j]
    src = local_block(step.shape, step.mesh, step.before, step.mesh.coordinate(s))
    dst = local_block(step.shape, step.target_mesh, step.after, step.target_mesh.coordinate(t))
    return tuple(slice(a0 + a - b0, a0 + b - b0) for (a0, _), (a, b), (b0, _) in zip(src, step.blocks[j], dst))


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


def _subsets(opts):
    """Every choice of one option per entry of ``opts`` (lists, the first the default), fewest changes first."""
    combos = list(itertools.product(*[range(len(o)) for o in opts]))
    combos.sort(key=lambda c: sum(x > 0 for x in c))
    return [[o[x] for o, x in zip(opts, c)] for c in combos]


def _placed(placements, axes, picks) -> list:
    """``placements`` with each of ``axes`` as its pick: a Shard nested innermost in its dim after the axes that keep
    theirs, a Replicate un-sharding the axis (the other axes' nesting kept)."""
    out = list(placements)
    for d in {p.dim for p in [*placements, *picks] if isinstance(p, Shard)}:
        keep = [a for a in shard_axes(placements, d) if a not in axes or picks[axes.index(a)] == placements[a]]
        new = [a for a, p in zip(axes, picks) if isinstance(p, Shard) and p.dim == d and a not in keep]
        out = with_nesting(out, d, keep + new)
    for a, p in zip(axes, picks):
        if not isinstance(p, Shard):
            out[a] = p
    return out


def scattered(shape, mesh, src, dst, limit=16) -> list:
    """``dst`` (a layout to send between meshes of one shape) with each axis that all-reduces a Partial of ``src``
    into a Replicate reduce-scattering it along a tensor dim instead, for the target to gather after the transfer
    (a k-th of the tensor sent, not all of it), every choice of dims but none; [] past ``limit`` choices."""
    axes = [i for i, p in enumerate(src) if isinstance(p, Partial) and isinstance(dst[i], Replicate)
            and mesh.shape[i] > 1]
    dims = [Shard(d) for d, n in enumerate(shape) if n > 1]
    if not axes or not dims or (len(dims) + 1) ** len(axes) > limit:
        return []
    return [_placed(dst, axes, picks) for picks in _subsets([[dst[a], *dims] for a in axes])[1:]]


def cross_choices(shape, src_mesh, src, pre, dst_mesh, dst, mid, budget=1 << 12) -> list:
    """(source layout, target layout, pieces) a reshard between meshes of other shapes may send between, the plain
    pair (``pre``, ``mid``) first and the source wholly gathered second: the source gathers some of its shards and
    reduce-scatters a Partial axis it does not keep (instead of all-reducing it), the target receives its Replicate
    axes sharded and gathers them after the transfer; last (a tie keeps whole blocks) the plain pair with a target
    that no single source block holds receiving the pieces of several (``pieces``: :func:`cross_moves`). The plain
    ones alone where the choices times the ranks exceed ``budget``."""
    dims = [Shard(d) for d, n in enumerate(shape) if n > 1]
    s_axes, s_opts = [], []
    for i, p in enumerate(pre):
        if src_mesh.shape[i] > 1 and isinstance(p, Shard):
            s_axes.append(i)
            s_opts.append([p, Replicate()])
        elif src_mesh.shape[i] > 1 and isinstance(src[i], Partial) and not isinstance(p, Partial):
            s_axes.append(i)
            s_opts.append([p, *dims])
    t_axes = [i for i, p in enumerate(dst) if dst_mesh.shape[i] > 1 and isinstance(p, Replicate)]
    whole = tuple(p if isinstance(p, Partial) else Replicate() for p in pre)  # pre's Partial axes travel
    plain = [(tuple(pre), tuple(mid), False), (whole, tuple(mid), False)]
    pieces = [(tuple(pre), tuple(mid), True)] if src_mesh.size * dst_mesh.size <= budget else []
    count = (np.prod([len(o) for o in s_opts]) if s_opts else 1) * (len(dims) + 1) ** len(t_axes)
    if count * (src_mesh.size + dst_mesh.size) > budget:
        return plain + pieces
    out = list(plain)
    gots = [tuple(_placed(mid, t_axes, tpicks)) for tpicks in _subsets([[Replicate(), *dims] for _ in t_axes])]
    for picks in _subsets(s_opts):
        via = tuple(_placed(pre, s_axes, picks))
        parts = _parts(shape, src_mesh, via)
        for got in gots:  # a target block lies in one source block only where the target splits each dim as finely
            if (via, got, False) not in out and all(a >= b for a, b in zip(_parts(shape, dst_mesh, got), parts)):
                out.append((via, got, False))
    return out + pieces


def _parts(shape, mesh, placements) -> list[int]:
    """How many non-empty chunks ``placements`` split each tensor dim into (nested ceil chunks)."""
    out = []
    for d, n in enumerate(shape):
        sizes = [int(n)]
        for a in shard_axes(placements, d):
            k = mesh.shape[a]
            sizes = [min(-(-m // k), max(0, m - i * -(-m // k))) for m in sizes for i in range(k)]
        out.append(sum(m > 0 for m in sizes))
    return out
