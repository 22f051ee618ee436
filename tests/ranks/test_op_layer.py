"""The op layer: values and gradients against the dense run, and the placements Paddle 3.3.1 gives (run on its CPU
build with 2 ranks; each expected placement below is what it printed)."""

import pytest
import torch
import torch.nn.functional as F

from meshviz import compat
from meshviz.core.placements import parse_placement
from meshviz.testing import run_ranks


def _setup():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    return dist, dist.ProcessMesh([0, 1], dim_names=["x"])


def mse_grad():
    dist, mesh = _setup()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)
    dx = dist.shard_tensor(x, mesh, [dist.Shard(0)]).requires_grad_()
    dy = dist.shard_tensor(y, mesh, [dist.Shard(0)])
    loss = F.mse_loss(dx, dy)
    loss.backward()
    ref = x.clone().requires_grad_()
    F.mse_loss(ref, y).backward()
    torch.testing.assert_close(dist.unshard_dtensor(loss), F.mse_loss(x, y))
    torch.testing.assert_close(dist.unshard_dtensor(dx.grad), ref.grad)
    return repr(dx.grad.placements)


def test_mse_loss_gradient_is_the_dense_gradient():
    # torch DTensor's rule for aten.mse_loss_backward gives 2x on 2 ranks; the op layer runs its decomposition
    assert run_ranks(mse_grad, 2) == ["[S(0)]"] * 2


def masked_select_default_rule(placement):
    import meshviz.trace as trace

    dist, mesh = _setup()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, generator=g)
    if placement == "P":
        local = torch.randn(4, 6, generator=g)
        local = local if dist.get_rank() == 0 else x - local
        dx = dist.dtensor_from_local(local, mesh, [dist.Partial()], shape=[4, 6]).requires_grad_()
    else:
        dx = dist.shard_tensor(x, mesh, [parse_placement(placement)]).requires_grad_()
    with trace.record() as events:
        out = torch.masked_select(dx, dx > 0)
    (out * torch.arange(out.shape[0], dtype=out.dtype)).sum().backward()
    ref = x.clone().requires_grad_()
    rout = torch.masked_select(ref, ref > 0)
    (rout * torch.arange(rout.shape[0], dtype=rout.dtype)).sum().backward()
    assert out.placements == [dist.Replicate()]
    torch.testing.assert_close(out._local_value(), rout.detach())
    torch.testing.assert_close(dist.unshard_dtensor(dx.grad), ref.grad)
    rules = [(e.op, e.payload.rule) for e in events.of_kind("op")]
    assert ("masked_select.default", "default") in rules, rules
    assert bool(events.of_kind("reshard")) == (placement != "R")
    try:
        torch.masked_select(dist.shard_tensor(x, mesh, [dist.Shard(0)]), torch.ones(5, dtype=torch.bool))
    except ValueError as e:
        assert "masked_select" in str(e)
    else:
        raise AssertionError("a mask of the wrong shape was let through")
    return True


@pytest.mark.parametrize("placement", ["S(0)", "S(1)", "R", "P"])
def test_masked_select_runs_by_paddles_default_rule(placement):
    assert run_ranks(masked_select_default_rule, 2, placement) == [True, True]


def strided_view():
    dist, mesh = _setup()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 8, 4, 48, generator=g)
    got = {}
    for d in range(4):
        t = dist.shard_tensor(x, mesh, [dist.Shard(d)])
        got[d] = repr(t.reshape([64, 48]).placements)
    xs = dist.shard_tensor(x, mesh, [dist.Shard(2)]).requires_grad_()
    t = xs.reshape([64, 48])
    assert t._local_shape == [64, 48] and t.local_shape == [64, 48]
    torch.testing.assert_close(t._local_value(), x.reshape(64, 48))
    torch.testing.assert_close(dist.unshard_dtensor(t), x.reshape(64, 48))
    w = torch.randn(64, 48, generator=g)
    (t * w).sum().backward()
    assert xs.grad.placements == [dist.Shard(2)]
    torch.testing.assert_close(dist.unshard_dtensor(xs.grad), w.reshape(2, 8, 4, 48))
    h = torch.randn(4, 6, 8, generator=g)
    lin = torch.nn.Linear(8, 3)
    import meshviz.trace as trace

    with trace.record() as events:
        o = lin(dist.shard_tensor(h, mesh, [dist.Shard(1)]))
    torch.testing.assert_close(dist.unshard_dtensor(o), lin(h))
    moved = events.of_kind("collective", "reshard_step")
    return got, repr(o.placements), len(moved)


