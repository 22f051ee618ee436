"""The op layer's rules on placements and shapes alone (no process group), as Paddle's *_spmd_rule_test checks its
SPMD rules: each rule's strategy, the precedence of :func:`plan`, and local rules run on simulated ranks' blocks
against the dense op."""

import itertools

import numpy as np
import pytest
import torch

from meshviz.core.mesh import ProcessMesh
from meshviz.core.placements import Partial, ReduceType, Replicate, Shard
from meshviz.core.planner import assemble, initial_locals
from meshviz.runtime.op_plan import plan
from meshviz.runtime.op_rules import RULES, Strategy, TensorSpec, merged

aten = torch.ops.aten
M1 = ProcessMesh([0, 1], ["x"])
M2 = ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
R, P = Replicate(), Partial()


def spec(mesh, placements, shape, dtype=torch.float32):
    return TensorSpec(mesh, placements, shape, dtype)


def test_every_registered_rule_names_its_op_and_kind():
    kinds = {"corrected", "random", "paddle", "local", "default"}
    assert RULES, "no rule registered"
    for op, rule in RULES.items():
        assert rule.op is op and rule.kind in kinds
        assert (rule.fn is None) == (rule.kind in ("corrected", "default")), op
        if rule.kind == "corrected":
            assert rule.why, f"{op}: a correction says why torch's rule is wrong"


def test_cumsum_keeps_the_scanned_dim_whole():
    rule = RULES[aten.cumsum.default].fn
    x = spec(M2, [Shard(0), Shard(1)], (4, 6))
    assert rule((x, 1), {}) == Strategy(([Shard(0), R],))
    assert rule((x, 0), {}) == Strategy(([R, Shard(1)],))
    assert rule((spec(M2, [Shard(1), R], (4, 6)), -2), {}) is None  # the scanned dim is whole already


def test_extremum_rules_make_whole_a_reduced_dim_some_rank_holds_none_of():
    M4 = ProcessMesh([0, 1, 2, 3], ["x"])
    for op in (aten.max.default, aten.min.default):
        rule = RULES[op].fn
        assert rule((spec(M4, [Shard(0)], (6,)),), {}) == Strategy(([R],))  # 2, 2, 2, 0
        assert rule((spec(M4, [Shard(0)], (8,)),), {}) is None  # every rank holds 2: torch's rule
        assert rule((spec(M2, [Shard(1), Shard(0)], (1, 3)),), {}) == Strategy(([R, R],))  # 1 row, 0 on y=1
    amax = RULES[aten.amax.default].fn
    assert amax((spec(M2, [Shard(0), Shard(1)], (3, 1)), [1]), {}) == Strategy(([Shard(0), R],))
    assert amax((spec(M2, [Shard(0), Shard(1)], (1, 4)), [1]), {}) is None  # dim 0's empty block is kept
    assert RULES[aten.aminmax.default].fn((spec(M4, [Shard(0)], (3, 2)),), {"dim": 0}) == Strategy(([R],))


def test_join_rules_merge_the_inputs_as_paddle_does():
    a, b = spec(M2, [Shard(0), R], (4, 6)), spec(M2, [R, Shard(1)], (4, 6))
    # stack: every input aligned to the merged placements
    assert RULES[aten.stack.default].fn(([a, b], 0), {}) == Strategy(([Shard(0), Shard(1)],) * 2)
    # cat never keeps the dim it joins along sharded
    assert RULES[aten.cat.default].fn(([a, b], 0), {}) == Strategy(([R, Shard(1)],) * 2)
    # a Partial axis stays only where every input has it; a dense input joins as Replicate
    pa, pb = spec(M1, [P], (3,)), spec(M1, [P], (3,))
    assert merged([pa, pb]) == [P]
    assert merged([pa, spec(M1, [R], (3,))]) == [R]
    assert RULES[aten.stack.default].fn(([pa, torch.zeros(3)], 0), {}) == Strategy(([R],))


def test_gather_rule_keeps_the_gathered_dim_whole():
    rule = RULES[aten.gather.default].fn
    x, i = spec(M2, [Shard(0), Shard(1)], (4, 6)), spec(M2, [R, R], (4, 2), torch.int64)
    got = rule((x, 1, i), {})
    assert got == Strategy(([Shard(0), R], [Shard(0), R]), ([Shard(0), R],))
    assert rule((x, 1, i), {"sparse_grad": True}) is None


