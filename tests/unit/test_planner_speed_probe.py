"""Cold planning between meshes: the one-source search, the pieces and the transfer's bytes give the plans they gave."""

import hashlib
import random
import tracemalloc

import numpy as np
import pytest

from meshviz.core import Partial, ProcessMesh, ReduceType, Replicate, Shard, plan_reshard, simulate
from meshviz.core.crossmesh import (
    _first_holders,
    _first_holders_by_table,
    _tries,
    _unique_rows,
    _virtual,
    cross_moves,
    kept_partials,
)
from meshviz.core.layout import Layout, local_block, normalize_placements
from meshviz.core.planner import apply_step
from meshviz.core.traffic import step_received
from tests.partials import assert_target_holds, random_locals

pytestmark = pytest.mark.torch_free  # imports no torch: the test command runs it once, torch blocked

SUM, MAX = ReduceType.kRedSum, ReduceType.kRedMax


def _mesh(shape, start=0) -> ProcessMesh:
    return ProcessMesh(np.arange(start, start + int(np.prod(shape))).reshape(shape))


# -- the one-source search and the pieces, written out target by target (the planner before it worked a mesh at once)


def _reference_moves(shape, src_mesh, pre, dst_mesh, want, pairs=(), pieces=False):
    ndim = len(shape)
    vshape = tuple(shape) + tuple(src_mesh.shape[s] for s, _ in pairs)
    pre = _virtual(pre, [s for s, _ in pairs], ndim)
    want = _virtual(want, [t for _, t in pairs], ndim)
    src_ids, dst_ids = np.asarray(src_mesh.process_ids), dst_mesh.ids
    have = Layout(vshape, src_mesh, tuple(pre)).bounds()
    want = Layout(vshape, dst_mesh, tuple(want)).bounds()
    full = want[:, :, 1] > want[:, :, 0]
    order = np.argsort(src_ids)
    pos = np.minimum(np.searchsorted(src_ids, dst_ids, sorter=order), len(src_ids) - 1)
    idx = np.where(src_ids[order[pos]] == dst_ids, order[pos], -1)
    pick = np.full(len(want), -1)
    for cand in _tries(idx, len(src_ids)):
        h = have[np.maximum(cand, 0)]
        ok = (pick < 0) & (cand >= 0) & np.all(~full | ((h[..., 0] <= want[..., 0]) & (want[..., 1] <= h[..., 1])), 1)
        pick[ok] = cand[ok]
        if (pick >= 0).all():
            break
    blocks, first = np.unique(have.reshape(len(have), -1), axis=0, return_index=True)
    blocks = blocks.reshape(len(blocks), -1, 2)
    for j in np.flatnonzero(pick < 0):
        holders = [first[u] for u, b in enumerate(blocks)
                   if all(not full[j, d] or (b[d, 0] <= want[j, d, 0] and want[j, d, 1] <= b[d, 1])
                          for d in range(len(vshape)))]
        if not holders and not pieces:
            return None
        pick[j] = min(holders) if holders else -1
    pairs_, rels = [], []
    for j, (p, t) in enumerate(zip(pick.tolist(), dst_ids.ravel().tolist())):
        if p >= 0:
            pairs_.append((int(src_ids[p]), t))
            rels.append(tuple((int(want[j, d, 0] - have[p, d, 0]), int(want[j, d, 1] - have[p, d, 0])) if full[j, d]
                              else (0, 0) for d in range(ndim)))
        elif not full[j].all():
            pairs_.append((t if t in src_ids else int(src_ids[0]), t))
            rels.append(((0, 0),) * ndim)
        else:
            for u, b in enumerate(blocks):
                lo, hi = np.maximum(b[:, 0], want[j, :, 0]), np.minimum(b[:, 1], want[j, :, 1])
                if (hi > lo).all():
                    mine = [s for s in range(len(src_ids)) if src_ids[s] == t and (have[s] == b).all()]
                    src = mine[0] if mine else int(first[u])
                    pairs_.append((int(src_ids[src]), t))
                    rels.append(tuple((int(lo[d] - have[src, d, 0]), int(hi[d] - have[src, d, 0]))
                                      for d in range(ndim)))
    return tuple(pairs_), tuple(rels)


