"""shard_layer, shard_optimizer (stages 1-3), shard_scaler, shard_dataloader on gloo ranks, against one process."""

import numpy as np
import pytest
import torch

from meshviz.testing import run_ranks


class _Data(torch.utils.data.Dataset):
    def __init__(self, n=8, seq=3, hidden=6):
        g = torch.Generator().manual_seed(7)
        self.x = torch.rand(n, seq, hidden, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i]


def _weights(hidden=6, inner=8):
    g = torch.Generator().manual_seed(3)
    return torch.randn(hidden, inner, generator=g), torch.randn(inner, hidden, generator=g)


def _reference_hybrid(steps=3):
    w0, w1 = (torch.nn.Parameter(w.clone()) for w in _weights())
    opt = torch.optim.AdamW([w0, w1], lr=0.01)
    losses = []
    loader = torch.utils.data.DataLoader(_Data(), batch_size=2)
    for step, x in enumerate(loader):
        if step == steps:
            break
        loss = torch.matmul(torch.matmul(x, w0), w1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, w0.detach(), w1.detach()


class HybridMlp(torch.nn.Module):
    """Seed 001 section 4.4: column-parallel stage on mesh0, row-parallel stage on mesh1, data parallel on x."""

    def __init__(self, mesh0, mesh1):
        import meshviz.distributed as dist

        super().__init__()
        w0, w1 = _weights()
        self.mesh1 = mesh1
        self.w0 = dist.shard_tensor(torch.nn.Parameter(w0.clone()), mesh0, [dist.Replicate(), dist.Shard(1)])
        self.w1 = dist.shard_tensor(torch.nn.Parameter(w1.clone()), mesh1, [dist.Replicate(), dist.Shard(0)])

    def forward(self, x):
        import meshviz.distributed as dist

        y = torch.matmul(x, self.w0)
        y = dist.reshard(y, self.mesh1, [dist.Shard(0), dist.Shard(2)])
        return torch.matmul(y, self.w1)


def hybrid(steps=3):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh0 = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    mesh1 = dist.ProcessMesh([[4, 5], [6, 7]], dim_names=["x", "y"])
    model = HybridMlp(mesh0, mesh1)
    loader = torch.utils.data.DataLoader(_Data(), batch_size=2)
    loader = dist.shard_dataloader(loader, meshes=[mesh0, mesh1], shard_dims="x")
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    losses, placements = [], None
    for step, x in enumerate(loader):
        if step == steps:
            break
        assert x.placements == [dist.Shard(0), dist.Replicate()] and x.process_mesh == mesh0
        logits = model(x)
        loss = logits.mean()
        placements = [repr(logits.placements), repr(loss.placements)]
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(dist.unshard_dtensor(loss).detach()) if dist.get_rank() >= 4 else None)
    return {"losses": losses, "pl": placements, "w0": dist.unshard_dtensor(model.w0).detach(),
            "w1": dist.unshard_dtensor(model.w1).detach()}