def test_strided_views_read_as_paddles_reshape_rule():
    res = run_ranks(strided_view, 2)
    got, linear, moved = res[0]
    # Paddle 3.3.1: [2, 8, 4, 48] reshaped to [64, 48] keeps S(0), Replicate for S(1)/S(2), S(3) -> S(1)
    assert got == {0: "[S(0)]", 1: "[R]", 2: "[R]", 3: "[S(1)]"}
    # a Linear over a sequence-sharded activation keeps S(1) and moves nothing, as Paddle's matmul; torch 2.11
    # gathers it (its view rule cannot flatten a split non-leading dim): the same values, Replicate
    if compat.linear_keeps_split_batch_dims():
        assert linear == "[S(1)]" and moved == 0
    else:
        assert linear == "[R]" and moved == 1


def grad_placements():
    dist, mesh = _setup()
    g = torch.Generator().manual_seed(3)
    out = {}

    def leaf(t, pl):
        return dist.shard_tensor(t, mesh, [pl]).requires_grad_()

    a, b = torch.randn(4, 6, generator=g), torch.randn(6, 5, generator=g)
    da, db = leaf(a, dist.Shard(1)), leaf(b, dist.Replicate())
    (da @ db).sum().backward()
    ra, rb = a.clone().requires_grad_(), b.clone().requires_grad_()
    (ra @ rb).sum().backward()
    torch.testing.assert_close(dist.unshard_dtensor(da.grad), ra.grad)
    torch.testing.assert_close(dist.unshard_dtensor(db.grad), rb.grad)
    out["mm"] = (repr(da.grad.placements), repr(db.grad.placements))

    x, w = torch.randn(4, 6, generator=g), torch.randn(6, 5, generator=g)
    dx, dw = leaf(x, dist.Shard(0)), leaf(w, dist.Replicate())
    (dx @ dw).mean().backward()
    rw = w.clone().requires_grad_()
    (x @ rw).mean().backward()
    torch.testing.assert_close(dist.unshard_dtensor(dw.grad), rw.grad)
    out["dp"] = (repr(dx.grad.placements), repr(dw.grad.placements))

    p, q, bias = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g), torch.randn(6, generator=g)
    dp_, dq, dbias = leaf(p, dist.Shard(0)), leaf(q, dist.Replicate()), leaf(bias, dist.Replicate())
    (dp_ * dq + dbias).relu().sum().backward()
    rp, rq, rbias = (t.clone().requires_grad_() for t in (p, q, bias))
    (rp * rq + rbias).relu().sum().backward()
    for d, r in ((dp_, rp), (dq, rq), (dbias, rbias)):
        torch.testing.assert_close(dist.unshard_dtensor(d.grad), r.grad)
    out["mul"] = (repr(dp_.grad.placements), repr(dq.grad.placements), repr(dbias.grad.placements))

    s0, s2 = torch.randn(4, 6, 2, generator=g), torch.randn(4, 6, 2, generator=g)
    st = torch.stack([dist.shard_tensor(s0, mesh, [dist.Shard(0)]), dist.shard_tensor(s2, mesh, [dist.Shard(2)])])
    torch.testing.assert_close(dist.unshard_dtensor(st), torch.stack([s0, s2]))
    out["stack"] = repr(st.placements)

    z = torch.randn(4, 6, generator=g)
    local = z if dist.get_rank() == 0 else torch.zeros_like(z)
    dz = dist.dtensor_from_local(local, mesh, [dist.Partial()], shape=[4, 6]).requires_grad_()
    zl = dist.dtensor_to_local(dz)
    (zl * (dist.get_rank() + 2.0)).sum().backward()
    # each rank's block got its own gradient; as a Partial tensor they add up: (2 + 3) everywhere
    torch.testing.assert_close(dist.unshard_dtensor(dz.grad), torch.full((4, 6), 5.0))
    out["to_local"] = repr(dz.grad.placements)

    e = torch.arange(8.0).reshape(2, 4)
    wt = torch.tensor([1.0, 2.0, 3.0, 4.0])
    for src, dst in (("R", "S(0)"), ("P", "R"), ("S(0)", "R"), ("R", "P")):
        pl = parse_placement(src) if src != "P" else dist.Partial()
        de = dist.shard_tensor(e, mesh, [pl]).requires_grad_()
        f = dist.reshard(de, mesh, [parse_placement(dst) if dst != "P" else dist.Partial()])
        (f * wt).sum().backward()
        torch.testing.assert_close(dist.unshard_dtensor(de.grad), wt.expand(2, 4))
        out[f"reshard {src}->{dst}"] = repr(de.grad.placements)
    return out


