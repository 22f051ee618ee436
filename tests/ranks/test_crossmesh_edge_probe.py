"""dist.reshard between meshes of different shapes on 4 thread ranks: the dense truth, and only Paddle's moves."""

from __future__ import annotations

import numpy as np
import pytest

from meshviz.core import Partial, ReduceType, Replicate, Shard
from meshviz.testing import run_ranks

from ..partials import dense_of

pytestmark = pytest.mark.timeout(120)

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()
G, ROW, COL, LINE, ONE, OTHER = [[0, 1], [2, 3]], [0, 1], [0, 2], [0, 1, 2, 3], [3], [2, 0, 3]
CASES = [  # (source mesh, placements, target mesh, placements, the collectives every rank may issue)
    (G, [R, S0], ROW, [S0], set()),  # global -> sub: nothing moves
    (G, [S1, R], COL, [S1], set()),
    (G, [R, R], COL, [S0], set()),
    (G, [S0, P], COL, [S0], {"all_reduce"}),
    (ROW, [S0], G, [R, S0], {"send_recv"}),  # sub -> global: p2p from the sub mesh only
    (COL, [R], G, [R, S1], {"send_recv"}),
    (ROW, [S0], G, [S0, S0], {"send_recv"}),  # slices of the source's block, away from its start
    (ROW, [S1], G, [S0, R], {"send_recv"}),  # no single block holds a target block: pieces of several
    (LINE, [S0], ONE, [R], {"all_gather", "send_recv"}),
    (ONE, [R], LINE, [S1], {"send_recv"}),
    (ONE, [R], G, [S0, Partial(ReduceType.kRedMax)], {"send_recv"}),
    (G, [S0, S1], OTHER, [S1], {"send_recv"}),  # each target's columns in pieces of two blocks
    (ROW, [P], G, [S1, S0], {"reduce_scatter", "send_recv"}),  # each target's block within a scattered one
]


def _mesh(dist, ids):
    a = np.array(ids)
    return dist.ProcessMesh(ids, dim_names=[f"d{i}" for i in range(a.ndim)])


def _reshards(log):
    import torch

    import meshviz.distributed as dist

    dist.init_parallel_env()
    me = dist.get_rank()
    out = []
    for i, (sm, sp, dm, dp, _) in enumerate(CASES):
        value = np.random.default_rng(i).integers(0, 9, size=(5, 6)).astype(np.float32)
        src = dist.shard_tensor(torch.from_numpy(value), _mesh(dist, sm), sp)
        log.pop(me, None)
        got = dist.reshard(src, _mesh(dist, dm), dp)
        ops = set(log.pop(me, ()))
        local = got._local_value() if _mesh(dist, dm).contains(me) else None
        out.append((ops, None if local is None else local.numpy().copy()))
    return me, out


def test_each_target_rank_gets_its_block_and_the_moves_are_paddles(monkeypatch):
    import meshviz.distributed as dist
    from meshviz.core import ProcessMesh
    from meshviz.core.layout import local_block, normalize_placements
    from meshviz.runtime import reshard

    log: dict = {}
    issue = reshard.run

    def counted(call, *a, **kw):
        log.setdefault(dist.get_rank(), []).append(call.op.value)
        return issue(call, *a, **kw)

    monkeypatch.setattr(reshard, "run", counted)
    results = dict(run_ranks(_reshards, 4, log, ranks="threads", timeout=100))
    for i, (_, _, dm, dp, may) in enumerate(CASES):
        value = np.random.default_rng(i).integers(0, 9, size=(5, 6)).astype(np.float32)
        mesh = ProcessMesh(dm, [f"d{k}" for k in range(np.array(dm).ndim)])
        dst = normalize_placements(value.shape, mesh, dp)
        issued = set().union(*(results[r][i][0] for r in range(4)))
        assert issued <= may and ("all_gather" in issued) == ("all_gather" in may), (i, issued)
        got = {r: results[r][i][1] for r in mesh.process_ids}
        np.testing.assert_array_equal(dense_of(got, value.shape, mesh, dst), value, err_msg=str(i))
        if not any(isinstance(p, Partial) for p in dst):
            for c in np.ndindex(*mesh.shape):
                blk = tuple(slice(a, b) for a, b in local_block(value.shape, mesh, dst, c))
                np.testing.assert_array_equal(got[mesh.rank_at(c)], value[blk], err_msg=f"case {i} at {c}")