@pytest.mark.parametrize("mesh", [M1, M2], ids=["1d", "2d"])
def test_gather_rule_on_simulated_ranks_gives_the_dense_value(mesh):
    """Each rank gathers from the blocks the strategy lays out; the blocks assemble to the dense gather."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 6)).astype(np.float32)
    index = rng.integers(0, 6, (5, 3))
    one = [Shard(0), Shard(1), R, P]
    for pls in itertools.product(one, repeat=mesh.ndim):
        if len({p.dim for p in pls if isinstance(p, Shard)}) < sum(isinstance(p, Shard) for p in pls):
            continue
        got = RULES[aten.gather.default].fn((spec(mesh, pls, x.shape), 1, spec(mesh, [R] * mesh.ndim, index.shape,
                                                                                  torch.int64)), {})
        (want_x, want_i), (out,) = got.inputs, got.outputs
        xs, idx = initial_locals(x, mesh, want_x), initial_locals(index, mesh, want_i)
        outs = {r: torch.gather(torch.from_numpy(xs[r]), 1, torch.from_numpy(idx[r])).numpy() for r in xs}
        np.testing.assert_allclose(assemble(outs, (5, 3), mesh, out), np.take_along_axis(x, index, 1), rtol=1e-6,
                                   err_msg=f"{pls}")


@pytest.mark.parametrize("op", ["triu", "tril"])
def test_triangle_rules_on_simulated_ranks_give_the_dense_value(op):
    """triu / tril keep the batch dims as they lie and make the last two whole (Paddle's tril_triu rule)."""
    rule, fn = RULES[getattr(aten, op).default].fn, getattr(torch, op)
    x = np.random.default_rng(1).standard_normal((3, 5, 4)).astype(np.float32)
    one = [Shard(0), Shard(1), Shard(2), R, P]
    for pls in itertools.product(one, repeat=M2.ndim):
        if len({p.dim for p in pls if isinstance(p, Shard)}) < sum(isinstance(p, Shard) for p in pls):
            continue
        got = rule((spec(M2, pls, x.shape), 1), {})
        (want,), (out,) = got.inputs, got.outputs
        assert want == [R if isinstance(p, Shard) and p.dim >= 1 else p for p in pls] == out
        blocks = initial_locals(x, M2, want)
        outs = {r: fn(torch.from_numpy(b), 1).numpy() for r, b in blocks.items()}
        np.testing.assert_allclose(assemble(outs, x.shape, M2, out), fn(torch.from_numpy(x), 1).numpy(),
                                   err_msg=f"{pls}")


def _valid(pls) -> bool:
    dims = [p.dim for p in pls if isinstance(p, Shard)]
    return len(dims) == len(set(dims))


@pytest.mark.parametrize("op", ["index_select", "argmax", "argmin"])
def test_reduction_and_index_rules_on_simulated_ranks_give_the_dense_value(op):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    index = np.array([3, 0, 2, 2, 1])
    rule = RULES[getattr(aten, op).default].fn
    for dim, pls in itertools.product((0, 1), itertools.product([Shard(0), Shard(1), R, P], repeat=M2.ndim)):
        if not _valid(pls):
            continue
        if op == "index_select":
            for ipl in ([R, R], [R, Shard(0)], [Shard(0), R]):
                got = rule((spec(M2, pls, x.shape), dim, spec(M2, ipl, index.shape, torch.int64)), {})
                (wx, wi), (out,) = got.inputs, got.outputs
                xs, ids = initial_locals(x, M2, wx), initial_locals(index, M2, wi)
                outs = {r: torch.index_select(torch.from_numpy(xs[r]), dim, torch.from_numpy(ids[r])).numpy()
                        for r in xs}
                want = np.take(x, index, axis=dim)
                np.testing.assert_allclose(assemble(outs, want.shape, M2, out), want, err_msg=f"{pls} {ipl} {dim}")
        else:
            got = rule((spec(M2, pls, x.shape), dim), {})
            (wx,), (out,) = got.inputs, got.outputs
            xs = initial_locals(x, M2, wx)
            fn = getattr(torch, op)
            outs = {r: fn(torch.from_numpy(xs[r]), dim).numpy() for r in xs}
            want = fn(torch.from_numpy(x), dim).numpy()
            np.testing.assert_array_equal(assemble(outs, want.shape, M2, out), want, err_msg=f"{pls} {dim}")


def test_pointwise_ops_reduce_a_partial_that_meets_a_shard():
    s0, p = spec(M1, [Shard(0)], (4, 6)), spec(M1, [P], (4, 6))
    assert plan(aten.mul.Tensor, (s0, p), {}).strategy == Strategy((None, [Shard(0)]))
    assert plan(aten.mul.Tensor, (s0, spec(M1, [P], (6,))), {}).strategy == Strategy((None, [R]))
    assert plan(aten.mul.Tensor, (p, p), {}).strategy is None  # no shard on the axis: torch's rule
    # div sums its divisor first (a quotient is linear in the dividend only)
    assert plan(aten.div.Tensor, (spec(M1, [R], (4, 6)), p), {}).strategy == Strategy((None, [R]))
    # the layouts torch needs still apply on top: a dim split unevenly by both axes goes whole on the inner one
    got = plan(aten.pow.Tensor_Tensor, (spec(M2, [Shard(0), P], (5, 3)), spec(M2, [Shard(0), Shard(0)], (3,))), {})
    assert got.strategy == Strategy(([Shard(0), R], [Shard(0), R]))


def test_plan_precedence():
    x = spec(M1, [Shard(0)], (4, 6))
    # refused: item() of a block, inputs on two meshes, mixed Partial reductions entering an op
    assert plan(aten._local_scalar_dense.default, (x,), {}).how == "refuse"
    assert plan(aten._local_scalar_dense.default, (spec(M1, [R], ()),), {}).how == "torch"
    other = spec(ProcessMesh([1, 0], ["x"]), [Shard(0)], (4, 6))
    assert "different meshes" in plan(aten.add.Tensor, (x, other), {}).why
    mixed = spec(M2, [Partial(ReduceType.kRedMax), Partial()], (4, 6))
    assert plan(aten.add.Tensor, (mixed, 1.0), {}).how == "refuse"
    assert plan(aten.detach.default, (mixed,), {}).how == "torch"  # a metadata op keeps the layout
    # random before corrected before the op's rule before torch's
    assert plan(aten.native_dropout.default, (x, 0.5, True), {}).how == "random"
    assert plan(aten.mse_loss.default, (x, x, 1), {}).how == "corrected"
    assert plan(aten.gather.default, (x, 1, spec(M1, [R], (4, 2), torch.int64)), {}).how == "local"
    assert plan(aten.cumsum.default, (spec(M1, [Shard(1)], (4, 6)), 1), {}).strategy == Strategy(([R],))
    assert plan(aten.add.Tensor, (x, x), {}).how == "torch" and plan(aten.add.Tensor, (x, x), {}).strategy is None


def test_plan_lays_out_what_torch_cannot_run_right():
    # a dim sharded unevenly by two mesh axes: the inner axis goes Replicate first
    co = spec(M2, [Shard(0), Shard(0)], (5, 3))
    assert plan(aten.sum.default, (co,), {}).strategy == Strategy(([Shard(0), R],))
    assert plan(aten.sum.default, (spec(M2, [Shard(0), Shard(0)], (8, 3)),), {}).strategy is None
    assert plan(aten.clone.default, (co,), {}).strategy is None  # a copy runs on the blocks as they lie
    # an in-place op that is not linear gets a Partial self summed first; a linear one runs on each summand
    p = spec(M2, [Shard(0), P], (4, 3))
    assert plan(aten.log_.default, (p,), {}).strategy == Strategy(([Shard(0), R],))
    assert plan(aten.mul_.Scalar, (p, 2.0), {}).strategy is None


def test_strategy_reads_short():
    assert repr(Strategy(([Shard(0), R], None), ([Shard(0), P],))) == "Strategy([S(0), R], - -> [S(0), P(sum)])"
    assert repr(Strategy(([R],))) == "Strategy([R] -> torch)"