def test_gradients_lie_as_paddle_lays_them():
    res = run_ranks(grad_placements, 2)
    assert res[0] == res[1]
    assert res[0] == {
        "mm": ("[S(1)]", "[R]"),
        "dp": ("[S(0)]", "[P(sum)]"),
        "mul": ("[S(0)]", "[R]", "[P(sum)]"),
        "stack": "[S(1)]",
        "to_local": "[P(sum)]",
        "reshard R->S(0)": "[R]",
        "reshard P->R": "[R]",
        "reshard S(0)->R": "[S(0)]",
        "reshard R->P": "[R]",
    }


def dropout_as_dense():
    dist, _ = _setup()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], ["a", "b"])
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(4))
    got = []
    for pl in ([dist.Shard(0), dist.Replicate()], [dist.Replicate(), dist.Replicate()],
               [dist.Shard(0), dist.Shard(1)], [dist.Partial(), dist.Shard(1)]):
        torch.manual_seed(3)
        dx = dist.shard_tensor(x, mesh, pl).requires_grad_()
        y = F.dropout(dx, 0.4)  # on 5 rows the blocks are uneven: the ranks would draw different amounts
        y2 = F.dropout(dist.shard_tensor(x, mesh, [dist.Replicate(), dist.Replicate()]), 0.3)
        (y * torch.arange(15.0).reshape(5, 3)).sum().backward()
        torch.manual_seed(3)
        rx = x.clone().requires_grad_()
        ry = F.dropout(rx, 0.4)
        ry2 = F.dropout(x, 0.3)
        (ry * torch.arange(15.0).reshape(5, 3)).sum().backward()
        torch.testing.assert_close(dist.unshard_dtensor(y), ry)
        torch.testing.assert_close(y2._local_value(), ry2)  # every replica holds the dense run's mask
        torch.testing.assert_close(dist.unshard_dtensor(dx.grad), rx.grad)
        got.append(repr(y.placements))
    w = dist.shard_tensor(torch.zeros(6, 4), mesh, [dist.Shard(0), dist.Shard(1)])
    torch.manual_seed(5)
    torch.nn.init.normal_(w)
    torch.manual_seed(5)
    torch.testing.assert_close(dist.unshard_dtensor(w), torch.nn.init.normal_(torch.zeros(6, 4)))
    return got


def test_random_ops_draw_what_the_dense_run_draws():
    res = run_ranks(dropout_as_dense, 4)
    assert res[0] == ["[S(0), R]", "[R, R]", "[S(0), S(1)]", "[P(sum), S(1)]"]


def inplace_and_uneven():
    dist, _ = _setup()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], ["a", "b"])
    x = torch.rand(5, 3, generator=torch.Generator().manual_seed(6)) + 0.5
    p = dist.shard_tensor(x, mesh, [dist.Shard(0), dist.Partial()])
    y = (p * 1).log_()  # log of a sum, not a sum of logs
    torch.testing.assert_close(dist.unshard_dtensor(y), x.log())
    c = dist.shard_tensor(x, mesh, [dist.Shard(0), dist.Shard(0)])  # 5 rows nested over 2 x 2: uneven
    torch.testing.assert_close(dist.unshard_dtensor(c.sum(0)), x.sum(0))
    z = torch.logit(p * 0.5)
    z.neg_()  # an in-place op on a tensor laid out anew for torch still writes into the caller's tensor
    torch.testing.assert_close(dist.unshard_dtensor(z), -torch.logit(x * 0.5))
    return repr(y.placements)


def test_inplace_on_partial_and_uneven_co_shards_match_dense():
    assert run_ranks(inplace_and_uneven, 4) == ["[S(0), R]"] * 4


