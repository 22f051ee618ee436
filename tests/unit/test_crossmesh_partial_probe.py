"""Reshards between meshes: Partial axes that travel unreduced (Paddle's sub-mesh functions) and same-shape plans
that move no more bytes than Paddle's (1-D: send, then gather on the target; N-D: reshard on the source, send)."""

import random

import numpy as np
import pytest

from meshviz.core import Partial, ProcessMesh, ReduceType, Replicate, Shard
from meshviz.core.layout import local_block
from meshviz.core.planner import apply_step, plan_reshard

from ..partials import AVG, MAX, SUM, assert_target_holds, random_locals

pytestmark = pytest.mark.torch_free

GLOBAL = ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
ROW = ProcessMesh([0, 1], ["y"])  # GLOBAL at x = 0
COL = ProcessMesh([0, 2], ["x"])  # GLOBAL at y = 0
LINE = ProcessMesh([0, 1, 2, 3], ["x"])
A, B = ProcessMesh([0, 1], ["a"]), ProcessMesh([2, 3], ["a"])
G2 = ProcessMesh([[4, 5], [6, 7]], ["x", "y"])
R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()


def _run(plan, locals_):
    for step in plan.steps:
        locals_ = apply_step(step, locals_)
    return locals_


def _check(shape, sm, sp, dm, dp, seed, itemsize=4):
    """The plan, its result on every target rank against the dense tensor (the reduction over the target's Partial
    axes where it has them, each rank's block where it has none), and the source's local values."""
    rng = np.random.default_rng(seed)
    plan = plan_reshard(shape, sm, sp, dm, dp, itemsize=itemsize)
    locals_, dense = random_locals(rng, shape, sm, plan.src_placements)
    out = _run(plan, dict(locals_))
    got = {r: out[r] for r in dm.process_ids}
    assert_target_holds(got, dense, shape, dm, plan.dst_placements, str(plan))
    return plan, locals_, got


# -- Partial kept across meshes of other shapes ----------------------------------------------------------------


@pytest.mark.parametrize("sm, sp, dm, dp", [(GLOBAL, [R, P], ROW, [P]), (GLOBAL, [P, R], COL, [P]),
                                            (GLOBAL, [R, Partial(ReduceType.kRedMax)], ROW,
                                             [Partial(ReduceType.kRedMax)]),
                                            (GLOBAL, [R, Partial(ReduceType.kRedAvg)], ROW,
                                             [Partial(ReduceType.kRedAvg)])])
def test_global_to_sub_mesh_keeps_the_partial_and_moves_nothing(sm, sp, dm, dp):
    """Paddle's GlobalToSubMeshReshardFunction: each target rank keeps its own summand, no all-reduce."""
    plan, src_locals, got = _check((5, 6), sm, sp, dm, dp, seed=1)
    assert plan.ops == ["send_recv"] and plan.total_bytes == 0, plan
    assert all(s == t for s, t in plan.steps[0].groups), plan
    for r in dm.process_ids:
        np.testing.assert_array_equal(got[r], src_locals[r])  # its own summand, not the sum


@pytest.mark.parametrize("rt", [SUM, AVG, MAX])
def test_sub_to_global_mesh_sends_each_summand_as_paddle_pairs_them(rt):
    """Paddle's SubMeshToGlobalReshardFunction: the sub mesh's i-th rank sends its partial value to the i-th rank of
    each other slice; nothing is reduced, and each rank receives one block (not the all-reduce's 2x)."""
    plan, src_locals, got = _check((4, 6), ROW, [Partial(rt)], GLOBAL, [R, Partial(rt)], seed=2)
    assert plan.ops == ["send_recv"], plan
    assert set(plan.steps[0].groups) == {(0, 0), (1, 1), (0, 2), (1, 3)}, plan
    assert plan.total_bytes == 4 * 6 * 4, plan  # one whole summand, float32
    for c in np.ndindex(*GLOBAL.shape):
        np.testing.assert_array_equal(got[GLOBAL.rank_at(c)], src_locals[ROW.rank_at((c[1],))])


