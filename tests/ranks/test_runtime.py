"""Runtime on gloo ranks: shard_tensor, reshard, dtensor_from_local, SPMD ops and autograd, against one process."""

import itertools
import random

import numpy as np
import pytest
import torch

from meshviz.core import Partial, ReduceType, Replicate, Shard
from meshviz.core.planner import plan_reshard, simulate
from meshviz.testing import RankFailed, run_ranks

SEED_MESH = [[2, 4, 5], [0, 1, 3]]


def _expect_local(value, src_mesh, src, dst_mesh, dst, rank):
    plan = plan_reshard(value.shape, src_mesh, src, dst_mesh, dst)
    return simulate(plan, value).get(rank)


# -- seed 001 sections 1, 2, 5, 6 -----------------------------------------------------------------------


def seed_sections():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    res = {}
    mesh = dist.ProcessMesh(SEED_MESH, dim_names=["x", "y"])
    dense = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]])
    d = dist.shard_tensor(dense, mesh, [dist.Shard(0), dist.Shard(1)])
    assert isinstance(d, torch.Tensor) and list(d.shape) == [4, 3]
    assert d.placements == [dist.Shard(0), dist.Shard(1)] and d.process_mesh == mesh
    res["s1"] = d._local_value().tolist()
    assert d.to_local().tolist() == res["s1"]
    res["s1_full"] = dist.unshard_dtensor(d).tolist()
    m = dist.ProcessMesh([0, 1], dim_names=["x"])
    a = torch.tensor([[1, 2, 3], [4, 5, 6]])
    if r < 2:
        res["s5_0"] = dist.shard_tensor(a, m, [dist.Shard(0)])._local_value().tolist()
        res["s5_1"] = dist.shard_tensor(a, m, [dist.Shard(1)])._local_value().tolist()
    else:
        # ranks outside the mesh hold an empty block and do not hang
        assert dist.shard_tensor(a, m, [dist.Shard(0)])._local_value().numel() == 0
    with pytest.raises(ValueError, match=r"Shard\(2\) is out of range"):
        dist.shard_tensor(a, m, [dist.Shard(2)])
    with pytest.raises(ValueError, match=r"Shard\(3\) is out of range"):
        dist.shard_tensor(a, m, [dist.Shard(3)])
    p = dist.shard_tensor(a, m, [dist.Partial()])
    res["s6_p"] = p._local_value().tolist() if r < 2 else None
    res["s6_pr"] = dist.reshard(p, m, [dist.Replicate()])._local_value().tolist() if r < 2 else None
    s = dist.shard_tensor(a, m, [dist.Shard(0)])
    out = dist.reshard(s, m, [dist.Replicate()])
    res["s6_sr"] = out._local_value().tolist() if r < 2 else None
    assert out.placements == [dist.Replicate()]
    return res


def test_seed_001_sections_1_5_6_on_6_ranks():
    res = run_ranks(seed_sections, 6, timeout=120)
    full = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    # rank at mesh coordinate c holds block c, also for these non-increasing ids
    expect = {2: [[1], [4]], 4: [[2], [5]], 5: [[3], [6]], 0: [[7], [10]], 1: [[8], [11]], 3: [[9], [12]]}
    for r in range(6):
        assert res[r]["s1"] == expect[r], r
        assert res[r]["s1_full"] == full
    assert res[0]["s5_0"] == [[1, 2, 3]] and res[1]["s5_0"] == [[4, 5, 6]]
    assert res[0]["s5_1"] == [[1, 2], [4, 5]] and res[1]["s5_1"] == [[3], [6]]
    assert res[0]["s6_p"] == [[1, 2, 3], [4, 5, 6]] and res[1]["s6_p"] == [[0, 0, 0], [0, 0, 0]]
    for r in (0, 1):
        assert res[r]["s6_pr"] == [[1, 2, 3], [4, 5, 6]]
        assert res[r]["s6_sr"] == [[1, 2, 3], [4, 5, 6]]


# -- every reshard against the planner's simulation and the single-process tensor ------------------------

_PL = [Shard(0), Shard(1), Replicate(), Partial(), Partial(ReduceType.kRedMax), Partial(ReduceType.kRedAvg)]


def _cases_2d(n, seed=0):
    rng = random.Random(seed)
    pairs = list(itertools.product(itertools.product(_PL, repeat=2), repeat=2))
    rng.shuffle(pairs)
    return pairs[:n]