def _extremes_of_empty_tails():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    m4 = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    out = []
    for n in (2, 9):  # 1, 1, 0, 0 rows and 3, 3, 3, 0: a rank holds none
        x = torch.arange(float(n)) - 3
        t = dist.shard_tensor(x, m4, [dist.Shard(0)])
        got = [t.max(), t.min(), torch.amax(t, 0), torch.amin(t, [0]), *torch.aminmax(t)]
        out.append(([dist.unshard_dtensor(v).item() for v in got], x))
    x = torch.arange(15.0).reshape(5, 3)  # 2, 2, 1, 0 rows
    t = dist.shard_tensor(x, m4, [dist.Shard(0)])
    out.append(([dist.unshard_dtensor(torch.amax(t, 0)), dist.unshard_dtensor(torch.amax(t, 1))], x))
    return out


def test_max_and_min_over_an_empty_tail_give_the_dense_value():
    """torch's rule reduces each block and an empty one has no extremum: it raised on the ranks holding none."""
    for out in run_ranks(_extremes_of_empty_tails, 4):
        for got, x in out[:2]:
            assert got == [x.max().item(), x.min().item(), x.max().item(), x.min().item(), x.min().item(),
                           x.max().item()]
        (over_rows, over_cols), x = out[2]
        torch.testing.assert_close(over_rows, x.amax(0))
        torch.testing.assert_close(over_cols, x.amax(1))


def _under_a_torch_function_mode():
    from torch.overrides import TorchFunctionMode

    dist, mesh = _setup()

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    x = torch.arange(16.0).reshape(4, 4)
    d = dist.shard_tensor(x, mesh, [dist.Shard(0)])
    d + d, d.sum(0)  # decided (and each op's call chosen) outside the mode
    out = []
    for t in (x, d):
        with Seen() as seen:  # an aten op called as such passes no torch function: the mode stays on
            s, m = torch.ops.aten.add.Tensor(t, t), torch.ops.aten.sum.dim_IntList(t * 3, [0])
        out.append((seen.names, s, m))
    (dense_names, s0, m0), (names, s1, m1) = out
    torch.testing.assert_close(dist.unshard_dtensor(s1), s0)
    torch.testing.assert_close(dist.unshard_dtensor(m1), m0)
    return names, dense_names


def test_a_torch_function_mode_sees_the_users_calls_only():
    # the op layer runs an op through its Tensor method where that is the same aten op: a mode must not see those
    # calls on each rank's block (nor anything else the dense run does not show it)
    for names, dense_names in run_ranks(_under_a_torch_function_mode, 2):
        assert names == dense_names and len(names) == 3  # the two aten ops and the product


def _torch_rule_moves(shape):
    import meshviz.trace as trace

    dist, _ = _setup()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"]) if shape == "2d" else dist.ProcessMesh(
        [0, 1], dim_names=["x"])
    pl = [dist.Shard(0), dist.Shard(1)] if shape == "2d" else [dist.Shard(0)]
    g = torch.Generator().manual_seed(4)
    x, w, v = torch.randn(4, 6, generator=g), torch.randn(6, 4, generator=g), torch.randn(4, 6, generator=g)
    dx = dist.shard_tensor(x, mesh, pl).requires_grad_()
    dw = dist.shard_tensor(w, mesh, pl).requires_grad_()
    dv = dist.shard_tensor(v, mesh, pl).requires_grad_()
    seen = []
    for _ in range(2):  # the call that decides, then the remembered decision
        with trace.record() as events:
            out = (dx @ dw).softmax(1).cumsum(0) @ dv
        seen.append(sorted((e.kind, e.op) for e in events.events if e.kind in ("collective", "reshard_step")))
    out.sum().backward()
    refs = [t.clone().requires_grad_() for t in (x, w, v)]
    rout = (refs[0] @ refs[1]).softmax(1).cumsum(0) @ refs[2]
    rout.sum().backward()
    torch.testing.assert_close(dist.unshard_dtensor(out), rout.detach())
    for d, r in zip((dx, dw, dv), refs):
        torch.testing.assert_close(dist.unshard_dtensor(d.grad), r.grad)
    return seen


@pytest.mark.parametrize("shape", ["1d", "2d"])
def test_the_moves_torchs_rule_asks_for_are_meshvizs_reshards(shape):
    # mm of a row-sharded weight, softmax and cumsum along a sharded dim: torch's rule gathers first; meshviz's
    # planner makes those moves (reshard events), the same on the call that decides and on the remembered one
    for seen in run_ranks(_torch_rule_moves, 4 if shape == "2d" else 2, shape):
        first, again = seen
        assert first == again and first, seen
        assert all(kind == "reshard_step" for kind, _ in first), first


