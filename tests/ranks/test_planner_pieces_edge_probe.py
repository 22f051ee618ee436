"""dist.reshard between meshes on 8 thread ranks, pieces of several blocks sent, gathered on the target: the dense."""

from __future__ import annotations

import numpy as np
import pytest

from meshviz.core import Partial, ReduceType, Replicate, Shard
from meshviz.testing import run_ranks

from ..partials import dense_of, random_locals

pytestmark = pytest.mark.timeout(120)

R, S0, S1, P, MAX = Replicate(), Shard(0), Shard(1), Partial(), Partial(ReduceType.kRedMax)
GRID, LINE, PAIR, GRID2, A, B = [[0, 1], [2, 3]], [0, 1, 2, 3], [4, 5], [[4, 5], [6, 7]], [0, 1], [2, 3]
CASES = [  # (shape, source mesh, placements, target mesh, placements, the plan's bytes; before the fix)
    ((4, 4), GRID, [S0, S1], PAIR, [R], 64),  # 112: the pieces of 4 blocks
    ((8, 4), LINE, [S0], PAIR, [R], 128),  # 224
    ((8, 4), LINE, [S0], GRID2, [R, R], 128),  # 224: quarters sent, gathered on the target
    ((8, 4), GRID, [S0, R], PAIR, [R], 128),  # 192
    ((8, 4), GRID, [P, S0], PAIR, [R], 192),  # 256
    ((5, 6), [0, 1], [S1], GRID, [S0, R], 48),  # 108, the target ranks among the source's
    ((5, 6), GRID, [S0, S1], [0, 5], [R], 120),  # 228: rank 0's own piece copied, the others received
    ((5, 7), GRID, [S0, S1], [4, 5, 6], [S1], 60),  # 192, uneven pieces
    ((3, 5), GRID, [S1, S1], [[1, 6], [7, 3], [2, 5], [0, 4]], [S0, MAX], 20),  # 80, an empty target block
    ((8, 4), A, [MAX], GRID2, [S0, S0], 96),  # 160
    ((8, 4), A, [P], B, [R], 192),  # 256 (Paddle's PToRReshardFunctionCrossMesh too)
    ((7, 3), A, [MAX], B, [R], 144),  # 172, uneven blocks
    ((8, 4), GRID, [P, P], GRID2, [R, R], 224),  # 384
]


def _mesh(dist, ids):
    return dist.ProcessMesh(ids, dim_names=[f"d{i}" for i in range(np.array(ids).ndim)])


def _reshards(cases=None):
    import torch

    import meshviz.distributed as dist

    dist.init_parallel_env()
    me = dist.get_rank()
    out = []
    for i, (shape, sm, sp, dm, dp, _) in enumerate(cases or CASES):
        src_mesh, dst_mesh = _mesh(dist, sm), _mesh(dist, dm)
        locals_, _ = random_locals(np.random.default_rng(i), shape, src_mesh, sp)
        local = torch.from_numpy(locals_[me].astype(np.float32)) if src_mesh.contains(me) else torch.zeros(0)
        src = dist.dtensor_from_local(local, src_mesh, sp, shape=list(shape))
        got = dist.reshard(src, dst_mesh, dp)
        value = got._local_value().numpy().copy() if dst_mesh.contains(me) else None
        out.append((dist.plan_of(src, dst_mesh, dp).total_bytes, value))
    return me, out


def test_each_target_rank_holds_its_block_of_the_dense_tensor_and_the_plan_moves_fewer_bytes():
    from meshviz.core import ProcessMesh
    from meshviz.core.layout import local_block, normalize_placements

    results = dict(run_ranks(_reshards, 8, ranks="threads", timeout=100))
    for i, (shape, sm, sp, dm, dp, nbytes) in enumerate(CASES):
        src_mesh = ProcessMesh(sm, [f"d{k}" for k in range(np.array(sm).ndim)])
        mesh = ProcessMesh(dm, [f"d{k}" for k in range(np.array(dm).ndim)])
        _, dense = random_locals(np.random.default_rng(i), shape, src_mesh, sp)
        assert {results[r][i][0] for r in range(8)} == {nbytes}, i
        dst = normalize_placements(shape, mesh, dp)
        got = {r: results[r][i][1] for r in mesh.process_ids}
        np.testing.assert_array_equal(dense_of(got, shape, mesh, dst), dense, err_msg=str(i))
        for c in np.ndindex(*mesh.shape) if not any(isinstance(p, Partial) for p in dst) else ():
            blk = tuple(slice(a, b) for a, b in local_block(shape, mesh, dst, c))
            np.testing.assert_array_equal(got[mesh.rank_at(c)], dense[blk], err_msg=f"case {i} at {c}")


def _seeded_cases():
    """Seeded reshards between meshes of 1-8 of the 8 ranks whose plans send some target pieces of several blocks."""
    import random

    from meshviz.core import ProcessMesh
    from meshviz.core.planner import plan_reshard

    rng, out = random.Random(29), []
    shapes = [(2,), (4,), (3,), (2, 2), (2, 3), (8,), (2, 1), (4, 2)]
    for _ in range(400):
        sshape, dshape = rng.choice(shapes), rng.choice(shapes)
        ns, nd = int(np.prod(sshape)), int(np.prod(dshape))
        sm = np.array(rng.sample(range(8), ns)).reshape(sshape).tolist()
        dm = np.array(rng.sample(range(8), nd)).reshape(dshape).tolist()
        shape = tuple(rng.choice([1, 2, 3, 5, 6]) for _ in range(rng.choice([1, 2, 3])))
        opts = [R, P, MAX, *[Shard(d) for d in range(len(shape))]]
        sp, dp = [rng.choice(opts) for _ in sshape], [rng.choice(opts) for _ in dshape]
        names = [[f"d{k}" for k in range(len(s))] for s in (sshape, dshape)]
        plan = plan_reshard(shape, ProcessMesh(sm, names[0]), sp, ProcessMesh(dm, names[1]), dp)
        moved = [s for s in plan.steps if s.op == "send_recv" and s.blocks is not None]
        if moved and len({t for _, t in moved[0].groups}) < len(moved[0].groups):
            out.append((shape, sm, sp, dm, dp, plan.total_bytes))
        if len(out) == 12:
            break
    return out


def test_seeded_reshards_that_send_pieces_give_every_rank_the_dense_values():
    from meshviz.core import ProcessMesh
    from meshviz.core.layout import normalize_placements

    cases = _seeded_cases()
    assert len(cases) == 12, cases
    results = dict(run_ranks(_reshards, 8, cases, ranks="threads", timeout=100))
    for i, (shape, sm, sp, dm, dp, nbytes) in enumerate(cases):
        src_mesh = ProcessMesh(sm, [f"d{k}" for k in range(np.array(sm).ndim)])
        mesh = ProcessMesh(dm, [f"d{k}" for k in range(np.array(dm).ndim)])
        _, dense = random_locals(np.random.default_rng(i), shape, src_mesh, sp)
        assert {results[r][i][0] for r in range(8)} == {nbytes}, i
        got = {r: results[r][i][1] for r in mesh.process_ids}
        np.testing.assert_array_equal(dense_of(got, shape, mesh, normalize_placements(shape, mesh, dp)), dense,
                                      err_msg=str(cases[i]))
