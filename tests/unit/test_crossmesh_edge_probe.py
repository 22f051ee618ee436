"""Reshards between meshes of different shapes: each target block from a source block that holds it, as Paddle's."""

import random

import numpy as np
import pytest

from meshviz.core import Partial, ProcessMesh, ReduceType, Replicate, Shard
from meshviz.core.planner import apply_step, plan_reshard

from ..partials import assert_target_holds, random_locals

pytestmark = pytest.mark.torch_free

GLOBAL = ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
ROW = ProcessMesh([0, 1], ["y"])  # GLOBAL at x = 0
COL = ProcessMesh([0, 2], ["x"])  # GLOBAL at y = 0
LINE = ProcessMesh([0, 1, 2, 3], ["x"])
ONE = ProcessMesh([3], ["z"])
OTHER = ProcessMesh([2, 0, 3], ["w"])
R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()

CASES = [  # (source mesh, placements, target mesh, placements)
    (GLOBAL, [R, S0], ROW, [S0]),  # global -> sub: the target ranks hold their blocks already
    (GLOBAL, [S1, R], COL, [S1]),
    (GLOBAL, [R, R], COL, [S0]),  # a slice of what the rank holds
    (GLOBAL, [S0, P], COL, [S0]),  # the Partial reduced first, then nothing moves
    (ROW, [S0], GLOBAL, [R, S0]),  # sub -> global: the sub mesh sends its blocks to the other row
    (COL, [R], GLOBAL, [R, S1]),
    (ROW, [S0], GLOBAL, [S0, S0]),  # slices of the source's block, away from its start
    (ROW, [S1], GLOBAL, [S0, R]),  # no single block holds a target block: replicate first
    (LINE, [S0], ONE, [R]),
    (ONE, [R], LINE, [S1]),
    (ONE, [R], GLOBAL, [S0, Partial(ReduceType.kRedMax)]),
    (GLOBAL, [S0, S1], OTHER, [S1]),
    (ROW, [P], GLOBAL, [S1, S0]),
    (OTHER, [S0], GLOBAL, [Shard(0, 1), Shard(0, 0)]),  # a co-shard nesting on the target
]


def _run(plan, locals_):
    for step in plan.steps:
        locals_ = apply_step(step, locals_)
    return locals_


def _check(shape, sm, sp, dm, dp, seed):
    rng = np.random.default_rng(seed)
    plan = plan_reshard(shape, sm, sp, dm, dp)
    locals_, dense = random_locals(rng, shape, sm, plan.src_placements)
    out = _run(plan, locals_)
    assert set(out) >= set(dm.process_ids), (plan, sorted(out))
    got = {r: out[r] for r in dm.process_ids}
    assert_target_holds(got, dense, shape, dm, plan.dst_placements, str(plan))
    return plan


@pytest.mark.parametrize("shape", [(5, 6), (4, 4), (3, 1), (0, 3), (2, 0)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].shape}{c[1]}->{c[2].shape}{c[3]}")
def test_every_target_rank_gets_its_block_of_the_dense_tensor(case, shape):
    _check(shape, *case, seed=len(shape) * 7 + shape[0])


@pytest.mark.parametrize("sm, sp, dm, dp", [(GLOBAL, [R, S0], ROW, [S0]), (GLOBAL, [S1, R], COL, [S1]),
                                            (GLOBAL, [R, R], COL, [S0]), (GLOBAL, [R, R], ONE, [R]),
                                            (LINE, [R], ProcessMesh([[0, 1]], ["a", "b"]), [R, S0])])
def test_a_global_to_sub_mesh_reshard_moves_nothing(sm, sp, dm, dp):
    """Paddle's GlobalToSubMeshReshardFunction: the target ranks keep what they hold, no communication."""
    plan = _check((5, 6), sm, sp, dm, dp, seed=3)
    assert plan.ops == ["send_recv"], plan
    assert plan.total_bytes == 0 and all(s == t for s, t in plan.steps[-1].groups), plan