def _batch_norm_statistics():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    out = {}
    for pl in ("S(1)", "S(0)", "P(sum)"):
        stats = [dist.shard_tensor(v, mesh, [dist.Replicate()]) for v in (torch.zeros(4), torch.ones(4))]
        x = dist.shard_tensor(torch.arange(24.0).reshape(6, 4), mesh, [parse_placement(pl)])
        y = F.batch_norm(x, *stats, training=True, momentum=0.5)  # a channel split moves the statistics
        ev = F.batch_norm(x, *stats, training=False)
        out[pl] = [dist.unshard_dtensor(t) for t in (y, *stats, ev)] + [[str(p) for p in stats[0].placements]]
    return out


def test_batch_norm_updates_running_statistics_held_in_another_layout():
    x, stats = torch.arange(24.0).reshape(6, 4), [torch.zeros(4), torch.ones(4)]
    y = F.batch_norm(x, *stats, training=True, momentum=0.5)
    want = [y, *stats, F.batch_norm(x, *stats, training=False)]
    for res in run_ranks(_batch_norm_statistics, 2, timeout=60):
        for pl, got in res.items():
            assert got[-1] == ["R"], pl  # the caller's layout is kept
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, msg=pl)


def embedding_on_a_sub_mesh():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 2], dim_names=["dp"])  # ranks 1 and 3 are outside it, as another pipeline stage's
    g = torch.Generator().manual_seed(0)
    w = dist.shard_tensor(torch.randn(16, 8, generator=g), mesh, [dist.Shard(0)])
    ids = dist.shard_tensor(torch.arange(16).reshape(4, 4), mesh, [dist.Shard(0)])
    out = F.embedding(ids, w)
    full = dist.unshard_dtensor(out)
    return repr(out.placements), tuple(out.shape), full if mesh.contains(dist.get_rank()) else None


def test_ranks_outside_the_mesh_lay_an_op_out_as_its_members_do():
    """A rank outside an op's mesh keeps only the layout, and it must be the members' (a stage transfer sizes its
    buffers from it): torch prices every move at 0 there, so it chose another strategy for an embedding."""
    w = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    want = F.embedding(torch.arange(16).reshape(4, 4), w)
    got = run_ranks(embedding_on_a_sub_mesh, 4)
    assert {placements for placements, _, _ in got} == {"[S(0)]"}
    assert all(shape == (4, 4, 8) for _, shape, _ in got)
    for r in (0, 2):
        torch.testing.assert_close(got[r][2], want)


def linear_on_a_sub_mesh():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([[0, 1], [4, 5]], dim_names=["dp", "mp"])  # the other four ranks: another stage's
    g = torch.Generator().manual_seed(0)
    x = dist.shard_tensor(torch.randn(4, 4, 8, generator=g), mesh, [dist.Shard(1), dist.Replicate()])
    w = dist.shard_tensor(torch.randn(16, 8, generator=g), mesh, [dist.Replicate(), dist.Shard(0)])
    out = F.linear(x, w)
    full = dist.unshard_dtensor(out)
    return repr(out.placements), tuple(out._local_value().shape), full if mesh.contains(dist.get_rank()) else None


def test_ranks_outside_the_mesh_lay_a_linear_on_a_split_sequence_out_as_its_members_do():
    """``[s, b, h]`` split along b: the members keep torch's strided layout through the 2-D view (2.12 and later),
    and the ranks outside must reach the same ``[S(1), S(2)]`` (they had ``[R, S(2)]``: a stage transfer failed)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 4, 8, generator=g), torch.randn(16, 8, generator=g)
    got = run_ranks(linear_on_a_sub_mesh, 8)
    keeps = compat.linear_keeps_split_batch_dims()  # torch 2.11 gathers the batch first, on every rank
    assert {placements for placements, _, _ in got} == {"[S(1), S(2)]" if keeps else "[R, S(2)]"}, got
    for r in (0, 1, 4, 5):
        assert got[r][1] == ((4, 2, 8) if keeps else (4, 4, 8))
        torch.testing.assert_close(got[r][2], F.linear(x, w))