def many_reshards(mesh_ids, shape, cases):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh = dist.ProcessMesh(mesh_ids, dim_names=["x", "y"][: np.asarray(mesh_ids).ndim])
    value = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 1
    checked = 0
    for src, dst in cases:
        t = dist.shard_tensor(torch.from_numpy(value), mesh, list(src))
        out = dist.reshard(t, mesh, list(dst))
        want = _expect_local(value, mesh, src, mesh, dst, r)
        got = out._local_value()
        if want is None:
            assert got.numel() == 0
        else:
            assert got.shape == want.shape, (src, dst, got.shape, want.shape)
            np.testing.assert_allclose(got.numpy(), want, err_msg=f"{src}->{dst} rank {r}")
            checked += 1
        assert out.placements == list(plan_reshard(shape, mesh, src, mesh, dst).dst_placements)
    full = dist.unshard_dtensor(dist.reshard(t, mesh, [Shard(1), Partial()][: mesh.ndim]))
    if mesh.contains(r):
        np.testing.assert_allclose(full.numpy(), value)
    return checked


def test_reshards_on_seed_mesh_uneven_shape():
    res = run_ranks(many_reshards, 6, SEED_MESH, (5, 7), _cases_2d(120), timeout=240)
    assert all(c == 120 for c in res)


def test_reshards_on_sub_mesh_1d():
    cases = [((a,), (b,)) for a in _PL for b in _PL]
    res = run_ranks(many_reshards, 4, [3, 1, 2], (5, 3), cases, timeout=180)
    assert res[0] == 0 and all(c == len(cases) for c in res[1:])


def test_co_shard_and_nd_blocks():
    res = run_ranks(nd_blocks, 4, timeout=120)
    assert res[1]["s01"] == [[2, 3], [6, 7]]
    assert [res[r]["co"] for r in range(4)] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]], [[8, 9, 10, 11]], [[12, 13, 14, 15]]]
    assert [res[r]["uneven"] for r in range(4)] == [2, 2, 1, 0]


def nd_blocks():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    v = torch.arange(16).reshape(4, 4)
    res = {
        "s01": dist.shard_tensor(v, mesh, [dist.Shard(0), dist.Shard(1)])._local_value().tolist(),
        "co": dist.shard_tensor(v, mesh, [dist.Shard(0), dist.Shard(0)])._local_value().tolist(),
    }
    m4 = dist.ProcessMesh([0, 1, 2, 3])
    res["uneven"] = dist.shard_tensor(torch.arange(5), m4, [dist.Shard(0)])._local_value().numel()
    # even all-to-all in both directions, and across a 3-D tensor's middle dim
    value = np.arange(8 * 4 * 8, dtype=np.float32).reshape(8, 4, 8)
    for src, dst in [(0, 2), (2, 0), (1, 2), (2, 1)]:
        t = dist.shard_tensor(torch.from_numpy(value), m4, [dist.Shard(src)])
        got = dist.reshard(t, m4, [dist.Shard(dst)])._local_value().numpy()
        want = _expect_local(value, m4, [Shard(src)], m4, [Shard(dst)], dist.get_rank())
        np.testing.assert_array_equal(got, want)
    return res


# -- across meshes ----------------------------------------------------------------------------------------


def cross_mesh():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    value = np.arange(2 * 6 * 5, dtype=np.float32).reshape(2, 6, 5)
    m0 = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    m1 = dist.ProcessMesh([[4, 5], [6, 7]], dim_names=["x", "y"])
    m_line = dist.ProcessMesh([5, 2, 7], dim_names=["x"])
    m_overlap = dist.ProcessMesh([[2, 3], [4, 5]], dim_names=["x", "y"])
    cases = [
        (m0, [Shard(0), Partial()], m1, [Shard(0), Shard(2)]),  # seed 001 4.4
        (m0, [Replicate(), Replicate()], m1, [Replicate(), Replicate()]),
        (m0, [Shard(1), Shard(0)], m_line, [Shard(1)]),
        (m_line, [Partial()], m0, [Partial(), Shard(2)]),
        (m0, [Shard(0), Shard(1)], m_overlap, [Shard(1), Shard(0)]),
    ]
    for sm, sp, dm, dp in cases:
        t = dist.shard_tensor(torch.from_numpy(value), sm, sp)
        out = dist.reshard(t, dm, dp)
        want = _expect_local(value, sm, sp, dm, dp, r)
        got = out._local_value()
        if want is None:
            assert got.numel() == 0
        else:
            np.testing.assert_allclose(got.numpy(), want, err_msg=f"{sp}->{dp} rank {r}")
        full = dist.unshard_dtensor(out)
        if dm.contains(r):
            np.testing.assert_allclose(full.numpy(), value)
    return True