_MESHES = [(1,), (2,), (3,), (4,), (6,), (8,), (16,), (2, 2), (2, 4), (4, 2), (3, 4), (4, 4), (2, 8), (8, 8),
           (2, 2, 2), (2, 1, 4), (4, 4, 4)]


def _placements(rng, mesh_ndim, ndim, partial):
    out = []
    for _ in range(mesh_ndim):
        r = rng.random()
        if r < partial:
            out.append(Partial(rng.choice([SUM, SUM, MAX])))
        elif r < 0.45 or not ndim:
            out.append(Replicate())
        else:
            out.append(Shard(rng.randrange(ndim)))
    return out


def _cases(seed, n):
    rng = random.Random(seed)
    for _ in range(n):
        ndim = rng.choice([0, 1, 2, 2, 3])
        shape = [rng.choice([0, 1, 3, 5, 7, 8, 16, 17]) for _ in range(ndim)]
        a, b = rng.choice(_MESHES), rng.choice(_MESHES)
        src_mesh = _mesh(a)
        dst_mesh = _mesh(b, start=rng.choice([0, 0, 1, int(np.prod(a))]))
        src = normalize_placements(shape, src_mesh, _placements(rng, len(a), ndim, 0.25))
        dst = normalize_placements(shape, dst_mesh, _placements(rng, len(b), ndim, 0.25))
        pairs = kept_partials(src_mesh, src, dst_mesh, dst)
        pre = tuple(Replicate() if isinstance(p, Partial) and i not in [s for s, _ in pairs] else p
                    for i, p in enumerate(src))
        got = tuple(Replicate() if isinstance(p, Partial) and i not in [t for _, t in pairs] else p
                    for i, p in enumerate(dst))
        yield shape, src_mesh, pre, dst_mesh, got, tuple(pairs), rng.random() < 0.5


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cross_moves_pick_the_sources_and_slices_the_target_by_target_search_picks(seed):
    """Every target's source (the target itself, a slice of the target mesh, the next in turn, the first holder),
    its slice, the pieces of several sources and the refusals: as searched target by target, with plain ints."""
    seen = {"none": 0, "pieces": 0, "one": 0}
    for shape, src_mesh, pre, dst_mesh, got, pairs, pieces in _cases(seed, 150):
        want = _reference_moves(shape, src_mesh, pre, dst_mesh, got, pairs, pieces)
        have = cross_moves(shape, src_mesh, pre, dst_mesh, got, pairs, pieces)
        assert have == want, (shape, src_mesh.shape, pre, dst_mesh.shape, got, pairs, pieces)
        if have is None:
            seen["none"] += 1
            continue
        assert all(type(x) is int for pair in have[0] for x in pair)
        assert all(type(x) is int for rel in have[1] for ab in rel for x in ab)
        seen["pieces" if len(have[0]) > dst_mesh.size else "one"] += 1
    assert min(seen.values()) > 0, seen  # each outcome met


@pytest.mark.parametrize("cols", [0, 1, 2, 6])
def test_distinct_rows_in_numpys_order_with_first_indices_and_inverse(cols):
    rng = np.random.default_rng(cols)
    for n in (1, 2, 7, 64, 300):
        rows = rng.integers(-3, 4, size=(n, cols)).astype(np.int64)
        want = np.unique(rows, axis=0, return_index=True, return_inverse=True)
        got = _unique_rows(rows)
        for w, g in zip(want, got):
            np.testing.assert_array_equal(np.asarray(w).reshape(np.shape(g)), g)


# -- plans of the cases the search and the byte count went through, pinned (the planner before this change) ---------

