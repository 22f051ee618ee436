"""Reshards between meshes: the pieces a target needs sent and gathered there, where that moves fewer bytes."""

import random

import numpy as np
import pytest

from meshviz.core import Partial, ProcessMesh, ReduceType, Replicate, Shard
from meshviz.core import planner as planner_mod
from meshviz.core.planner import plan_reshard, simulate

from ..partials import assert_target_holds, dense_of, random_locals

pytestmark = pytest.mark.torch_free

GRID = ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
LINE = ProcessMesh([0, 1, 2, 3], ["x"])
PAIR = ProcessMesh([4, 5], ["z"])  # ranks of their own
GRID2 = ProcessMesh([[4, 5], [6, 7]], ["a", "b"])
A, B = ProcessMesh([0, 1], ["x"]), ProcessMesh([2, 3], ["x"])
R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()


def _check(shape, sm, sp, dm, dp, seed):
    """The plan, after checking every target rank's block (or the reduction of the summands) against the dense."""
    plan = plan_reshard(shape, sm, sp, dm, dp)
    locals_, dense = random_locals(np.random.default_rng(seed), shape, sm, plan.src_placements)
    out = dict(locals_)
    for step in plan.steps:
        out = planner_mod.apply_step(step, out)
    got = {r: out[r] for r in dm.process_ids}
    assert_target_holds(got, dense, shape, dm, plan.dst_placements, str(plan))
    return plan


def _plain(monkeypatch, *args):
    """The plan without the choices: the source's layout sent as it is, else wholly gathered (the former plan)."""
    with monkeypatch.context() as m:
        m.setattr(planner_mod, "cross_choices", lambda shape, sm, src, pre, dm, dst, mid: [
            (tuple(pre), tuple(mid), False),
            (tuple(p if isinstance(p, Partial) else R for p in pre), tuple(mid), False)])
        m.setattr(planner_mod, "scattered", lambda *a: [])
        return plan_reshard(*args)


@pytest.mark.parametrize("shape, sm, sp, dm, dp, ops, before, after", [
    # 2x2 -> 1-D of 2: each target gets the 4 blocks (64 B); before: gathered along y and x on the source (16 + 32 B),
    # the whole sent (64 B)
    ((4, 4), GRID, [S0, S1], PAIR, [R], ["send_recv"], 112, 64),
    ((8, 4), LINE, [S0], PAIR, [R], ["send_recv"], 224, 128),  # 1-D of 4 -> 1-D of 2: the 4 blocks, not 96 + 128 B
    # each quarter sent (32 B), gathered on the target (32 + 64 B); before: 96 B gathered, 128 sent
    ((8, 4), LINE, [S0], GRID2, [R, R], ["send_recv", "all_gather", "all_gather"], 224, 128),
    # a half sent (64 B), gathered on the target (64 B); before: 64 B gathered, the whole sent (128 B)
    ((8, 4), GRID, [S0, R], PAIR, [R], ["send_recv", "all_gather"], 192, 128),
    ((8, 4), GRID, [P, S0], PAIR, [R], ["all_reduce", "send_recv", "all_gather"], 256, 192),
    ((5, 6), GRID, [S0, S1], ProcessMesh([0, 5], ["z"]), [R], ["send_recv"], 228, 120),  # rank 0 keeps its block
    ((5, 7), GRID, [S0, S1], ProcessMesh([4, 5, 6], ["z"]), [S1], ["send_recv"], 192, 60),  # uneven pieces
    ((3, 5), GRID, [S1, S1], ProcessMesh([[1, 6], [7, 3], [2, 5], [0, 4]], ["a", "b"]),  # an empty target block
     [S0, Partial(ReduceType.kRedMax)], ["send_recv", "zero_fill"], 80, 20),
    # a reduce-scatter in place of the all-reduce (1-D of 2 -> 2x2): each target's quarter from one source block
    ((8, 4), A, [Partial(ReduceType.kRedMax)], GRID2, [S0, S0], ["reduce_scatter", "send_recv"], 160, 96),
    # 1-D -> 1-D of one size, P -> R: reduce-scatter (64 B), the shards sent (64 B), gathered (64 B); before
    # (and Paddle's PToRReshardFunctionCrossMesh, the partial sent whole, then all-reduced): 128 + 128 B
    ((8, 4), A, [P], B, [R], ["reduce_scatter", "send_recv", "all_gather"], 256, 192),
    ((8, 4), A, [Partial(ReduceType.kRedMax)], B, [R], ["reduce_scatter", "send_recv", "all_gather"], 256, 192),
    ((8, 4), GRID, [P, P], GRID2, [R, R],
     ["reduce_scatter", "reduce_scatter", "send_recv", "all_gather", "all_gather"], 384, 224),
])
def test_the_pieces_are_sent_and_gathered_on_the_target(monkeypatch, shape, sm, sp, dm, dp, ops, before, after):
    plan = _check(shape, sm, sp, dm, dp, seed=sum(shape))
    assert plan.ops == ops, plan
    assert plan.total_bytes == after, plan
    assert _plain(monkeypatch, shape, sm, sp, dm, dp).total_bytes == before