def test_reshard_across_meshes_8_ranks():
    assert all(run_ranks(cross_mesh, 8, timeout=180))


# -- SPMD ops, autograd, optimizers ------------------------------------------------------------------------


def _mlp_weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=g), torch.randn(16, 8, generator=g), torch.randn(4, 8, generator=g)


def mlp(kind):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    w0, w1, x = _mlp_weights()
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    if kind == "tp":  # seed 001 4.2: column- then row-parallel
        p0 = dist.shard_tensor(torch.nn.Parameter(w0.clone()), mesh, [dist.Shard(1)])
        p1 = dist.shard_tensor(torch.nn.Parameter(w1.clone()), mesh, [dist.Shard(0)])
        xx = x
    else:  # seed 001 4.1: data parallel
        p0 = dist.shard_tensor(torch.nn.Parameter(w0.clone()), mesh, [dist.Replicate()])
        p1 = dist.shard_tensor(torch.nn.Parameter(w1.clone()), mesh, [dist.Replicate()])
        xx = dist.shard_tensor(x, mesh, [dist.Shard(0)])
    assert isinstance(p0, torch.nn.Parameter) and p0.requires_grad
    opt = torch.optim.AdamW([p0, p1], lr=0.01)
    losses, pls = [], None
    for _ in range(3):
        y = torch.matmul(xx, p0)
        z = torch.matmul(y, p1)
        loss = z.relu().mean()
        pls = [repr(y.placements), repr(z.placements)]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(dist.unshard_dtensor(loss).detach()))
    return {"pls": pls, "losses": losses, "w0": dist.unshard_dtensor(p0).detach(),
            "w1": dist.unshard_dtensor(p1).detach()}


def _reference():
    w0, w1, x = _mlp_weights()
    p0, p1 = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w1.clone())
    opt = torch.optim.AdamW([p0, p1], lr=0.01)
    losses = []
    for _ in range(3):
        loss = (x @ p0 @ p1).relu().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, p0.detach(), p1.detach()


@pytest.mark.parametrize("kind,pls", [("tp", ["[S(1)]", "[P(sum)]"]), ("dp", ["[S(0)]", "[S(0)]"])])
def test_seed_mlp_training_matches_single_process(kind, pls):
    losses, w0, w1 = _reference()
    res = run_ranks(mlp, 4, kind, timeout=120)
    for r in res:
        assert r["pls"] == pls  # column parallel -> Shard(last); row parallel -> Partial; dp -> Shard(0)
        np.testing.assert_allclose(r["losses"], losses, rtol=1e-5)
        torch.testing.assert_close(r["w0"], w0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["w1"], w1, rtol=1e-5, atol=1e-6)


def spmd_ops():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    g = torch.Generator().manual_seed(1)
    a = torch.randn(4, 6, generator=g, requires_grad=True)
    b = torch.randn(6, generator=g, requires_grad=True)
    emb = torch.randn(10, 4, generator=g, requires_grad=True)
    idx = torch.tensor([[1, 2], [9, 0], [3, 3], [4, 7]])
    da = dist.shard_tensor(a.detach(), mesh, [dist.Shard(0), dist.Shard(1)], stop_gradient=False)
    db = dist.shard_tensor(b.detach(), mesh, [dist.Replicate(), dist.Shard(0)], stop_gradient=False)
    de = dist.shard_tensor(emb.detach(), mesh, [dist.Replicate(), dist.Replicate()], stop_gradient=False)
    di = dist.shard_tensor(idx, mesh, [dist.Shard(0), dist.Replicate()])
    s = (da * db + 1.0).relu()  # elementwise with broadcasting
    col_sum = s.sum(dim=1)  # reduce over a sharded dim -> Partial
    assert any(p.is_partial() for p in col_sum.placements), col_sum.placements
    e = torch.nn.functional.embedding(di, de)
    total = col_sum.sum() + s.mean() + e.sum() * 0.5
    total.backward()
    ref = ((a * b + 1.0).relu().sum(dim=1)).sum() + (a * b + 1.0).relu().mean() + emb[idx].sum() * 0.5
    ref.backward()
    torch.testing.assert_close(dist.unshard_dtensor(total).detach(), ref.detach())
    torch.testing.assert_close(dist.unshard_dtensor(da.grad), a.grad)
    torch.testing.assert_close(dist.unshard_dtensor(db.grad), b.grad)
    torch.testing.assert_close(dist.unshard_dtensor(de.grad), emb.grad)
    return [repr(col_sum.placements), repr(da.grad.placements)]