_PINNED = {
    # a target's column block in no source block: the search refuses without a targets x blocks table, the source
    # gathers
    "refused_32x32_to_1024": (([4096, 4096], _mesh((32, 32)), [Shard(0), Shard(1)], _mesh((1024,)), [Shard(1)]),
                              ["all_gather", "all_gather", "send_recv"], [2031616, 65011712, 0], 1024,
                              "bfa9558a195b3867"),
    # each target's block from the 8 source blocks it spans (pieces)
    "pieces_8x8_to_32": (([1024, 1024], _mesh((8, 8)), [Shard(0), Shard(1)], _mesh((32,)), [Shard(0)]),
                         ["send_recv"], [131072], 256, "d9c1b3302bb7cc6c"),
    "gathered_8x8_to_64": (([4096, 256], _mesh((8, 8)), [Shard(0), Shard(1)], _mesh((64,)), [Replicate()]),
                           ["all_gather", "all_gather", "send_recv"], [458752, 3670016, 0], 64, "964596afefc357a9"),
    # a Partial(max) travels unreduced onto a 2-D mesh, an uneven dim of 31 on 4
    "kept_partial_uneven": (([1, 31], _mesh((256,)), [Partial(MAX)], _mesh((4, 256)), [Shard(1), Partial(MAX)]),
                            ["send_recv"], [32], 1024, "f7fc9322079cd287"),
    "same_shape_other_ids": (([4096, 4096], _mesh((32, 32)), [Shard(0), Shard(1)], _mesh((32, 32), 1024),
                              [Shard(1), Shard(0)]), ["all_gather", "all_to_all", "slice", "send_recv"],
                             [2031616, 2031616, 0, 65536], 1024, "d5d5d1eb8a68db5a"),
}


@pytest.mark.parametrize("name", list(_PINNED))
def test_cross_mesh_plans_keep_their_steps_pairs_and_bytes(name):
    args, ops, step_bytes, n_pairs, digest = _PINNED[name]
    plan = plan_reshard(*args)
    assert plan.ops == ops
    assert [s.bytes for s in plan.steps] == step_bytes
    sr = next(s for s in plan.steps if s.op == "send_recv")
    assert len(sr.groups) == n_pairs
    assert hashlib.sha256(repr((sr.groups, sr.blocks)).encode()).hexdigest()[:16] == digest


def test_the_refused_one_source_search_builds_no_targets_by_blocks_table():
    """32x32 -> 1,024 ranks, Shard(0), Shard(1) -> Shard(1): no source block holds a target's column, seen per dim;
    the search once held a 1,024 x 1,024 table (over 4 MiB at its peak)."""
    peak = _peak(_PINNED["refused_32x32_to_1024"][0])
    assert peak < 2.5 * 2**20, f"{peak / 2**20:.1f} MiB"


def _peak(args) -> int:
    plan_reshard(*args)  # imports, the mesh's index
    tracemalloc.start()
    try:
        plan_reshard(*args)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_one_source_search_at_4096_ranks_builds_no_targets_by_chunks_table():
    """4,096 ranks, Shard(0) -> a 64 x 64 mesh's Shard(0), Shard(1): each target's rows in no source row, found by a
    lookup per dim (a table of targets by a dim's 4,096 chunks would hold 16 MiB)."""
    args = ([4096, 4096], _mesh((4096,)), [Shard(0)], _mesh((64, 64)), [Shard(0), Shard(1)])
    assert plan_reshard(*args).ops == ["all_gather", "send_recv"]
    assert _peak(args) < 8 * 2**20