def test_a_sub_to_global_reshard_sends_the_sub_meshs_blocks_as_paddle_pairs_them():
    """Paddle's SubMeshToGlobalReshardFunction: the sub mesh's i-th rank sends to the i-th rank of each other slice."""
    row = _check((4, 6), ROW, [S0], GLOBAL, [R, S0], seed=4)
    assert row.ops == ["send_recv"] and set(row.steps[0].groups) == {(0, 0), (1, 1), (0, 2), (1, 3)}
    assert row.total_bytes == 2 * 6 * 4  # one half of the tensor, float32
    col = _check((4, 6), COL, [R], GLOBAL, [R, R], seed=5)
    assert col.ops == ["send_recv"] and set(col.steps[0].groups) == {(0, 0), (0, 1), (2, 2), (2, 3)}
    nested = _check((5, 6), ROW, [S0], GLOBAL, [S0, S0], seed=8)  # rows 0-2 on 0, 3-4 on 1; 2 ways more inside
    assert nested.ops == ["send_recv"] and nested.steps[0].groups == ((0, 0), (0, 1), (1, 2), (1, 3))
    assert nested.steps[0].blocks == (((0, 2), (0, 6)), ((2, 3), (0, 6)), ((0, 1), (0, 6)), ((1, 2), (0, 6)))


def test_the_source_gathers_only_where_no_single_block_holds_a_target_block():
    plan = _check((5, 6), ROW, [S1], GLOBAL, [S0, R], seed=6)  # each target gets the pieces it needs: 48 B
    assert plan.ops == ["send_recv"] and plan.total_bytes == 48  # (gathered on the source, then sent: 108 B)
    held = _check((5, 6), GLOBAL, [S0, S1], ProcessMesh([[0, 1, 2, 3]], ["a", "b"]), [R, Shard(1)], seed=7)
    assert held.ops == ["send_recv"] and held.total_bytes == 40  # its columns from two sources' blocks (was 108 B)


@pytest.mark.parametrize("sm, sp, dm, dp, reduce", [(GLOBAL, [P, R], OTHER, [R], None),
                                                    (GLOBAL, [R, R], OTHER, [P], np.sum),
                                                    (ROW, [P], GLOBAL, [R, Partial(ReduceType.kRedMax)], np.max)])
def test_a_scalar_goes_whole(sm, sp, dm, dp, reduce):
    plan = plan_reshard((), sm, sp, dm, dp)
    # Partial sum along the first axis: summands 1 and 2 there (replicas alike), else 3 everywhere; the tensor is 3
    locals_ = {r: np.array(1.0 + sm.coordinate(r)[0] if sp[0] == P else 3.0) for r in sm.process_ids}
    dense = 3.0
    got = [_run(plan, locals_)[r] for r in dm.process_ids]
    assert all(isinstance(g, np.ndarray) and g.shape == () for g in got), plan  # not numpy scalars
    if reduce is None:
        assert got == [dense] * len(got), plan
    else:
        assert reduce(got) == dense, plan


def test_65536_ranks_pair_as_paddle_without_a_search_per_pair():
    big = ProcessMesh(np.arange(65536).reshape(256, 256), ["x", "y"])
    row = ProcessMesh(np.arange(256), ["y"])
    down = plan_reshard((512, 8), big, [R, S0], row, [S0])
    assert down.ops == ["send_recv"] and down.total_bytes == 0
    up = plan_reshard((512, 8), row, [S0], big, [R, S0])
    assert up.ops == ["send_recv"] and up.total_bytes == 2 * 8 * 4
    assert up.steps[0].groups == tuple((r % 256, r) for r in range(65536))


def _random_mesh(rng, ranks):
    n = rng.choice([1, 2, 3, 4])
    ids = rng.sample(ranks, n)
    shape = rng.choice([s for s in ([n], [1, n], [n, 1], [2, n // 2] if n % 2 == 0 else [n]) if np.prod(s) == n])
    return ProcessMesh(np.array(ids).reshape(shape), [f"a{i}" for i in range(len(shape))])


def _random_placements(rng, mesh, ndim):
    return [rng.choice([R, P, Partial(ReduceType.kRedMax), *[Shard(d) for d in range(ndim)]]) for _ in mesh.shape]


def test_seeded_meshes_of_other_shapes_agree_with_the_dense_tensor():
    rng = random.Random(20260)
    seen = 0
    while seen < 150:
        sm, dm = _random_mesh(rng, list(range(6))), _random_mesh(rng, list(range(6)))
        if sm.shape == dm.shape:
            continue
        shape = tuple(rng.choice([1, 2, 3, 5]) for _ in range(rng.choice([1, 2])))
        _check(shape, sm, _random_placements(rng, sm, len(shape)), dm, _random_placements(rng, dm, len(shape)),
               seed=seen)
        seen += 1