def test_spmd_elementwise_reduction_embedding_autograd():
    res = run_ranks(spmd_ops, 4, timeout=120)
    assert len({tuple(r) for r in res}) == 1


def reshard_grad():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh0 = dist.ProcessMesh([0, 1], dim_names=["x"])
    mesh1 = dist.ProcessMesh([2, 3], dim_names=["x"])
    g = torch.Generator().manual_seed(2)
    w0, w1, x = torch.randn(8, 16, generator=g), torch.randn(16, 4, generator=g), torch.randn(4, 8, generator=g)
    rw0, rw1 = w0.clone().requires_grad_(), w1.clone().requires_grad_()
    ref = (x @ rw0 @ rw1).mean()
    ref.backward()
    # seed 001 4.3: two stages on two meshes; the reshard carries activations forward and gradients back
    p0 = dist.shard_tensor(torch.nn.Parameter(w0.clone()), mesh0, [dist.Replicate()])
    p1 = dist.shard_tensor(torch.nn.Parameter(w1.clone()), mesh1, [dist.Replicate()])
    y = torch.matmul(x, p0)
    y = dist.reshard(y, mesh1, [dist.Replicate()])
    z = torch.matmul(y, p1)
    loss = z.mean()
    loss.backward()
    r = dist.get_rank()
    g0 = dist.unshard_dtensor(p0.grad)
    g1 = dist.unshard_dtensor(p1.grad)
    if r in (0, 1):
        torch.testing.assert_close(g0, rw0.grad)
        assert p1.grad._local_value().numel() == 0
    else:
        torch.testing.assert_close(g1, rw1.grad)
        torch.testing.assert_close(dist.unshard_dtensor(loss).detach(), ref.detach())
    return True


def test_pipeline_reshard_backward_across_meshes():
    assert all(run_ranks(reshard_grad, 4, timeout=120))


# -- dtensor_from_local, local_map ---------------------------------------------------------------------


def from_local():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh = dist.ProcessMesh([[2, 4, 5], [0, 1, 3]], dim_names=["x", "y"])
    coord = mesh.coordinate(r)
    local = torch.full((2, 2), float(r), requires_grad=True)
    t = dist.dtensor_from_local(local, mesh, [dist.Shard(0), dist.Shard(1)])
    assert list(t.shape) == [4, 6]
    full = dist.unshard_dtensor(t)
    # block (i, j) of the global tensor is the local value of the rank at coordinate (i, j)
    for i in range(2):
        for j in range(3):
            assert (full[2 * i : 2 * i + 2, 2 * j : 2 * j + 2] == mesh.mesh[i][j]).all()
    (full * 3).sum().backward()
    assert local.grad.eq(3).all()
    back = dist.dtensor_to_local(t)
    assert back.tolist() == local.tolist()
    f = dist.local_map(lambda v: v * 2 + coord[1], out_placements=[[dist.Shard(0), dist.Shard(1)]])
    doubled = dist.unshard_dtensor(f(t))
    assert doubled[0, 2].item() == mesh.mesh[0][1] * 2 + 1
    with pytest.raises(ValueError, match="does not match the block"):
        dist.dtensor_from_local(torch.zeros(3, 3), mesh, [dist.Shard(0), dist.Shard(1)], shape=[4, 6])
    return True


def test_dtensor_from_local_and_local_map():
    assert all(run_ranks(from_local, 6, timeout=120))