def test_seed_hybrid_2x2_plus_2x2_on_8_ranks_matches_single_process():
    ref_losses, ref_w0, ref_w1 = _reference_hybrid()
    res = run_ranks(hybrid, 8, timeout=240)
    for r, out in enumerate(res):
        if r < 4:
            torch.testing.assert_close(out["w0"], ref_w0, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_allclose(out["losses"], ref_losses, rtol=1e-5)
            torch.testing.assert_close(out["w1"], ref_w1, rtol=1e-5, atol=1e-6)
            assert out["pl"][0] == "[S(0), P(sum)]"


def _ref_dp(steps=3):
    w0, w1 = (torch.nn.Parameter(w.clone()) for w in _weights())
    opt = torch.optim.AdamW([w0, w1], lr=0.05, weight_decay=0.1)
    x = _Data().x
    for _ in range(steps):
        (torch.matmul(torch.matmul(x, w0).relu(), w1) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return w0.detach(), w1.detach()


def dp_stages(stage, mesh_ids):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh(mesh_ids, dim_names=["dp", "mp"][: np.asarray(mesh_ids).ndim])
    w0, w1 = _weights()
    rep = [dist.Replicate()] * mesh.ndim
    p0 = dist.shard_tensor(torch.nn.Parameter(w0.clone()), mesh, rep)
    p1 = dist.shard_tensor(torch.nn.Parameter(w1.clone()), mesh, rep)
    stages = {0: None, 1: dist.ShardingStage1("dp", mesh), 2: dist.ShardingStage2("dp", mesh),
              3: dist.ShardingStage3("dp", mesh)}
    opt = dist.shard_optimizer(torch.optim.AdamW([p0, p1], lr=0.05, weight_decay=0.1), stages[stage])
    pl = [dist.Shard(0)] + [dist.Replicate()] * (mesh.ndim - 1)
    x = dist.shard_tensor(_Data().x, mesh, pl)
    for _ in range(3):
        (torch.matmul(torch.matmul(x, p0).relu(), p1) ** 2).mean().backward()
        opt.step()
        opt.clear_grad()
    state_pl = None
    for st in opt.state.values():
        if "exp_avg" in st:
            state_pl = repr(st["exp_avg"].placements)
            local_rows = st["exp_avg"]._local_value().shape[0]
            break
    return {"w0": dist.unshard_dtensor(p0).detach(), "w1": dist.unshard_dtensor(p1).detach(),
            "state": state_pl, "rows": local_rows, "param": repr(p0.placements)}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_shard_optimizer_stages_match_single_process(stage):
    ref0, ref1 = _ref_dp()
    res = run_ranks(dp_stages, 4, stage, [[0, 1], [2, 3]], timeout=120)
    for out in res:
        torch.testing.assert_close(out["w0"], ref0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out["w1"], ref1, rtol=1e-5, atol=1e-6)
        if stage:
            assert out["state"] == "[S(0), R]" and out["rows"] == 3  # 6 rows of w0 split over dp=2
        else:
            assert out["state"] == "[R, R]"
        assert out["param"] == ("[S(0), R]" if stage == 3 else "[R, R]")


class DemoNet(torch.nn.Module):
    """Seed 003's DemoNet; torch Linear weights are [out, in], so Paddle's Shard(1) column split is Shard(0)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.linear_0 = torch.nn.Linear(16, 16)
        self.linear_1 = torch.nn.Linear(16, 8)
        self.relu = torch.nn.ReLU()

    def forward(self, x):
        return self.linear_1(self.relu(self.linear_0(x)))


def layer_shard():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    model = DemoNet()

    def shard_fn(name, layer, pm):
        if name == "linear_0":
            layer.weight = dist.shard_tensor(layer.weight, pm, [dist.Shard(0)])
            layer.bias = dist.shard_tensor(layer.bias, pm, [dist.Shard(0)])
        if name == "linear_1":
            layer.weight = dist.shard_tensor(layer.weight, pm, [dist.Shard(1)])

    def input_fn(inputs, pm):
        return tuple(dist.shard_tensor(t, pm, [dist.Replicate()]) for t in inputs)

    dist.shard_layer(model, mesh, shard_fn, input_fn=input_fn)
    pls = {n: repr(p.placements) for n, p in model.named_parameters()}
    x = torch.rand(4, 16, generator=torch.Generator().manual_seed(5))
    out = model(x)
    loss = out.sum()
    loss.backward()
    grads = {n: dist.unshard_dtensor(p.grad) for n, p in model.named_parameters()}
    return pls, dist.unshard_dtensor(out).detach(), grads, repr(out.placements)


def test_shard_layer_seed_003_demonet():
    ref = DemoNet()
    x = torch.rand(4, 16, generator=torch.Generator().manual_seed(5))
    out = ref(x)
    out.sum().backward()
    res = run_ranks(layer_shard, 2, timeout=120)
    for pls, got, grads, _opl in res:
        assert pls == {"linear_0.weight": "[S(0)]", "linear_0.bias": "[S(0)]", "linear_1.weight": "[S(1)]",
                       "linear_1.bias": "[R]"}
        torch.testing.assert_close(got, out.detach())
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, msg=n)


def loader_axes():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    data = torch.arange(8.0).reshape(4, 2)
    loader = torch.utils.data.DataLoader(list(zip(data, data * 10)), batch_size=4)
    out = {}
    for axis in ("x", "y", None):
        batch = next(iter(dist.shard_dataloader(loader, [mesh], shard_dims=axis)))
        out[axis] = [batch[0]._local_value()[:, 0].tolist(), repr(batch[1].placements)]
    with pytest.raises(ValueError, match="unknown mesh dim name 'z'"):
        dist.shard_dataloader(loader, [mesh], shard_dims="z")
    return out


def test_shard_dataloader_uses_the_named_axis():
    res = run_ranks(loader_axes, 4, timeout=90)
    # rank r sits at (r // 2, r % 2); 'x' splits rows over the mesh rows, 'y' over the columns
    assert [res[r]["x"][0] for r in range(4)] == [[0, 2], [0, 2], [4, 6], [4, 6]]
    assert [res[r]["y"][0] for r in range(4)] == [[0, 2], [4, 6], [0, 2], [4, 6]]
    assert res[0]["x"][1] == "[S(0), R]" and res[0]["y"][1] == "[R, S(0)]" and res[0][None][1] == "[R, R]"


def scaler_run():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    w0, _ = _weights()
    p = dist.shard_tensor(torch.nn.Parameter(w0.clone()), mesh, [dist.Shard(1)])
    opt = dist.shard_optimizer(torch.optim.SGD([p], lr=0.1))
    scaler = dist.shard_scaler()
    x = torch.ones(2, 6)
    loss = torch.matmul(x, p).sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    skipped_before = dist.unshard_dtensor(p).detach().clone()
    # an inf on one rank only: every rank must skip
    loss = torch.matmul(x, p).sum()
    scaler.scale(loss).backward()
    if dist.get_rank() == 1:
        p.grad._local_value().detach().fill_(float("inf"))
    scaler.step(opt)
    scaler.update()
    return skipped_before, dist.unshard_dtensor(p).detach(), scaler.loss_scaling


def test_shard_scaler_unscales_and_skips_together():
    w0, _ = _weights()
    expect = w0 - 0.1 * torch.ones(6, 8) * 2
    for before, after, scale in run_ranks(scaler_run, 2, timeout=90):
        torch.testing.assert_close(before, expect)
        torch.testing.assert_close(after, before)
        assert scale == 2.0**14


def overflowing_scales(steps):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    p = dist.shard_tensor(torch.nn.Parameter(torch.ones(2)), mesh, [dist.Replicate()])
    opt = dist.shard_optimizer(torch.optim.SGD([p], lr=0.1))
    scaler = dist.shard_scaler()  # 2**15, halved after each overflowing step
    scales = []
    for _ in range(steps):
        scaler.scale((p * float("inf")).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.loss_scaling)
    return scales, dist.unshard_dtensor(p).detach()


def test_shard_scalers_scale_never_falls_below_one():
    # Paddle's update_loss_scaling: prev * decr_ratio, made 1 where that is below 1
    want = [max(2.0**15 * 0.5**k, 1.0) for k in range(1, 19)]
    for scales, p in run_ranks(overflowing_scales, 2, 18, timeout=90):
        assert scales == want and scales[-4:] == [1.0] * 4
        torch.testing.assert_close(p, torch.ones(2))  # every step skipped


# -- optimizer sharding where Paddle puts it ----------------------------------------------------------------


def accumulation_steps():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    w = dist.shard_tensor(torch.nn.Parameter(torch.zeros(2)), mesh, [dist.Replicate()])
    opt = dist.shard_optimizer(torch.optim.SGD([w], lr=1.0), gradient_accumulation_steps=2)
    seen = []
    for _ in range(4):
        (w * torch.tensor([1.0, 2.0])).sum().backward()
        opt.step()
        opt.clear_grad()
        seen.append(dist.unshard_dtensor(w).detach().tolist())
    return seen, opt.gradient_accumulation_steps


def test_gradient_accumulation_steps_does_not_skip_steps():
    # Paddle 3.3.1 (CPU, 4 ranks) gives exactly these: its step() updates every time; the loop accumulates
    for seen, k in run_ranks(accumulation_steps, 2, timeout=90):
        assert seen == [[-1.0, -2.0], [-2.0, -4.0], [-3.0, -6.0], [-4.0, -8.0]] and k == 2


def _steps_with_an_edit(x, w0, w1, opt):
    """Three steps of the two-layer model, ``w1`` halved in place after the first (an edit between steps)."""
    for i in range(3):
        (torch.matmul(torch.matmul(x, w0).relu(), w1) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        if i == 0:
            with torch.no_grad():
                w1.mul_(0.5)


def resumed_stages(stage, path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    w0, w1 = _weights()
    p0 = dist.shard_tensor(torch.nn.Parameter(torch.zeros_like(w0)), mesh, [dist.Replicate(), dist.Shard(1)])
    p1 = dist.shard_tensor(torch.nn.Parameter(torch.zeros_like(w1)), mesh, [dist.Replicate(), dist.Replicate()])
    cls = {1: dist.ShardingStage1, 2: dist.ShardingStage2, 3: dist.ShardingStage3}[stage]
    opt = dist.shard_optimizer(torch.optim.AdamW([p0, p1], lr=0.05, weight_decay=0.1), cls("dp", mesh))
    rep = [dist.Replicate(), dist.Replicate()]
    dist.save_state_dict({"w0": dist.shard_tensor(w0, mesh, rep), "w1": dist.shard_tensor(w1, mesh, rep)}, path)
    dist.load_state_dict({"w0": p0, "w1": p1}, path)  # a resumed run: the optimizer was made before the load
    _steps_with_an_edit(dist.shard_tensor(_Data().x, mesh, [dist.Shard(0), dist.Replicate()]), p0, p1, opt)
    held = {id(q): q for q in [p0, p1] + [q for g in opt.param_groups for q in g["params"]]}
    storages = {q._local_value().untyped_storage()._cdata for q in held.values()}
    return dist.unshard_dtensor(p0).detach(), dist.unshard_dtensor(p1).detach(), len(storages)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharding_stages_step_what_the_parameters_hold_now(stage, tmp_path):
    w0, w1 = (torch.nn.Parameter(w.clone()) for w in _weights())
    _steps_with_an_edit(_Data().x, w0, w1, torch.optim.AdamW([w0, w1], lr=0.05, weight_decay=0.1))
    for r0, r1, storages in run_ranks(resumed_stages, 4, stage, str(tmp_path / "ckpt"), timeout=120):
        torch.testing.assert_close(r0, w0.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r1, w1.detach(), rtol=1e-5, atol=1e-6)
        assert storages == 2  # the optimizer steps views of the parameters' blocks, no copies beside them


def tp_stages(stage):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    w0, w1 = _weights()
    # column-parallel w0 (split on dim 1), row-parallel w1 (split on dim 0: a tp weight), a split bias
    p0 = dist.shard_tensor(torch.nn.Parameter(w0.clone()), mesh, [dist.Replicate(), dist.Shard(1)])
    p1 = dist.shard_tensor(torch.nn.Parameter(w1.clone()), mesh, [dist.Replicate(), dist.Shard(0)])
    bias = dist.shard_tensor(torch.nn.Parameter(torch.zeros(8)), mesh, [dist.Replicate(), dist.Shard(0)])
    cls = {1: dist.ShardingStage1, 2: dist.ShardingStage2, 3: dist.ShardingStage3}[stage]
    shard_fn = cls(sharding_mesh_dim="dp", mesh=mesh)  # Paddle's keywords
    opt = dist.shard_optimizer(torch.optim.AdamW([p0, p1, bias], lr=0.05, weight_decay=0.1), shard_fn)
    x = dist.shard_tensor(_Data().x, mesh, [dist.Shard(0), dist.Replicate()])
    for _ in range(3):
        (torch.matmul((torch.matmul(x, p0) + bias).relu(), p1) ** 2).mean().backward()
        opt.step()
        held = {id(q): q for q in [p0, p1, bias] + [q for g in opt.param_groups for q in g["params"]]}
        blocks = [q.grad._local_value() for q in held.values() if q.grad is not None]
        # a block two tensors share counts once (stage 2: the parameter keeps the part its shadow steps)
        blocks = list({(b.untyped_storage()._cdata, b.storage_offset(), b.numel()): b for b in blocks}.values())
        # the storage the gradients keep alive against their own bytes (a view of a bucket keeps all of it)
        kept = (sum({b.untyped_storage()._cdata: b.untyped_storage().nbytes() for b in blocks}.values()),
                sum(b.numel() * b.element_size() for b in blocks))
        opt.clear_grad()
    states = [repr(st["exp_avg"].placements) for st in opt.state.values() if "exp_avg" in st]
    return {"w0": dist.unshard_dtensor(p0).detach(), "w1": dist.unshard_dtensor(p1).detach(),
            "bias": dist.unshard_dtensor(bias).detach(), "states": sorted(states),
            "params": [repr(p.placements) for p in (p0, p1, bias)], "kept": kept}


def _ref_tp(steps=3):
    w0, w1 = (torch.nn.Parameter(w.clone()) for w in _weights())
    bias = torch.nn.Parameter(torch.zeros(8))
    opt = torch.optim.AdamW([w0, w1, bias], lr=0.05, weight_decay=0.1)
    x = _Data().x
    for _ in range(steps):
        (torch.matmul((torch.matmul(x, w0) + bias).relu(), w1) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return w0.detach(), w1.detach(), bias.detach()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharding_stages_shard_a_tensor_parallel_weight_on_its_next_dim(stage):
    ref = _ref_tp()
    res = run_ranks(tp_stages, 4, stage, timeout=120)
    # Paddle 3.3.1 (CPU): moments of a [R, S(0)] weight are [S(1), S(0)]; a 1-D [R, S(0)] bias stays put
    states = sorted(["[S(0), S(1)]", "[S(1), S(0)]", "[R, S(0)]"])
    for out in res:
        for got, want in zip((out["w0"], out["w1"], out["bias"]), ref):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert out["states"] == states
        assert out["kept"][0] == out["kept"][1] > 0
        if stage == 3:
            assert out["params"] == ["[S(0), S(1)]", "[S(1), S(0)]", "[R, S(0)]"]
        else:
            assert out["params"] == ["[R, S(1)]", "[R, S(0)]", "[R, S(0)]"]


def test_sharding_stage_keywords_and_placement_rule():
    import meshviz.distributed as dist

    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    for stage in (dist.ShardingStage1("dp", mesh), dist.ShardingStage2(sharding_mesh_dim="dp", mesh=mesh),
                  dist.ShardingStage3(mesh=mesh, sharding_mesh_dim=0), dist.ShardingStage1(mesh)):
        assert stage.mesh == mesh and stage.sharding_mesh_dim in ("dp", 0)
    with pytest.raises(ValueError, match="unknown mesh dim name 'pp'"):
        dist.ShardingStage1("pp", mesh)
    with pytest.raises(TypeError, match="unexpected keyword"):
        dist.ShardingStage1("dp", mesh, degree=2)


def test_shard_scaler_keeps_the_scalers_settings():
    import meshviz.distributed as dist

    torch_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25,
                                        growth_interval=2)
    s = dist.shard_scaler(torch_scaler)
    assert (s.get_scale(), s.get_incr_ratio(), s.get_decr_ratio(), s.get_incr_every_n_steps(), s.is_enable()) == (
        1024.0, 4.0, 0.25, 2, True)
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.5)
    scales = []
    for bad in (False, False, True, False):
        s.scale((w * (float("inf") if bad else 1.0)).sum()).backward()
        s.step(opt)
        s.update()
        opt.zero_grad()
        scales.append(s.get_scale())
    # two clean steps: x4; an inf: x0.25 and no update; three updates of 0.5 each
    assert scales == [1024.0, 4096.0, 1024.0, 1024.0]
    torch.testing.assert_close(w.detach(), torch.full((3,), 1.0 - 3 * 0.5))
    off = dist.shard_scaler(torch.amp.GradScaler("cpu", enabled=False))
    assert not off.is_enable() and off.scale(torch.tensor(3.0)).item() == 3.0


def fleet_scaler():
    import meshviz.distributed as dist
    from meshviz.distributed import fleet

    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": 1, "mp_degree": 2, "pp_degree": 1}
    fleet.init(is_collective=True, strategy=s)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=64.0, growth_factor=3.0, backoff_factor=0.125,
                                        growth_interval=5)
    scaler = fleet.distributed_scaler(torch_scaler)
    settings = (scaler.get_scale(), scaler.get_incr_ratio(), scaler.get_decr_ratio(), scaler.get_incr_every_n_steps())
    w = torch.nn.Parameter(torch.ones(4))
    opt = fleet.distributed_optimizer(torch.optim.SGD([w], lr=0.5))
    scaler.scale(w.sum()).backward()
    if dist.get_rank() == 1:
        w.grad.fill_(float("inf"))  # only rank 1 sees an inf: every rank must skip the step
    scaler.step(opt)
    scaler.update()
    opt.clear_grad()
    skipped = (w.detach().tolist(), scaler.get_scale())
    scaler.scale(w.sum()).backward()
    scaler.step(opt)
    scaler.update()
    stepped = w.detach().tolist()
    s.hybrid_configs = {"dp_degree": 2, "mp_degree": 1, "pp_degree": 1}
    fleet.init(is_collective=True, strategy=s)
    same = fleet.distributed_scaler(torch_scaler) is torch_scaler  # pure data parallel: left as it is
    return settings, skipped, stepped, same


def test_fleet_distributed_scaler_keeps_settings_and_skips_together():
    for settings, skipped, stepped, same in run_ranks(fleet_scaler, 2, timeout=90):
        assert settings == (64.0, 3.0, 0.125, 5)
        assert skipped == ([1.0] * 4, 8.0)
        assert stepped == [0.5] * 4 and same


def _grad_kept_uncopied():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([[0, 1]], dim_names=["dp", "mp"])
    g = torch.Generator().manual_seed(3)
    w0, x = torch.randn(6, 8, generator=g), torch.randn(4, 6, generator=g)
    w = dist.shard_tensor(torch.nn.Parameter(w0.clone()), mesh, [dist.Replicate(), dist.Shard(1)])
    opt = dist.shard_optimizer(torch.optim.AdamW([w], lr=0.1))
    (dist.shard_tensor(x, mesh, [dist.Shard(0), dist.Replicate()]) @ w).sum().backward()
    placed, block = str(w.grad.placements), w.grad._local
    opt.step()
    # a reshard the caller keeps its input of copies the block, even on a line of one rank
    p = dist.dtensor_from_local(torch.ones(6, 4), mesh, [dist.Partial(), dist.Shard(1)])
    r = dist.reshard(p, mesh, [dist.Replicate(), dist.Shard(1)])
    r._local.add_(1)
    return (placed, str(w.grad.placements), w.grad._local.data_ptr() == block.data_ptr(), w.grad._local.clone(),
            w.detach()._local.clone(), float(p._local.sum()))


def test_a_gradient_reduced_over_a_line_of_one_rank_is_not_copied():
    """The step reduces a Partial gradient to the parameter's layout; over a dp axis of one rank that keeps the block,
    and the gradient it replaces is not copied (a copy of every weight a step), yet the update is torch's."""
    g = torch.Generator().manual_seed(3)
    w0, x = torch.randn(6, 8, generator=g), torch.randn(4, 6, generator=g)
    w = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([w], lr=0.1)
    (x @ w).sum().backward()
    opt.step()
    for rank, (placed, after, same, grad, block, kept) in enumerate(run_ranks(_grad_kept_uncopied, 2)):
        assert (placed, after, same) == ("[P(sum), S(1)]", "[R, S(1)]", True)
        cols = slice(4 * rank, 4 * rank + 4)
        torch.testing.assert_close(grad, w.grad[:, cols])
        torch.testing.assert_close(block, w.detach()[:, cols])
        assert kept == 24.0


def _stage_with_nothing_dist(dist_input):
    import warnings

    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    w = torch.nn.Parameter(torch.ones(4, 4))
    opt = dist.shard_optimizer(torch.optim.AdamW([w], lr=0.1), dist.ShardingStage1("dp", mesh))
    x = torch.ones(2, 4)
    x = dist.shard_tensor(x, mesh, [dist.Shard(0)]) if dist_input else x
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            (x @ w).sum().backward()
            opt.step()
            opt.clear_grad()
    return [str(m.message) for m in seen if "shard_optimizer" in str(m.message)]


def test_a_sharding_stage_with_nothing_dist_to_shard_says_so_once():
    """Dense parameters and dense inputs: the stage has nothing to shard (each rank steps its own copy); a dense
    parameter fed dist inputs gets a dist gradient and is sharded, so nothing is said."""
    for said in run_ranks(_stage_with_nothing_dist, 2, False, timeout=60):
        assert len(said) == 1 and "every parameter and gradient here is dense, so nothing is sharded" in said[0]
    assert run_ranks(_stage_with_nothing_dist, 2, True, timeout=60) == [[], []]


def _transposed_blocks():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    dense = torch.arange(192.0).reshape(6, 4, 8)
    want = dense.transpose(0, 1).reshape(24, 8)
    out = []
    for src in ([dist.Replicate()], [dist.Shard(2)]):
        y = dist.shard_tensor(dense, mesh, src).transpose(0, 1)
        for dst in ([dist.Replicate()], [dist.Shard(2)], [dist.Shard(0)]):
            s = dist.reshard(y, mesh, dst)  # a new tensor: contiguous, its block too (it may have been transposed)
            out.append((s.is_contiguous() and s._local_value().is_contiguous(),
                        torch.equal(dist.unshard_dtensor(s.reshape(24, 8)), want)))
    block = torch.arange(32.0).reshape(8, 4).t()  # [4, 8], not contiguous
    t = dist.dtensor_from_local(block, mesh, [dist.Shard(0)])
    out.append((t._local_value().is_contiguous() and torch.equal(t._local_value(), block),
                torch.equal(dist.unshard_dtensor(t.reshape(-1)), block.repeat(2, 1).reshape(-1))))
    sliced = torch.arange(32.0).reshape(4, 8)[:, ::2]  # strided
    t = dist.dtensor_from_local(sliced, mesh, [dist.Replicate()])
    out.append((t._local_value().is_contiguous(), torch.equal(t.view(-1)._local_value(), sliced.reshape(-1))))
    return out


def test_a_block_that_is_not_contiguous_is_made_contiguous_as_its_strides_say():
    for out in run_ranks(_transposed_blocks, 2, timeout=60):
        assert out == [(True, True)] * 8, out
