"""dtensor_from_local: blocks that do not fit one global shape raise the same ValueError on every rank."""

import pytest
import torch

from meshviz.testing import run_ranks


def _raised(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


def _world_goes_on() -> float:
    import meshviz.distributed as dist

    s = torch.ones(1)
    dist.all_reduce(s)
    return s.item()


def _misfit(placements, mesh, shape, held) -> str:
    return (f"dtensor_from_local: the local tensor does not match the block that {placements} on ProcessMesh({mesh}) "
            f"gives each rank of a global shape {shape}: {held}")


def one_block_wrong():
    """shape=[6] on [0, 1, 2] gives blocks of 2; rank 1 passes 3 rows: only its own check could see it."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh = dist.ProcessMesh([0, 1, 2], dim_names=["x"])
    local = torch.ones(3 if r == 1 else 2, 4)
    msg = _raised(lambda: dist.dtensor_from_local(local, mesh, [dist.Shard(0)], shape=[6, 4]))
    return msg, _world_goes_on()


@pytest.mark.timeout(60)
def test_a_block_that_does_not_fit_the_shape_raises_on_every_rank():
    res = run_ranks(one_block_wrong, 3, timeout=50)
    msg = _misfit("[S(0)]", "shape=[3], mesh=[0, 1, 2], dim_names=['x']", "[6, 4]",
                  "rank 1 holds [3, 4] (its block: [2, 4])")
    assert res == [(msg, 3.0)] * 3


def blocks_wrong_on_a_2d_mesh():
    """The seed mesh, [S(0), S(1)] of [5, 7]: blocks (3|2) x (3|3|1); ranks 2 and 3 swap theirs. Rank 6 is outside
    the mesh: it takes part in the check and raises too."""
    import meshviz.distributed as dist
    from meshviz.core.layout import local_shape

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh = dist.ProcessMesh([[2, 4, 5], [0, 1, 3]], dim_names=["x", "y"])
    pl = [dist.Shard(0), dist.Shard(1)]
    swap = {2: 3, 3: 2}
    coord = mesh.coordinate(swap.get(r, r)) if r < 6 else (0, 0)
    block = local_shape((5, 7), mesh, pl, coord)
    msg = _raised(lambda: dist.dtensor_from_local(torch.zeros(block), mesh, pl, shape=[5, 7]))
    # the same call with every block right goes through, on and off the mesh
    right = local_shape((5, 7), mesh, pl, mesh.coordinate(r)) if r < 6 else (0, 0)
    t = dist.dtensor_from_local(torch.full(right, float(r)), mesh, pl, shape=[5, 7])
    return msg, list(t.shape), dist.unshard_dtensor(t).tolist() if r < 6 else None


@pytest.mark.timeout(90)
def test_wrong_blocks_are_named_with_their_ranks_on_and_off_the_mesh():
    res = run_ranks(blocks_wrong_on_a_2d_mesh, 7, timeout=80)
    msg = _misfit("[S(0), S(1)]", "shape=[2, 3], mesh=[[2, 4, 5], [0, 1, 3]], dim_names=['x', 'y']", "[5, 7]",
                  "rank 2 holds [2, 1] (its block: [3, 3]); rank 3 holds [3, 3] (its block: [2, 1])")
    assert [m for m, _, _ in res] == [msg] * 7
    # the dense value: block (i, j) is the rank at coordinate (i, j), as a single process lays it out
    ids = [[2, 4, 5], [0, 1, 3]]
    rows, cols = [0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1, 2]
    dense = [[float(ids[i][j]) for j in cols] for i in rows]
    assert all(s == [5, 7] for _, s, _ in res)
    assert [d for _, _, d in res[:6]] == [dense] * 6 and res[6][2] is None


def uneven_without_shape():
    """shape=None: each rank's block times the mesh (Paddle's inference) gives rank 2 [3], the others [6]; checked
    where collectives are."""
    import meshviz.distributed as dist
    from meshviz.runtime.match import set_checking

    dist.init_parallel_env()
    set_checking(True)
    r = dist.get_rank()
    mesh = dist.ProcessMesh([0, 1, 2], dim_names=["x"])
    local = torch.ones(1 if r == 2 else 2)
    msg = _raised(lambda: dist.dtensor_from_local(local, mesh, [dist.Shard(0)]))
    # the shape the message names works, and lays the blocks out as given
    t = dist.dtensor_from_local(torch.arange(1 if r == 2 else 2) + 10.0 * r, mesh, [dist.Shard(0)], shape=[5])
    # blocks that fit no global shape (the short one first, where 5 on 3 ranks gives 2, 2, 1): nothing to suggest
    bad = torch.ones(1 if r == 0 else 2)
    msg2 = _raised(lambda: dist.dtensor_from_local(bad, mesh, [dist.Shard(0)]))
    # ranks given different global shapes
    msg3 = _raised(lambda: dist.dtensor_from_local(torch.ones(2), mesh, [dist.Shard(0)], shape=[6 if r else 5]))
    return msg, dist.unshard_dtensor(t).tolist(), msg2, msg3, _world_goes_on()


@pytest.mark.timeout(60)
def test_uneven_blocks_without_a_shape_raise_on_every_rank_with_the_shape_to_pass():
    res = run_ranks(uneven_without_shape, 3, timeout=50)
    head = "dtensor_from_local: the ranks of the mesh give different global shapes: "
    msg = head + ("ranks 0, 1: [6] (their block [2] times the mesh); rank 2: [3] (its block [1] times the mesh). "
                  "The blocks are those of a global shape [5]: pass shape=[5] on every rank")
    msg2 = head + ("rank 0: [3] (its block [1] times the mesh); ranks 1, 2: [6] (their block [2] times the mesh). "
                   "Pass the one global shape (shape=[...]) on every rank, each with its block of it")
    msg3 = head + ("rank 0: shape=[5] (its block [2]); ranks 1, 2: shape=[6] (their block [2]). "
                   "The blocks are those of a global shape [6]: pass shape=[6] on every rank")
    dense = [0.0, 1.0, 10.0, 11.0, 20.0]
    assert res == [(msg, dense, msg2, msg3, 3.0)] * 3


def even_blocks():
    """Even blocks, no shape: local x mesh, as before (no error); a co-sharded dim too."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    t = dist.dtensor_from_local(torch.full((2, 3), float(r)), mesh, [dist.Shard(0), dist.Shard(0)])
    return list(t.shape), dist.unshard_dtensor(t)[:, 0].tolist()


@pytest.mark.timeout(60)
def test_even_blocks_need_no_shape():
    res = run_ranks(even_blocks, 4, timeout=50)
    assert res == [([8, 3], [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0])] * 4


def blocks_of_two_dtypes():
    """shape=[4, 2] on [0, 1, 2]: ranks 0 and 2 pass float32 blocks, rank 1 float64 (on gloo the later reshard's
    collective then aborts the processes; on thread ranks the ranks' values mixed)."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh = dist.ProcessMesh([0, 1, 2], dim_names=["x"])
    local = torch.ones(2 if r < 2 else 0, 2, dtype=torch.float64 if r == 1 else torch.float32)
    msg = _raised(lambda: dist.dtensor_from_local(local, mesh, [dist.Shard(0)], shape=[4, 2]))
    return msg, _world_goes_on()


@pytest.mark.timeout(60)
def test_blocks_of_different_dtypes_raise_on_every_rank():
    msg = ("dtensor_from_local: the ranks of the mesh give blocks of different dtypes: ranks 0, 2: float32; "
           "rank 1: float64. Pass every rank's block in one dtype")
    assert run_ranks(blocks_of_two_dtypes, 3, timeout=50) == [(msg, 3.0)] * 3