def local_map_off_the_mesh():
    """A pipeline stage's local function: ranks 2 and 3 are outside the stage's mesh [0, 1]."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    t = dist.shard_tensor(torch.arange(12.0).reshape(4, 3), mesh, [dist.Shard(0)])
    f = dist.local_map(lambda v: torch.cat([v, torch.ones(v.shape[0], 1)], 1) * 2, [[dist.Shard(0)]])
    out = f(t)
    return list(out.shape), out.placements, out._local_value().tolist()


def test_local_map_on_a_rank_outside_the_mesh_agrees_on_the_shape():
    res = run_ranks(local_map_off_the_mesh, 4, timeout=120)
    want = (torch.cat([torch.arange(12.0).reshape(4, 3), torch.ones(4, 1)], 1) * 2).tolist()
    assert [r[:2] for r in res] == [([4, 4], [dist_shard0()])] * 4  # every rank: the same global shape
    assert res[0][2] + res[1][2] == want and res[2][2] == res[3][2] == []


def local_map_as_paddle():
    """Paddle's local_map: nested inputs flattened, one placement list per output value; uneven blocks too."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1, 2], dim_names=["x"])
    dense = torch.arange(10.0).reshape(5, 2)  # 5 rows on 3 ranks: 2, 2, 1
    a = dist.shard_tensor(dense, mesh, [dist.Shard(0)])
    b = dist.shard_tensor(dense * 10, mesh, [dist.Shard(0)])
    summed = dist.local_map(lambda xs, k: xs[0] + xs[1] * k["k"], [[dist.Shard(0)]])([a, b], {"k": 2})
    both = dist.local_map(lambda x: {"twice": x * 2, "n": x.shape[0]}, [[dist.Shard(0)], None])(a)
    errors = []
    for call in (lambda: dist.local_map(lambda x: (x + 1, x * 2), [[dist.Shard(0)]])(a),
                 lambda: dist.local_map(lambda x: x, [[dist.Shard(0)], [dist.Shard(0)]])(a),
                 lambda: dist.local_map(lambda x: (x, 3), [[dist.Shard(0)], [dist.Shard(0)]])(a),
                 lambda: dist.local_map(lambda x: x, [[dist.Shard(0)]], in_placements=[[dist.Shard(0)]])([a, b])):
        try:
            call()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e).split(" of ")[0].split(" (")[0])
    return (list(summed.shape), dist.unshard_dtensor(summed).tolist(), list(both["twice"].shape),
            dist.unshard_dtensor(both["twice"]).tolist(), both["n"], errors)


def test_local_map_flattens_nested_inputs_and_checks_one_placement_per_output():
    dense = torch.arange(10.0).reshape(5, 2)
    for r, out in enumerate(run_ranks(local_map_as_paddle, 3, timeout=60)):
        shape, summed, shape2, twice, n, errors = out
        assert shape == shape2 == [5, 2]  # as the input (an uneven split), on every rank
        assert summed == (dense * 21).tolist() and twice == (dense * 2).tolist()
        assert n == [2, 2, 1][r]
        assert errors == ["local_map: 1 out_placements for 2 output(s)", "local_map: 2 out_placements for 1 output(s)",
                          "local_map: an output", "local_map: 1 in_placements for 2 inputs"], errors


def dist_shard0():
    from meshviz import Shard

    return Shard(0)


# -- bad input: a clear error on every rank, before any communication ---------------------------------------


