"""dist.reshard between meshes on 8 thread ranks: a Partial that travels unreduced (Paddle's sub-mesh functions),
and same-shape moves in Paddle's order; each target block against the dense truth, the steps from trace events."""

from __future__ import annotations

import numpy as np
import pytest

from meshviz.core import Partial, ProcessMesh, Replicate, Shard
from meshviz.testing import run_ranks

from ..partials import dense_of

pytestmark = pytest.mark.timeout(120)

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()
G, G2, ROW, A, B = [[0, 1], [2, 3]], [[4, 5], [6, 7]], [0, 1], [0, 1], [2, 3]
SHAPE = (4, 6)
CASES = [  # (source mesh, placements, target mesh, placements, {rank: its steps (op, group)}, most bytes a rank gets)
    (ROW, [P], G, [R, P], {0: [("send_recv", [[0, 0], [0, 2]])], 2: [("send_recv", [[0, 2]])]},
     4 * 6 * 4),  # SubMeshToGlobal: each summand sent as it is, no all-reduce
    (G, [R, P], ROW, [P], {0: [("send_recv", [[0, 0]])], 2: []}, 0),  # GlobalToSubMesh: each keeps its summand
    (A, [S0], B, [R], {0: [("send_recv", [[0, 2]])], 2: [("send_recv", [[0, 2]]), ("all_gather", [2, 3])]},
     2 * 6 * 4),  # SToRReshardFunctionCrossMesh: send the shard, gather on the target
    (G, [S0, S1], G2, [R, R], {0: [("send_recv", [[0, 4]])], 4: [("send_recv", [[0, 4]]), ("all_gather", [4, 5]),
                                                              ("all_gather", [4, 6])]},
     2 * 6 * 4),  # a quarter sent, gathered on the target (Paddle: gathered on the source, the whole sent)
    (G, [S0, R], G2, [R, S1], {0: [("slice", [0, 1]), ("send_recv", [[0, 4]])],
                               4: [("send_recv", [[0, 4]]), ("all_gather", [4, 6])]},
     2 * 3 * 4),  # a quarter sent, a quarter gathered (Paddle: a half gathered on the source, a half sent)
]


def _mesh(dist, ids):
    return dist.ProcessMesh(ids, dim_names=[f"d{i}" for i in range(np.array(ids).ndim)])


def _summand(i, rank):
    return np.random.default_rng(100 * i + rank).integers(0, 9, size=SHAPE).astype(np.float32)


def _reshard(i):
    import torch

    import meshviz.distributed as dist
    from meshviz import trace

    dist.init_parallel_env()
    me = dist.get_rank()
    sm, sp, dm, dp, _, _ = CASES[i]
    src_mesh, dst_mesh = _mesh(dist, sm), _mesh(dist, dm)
    if any(isinstance(p, Partial) for p in sp):  # a different summand on every rank (replicas alike)
        coord = src_mesh.coordinate(me) if src_mesh.contains(me) else None
        key = 0 if coord is None else coord[[k for k, p in enumerate(sp) if isinstance(p, Partial)][0]]
        src = dist.dtensor_from_local(torch.from_numpy(_summand(i, key)), src_mesh, sp, shape=list(SHAPE))
    else:
        src = dist.shard_tensor(torch.from_numpy(_summand(i, 0)), src_mesh, sp)
    with trace.record() as rec:
        got = dist.reshard(src, dst_mesh, dp)
    steps = [(e.op, e.group, e.bytes) for e in rec.events if e.kind == "reshard_step"]
    collectives = [e.op for e in rec.events if e.kind == "collective"]
    local = got._local_value().numpy().copy() if dst_mesh.contains(me) else None
    return me, (steps, collectives, local)


def _dense(i, sm, sp):
    if not any(isinstance(p, Partial) for p in sp):
        return _summand(i, 0)
    k = [a for a, p in enumerate(sp) if isinstance(p, Partial)][0]
    return sum(_summand(i, j) for j in range(np.array(sm).shape[k]))


@pytest.mark.parametrize("i", range(len(CASES)), ids=["sub_to_global", "global_to_sub", "1d_s_to_r", "2d_s0s1_to_rr",
                                                       "2d_s0r_to_rs1"])
def test_each_target_rank_gets_its_block_and_the_steps_are_paddles(i):
    from meshviz.core.layout import local_block, normalize_placements

    results = dict(run_ranks(_reshard, 8, i, ranks="threads", timeout=100))
    sm, sp, dm, dp, steps, most = CASES[i]
    mesh = ProcessMesh(dm, [f"d{k}" for k in range(np.array(dm).ndim)])
    dst = normalize_placements(SHAPE, mesh, dp)
    dense = _dense(i, sm, sp)
    got = {r: results[r][2] for r in mesh.process_ids}
    np.testing.assert_array_equal(dense_of(got, SHAPE, mesh, dst), dense)
    for c in np.ndindex(*mesh.shape):
        r = mesh.rank_at(c)
        if any(isinstance(p, Partial) for p in dst):  # the peer's summand as it was: nothing reduced
            k = [a for a, p in enumerate(dst) if isinstance(p, Partial)][0]
            np.testing.assert_array_equal(got[r], _summand(i, c[k]), err_msg=f"case {i} at {c}")
        else:
            blk = tuple(slice(a, b) for a, b in local_block(SHAPE, mesh, dst, c))
            np.testing.assert_array_equal(got[r], dense[blk], err_msg=f"case {i} at {c}")
    for r, want in steps.items():
        assert [(op, group) for op, group, _ in results[r][0]] == want, (i, r, results[r][0])
    issued = set().union(*(results[r][1] for r in range(8)))  # the collectives every rank issued
    assert "all_reduce" not in issued or any(op == "all_reduce" for w in steps.values() for op, _ in w), issued
    assert max(b for r in range(8) for _, _, b in results[r][0]) == most, [results[r][0] for r in range(8)]
