"""Paddle's API where programs hit it: short placement lists, co_shard_order, _local_shape, shard_optimizer over a
plain model, global-norm clipping of dist gradients, opt.state[p] under sharding stages; against one process."""

import pytest
import torch

from meshviz.testing import run_ranks

# -- short placement lists, _local_shape, co_shard_order at runtime ------------------------------------------------


def short_lists():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    a = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    t = dist.shard_tensor(a, mesh, [dist.Shard(0)])
    out = {"placements": t.placements, "local": t._local_value().clone(), "local_shape": t._local_shape}
    out["full"] = dist.reshard(t, mesh, [dist.Replicate()])._local_value().clone()
    out["to_s1"] = dist.reshard(t, mesh, [dist.Replicate(), dist.Shard(1)])._local_value().clone()
    blk = a[3 * (r // 2):3 * (r // 2) + 3]
    f = dist.dtensor_from_local(blk, mesh, [dist.Shard(0)])
    out["from_local"] = (list(f.shape), f.placements, dist.unshard_dtensor(f).clone())
    u = dist.shard_tensor(torch.arange(5.0), dist.ProcessMesh([[0, 1, 2, 3]], ["a", "b"]), [dist.Replicate(),
                                                                                          dist.Shard(0)])
    out["uneven_local_shape"] = u._local_shape
    with pytest.warns(UserWarning, match="trailing Replicate past its axes are dropped"):
        long = dist.shard_tensor(a, mesh, [dist.Shard(0), dist.Replicate(), dist.Replicate()])
    out["long"] = (long.placements, long._local_value().clone())
    for bad in ([dist.Shard(0), dist.Replicate(), dist.Shard(1)],):
        for call in (lambda: dist.shard_tensor(a, mesh, bad), lambda: dist.reshard(t, mesh, bad),
                     lambda: dist.dtensor_from_local(blk, mesh, bad)):
            with pytest.raises(ValueError, match="at most one per mesh axis"):
                call()
    # Paddle's test_co_shard case 0: explicit default orders, rank i holds row i
    c = dist.shard_tensor(a[:4], mesh, [dist.Shard(0, shard_order=0), dist.Shard(0, co_shard_order=1)])
    out["co_default"] = (c.placements, c._local_value().clone())
    # a non-default nesting (Paddle's case 1) has no torch DTensor form: clear error on every rank, nothing sent
    with pytest.raises(ValueError, match="co_shard_order"):
        dist.shard_tensor(a[:4], mesh, [dist.Shard(0, co_shard_order=1), dist.Shard(0, co_shard_order=0)])
    return out


def test_short_placement_lists_pad_with_replicate_and_local_shape():
    from meshviz.core.placements import Replicate, Shard

    a = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    res = run_ranks(short_lists, 4, timeout=120)
    for r, out in enumerate(res):
        row = r // 2
        assert out["placements"] == [Shard(0), Replicate()]
        torch.testing.assert_close(out["local"], a[3 * row:3 * row + 3])
        assert out["local_shape"] == [3, 4] and isinstance(out["local_shape"], list)
        torch.testing.assert_close(out["full"], a)  # [R] is [R, R]
        col = r % 2
        torch.testing.assert_close(out["to_s1"], a[:, 2 * col:2 * col + 2])
        shape, pl, full = out["from_local"]
        assert shape == [6, 4] and pl == [Shard(0), Replicate()]
        torch.testing.assert_close(full, a)
        assert out["uneven_local_shape"] == [[2], [2], [1], [0]][r]
        assert out["long"][0] == [Shard(0), Replicate()]
        torch.testing.assert_close(out["long"][1], a[3 * row:3 * row + 3])
        pl, local = out["co_default"]
        assert pl == [Shard(0), Shard(0)]
        torch.testing.assert_close(local, a[r:r + 1])


# -- shard_optimizer over a plain model fed dist batches ----------------------------------------------------------


def _batches():
    g = torch.Generator().manual_seed(5)
    return torch.rand(8, 4, generator=g), torch.rand(8, 3, generator=g)


def _make_opt(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _reference_plain(kind, steps=3):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = _make_opt(kind, model.parameters())
    x, y = _batches()
    losses = []
    for _ in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.weight.detach(), model.bias.detach()


def plain_model(kind, mesh_ids, stage=0, steps=3):
    """stage None: the plain torch optimizer itself, not wrapped by shard_optimizer."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    names = ["dp", "mp"][:len(torch.tensor(mesh_ids).shape)]
    mesh = dist.ProcessMesh(mesh_ids, dim_names=names)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)  # a plain model: nothing sharded
    if stage is None:
        opt = _make_opt(kind, model.parameters())
        opt.clear_grad = opt.zero_grad
    else:
        shard_fn = {0: None, 1: dist.ShardingStage1, 2: dist.ShardingStage2, 3: dist.ShardingStage3}[stage]
        opt = dist.shard_optimizer(_make_opt(kind, model.parameters()), shard_fn and shard_fn("dp", mesh))
    grads = []
    x, y = _batches()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    loader = dist.shard_dataloader(loader, mesh, shard_dims="dp")
    losses = []
    for _ in range(steps):
        for xb, yb in loader:
            loss = ((model(xb) - yb) ** 2).mean()
            loss.backward()
            grads.append([p.grad.placements for p in model.parameters()])
            opt.step()
            opt.clear_grad()
            losses.append(dist.unshard_dtensor(loss).item())
    return {"losses": losses, "w": dist.unshard_dtensor(model.weight).detach(),
            "b": dist.unshard_dtensor(model.bias).detach(),
            "dist": [(p.is_dist(), p.placements, p.process_mesh == mesh) for p in model.parameters()],
            "same_objects": stage in (1, 2) or all(a is b for a, b in zip(model.parameters(),
                                                                          opt.param_groups[0]["params"])),
            "state": sorted(repr(opt.state[p]["exp_avg"].placements) for p in model.parameters()
                            if "exp_avg" in opt.state[p]), "grads": grads}


@pytest.mark.parametrize("kind,mesh_ids,stage", [("sgd", [0, 1], 0), ("adamw", [[0, 1], [2, 3]], 0),
                                                 ("adamw", [0, 1], 1), ("adamw", [[0, 1], [2, 3]], 3),
                                                 ("sgd", [0, 1], None), ("adamw", [[0, 1], [2, 3]], None)])
def test_shard_optimizer_over_a_plain_model_matches_one_process(kind, mesh_ids, stage):
    """Also a plain torch optimizer (stage None): Paddle 3.3.1 (2 ranks, Linear(4, 3), SGD, a Shard(0) batch) gives
    Partial(sum) gradients and, after the step, dist parameters, Replicate, with the one-process values."""
    from meshviz.core.placements import Partial, Replicate, Shard

    losses, w, b = _reference_plain(kind)
    n = len(torch.tensor(mesh_ids).flatten())
    for out in run_ranks(plain_model, n, kind, mesh_ids, stage, timeout=120):
        assert out["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
        torch.testing.assert_close(out["w"], w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out["b"], b, rtol=1e-5, atol=1e-6)
        ndim = len(torch.tensor(mesh_ids).shape)
        # Paddle 3.3.1: after the first step the parameters are dist, Replicate on the batches' mesh
        rep = [Replicate()] * ndim
        if stage == 3:  # the weight [3, 4] and bias [3] are sharded on dim 0 along dp
            assert out["dist"] == [(True, [Shard(0)] + rep[1:], True)] * 2
        else:
            assert out["dist"] == [(True, rep, True)] * 2
        assert out["same_objects"]
        # the batch is split on dp (mesh axis 0): the gradients are its Partial sums, whatever reduces them later
        assert out["grads"][0] == [[Partial()] + rep[1:]] * 2
        if kind == "adamw":
            want = "[S(0)]" if ndim == 1 else "[S(0), R]"
            assert out["state"] == ([want] * 2 if stage else ["[R, R]"] * 2)


# -- global-norm clipping over dist gradients ---------------------------------------------------------------------

_SHAPES = [(4, 6), (6,), (5, 3), (4, 4), (3, 2)]


def _grads():
    g = torch.Generator().manual_seed(9)
    return [torch.randn(s, generator=g) for s in _SHAPES]


def _clip_reference(max_norm):
    params = [torch.nn.Parameter(torch.zeros(s)) for s in _SHAPES]
    for p, g in zip(params, _grads()):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(norm), [p.grad for p in params]


def _layouts(dist, ndim):
    if ndim == 1:
        mesh = dist.ProcessMesh([0, 1], ["x"])
        return [(mesh, [dist.Partial()]), (mesh, [dist.Shard(0)]), (mesh, [dist.Replicate()]),
                (mesh, [dist.Partial(dist.ReduceType.kRedAvg)]), (mesh, [dist.Shard(1)])]
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
    other = dist.ProcessMesh([[3, 1], [2, 0]], ["a", "b"])
    half = dist.ProcessMesh([2, 3], ["h"])  # ranks 0 and 1 hold an empty block of this one
    return [(mesh, [dist.Shard(0), dist.Partial()]), (mesh, [dist.Replicate(), dist.Shard(0)]),
            (other, [dist.Partial(), dist.Replicate()]), (mesh, [dist.Shard(0), dist.Shard(0)]),
            (half, [dist.Shard(1)])]


def clip_dist(ndim, max_norm, via_optimizer):
    import meshviz.distributed as dist
    from meshviz.nn import ClipGradByGlobalNorm

    dist.init_parallel_env()
    params = []
    for (mesh, pl), g in zip(_layouts(dist, ndim), _grads()):
        dense_pl = [dist.Replicate() if p.is_partial() else p for p in pl]
        p = dist.shard_tensor(torch.nn.Parameter(torch.zeros(g.shape)), mesh, dense_pl)
        p.grad = dist.shard_tensor(g, mesh, pl)
        params.append(p)
    if via_optimizer:
        inner = torch.optim.SGD(params, lr=1.0)
        inner._grad_clip = ClipGradByGlobalNorm(max_norm)  # Paddle: SGD(..., grad_clip=ClipGradByGlobalNorm(c))
        opt = dist.shard_optimizer(inner)
        opt.step()
        return None, [-dist.unshard_dtensor(p).detach() for p in params]  # w = 0 - lr * clipped grad
    norm = float(ClipGradByGlobalNorm(max_norm)(params))
    return norm, [dist.unshard_dtensor(p.grad).detach() for p in params]


@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("via_optimizer", [False, True])
def test_clip_grad_by_global_norm_over_dist_grads_matches_torch(ndim, via_optimizer):
    total, _ = _clip_reference(1e9)
    max_norm = total / 3  # clips: every gradient is scaled by 1/3
    norm, want = _clip_reference(max_norm)
    assert norm == pytest.approx(total)
    for got_norm, got in run_ranks(clip_dist, 2 * ndim, ndim, max_norm, via_optimizer, timeout=120):
        if not via_optimizer:
            assert got_norm == pytest.approx(total, rel=1e-6)
        for g, w in zip(got, want):
            if g.numel() == 0:  # a rank outside that parameter's mesh
                continue
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# -- opt.state[p] by the user's parameter under ShardingStage1/2/3 -------------------------------------------------


def _weights():
    g = torch.Generator().manual_seed(3)
    return torch.randn(6, 8, generator=g), torch.randn(8, 5, generator=g), torch.rand(4, 3, 6, generator=g)


def _reference_adam(steps=3):
    w0, w1, x = _weights()
    p0, p1 = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w1.clone())
    opt = torch.optim.AdamW([p0, p1], lr=0.05, weight_decay=0.1)
    for _ in range(steps):
        (torch.matmul(torch.matmul(x, p0).relu(), p1) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [{k: v.clone() for k, v in opt.state[p].items()} for p in (p0, p1)], (p0.detach(), p1.detach())


def stage_states(stage, steps=3):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    w0, w1, x = _weights()
    rep = [dist.Replicate(), dist.Replicate()]
    p0 = dist.shard_tensor(torch.nn.Parameter(w0.clone()), mesh, rep)
    p1 = dist.shard_tensor(torch.nn.Parameter(w1.clone()), mesh, rep)
    cls = {1: dist.ShardingStage1, 2: dist.ShardingStage2, 3: dist.ShardingStage3}[stage]
    opt = dist.shard_optimizer(torch.optim.AdamW([p0, p1], lr=0.05, weight_decay=0.1), cls("dp", mesh))
    xs = dist.shard_tensor(x, mesh, [dist.Shard(0)])
    for _ in range(steps):
        (torch.matmul(torch.matmul(xs, p0).relu(), p1) ** 2).mean().backward()
        opt.step()
        opt.clear_grad()
    out = []
    for p in (p0, p1):
        st = opt.state[p]
        out.append({
            "keys": sorted(st), "in": p in opt.state, "placements": repr(st["exp_avg"].placements),
            "local_rows": st["exp_avg"]._local_value().shape[0],
            "exp_avg": dist.unshard_dtensor(st["exp_avg"]).detach(),
            "exp_avg_sq": dist.unshard_dtensor(st["exp_avg_sq"]).detach(), "step": float(st["step"]),
            "w": dist.unshard_dtensor(p).detach()})
    out.append(sorted(id(k) for k in opt.state) == sorted(id(p) for p in (p0, p1)))
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_opt_state_by_the_users_parameter_under_sharding_stages(stage):
    ref_states, ref_w = _reference_adam()
    for res in run_ranks(stage_states, 4, stage, timeout=120):
        *per_param, keys_are_params = res
        assert keys_are_params
        for got, want, w in zip(per_param, ref_states, ref_w):
            assert got["in"] and got["keys"] == sorted(want)
            assert got["placements"] == "[S(0), R]"  # the states are sharded along dp, as Paddle shows them
            assert got["local_rows"] == want["exp_avg"].shape[0] // 2
            torch.testing.assert_close(got["exp_avg"], want["exp_avg"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["exp_avg_sq"], want["exp_avg_sq"], rtol=1e-5, atol=1e-6)
            assert got["step"] == float(want["step"])
            torch.testing.assert_close(got["w"], w, rtol=1e-5, atol=1e-6)


# -- a mesh naming more ranks than the world ----------------------------------------------------------------------


def bigger_mesh():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    dp, mp = mesh.get_group(dim_name="dp"), mesh.get_group(dim_name="mp")
    out = {"dp": (dp.ranks, dp.rank, dp.nranks), "mp": (mp.ranks, mp.rank)}
    with pytest.raises(ValueError, match=r"all_reduce on group \[\d, \d\]: the world has no rank [23]"):
        dist.all_reduce(torch.ones(2), group=dp)
    t = torch.full((2,), float(dist.get_rank() + 1))
    dist.all_reduce(t, group=mp)  # the group the world holds works, after the error as before it
    out["mp_sum"] = t.tolist()
    return out


def test_a_mesh_larger_than_the_world_gives_its_groups_and_fails_only_to_communicate_on_them():
    # Paddle 3.3.1 returns the dp group of ProcessMesh([[0, 1], [2, 3]]) on 2 ranks (gloo then waits for ranks 2
    # and 3 forever when the group is made; meshviz makes none and says so at the first collective)
    res = run_ranks(bigger_mesh, 2, timeout=60)
    for r, out in enumerate(res):
        assert out["dp"] == ([r, r + 2], 0, 2)
        assert out["mp"] == ([0, 1], r)
        assert out["mp_sum"] == [3.0, 3.0]
