"""The tensor that Partial local values stand for, written out without meshviz's planner (a reference for tests)."""

import numpy as np

from meshviz.core import Partial, ReduceType, Replicate
from meshviz.core.layout import local_block

SUM, MAX, MIN, PROD, AVG = (ReduceType.kRedSum, ReduceType.kRedMax, ReduceType.kRedMin, ReduceType.kRedProd,
                            ReduceType.kRedAvg)
_NP_REDUCE = {SUM: np.sum, AVG: np.mean, MAX: np.max, MIN: np.min, PROD: np.prod}


def dense_of(locals_, shape, mesh, placements):
    """The tensor a set of local values stands for, written out here without the planner: each rank's block goes into
    a stack indexed by its Partial coordinates (replicas must agree), then the Partial axes are reduced, the last
    mesh axis first (mesh axis 0 is the outermost reduction)."""
    paxes = [i for i, p in enumerate(placements) if isinstance(p, Partial)]
    stack = np.full([mesh.shape[i] for i in paxes] + list(shape), np.nan)
    dense = [Replicate() if isinstance(p, Partial) else p for p in placements]
    for c in np.ndindex(*mesh.shape):
        blk = tuple(slice(a, b) for a, b in local_block(shape, mesh, dense, c))
        where = stack[tuple(c[i] for i in paxes)][blk]
        local = locals_[mesh.rank_at(c)]
        assert local.shape == where.shape, (placements, c, local.shape, where.shape)
        assert np.isnan(where).all() or np.array_equal(where, local), f"replicas disagree at {c} for {placements}"
        where[...] = local
    assert not np.isnan(stack).any()
    for k in reversed(range(len(paxes))):
        stack = _NP_REDUCE[placements[paxes[k]].reduce_type](stack, axis=k)
    return stack


def random_locals(rng, shape, mesh, placements):
    """Arbitrary local values for ``placements`` (a different summand on every Partial coordinate, as an op leaves
    them), and the tensor they stand for."""
    paxes = [i for i, p in enumerate(placements) if isinstance(p, Partial)]
    summands = rng.integers(1, 4, size=[mesh.shape[i] for i in paxes] + list(shape)).astype(np.float64)
    dense = [Replicate() if isinstance(p, Partial) else p for p in placements]
    locals_ = {}
    for c in np.ndindex(*mesh.shape):
        blk = tuple(slice(a, b) for a, b in local_block(shape, mesh, dense, c))
        locals_[mesh.rank_at(c)] = summands[tuple(c[i] for i in paxes)][blk].copy()
    for k in reversed(range(len(paxes))):
        summands = _NP_REDUCE[placements[paxes[k]].reduce_type](summands, axis=k)
    return locals_, summands


def assert_target_holds(got, dense, shape, mesh, placements, msg="") -> None:
    """``got`` (rank -> its local value on ``mesh``) stands for ``dense``; where no mesh axis is Partial, every rank
    holds exactly its block of it."""
    np.testing.assert_allclose(dense_of(got, shape, mesh, placements), dense, err_msg=msg)
    if not any(isinstance(p, Partial) for p in placements):
        for c in np.ndindex(*mesh.shape):
            blk = tuple(slice(a, b) for a, b in local_block(shape, mesh, placements, c))
            np.testing.assert_array_equal(got[mesh.rank_at(c)], dense[blk], err_msg=f"{msg}\nat {c}")