def test_a_kept_partial_with_a_shard_gathers_the_shard_only():
    """[S(0), P] on 2x2 to [P] on its first row: the other rows come from the second row (48 B; gathered along x
    first, 72 B); the Partial along y stays."""
    plan, _, _ = _check((5, 6), GLOBAL, [S0, P], ROW, [P], seed=3)
    assert plan.ops == ["send_recv"] and plan.total_bytes == 48, plan
    sub, _, _ = _check((4, 6), ROW, [P], GLOBAL, [S1, P], seed=4)  # a slice of each summand
    assert sub.ops == ["send_recv"] and "all_reduce" not in sub.ops, sub
    assert sub.total_bytes == 4 * 3 * 4, sub  # half of one summand


def test_a_partial_that_cannot_travel_is_reduced_and_refilled():
    """Different sizes (4 summands, 2 target ranks) or reductions that do not commute: reduce first, fill after."""
    sizes, _, _ = _check((4, 6), LINE, [P], GLOBAL, [R, P], seed=5)
    assert sizes.ops == ["all_reduce", "send_recv", "zero_fill"], sizes
    mixed, _, _ = _check((4, 6), GLOBAL, [P, Partial(ReduceType.kRedMax)], COL, [P], seed=6)
    assert "all_reduce" in mixed.ops and mixed.ops[-1] == "zero_fill", mixed
    one, _, _ = _check((4, 6), GLOBAL, [P, P], ROW, [P], seed=7)  # one axis travels, the other is reduced
    assert one.ops.count("all_reduce") == 1 and "zero_fill" not in one.ops, one


