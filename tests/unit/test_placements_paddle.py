"""Paddle 3.3.1's placement spellings without a process group: short lists, Shard's co_shard_order, its layouts and
reshard plans checked on simulated ranks against the dense tensor."""

import itertools
import pickle
import random

import numpy as np
import pytest

from meshviz.core.layout import layout, normalize_placements, pad_placements
from meshviz.core.mesh import ProcessMesh
from meshviz.core.placements import Partial, Replicate, Shard, parse_placement
from meshviz.core.planner import assemble, plan_reshard, simulate

M2 = ProcessMesh([[0, 1], [2, 3]], ["x", "y"])


def test_short_lists_pad_with_replicate_and_long_ones_drop_trailing_replicates():
    assert normalize_placements([4, 4], M2, [Shard(0)]) == (Shard(0), Replicate())
    assert normalize_placements([4, 4], M2, []) == (Replicate(), Replicate())
    assert pad_placements(["S(1)"], M2) == ["S(1)", Replicate()]
    # Paddle 3.3.1 keeps [Shard(0)] of [Shard(0), Replicate(), Replicate()] on a 1-D mesh (silently)
    with pytest.warns(UserWarning, match="2 trailing Replicates past its axes are dropped"):
        assert normalize_placements([4, 4], ProcessMesh([0, 1]), [Shard(0), Replicate(), "R"]) == (Shard(0),)
    with pytest.warns(UserWarning, match="1 trailing Replicate past"):
        assert plan_reshard([4, 4], M2, [Shard(0)], M2, [Replicate()] * 3).steps[0].op == "all_gather"
    # ... and raises for anything else past the mesh's axes
    with pytest.raises(ValueError, match="3 placements .* at most one per mesh axis"):
        normalize_placements([4, 4], M2, [Shard(0), Replicate(), Shard(1)])
    with pytest.raises(ValueError, match="only trailing Replicates may be extra"):
        plan_reshard([4, 4], M2, [Shard(0)], M2, [Replicate(), Replicate(), Partial()])


def test_shard_co_shard_order_is_a_value_like_paddles():
    # Paddle 3.3.1: Shard(0, shard_order=0) == Shard(0) (same hash); shard_order=1 differs; get_co_shard_order()
    assert Shard(0, co_shard_order=0) == Shard(0) and hash(Shard(0, shard_order=0)) == hash(Shard(0))
    assert Shard(0, co_shard_order=1) != Shard(0) and Shard(0, shard_order=1) == Shard(0, co_shard_order=1)
    assert Shard(0, 1).get_co_shard_order() == 1 and Shard(2).get_co_shard_order() == 0
    assert Shard(1).is_shard(1) and Shard(1, 2).get_dim() == 1
    assert repr(Shard(0)) == "S(0)" and repr(Shard(0, co_shard_order=1)) == "S(0,o=1)"
    for text in ("S(0,o=1)", "Shard(dim=0, shard_order=1)", "Shard(0, co_shard_order=1)"):
        assert parse_placement(text) == Shard(0, 1)
    assert parse_placement(repr(Shard(3, 2))) == Shard(3, 2)
    assert pickle.loads(pickle.dumps(Shard(1, 2))) == Shard(1, 2)
    with pytest.raises(AttributeError):
        Shard(0).co_shard_order = 1  # frozen
    for bad in (dict(co_shard_order=-1), dict(co_shard_order=1.5), dict(co_shard_order=1, shard_order=2)):
        with pytest.raises(ValueError):
            Shard(0, **bad)


