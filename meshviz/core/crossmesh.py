"""Between meshes: which source rank sends each target rank its block, and which Partial axes travel as they are."""

from __future__ import annotations

import itertools
from functools import lru_cache

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
    src_ids, dst_ids = src_mesh.ids.ravel(), dst_mesh.ids
    have = _bounds(Layout(vshape, src_mesh, tuple(pre)))  # (source, dim, (start, stop)), in src_ids order
    want = _bounds(Layout(vshape, dst_mesh, tuple(want)))  # (target, dim, (start, stop)), in dst_mesh order
    full = want[:, :, 1] > want[:, :, 0]  # an empty dim is a slice of any block
    idx = _own(src_mesh, dst_mesh)  # target mesh coordinate -> its source index
    pick = np.full(len(want), -1)
    for cand in _tries(idx, len(src_ids)):  # cand: a source index per target (-1: none)
        h = have[np.maximum(cand, 0)]
        ok = (pick < 0) & (cand >= 0) & np.all(~full | ((h[..., 0] <= want[..., 0]) & (want[..., 1] <= h[..., 1])), 1)
        pick[ok] = cand[ok]
        if (pick >= 0).all():
            break
    rest = np.flatnonzero(pick < 0)  # the first source that holds it, some targets at a time, replicas once
    if rest.size:
        blocks, first, inv = _unique_rows(have.reshape(len(have), -1))
    else:
        blocks, first, inv = have, 0, None
    b = blocks.reshape(len(blocks), -1, 2)[None]
    if rest.size:
        found = _first_holders(b[0], first, want[rest], full[rest])
        if not pieces and (found < 0).any():
            return None
        pick[rest] = np.where(found >= 0, found, len(have))
    pick[pick >= len(have)] = -1  # (pieces: from several blocks)
    rel = np.where(full[:, :, None], want - have[pick][:, :, :1], 0)[:, :ndim]  # the summand dims are no slices
    src_list, dst_list = src_ids.tolist(), dst_ids.ravel().tolist()
    if (pick >= 0).all():  # (every target from one source block)
        return tuple(zip(map(src_list.__getitem__, pick.tolist()), dst_list)), _slices(rel)
    split = _pieces(b[0], have, first, inv, want, (pick < 0) & full.all(axis=1), src_ids, dst_ids.ravel(), idx, ndim)
    src_at = set(src_list)
    empty = ((0, 0),) * ndim
    pairs_, rels = [], []
    for j, (p, t, r) in enumerate(zip(pick.tolist(), dst_list, _slices(rel))):
        if j in split:  # from several source blocks
            pairs_ += split[j][0]
            rels += split[j][1]
        else:  # (an empty block: an empty piece of any source, its own where it is one)
            pairs_.append((src_list[p] if p >= 0 else t if t in src_at else src_list[0], t))
            rels.append(r if p >= 0 else empty)
    return tuple(pairs_), tuple(rels)


def _pieces(blocks, have, first, inv, want, split, src_ids, dst_ids, idx, ndim) -> dict:
    """target index -> ((src, dst) pairs, slices) for each target of ``split`` (whose block no single source block
    holds): the part of each distinct source block it needs, in block order, sent by the target itself where it holds
    that block, else by the block's first holder."""
    js = np.flatnonzero(split)
    if not js.size:
        return {}
    lo = np.maximum(blocks[None, :, :, 0], want[js, None, :, 0])
    hi = np.minimum(blocks[None, :, :, 1], want[js, None, :, 1])
    jj, uu = np.nonzero((hi > lo).all(axis=2))
    own = idx.ravel()[js][jj]  # the target's own source index, or -1
    src = np.where((own >= 0) & (inv[np.maximum(own, 0)] == uu), own, first[uu])
    rels = _slices(np.stack([lo[jj, uu], hi[jj, uu]], axis=2)[:, :ndim] - have[src, :ndim, :1])
    pairs = list(zip(src_ids[src].tolist(), dst_ids[js][jj].tolist()))
    ends = np.searchsorted(jj, np.arange(len(js) + 1)).tolist()  # (jj ascends: each target's pieces in a run)
    return {j: (pairs[a:b], list(rels[a:b])) for j, a, b in zip(js.tolist(), ends, ends[1:])}


def _slices(rows: np.ndarray) -> tuple:
    """``rows`` (n, dim, (start, stop)) as a tuple of n tuples of (start, stop) pairs, each distinct row made once."""
    n = len(rows)
    if not n or not rows.shape[1]:
        return ((),) * n
    if n <= 64:  # (sorting out the distinct rows pays on larger meshes)
        return tuple(tuple(map(tuple, r)) for r in rows.tolist())
    uniq, _, inv = _unique_rows(rows.reshape(n, -1))
    made = [tuple(map(tuple, r)) for r in uniq.reshape(len(uniq), -1, 2).tolist()]
    return tuple(map(made.__getitem__, inv.tolist()))