def _random_mesh(rng, ranks):
    n = rng.choice([1, 2, 3, 4])
    ids = rng.sample(ranks, n)
    shape = rng.choice([s for s in ([n], [1, n], [n, 1], [2, n // 2] if n % 2 == 0 else [n]) if np.prod(s) == n])
    return ProcessMesh(np.array(ids).reshape(shape), [f"a{i}" for i in range(len(shape))])


def _placements(rng, mesh, ndim):
    return [rng.choice([R, P, P, Partial(ReduceType.kRedAvg), Partial(ReduceType.kRedMax),
                        *[Shard(d) for d in range(ndim)]]) for _ in mesh.shape]


def test_seeded_partials_between_meshes_agree_with_the_dense_tensor():
    """Every target rank against the dense tensor, and a Partial kept wherever the target has one of the source's
    size and reduction (then the plan reduces no more axes than the source has left over)."""
    rng = random.Random(31)
    kept = 0
    for seen in range(300):
        sm, dm = _random_mesh(rng, list(range(6))), _random_mesh(rng, list(range(6)))
        shape = tuple(rng.choice([1, 2, 3, 5]) for _ in range(rng.choice([1, 2])))
        sp, dp = _placements(rng, sm, len(shape)), _placements(rng, dm, len(shape))
        same = [(i, j) for i in range(sm.ndim) for j in range(dm.ndim) if sm.shape[i] == dm.shape[j] > 1]
        if same and seen % 2:  # half the cases: one sum along axes of one size on both sides, no other Partial
            i, j = rng.choice(same)
            sp = [R if isinstance(p, Partial) else p for p in sp]
            dp = [R if isinstance(p, Partial) else p for p in dp]
            sp[i], dp[j] = P, P
        plan, _, _ = _check(shape, sm, sp, dm, dp, seed=seen)
        if same and seen % 2 and sm.shape != dm.shape:
            kept += 1
            assert "all_reduce" not in plan.ops and "zero_fill" not in plan.ops, plan
    assert kept > 10, kept


# -- meshes of one shape ---------------------------------------------------------------------------------------


def _send_first_bytes(shape, sm, sp, dm, dp, itemsize=4):
    """Paddle's 1-D order (``SToRReshardFunctionCrossMesh``): send each rank its block, then reshard on the target."""
    blocks = [np.prod([b - a for a, b in local_block(shape, sm, sp, c)]) for c in np.ndindex(*sm.shape)]
    return int(max(blocks)) * itemsize + plan_reshard(shape, dm, sp, dm, dp, itemsize=itemsize).total_bytes


def _source_first_bytes(shape, sm, sp, dm, dp, itemsize=4):
    """Paddle's N-D order (CrossNdMeshReshardFunction): reshard on the source, then send each rank its block."""
    on_source = plan_reshard(shape, sm, sp, sm, dp, itemsize=itemsize)
    blocks = [np.prod([b - a for a, b in local_block(shape, dm, on_source.dst_placements, c)])
              for c in np.ndindex(*dm.shape)]
    return on_source.total_bytes + int(max(blocks)) * itemsize


@pytest.mark.parametrize("sp, dp, ops", [
    ([S0], [R], ["send_recv", "all_gather"]),  # SToRReshardFunctionCrossMesh: send, then gather on the target
    ([S0], [P], ["send_recv", "all_gather", "zero_fill"]),  # SToPReshardFunctionCrossMesh
    ([R], [S0], ["slice", "send_recv"]),  # RToSReshardFunctionCrossMesh: slice on the source, then send
    ([P], [S0], ["reduce_scatter", "send_recv"]),  # PToSReshardFunctionCrossMesh
    ([P], [P], ["send_recv"]),  # SameStatusReshardFunction
    # Paddle sends the partial whole, then all-reduces; a reduce-scatter, the shards sent, a gather moves less
    ([P], [R], ["reduce_scatter", "send_recv", "all_gather"]),
    ([S0], [S1], ["all_to_all", "send_recv"]),
    ([R], [P], ["zero_fill", "send_recv"]),
])
def test_one_d_meshes_of_one_shape_move_no_more_bytes_than_paddles_functions(sp, dp, ops):
    plan, _, _ = _check((8, 6), A, sp, B, dp, seed=8)
    assert plan.ops == ops, plan
    paddle = min(_send_first_bytes((8, 6), A, sp, B, dp), _source_first_bytes((8, 6), A, sp, B, dp))
    assert plan.total_bytes == (paddle * 3 // 4 if (sp, dp) == ([P], [R]) else paddle), plan


def test_a_shard_to_replicate_between_1d_meshes_sends_the_shards_not_the_whole():
    """Before: all-gather on the source (24 elements a rank) then send the whole (48): 288 B. Paddle: send the
    shard (24), gather on the target (24): 192 B."""
    plan, _, _ = _check((8, 6), A, [S0], B, [R], seed=9)
    assert [s.bytes for s in plan.steps] == [24 * 4, 24 * 4], plan
    assert plan.steps[0].groups == ((0, 2), (1, 3)) and plan.steps[1].mesh == B, plan


@pytest.mark.parametrize("sp, dp, ops", [
    ([S0, R], [R, S1], ["slice", "send_recv", "all_gather"]),  # a quarter sent, a quarter gathered
    ([S0, S1], [R, R], ["send_recv", "all_gather", "all_gather"]),
    ([P, R], [R, R], ["reduce_scatter", "send_recv", "all_gather"]),  # a half of the tensor sent, not all
    ([S0, P], [S0, P], ["send_recv"]),
])
def test_nd_meshes_of_one_shape_move_no_more_than_paddle(sp, dp, ops):
    """[S(0), R] -> [R, S(1)] on [[0,1],[2,3]] -> [[4,5],[6,7]]: Paddle gathers on the source (32 elements), slices,
    sends a half (32): 256 B a rank; slicing to [S(0), S(1)] first sends a quarter and gathers a quarter: 128 B."""
    plan, _, _ = _check((8, 8), GLOBAL, sp, G2, dp, seed=10)
    assert plan.ops == ops, plan
    assert plan.total_bytes <= _source_first_bytes((8, 8), GLOBAL, sp, G2, dp), plan
    if sp == [S0, R]:
        assert plan.total_bytes == 128 and _source_first_bytes((8, 8), GLOBAL, sp, G2, dp) == 256, plan


def test_seeded_meshes_of_one_shape_agree_and_move_no_more_than_paddle():
    rng = random.Random(47)
    for seen in range(200):
        sm = _random_mesh(rng, list(range(8)))
        ids = rng.sample(range(8), sm.size)
        dm = ProcessMesh(np.array(ids).reshape(sm.shape), list(sm.dim_names))
        shape = tuple(rng.choice([1, 2, 3, 4, 5, 8]) for _ in range(rng.choice([1, 2, 3])))
        sp, dp = _placements(rng, sm, len(shape)), _placements(rng, dm, len(shape))
        plan, _, _ = _check(shape, sm, sp, dm, dp, seed=seen)
        if sm != dm:
            assert plan.total_bytes <= _source_first_bytes(shape, sm, sp, dm, dp), plan
