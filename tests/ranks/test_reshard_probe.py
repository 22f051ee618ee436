"""Reshards of Partial tensors of every dtype and reshards no rank can finish, against one process and Paddle 3.3.1."""

from __future__ import annotations

import pytest

from meshviz.testing import run_ranks

pytestmark = pytest.mark.timeout(120)

_REDUCE = ("sum", "avg", "max", "min", "prod")


def _summand(rank: int, dtype):
    """Rank ``rank``'s summand of a 5 x 3 tensor (5 rows on 4 ranks split 2, 2, 1, 0)."""
    import torch

    base = torch.arange(15).reshape(5, 3) % 4
    return ((base + rank) % 3 == 0) if dtype is torch.bool else (base + rank).to(dtype)


def _reduced(dtype, reduce: str):
    """What the four summands reduce to, in ``dtype`` (a bool mean: true where any summand is)."""
    import torch

    stack = torch.stack([_summand(r, dtype) for r in range(4)])
    if dtype is torch.bool:
        return {"sum": stack.any(0), "avg": stack.any(0), "max": stack.any(0), "min": stack.all(0),
                "prod": stack.all(0)}[reduce]
    if reduce in ("sum", "prod"):
        return getattr(stack, reduce)(0, dtype=dtype)
    if reduce == "avg":
        total = stack.sum(0, dtype=dtype)
        return total / 4 if dtype.is_floating_point else total // 4
    return getattr(stack, "amax" if reduce == "max" else "amin")(0)


def _partials_reduced(dtypes):
    import torch

    import meshviz.distributed as dist

    dist.init_parallel_env()
    me = dist.get_rank()
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    out = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        for reduce in _REDUCE:
            p = dist.Partial(dist.ReduceType.parse(reduce))
            for target in (dist.Shard(0), dist.Replicate()):
                t = dist.dtensor_from_local(_summand(me, dtype), mesh, [p], shape=[5, 3])
                out[(name, reduce, repr(target))] = dist.reshard(t, mesh, [target])._local_value()
    return out


def _check_reduced(res, dtypes) -> None:
    import torch

    rows = [(0, 2), (2, 4), (4, 5), (5, 5)]
    for name in dtypes:
        dtype = getattr(torch, name)
        for reduce in _REDUCE:
            want = _reduced(dtype, reduce)
            for r in range(4):
                for target, block in (("R", want), ("S(0)", want[rows[r][0]:rows[r][1]])):
                    got = res[r][(name, reduce, target)]
                    assert got.dtype == dtype, (name, reduce, target, r, got.dtype)
                    torch.testing.assert_close(got, block, rtol=0, atol=0, msg=(name, reduce, target, r))


def test_a_partial_reduces_in_its_dtype_to_replicate_and_to_an_uneven_shard():
    """5 rows on 4 ranks: Partial -> Shard(0) reduces by an all-to-all of uneven chunks and a local reduction, which
    summed (and multiplied) int32 and uint8 blocks into int64: a uint8 product of 840 where Replicate holds 72, as
    the all-reduce wraps. Every rank now holds its rows (2, 2, 1, 0) of what one process reduces, in the dtype."""
    dtypes = ("int32", "uint8", "float16", "bfloat16", "float64")
    _check_reduced(run_ranks(_partials_reduced, 4, dtypes, timeout=100), dtypes)


def test_a_bool_partial_reduces_to_bools_and_its_mean_is_true_where_any_summand_is():
    """Paddle 3.3.1 (4 ranks) reduces a bool Partial(avg) as its Partial(sum): true where any summand is (the mean
    of bools is non-zero just there). It raised (a bool cannot hold the division); Partial(sum) / Partial(prod) ->
    Shard(0) gave int64 counts and products instead of bools."""
    _check_reduced(run_ranks(_partials_reduced, 4, ("bool",), timeout=100), ("bool",))


def _unfinishable():
    import torch

    import meshviz.distributed as dist
    from meshviz import trace

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    grid = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    rows = dist.shard_tensor(torch.arange(8.0).reshape(4, 2), grid, [dist.Shard(0), dist.Replicate()])
    complex_max = dist.dtensor_from_local(torch.ones(2, dtype=torch.complex64), mesh,
                                          [dist.Partial(dist.ReduceType.kRedMax)])
    out = []
    for t, m, pl in ((complex_max, mesh, [dist.Shard(0)]), (complex_max, mesh, [dist.Replicate()]),
                     (rows, grid, [dist.Shard(0, shard_order=1), dist.Shard(0)])):
        with trace.record() as rec:
            with pytest.raises(ValueError) as err:
                dist.reshard(t, m, pl)
        out.append((str(err.value), [e.kind for e in rec.events]))
    return out


def test_a_reshard_no_rank_can_finish_raises_on_every_rank_before_any_step():
    """A complex Partial(max) reduced (complex numbers have no order) and a target co-shard order a dist tensor
    cannot hold: every rank raises a ValueError naming the cause before the plan's first step. The max was a
    NotImplementedError after the all-to-all; the co-shard order raised only once its all-gather had run."""
    for events in run_ranks(_unfinishable, 4, timeout=100):
        (to_shard, kinds1), (to_rep, kinds2), (order, kinds3) = events
        assert "complex numbers have no order" in to_shard and "Partial(max)" in to_shard
        assert "complex numbers have no order" in to_rep
        assert "co-shards of tensor dim 0" in order
        assert kinds1 == kinds2 == kinds3 == []


_SUMMANDS = [[-5, 6, -6, 7, -1, 2], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]


def _int_means():
    import torch

    import meshviz.distributed as dist

    dist.init_parallel_env()
    me = dist.get_rank()
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    mine = torch.tensor(_SUMMANDS[me], dtype=torch.int32)
    out = {}
    for target in (dist.Replicate(), dist.Shard(0)):
        t = dist.dtensor_from_local(mine, mesh, [dist.Partial(dist.ReduceType.kRedAvg)], shape=[6])
        out[repr(target)] = dist.reshard(t, mesh, [target])._local_value()
    t = mine.clone()
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out["all_reduce"] = t
    return out


def test_an_integer_mean_rounds_toward_zero_as_paddles():
    """Paddle 3.3.1 (4 ranks) reshards an int32 Partial(avg) with sums [-5, 6, -6, 7, -1, 2] to [-1, 1, -1, 1, 0, 0]:
    its divide rounds toward zero, as NCCL's integer AVG does. The ranks floored: [-2, 1, -2, 1, -1, 0]."""
    import torch

    want = torch.tensor([-1, 1, -1, 1, 0, 0], dtype=torch.int32)
    rows = [(0, 2), (2, 4), (4, 6), (6, 6)]
    for r, out in enumerate(run_ranks(_int_means, 4, timeout=100)):
        torch.testing.assert_close(out["R"], want, rtol=0, atol=0)
        torch.testing.assert_close(out["all_reduce"], want, rtol=0, atol=0)
        torch.testing.assert_close(out["S(0)"], want[rows[r][0]:rows[r][1]], rtol=0, atol=0)