def test_where_the_source_sends_nothing_the_plan_stays():
    """A target that is a slice of the source keeps its blocks (Paddle's GlobalToSubMesh): gathering there is
    cheapest, and nothing is sent."""
    plan = _check((4, 4), GRID, [S0, S1], ProcessMesh([0, 1], ["y"]), [R], seed=3)
    assert plan.ops == ["all_gather", "all_gather", "send_recv"] and plan.total_bytes == 48, plan


def test_a_shard_to_shard_between_1d_meshes_takes_the_cheaper_side_on_uneven_blocks():
    to_cols = _check((5, 3), A, [S1], B, [S0], seed=4)  # the source's all-to-all is the cheaper on this shape
    to_rows = _check((5, 3), A, [S0], B, [S1], seed=5)  # and the target's on this one
    assert to_cols.ops == ["all_to_all", "send_recv"] and to_rows.ops == ["send_recv", "all_to_all"]
    assert (to_rows.total_bytes, to_cols.total_bytes) == (52, 52)


def test_seeded_reshards_between_meshes_agree_and_never_move_more(monkeypatch):
    rng = random.Random(83)
    shapes = [(2,), (4,), (3,), (2, 2), (2, 3), (6,), (8,), (2, 1), (1, 2), (2, 2, 2)]
    fewer = 0
    for seen in range(150):
        sshape = rng.choice(shapes)
        dshape = sshape if rng.random() < 0.3 else rng.choice(shapes)
        ns, nd = int(np.prod(sshape)), int(np.prod(dshape))
        start = rng.choice([0, ns, 1])
        sm = ProcessMesh(np.arange(ns).reshape(sshape), [f"s{i}" for i in range(len(sshape))])
        dm = ProcessMesh(np.array(rng.sample(range(start, start + nd), nd)).reshape(dshape),
                         [f"d{i}" for i in range(len(dshape))])
        if sm.process_ids == dm.process_ids and sm.shape == dm.shape:
            continue
        shape = tuple(rng.choice([1, 2, 3, 4, 5, 8]) for _ in range(rng.choice([1, 2, 3])))

        def pick(n):
            return [rng.choice([R, P, Partial(ReduceType.kRedMax), *[Shard(d) for d in range(len(shape))]])
                    for _ in range(n)]

        sp, dp = pick(len(sshape)), pick(len(dshape))
        plan = _check(shape, sm, sp, dm, dp, seed=seen)
        old = _plain(monkeypatch, shape, sm, sp, dm, dp)
        assert plan.total_bytes <= old.total_bytes, (plan, old)
        fewer += plan.total_bytes < old.total_bytes
        value = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
        if not any(isinstance(p, Partial) for p in [*plan.src_placements, *plan.dst_placements]):
            got = simulate(plan, value)
            np.testing.assert_array_equal(dense_of({r: got[r] for r in dm.process_ids}, shape, dm,
                                                   plan.dst_placements), value)
    assert fewer >= 15, fewer