def test_co_shard_order_nests_the_lowest_order_outermost():
    a = np.arange(8).reshape(4, 2)
    # Paddle's test_co_shard case 0 and 1 on [[0, 1], [2, 3]]: rank i holds row i; then row i%2*2 + i//2
    default = layout(a.shape, M2, [Shard(0, shard_order=0), Shard(0, shard_order=1)])
    assert default.placements == (Shard(0), Shard(0))
    assert [default.block_of(r)[0] for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    swapped = layout(a.shape, M2, [Shard(0, shard_order=1), Shard(0, shard_order=0)])
    assert [swapped.block_of(r)[0][0] for r in range(4)] == [r % 2 * 2 + r // 2 for r in range(4)]
    # one nesting, one spelling: orders are positions, all 0 for mesh order; a lone shard's order is dropped
    assert normalize_placements([4], M2, [Shard(0, 5), Shard(0, 2)]) == (Shard(0, 1), Shard(0, 0))
    assert normalize_placements([4, 2], M2, [Shard(0, 3), Shard(1, 1)]) == (Shard(0), Shard(1))
    m3 = ProcessMesh(np.arange(8).reshape(2, 2, 2).tolist(), ["a", "b", "c"])
    lay = layout([8], m3, [Shard(0, 2), Shard(0, 0), Shard(0, 1)])  # axis 1 outer, then 2, then 0
    for c in np.ndindex(2, 2, 2):
        i = c[1] * 4 + c[2] * 2 + c[0]
        assert lay.block(c) == ((i, i + 1),)


def _check(mesh, shape, src, dst):
    v = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) + 1
    plan = plan_reshard(shape, mesh, src, mesh, dst)
    out = simulate(plan, v)
    np.testing.assert_array_equal(assemble(out, shape, mesh, dst), v)
    lay = layout(shape, mesh, dst)
    if not lay.is_partial():  # each rank holds exactly its block of the dense tensor
        for c in np.ndindex(*mesh.shape):
            blk = lay.block(c)
            np.testing.assert_array_equal(out[mesh.rank_at(c)], v[tuple(slice(a, b) for a, b in blk)])
    return plan


def _choices(tensor_ndim, mesh_ndim):
    return [Replicate(), Partial(), Partial("max")] + [Shard(d, o) for d in range(tensor_ndim)
                                                       for o in range(mesh_ndim)]


def test_every_2d_reshard_with_co_shard_orders_gives_the_dense_tensor():
    ch = _choices(2, 2)
    n = 0
    for shape in [(4, 6), (5, 3)]:
        for src, dst in itertools.product(itertools.product(ch, repeat=2), repeat=2):
            _check(M2, shape, list(src), list(dst))
            n += 1
    assert n == 2 * len(ch) ** 4


def test_random_3d_reshards_with_co_shard_orders_give_the_dense_tensor():
    m3 = ProcessMesh(np.arange(12).reshape(2, 3, 2).tolist(), ["a", "b", "c"])
    rng = random.Random(0)
    ch = _choices(2, 3)
    for _ in range(600):
        shape = (rng.randint(1, 13), rng.randint(1, 7))
        _check(m3, shape, [rng.choice(ch) for _ in range(3)], [rng.choice(ch) for _ in range(3)])


def test_reshard_between_co_shard_orders_is_one_plan_paddle_agrees_with():
    # Paddle's test_co_shard case 1 continued: [S(0,o=1), S(0,o=0)] -> [S(0), R] gives rank i rows i//2*2 .. +2
    plan = _check(M2, (4, 2), [Shard(0, 1), Shard(0, 0)], [Shard(0), Replicate()])
    assert plan.dst_placements == (Shard(0), Replicate())
    swap = _check(M2, (8, 2), [Shard(0), Shard(0)], [Shard(0, 1), Shard(0, 0)])
    assert swap.dst_placements == (Shard(0, 1), Shard(0))
    assert "S(0,o=1)" in swap.describe()


def test_torch_conversion_refuses_a_nesting_torch_cannot_hold():
    from meshviz.runtime.dtensor import to_torch_placements

    assert len(to_torch_placements((Shard(0), Shard(0, 1)))) == 2  # mesh order: plain torch shards
    with pytest.raises(ValueError, match="co_shard_order"):
        to_torch_placements((Shard(0, 1), Shard(0, 0)))


def test_normalized_placements_are_remembered_per_tensor_rank_and_errors_and_warnings_repeat():
    for _ in range(2):  # the second call answers from what the first one made
        assert normalize_placements([4, 4], M2, [Shard(-1)]) == (Shard(1), Replicate())
        assert normalize_placements([4, 4, 4], M2, [Shard(-1)]) == (Shard(2), Replicate())
        assert normalize_placements([4, 4], M2, [Shard(0, 1), Shard(0, 0)]) == (Shard(0, 1), Shard(0, 0))
        assert normalize_placements([4, 4], M2, [Shard(0, 0), Shard(0, 1)]) == (Shard(0), Shard(0))
        assert normalize_placements([4, 4, 4], M2, ["S(2)", "R"]) == (Shard(2), Replicate())
        with pytest.raises(ValueError, match=r"Shard\(2\) is out of range for a 2-D tensor"):
            normalize_placements([4, 4], M2, ["S(2)", "R"])
        with pytest.warns(UserWarning, match="1 trailing Replicate past"):
            assert normalize_placements([4, 4], ProcessMesh([0, 1]), [Shard(0), Replicate()]) == (Shard(0),)
        with pytest.raises(ValueError, match="is not a placement"):
            normalize_placements([4, 4], M2, [[0], Replicate()])
        with pytest.raises(ValueError, match="placements must be a list with at most one"):
            normalize_placements([4, 4], M2, None)
        with pytest.raises(ValueError, match="placements must be a list, got 5"):
            normalize_placements([4, 4], M2, 5)