@pytest.mark.parametrize("seed", [0, 1])
def test_first_holders_by_lookup_and_by_table_agree(seed):
    """The least first index of a block holding each target: per-dim lookup (chunks tile each dim) and the table."""
    rng = random.Random(seed)
    for _ in range(80):
        ndim = rng.choice([0, 1, 2, 3])
        shape = tuple(rng.choice([0, 1, 2, 5, 9, 16]) for _ in range(ndim))
        src_mesh, dst_mesh = _mesh(rng.choice(_MESHES)), _mesh(rng.choice(_MESHES))
        have = Layout(shape, src_mesh, normalize_placements(shape, src_mesh, _placements(
            rng, src_mesh.ndim, ndim, 0))).bounds()
        want = Layout(shape, dst_mesh, normalize_placements(shape, dst_mesh, _placements(
            rng, dst_mesh.ndim, ndim, 0))).bounds()
        blocks, first, _ = _unique_rows(have.reshape(len(have), -1))
        blocks = blocks.reshape(len(blocks), -1, 2)
        full = want[:, :, 1] > want[:, :, 0]
        np.testing.assert_array_equal(_first_holders(blocks, first, want, full),
                                      _first_holders_by_table(blocks, first, want, full))


# -- the transfer's bytes per rank and the values, against the blocks ------------------------------------------------


def _brute_received(step, rank, itemsize):
    """Elements ``rank`` receives in a send_recv step, from each pair's slice (or the whole target block)."""
    n = 0
    for j, (s, t) in enumerate(step.groups):
        if t != rank or s == t:
            continue
        if step.blocks is None:
            blk = local_block(step.shape, step.target_mesh, step.after, step.target_mesh.coordinate(t))
        else:
            blk = step.blocks[j]
        n += int(np.prod([b - a for a, b in blk], dtype=np.int64))
    return n * itemsize


_SMALL = [
    ([16, 12], _mesh((4, 4)), [Shard(0), Shard(1)], _mesh((8,)), [Shard(0)]),  # pieces
    ([13, 7], _mesh((2, 4)), [Shard(1), Shard(0)], _mesh((4,), 3), [Replicate()]),
    ([5, 9], _mesh((8,)), [Partial(SUM)], _mesh((2, 4), 8), [Shard(1), Partial(SUM)]),
    ([7, 6], _mesh((2, 2, 2)), [Partial(MAX), Shard(0), Shard(1)], _mesh((4,)), [Shard(1)]),
    ([9, 4], _mesh((4, 4)), [Shard(0), Partial(SUM)], _mesh((4, 4), 16), [Replicate(), Shard(0)]),  # same shape
    ([3, 17], _mesh((2, 4)), [Shard(1), Shard(1)], _mesh((2, 4))[1], [Shard(1)]),  # onto a sub-mesh
    ([3, 17], _mesh((4,)), [Shard(1)], _mesh((2, 4)), [Shard(1), Shard(1)]),  # from one
    ([0, 5], _mesh((4,)), [Shard(0)], _mesh((2, 2), 4), [Shard(0), Shard(1)]),  # empty
]


@pytest.mark.parametrize("case", range(len(_SMALL)))
def test_cross_mesh_transfer_bytes_per_rank_and_values(case):
    shape, src_mesh, src, dst_mesh, dst = _SMALL[case]
    plan = plan_reshard(shape, src_mesh, src, dst_mesh, dst, itemsize=4)
    for step in plan.steps:
        if step.op == "send_recv":
            got = {r: step_received(step, r, 4) for r in step.target_mesh.process_ids}
            assert got == {r: _brute_received(step, r, 4) for r in step.target_mesh.process_ids}
            assert step.bytes == max(got.values(), default=0)
    rng = np.random.default_rng(case)
    locals_, dense = random_locals(rng, shape, src_mesh, plan.src_placements)
    out = locals_
    for step in plan.steps:
        out = apply_step(step, out)
    assert_target_holds({r: out[r] for r in dst_mesh.process_ids}, dense, shape, dst_mesh, plan.dst_placements,
                        plan.describe())
    if not any(isinstance(p, Partial) for p in plan.src_placements):
        whole = simulate(plan, dense)
        assert_target_holds({r: whole[r] for r in dst_mesh.process_ids}, dense, shape, dst_mesh, plan.dst_placements)