def bad_inputs():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    a = torch.ones(2, 3)
    errors = []
    for fn, pattern in [
        (lambda: dist.shard_tensor(a, mesh, [dist.Shard(2)]), r"Shard\(2\) is out of range"),
        (lambda: dist.shard_tensor(a, mesh, [dist.Shard(0), dist.Shard(1)]), "2 placements"),
        (lambda: dist.ProcessMesh([0, 0]), "distinct"),
        (lambda: dist.ProcessMesh([0, -1]), "non-negative"),
        (lambda: dist.shard_tensor(a, dist.ProcessMesh([0, 5]), [dist.Shard(0)]), "only 2 ranks"),
        (lambda: mesh.get_dim_size("z"), "unknown mesh dim name"),
        (lambda: dist.reshard(dist.shard_tensor(a, mesh, [dist.Shard(0)]), mesh, [dist.Shard(5)]), "out of range"),
        (lambda: dist.reshard(a, mesh, [dist.Replicate()]), "expects a dist tensor"),
        (lambda: dist.shard_tensor(a, [0, 1], [dist.Shard(0)]), "expected a ProcessMesh"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            fn()
        errors.append(pattern)
    # a trailing Replicate past the mesh's axes is dropped, as Paddle drops it (with a warning)
    with pytest.warns(UserWarning, match="trailing Replicate"):
        t = dist.shard_tensor(a, mesh, [dist.Shard(0), dist.Replicate()])
    assert t.placements == [dist.Shard(0)] and list(t._local_value().shape) == [1, 3]
    # a Partial value read on one rank would be a summand, not the value
    with pytest.raises(ValueError, match="unshard_dtensor"):
        dist.shard_tensor(torch.ones(2), mesh, [dist.Shard(0)]).sum().item()
    assert dist.shard_tensor(torch.ones(2), mesh, [dist.Replicate()]).sum().item() == 2.0
    # nothing is lost: after the errors the ranks still talk
    t = dist.reshard(dist.shard_tensor(a * (r + 1), mesh, [dist.Partial()]), mesh, [dist.Replicate()])
    return t._local_value().sum().item(), len(errors)


def test_bad_input_clear_errors_on_every_rank():
    res = run_ranks(bad_inputs, 2, timeout=60)
    assert res == [(6.0, 9), (6.0, 9)]


def raises_on_rank_1():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    t = dist.shard_tensor(torch.ones(4), mesh, [dist.Shard(0)])
    if dist.get_rank() == 1:
        raise RuntimeError("boom on purpose")
    dist.reshard(t, mesh, [dist.Replicate()])  # rank 0 waits here for rank 1
    return True


def test_a_raising_rank_is_named_and_nobody_hangs():
    # on gloo processes rank 0's all_gather may fail (rank 1's connection closed) before rank 1's own report comes:
    # then the roll-call names rank 1 as the one that never entered it, with the same error
    named = r"rank 1 (raised|never entered all_gather #1 on group \[0, 1\]: it is dead \(it raised) RuntimeError: " \
            r"boom on purpose"
    with pytest.raises(RankFailed, match=named) as info:
        run_ranks(raises_on_rank_1, 2, timeout=60, collective_timeout=5)
    # rank 0 ended by itself (its collective timed out after 5 s): nobody had to be killed at the deadline
    assert "still running" not in str(info.value)


# -- every Partial reduction, against the tensor itself -------------------------------------------------------

_ALL_PL = [Shard(0), Shard(1), Replicate()] + [Partial(rt) for rt in ReduceType]
_PROD, _MAX, _MIN = ReduceType.kRedProd, ReduceType.kRedMax, ReduceType.kRedMin


def reshards_against_the_tensor(mesh_ids, shape, cases):
    """For each (source, target, from_dense): shard_tensor of a tensor (or dtensor_from_local of arbitrary summands),
    reshard, unshard_dtensor: the tensor comes back."""
    import meshviz.distributed as dist

    from ..partials import random_locals

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh = dist.ProcessMesh(mesh_ids, dim_names=["x", "y", "z"][: np.asarray(mesh_ids).ndim])
    for i, (src, dst, from_dense) in enumerate(cases):
        rng = np.random.default_rng(i)  # the same on every rank
        if from_dense:
            value = rng.integers(1, 4, size=shape).astype(np.float64)
            t = dist.shard_tensor(torch.from_numpy(value), mesh, list(src))
        else:
            locs, value = random_locals(rng, shape, mesh, src)
            t = dist.dtensor_from_local(torch.from_numpy(locs[r]), mesh, list(src), shape=list(shape))
        out = dist.reshard(t, mesh, list(dst))
        assert out.placements == list(dst), (src, dst, out.placements)
        full = dist.unshard_dtensor(out)
        np.testing.assert_allclose(full.numpy(), value, err_msg=f"{list(src)} -> {list(dst)} on rank {r}")
    return len(cases)


def _mixed_cases_2x2(n, seed=0):
    """The transitions that were wrong (a PROD target over a pending SUM axis, from a dense tensor and from
    summands; outer reductions taken before inner ones they do not commute with), then a seeded sample of all 4096
    from arbitrary summands, in which every reduction appears."""
    P = Partial
    reported = [((a, P()), (P(_PROD), b)) for a in _ALL_PL for b in (Shard(0), Shard(1), P())]
    nested = [((P(_MAX), P()), (Replicate(), P())), ((P(), P(_MAX)), (Shard(0), Shard(0))),
              ((P(_MIN), P(_PROD)), (Replicate(), Replicate())), ((P(_PROD), P()), (Shard(1), P(_MAX)))]
    pairs = list(itertools.product(itertools.product(_ALL_PL, repeat=2), repeat=2))
    random.Random(seed).shuffle(pairs)
    return ([(s, d, True) for s, d in reported] + [(s, d, False) for s, d in reported + nested]
            + [(s, d, False) for s, d in pairs[:n]])


def test_every_reduction_on_2x2_against_the_tensor():
    # the reported case first: [R, P] -> [P(prod), S(0)] came back as twice the tensor
    cases = _mixed_cases_2x2(80)
    assert cases[6][:2] == ((Replicate(), Partial()), (Partial(_PROD), Shard(0)))
    assert {p.reduce_type for s, d, _ in cases for p in s + d if p.is_partial()} == set(ReduceType)
    res = run_ranks(reshards_against_the_tensor, 4, [[2, 0], [3, 1]], (3, 5), cases, timeout=240)
    assert res == [len(cases)] * 4


def test_every_one_axis_transition_on_4_ranks_against_the_tensor():
    cases = [((a,), (b,), dense) for a in _ALL_PL for b in _ALL_PL for dense in (True, False)]
    res = run_ranks(reshards_against_the_tensor, 4, [1, 3, 0, 2], (6, 3), cases, timeout=240)
    assert res == [128] * 4


# -- ProcessMesh on ranks: mesh[name], get_group, meshes equal by ids; dtensor_from_fn ----------------------


def mesh_surface():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    assert isinstance(dist.Shard(0), dist.Placement) and "Placement" in dist.__all__
    m = dist.ProcessMesh([[2, 0], [3, 1]], dim_names=["x", "y"])
    res = {"x": m["x"].process_ids, "y": m["y"].process_ids}
    # the group of this rank's line along an axis, with real values through it
    for name in ("x", "y"):
        g = m.get_group(name)
        t = torch.tensor([float(r)])
        dist.all_reduce(t, group=g)
        res["g" + name] = (g.ranks, g.rank, t.item())
    line = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    res["g1d"] = line.get_group().ranks
    with pytest.raises(ValueError, match="name the mesh dim"):
        m.get_group()
    # Replicate tensors on meshes that differ only in axis names meet in one op, as in Paddle
    a = dist.shard_tensor(torch.ones(2, 2), dist.ProcessMesh([0, 1, 2, 3], ["x"]), [dist.Replicate()])
    b = dist.shard_tensor(torch.full((2, 2), 2.0), dist.ProcessMesh([0, 1, 2, 3], ["dp"]), [dist.Replicate()])
    res["sum"] = dist.unshard_dtensor(a + b).tolist()
    # dtensor_from_fn: every rank builds the tensor with fn(*args, **kwargs) and keeps its block
    d = dist.dtensor_from_fn(torch.arange, line, [dist.Shard(0)], 8, dtype=torch.float32)
    res["fn"] = (d._local_value().tolist(), dist.unshard_dtensor(d).tolist(), d.placements == [dist.Shard(0)])
    p = dist.dtensor_from_fn(torch.ones, m, [dist.Partial(), dist.Shard(1)], 2, 4)
    res["fn_partial"] = dist.unshard_dtensor(p).tolist()
    return res


def test_mesh_surface_and_dtensor_from_fn_on_4_ranks():
    res = run_ranks(mesh_surface, 4, timeout=120)
    # mesh[name]: the calling rank's line (what Paddle 3.3.1 gives on the same mesh)
    assert [(res[r]["x"], res[r]["y"]) for r in range(4)] == [([0, 1], [2, 0]), ([0, 1], [3, 1]),
                                                             ([2, 3], [2, 0]), ([2, 3], [3, 1])]
    for r in range(4):
        line_x, line_y = res[r]["x"], res[r]["y"]
        assert res[r]["gx"] == (sorted(line_x), sorted(line_x).index(r), float(sum(line_x)))
        assert res[r]["gy"] == (sorted(line_y), sorted(line_y).index(r), float(sum(line_y)))
        assert res[r]["g1d"] == [0, 1, 2, 3]
        assert res[r]["sum"] == [[3.0, 3.0], [3.0, 3.0]]
        assert res[r]["fn"] == ([2.0 * r, 2.0 * r + 1], [float(i) for i in range(8)], True)
        assert res[r]["fn_partial"] == [[1.0] * 4] * 2