def _unique_rows(rows: np.ndarray):
    """``np.unique(rows, axis=0, return_index=True, return_inverse=True)`` (the distinct rows in order, each one's
    first index, each row's distinct one) by a stable lexsort, a few times faster than unique's sort of rows."""
    n = len(rows)
    if not rows.shape[1]:
        return rows[:1], np.zeros(min(n, 1), dtype=np.intp), np.zeros(n, dtype=np.intp)
    order = np.lexsort(rows.T[::-1])
    ranked = rows[order]
    new = np.ones(n, dtype=bool)
    new[1:] = (ranked[1:] != ranked[:-1]).any(axis=1)
    inv = np.empty(n, dtype=np.intp)
    inv[order] = np.cumsum(new) - 1
    return ranked[new], order[new], inv


@lru_cache(maxsize=16)
def _own(src_mesh, dst_mesh) -> np.ndarray:
    """Each target's index among the source's ranks (mesh order), -1 where it is none of them; the target's shape."""
    src_ids, dst_ids = src_mesh.ids.ravel(), dst_mesh.ids
    order = np.argsort(src_ids)
    pos = np.minimum(np.searchsorted(src_ids, dst_ids, sorter=order), len(src_ids) - 1)
    out = np.where(src_ids[order[pos]] == dst_ids, order[pos], -1)
    out.setflags(write=False)
    return out


def _bounds(layout: Layout) -> np.ndarray:
    """:meth:`~meshviz.core.layout.Layout.bounds`, read-only; kept for meshes of up to 4,096 ranks (the choices of
    one plan share their layouts)."""
    return _kept_bounds(layout) if layout.mesh.size <= 4096 else layout.bounds()


@lru_cache(maxsize=32)
def _kept_bounds(layout: Layout) -> np.ndarray:
    out = layout.bounds()
    out.setflags(write=False)
    return out


def _first_holders(blocks, first, want, full) -> np.ndarray:
    """For each target (``want``: target, dim, (start, stop); ``full``: the dim is not empty), the least of ``first``
    over the distinct ``blocks`` (block, dim, (start, stop)) that hold its block, -1 where none does. The blocks are
    every choice of one chunk per dim (a mesh axis shards one dim) and a dim's non-empty chunks tile it, so a target's
    dim lies in at most one of them: a lookup per dim, not a table of targets by blocks."""
    axes = []  # per dim: its chunks, each block's chunk, each target's chunk (-1: none)
    for d in range(blocks.shape[1]):
        chunks, _, iv = _unique_rows(blocks[:, d])
        solid = np.flatnonzero(chunks[:, 1] > chunks[:, 0])
        starts, stops = chunks[solid, 0], chunks[solid, 1]
        if (starts[1:] < stops[:-1]).any():  # pragma: no cover - chunks of a nested split never overlap
            return _first_holders_by_table(blocks, first, want, full)
        k = np.searchsorted(starts, want[:, d, 0], side="right") - 1  # the last chunk starting at or before it
        mine = np.full(len(want), -1)
        if len(solid):
            inside = (k >= 0) & (want[:, d, 1] <= stops[np.maximum(k, 0)])
            mine[inside] = solid[k[inside]]
        axes.append((len(chunks), iv, mine))
    sizes = [n for n, _, _ in axes]
    if int(np.prod(sizes, dtype=np.int64)) != len(blocks):  # pragma: no cover - see above
        return _first_holders_by_table(blocks, first, want, full)
    flat = np.empty(len(blocks), dtype=np.int64)
    flat[np.ravel_multi_index([iv for _, iv, _ in axes], sizes) if axes else np.zeros(len(blocks), int)] = first
    table = flat.reshape(sizes)
    out = np.full(len(want), -1, dtype=np.int64)
    code = (full << np.arange(len(axes), dtype=np.int64)).sum(axis=1)  # which dims are not empty, as bits
    for c in sorted(set(code.tolist())):  # targets with the same empty dims: any chunk holds those
        rows, kind = np.flatnonzero(code == c), [bool(c >> d & 1) for d in range(len(axes))]
        free = tuple(d for d in range(len(axes)) if not kind[d])
        least = table.min(axis=free) if free else table
        at = [axes[d][2][rows] for d in range(len(axes)) if kind[d]]
        held = np.all([a >= 0 for a in at], axis=0) if at else np.ones(len(rows), dtype=bool)
        out[rows[held]] = least[tuple(a[held] for a in at)] if at else least
    return out


def _first_holders_by_table(blocks, first, want, full) -> np.ndarray:
    """:func:`_first_holders` by a table of targets by blocks, some targets at a time."""
    out = np.full(len(want), -1, dtype=np.int64)
    step = max(1, (1 << 22) // max(1, blocks.size))
    for at in range(0, len(want), step):
        w, f = want[at:at + step, None], full[at:at + step, None]
        held = np.all(~f | ((blocks[None, :, :, 0] <= w[..., 0]) & (w[..., 1] <= blocks[None, :, :, 1])), axis=2)
        least = np.where(held, first[None, :], np.iinfo(np.int64).max).min(axis=1)
        out[at:at + step] = np.where(held.any(axis=1), least, -1)
    return out


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
