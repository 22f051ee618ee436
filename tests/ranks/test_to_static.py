"""to_static / DistModel and Strategy: modes, values against eager runs, gradient merge, sharding, programs."""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from meshviz.distributed.auto_parallel import Strategy, to_static
from meshviz.distributed.auto_parallel.strategy import UnknownOption
from meshviz.testing import run_ranks

IMAGE, CLASSES, B = 16, 8, 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear_0 = nn.Linear(IMAGE, IMAGE)
        self.linear_1 = nn.Linear(IMAGE, CLASSES)

    def forward(self, x):
        return self.linear_1(F.relu(self.linear_0(x)))


def data(step, rank=0, b=B):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.rand(b, IMAGE, generator=g), torch.rand(b, CLASSES, generator=g)


def eager(steps, batches, opt_cls=torch.optim.SGD, **kw):
    net = Net()
    opt = opt_cls(net.parameters(), lr=0.1, **kw)
    losses = []
    for x, y in batches[:steps]:
        loss = F.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return net, losses


def test_mode_defaults_and_errors():
    net = Net()
    assert to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.1)).mode == "train"
    dm = to_static(net, None, nn.MSELoss())
    assert dm.mode == "eval"
    dm.train()
    x, y = data(0)
    with pytest.raises(ValueError, match="optimizer and loss"):
        dm(x, y)
    pm = to_static(net)
    assert pm.mode == "predict"
    pm.eval()
    with pytest.raises(ValueError, match="loss function"):
        pm(x, y)
    pm.predict()
    with pytest.raises(ValueError, match="1 input"):
        pm(x, y)
    with pytest.raises(ValueError, match="mode can only be"):
        pm.serial_main_program("fit")
    with pytest.raises(ValueError, match="run one"):
        pm.dist_main_program("predict")
    with pytest.raises(TypeError):
        pm("x")
    s = Strategy()
    s.pipeline.enable, s.pipeline.pp_degree = True, 2
    with pytest.raises(ValueError, match=r"pp_degree \(2\) must divide the number of ranks \(1\)"):
        to_static(net, None, nn.MSELoss(), None, s)


def test_strategy_defaults_and_unknown_keys():
    s = Strategy()
    assert (s.sharding.enable, s.sharding.stage, s.sharding.degree) == (False, 1, 8)
    assert (s.gradient_merge.enable, s.gradient_merge.k_steps, s.gradient_merge.avg) == (False, 1, True)
    assert (s.pipeline.schedule_mode, s.pipeline.micro_batch_size, s.pipeline.accumulate_steps) == ("1F1B", 1, 1)
    assert (s.amp.dtype, s.amp.level, s.amp.init_loss_scaling) == ("float16", "o1", 32768.0)
    assert (s.fused_passes.enable, s.fused_passes.gemm_epilogue) == (False, False)
    assert s.return_numpy is True and s.split_data is True
    s2 = Strategy({"sharding": {"enable": True, "stage": 2}, "seed": 3})
    assert s2.sharding.stage == 2 and s2.seed == 3 and "stage=2" in repr(s2)
    with pytest.raises(UnknownOption):
        Strategy({"shardingg": {}})
    with pytest.raises(ValueError):
        Strategy({"sharding": {"stagee": 2}})
    with pytest.raises(AttributeError):
        s.gradient_merge.ksteps = 2
    with pytest.raises(ValueError):
        Strategy("config.yaml")


def test_strategy_refuses_a_k_steps_that_is_not_a_positive_int_when_it_is_set():
    s = Strategy()
    for bad, shown in (("2", "'2' (str)"), (2.0, "2.0 (float)"), (True, "True (bool)"), (0, "0 (int)"),
                       (-1, "-1 (int)")):
        words = f"Strategy.gradient_merge.k_steps must be a positive int, got {shown}"
        with pytest.raises(ValueError) as info:
            s.gradient_merge.k_steps = bad
        assert str(info.value) == words
        with pytest.raises(ValueError) as info:
            Strategy({"gradient_merge": {"enable": True, "k_steps": bad}})
        assert str(info.value) == words
    assert s.gradient_merge.k_steps == 1  # left as it was
    s.gradient_merge.k_steps = 3
    assert s.gradient_merge.k_steps == 3 and "k_steps=3" in repr(s)


def test_train_eval_predict_equal_eager():
    batches = [data(s) for s in range(3)]
    ref, ref_losses = eager(3, batches)
    net = Net()
    dm = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.1))
    losses = [dm(x, y) for x, y in batches]
    assert all(isinstance(v, np.ndarray) for v in losses)  # return_numpy, Paddle's default
    np.testing.assert_allclose([float(v) for v in losses], ref_losses, rtol=1e-6)
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)
    x, y = data(9)
    dm.eval()
    np.testing.assert_allclose(dm(x, y), F.mse_loss(ref(x), y).detach().numpy(), rtol=1e-6)
    dm.predict()
    outs = dm(x)
    assert list(outs) == ["out0"]
    np.testing.assert_allclose(outs["out0"], ref(x).detach().numpy(), rtol=1e-6)


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW])
def test_gradient_merge_equals_one_step_on_k_times_the_batch(opt_cls):
    k = 3
    micro = [data(s) for s in range(2 * k)]
    big = [(torch.cat([x for x, _ in micro[i:i + k]]), torch.cat([y for _, y in micro[i:i + k]]))
           for i in (0, k)]
    ref, _ = eager(2, big, opt_cls)
    s = Strategy({"gradient_merge": {"enable": True, "k_steps": k}, "return_numpy": False})
    net = Net()
    opt = opt_cls(net.parameters(), lr=0.1)
    dm = to_static(net, None, nn.MSELoss(), opt, s)
    before = [p.detach().clone() for p in net.parameters()]
    for i, (x, y) in enumerate(micro):
        dm(x, y)
        if i == k - 2:  # no update before the k-th call
            assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_amp_bf16_equals_eager_autocast():
    batches = [data(s) for s in range(3)]
    ref = Net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    s = Strategy({"amp": {"enable": True, "dtype": "bfloat16"}})
    net = Net()
    dm = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.1), s)
    for x, y in batches:
        dm(x, y)
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)
    assert not torch.equal(net.linear_0.weight, eager(3, batches)[0].linear_0.weight)  # bf16 really ran


def test_state_dict_round_trip_and_programs():
    net = Net()
    dm = to_static(net, None, nn.MSELoss(), torch.optim.AdamW(net.parameters(), lr=0.1),
                   input_spec=[((B, IMAGE), "float32")])
    x, y = data(0)
    dm(x, y)
    sd = dm.state_dict()
    assert {"linear_0.weight", "linear_0.weight.exp_avg", "linear_1.bias.exp_avg_sq"} <= set(sd)
    assert set(dm.state_dict("param")) == set(net.state_dict())
    other_net = Net()
    with torch.no_grad():
        for p in other_net.parameters():
            p.mul_(0)
    other = to_static(other_net, None, nn.MSELoss(), torch.optim.AdamW(other_net.parameters(), lr=0.1))
    other(x, y)  # creates optimizer state to overwrite
    other.set_state_dict(sd)
    dm(*data(1))
    other(*data(1))
    for a, b in zip(net.parameters(), other_net.parameters()):
        torch.testing.assert_close(a, b)
    prog = dm.serial_main_program("train")
    ops = prog.ops()
    assert "aten.addmm.default" in ops and "aten.mse_loss_backward.default" in ops and not prog.collectives()
    assert "f32[4, 16]" in str(prog)
    pred = dm.serial_main_program("predict")
    assert "aten.mse_loss.default" not in pred.ops()
    assert "aten.mse_loss_backward.default" in dm.dist_main_program("train").ops()
    assert "linear_0.weight" in str(dm.serial_startup_program())
    assert "initialised locally" in str(dm.dist_startup_program())


# -- several ranks ---------------------------------------------------------------------------------------
def _dp(strategy_dict, steps, opt_name):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    rank = dist.get_rank()
    net = Net()
    if rank == 1:  # data parallel starts from rank 0's parameters
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
    opt_cls = getattr(torch.optim, opt_name)
    dm = to_static(net, None, nn.MSELoss(), opt_cls(net.parameters(), lr=0.1), Strategy(strategy_dict))
    losses = [float(dm(*data(s, rank))) for s in range(steps)]
    dm.eval()
    ev = float(dm(*data(50, rank)))
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
              for k, v in net.state_dict().items()}
    prog = dm.dist_main_program("train")
    return params, losses, ev, prog.collectives(), str(dm.dist_startup_program("train"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy_dict, opt_name", [
    ({}, "SGD"),
    ({"sharding": {"enable": True, "stage": 1}}, "AdamW"),
    ({"sharding": {"enable": True, "stage": 2}}, "AdamW"),
    ({"sharding": {"enable": True, "stage": 3}}, "AdamW"),
])
def test_data_parallel_and_sharding_equal_eager_on_the_whole_batch(strategy_dict, opt_name):
    steps, world = 3, 2
    batches = [(torch.cat([data(s, r)[0] for r in range(world)]), torch.cat([data(s, r)[1] for r in range(world)]))
               for s in range(steps)]
    ref, ref_losses = eager(steps, batches, getattr(torch.optim, opt_name))
    res = run_ranks(_dp, world, strategy_dict, steps, opt_name, timeout=150)
    xe = torch.cat([data(50, r)[0] for r in range(world)])
    ye = torch.cat([data(50, r)[1] for r in range(world)])
    ref_eval = float(F.mse_loss(ref(xe), ye))
    for params, losses, ev, colls, startup in res:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        assert abs(ev - ref_eval) < 1e-5 * max(1, abs(ref_eval))
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6)
        assert colls  # the per-rank program shows its communication
        if not strategy_dict:
            assert "broadcast from rank 0" in startup


def _demo(steps):
    """Seed 003's DemoNet: Paddle's Shard(1) on linear_0.weight ([in, out]) is Shard(0) on torch's [out, in]."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])

    class DemoNet(Net):
        def __init__(self):
            super().__init__()
            self.linear_0.weight = dist.shard_tensor(self.linear_0.weight, mesh, [dist.Shard(0)])
            self.linear_1.weight = dist.shard_tensor(self.linear_1.weight, mesh, [dist.Shard(1)])

    net = DemoNet()
    dm = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.1))
    losses = [float(dm(*data(s))) for s in range(steps)]  # every rank feeds the same batch
    dm.eval()
    ev = float(dm(*data(50)))
    dm.predict()
    out = dm(data(50)[0])["out0"]
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
              for k, v in net.state_dict().items()}
    local_w0 = tuple(net.linear_0.weight._local_value().shape)
    return losses, ev, out, params, local_w0, dm.dist_main_program("train").collectives()


@pytest.mark.timeout(120)
def test_seed_demo_net_with_dist_tensor_weights_equals_eager():
    batches = [data(s) for s in range(3)]
    ref, ref_losses = eager(3, batches)
    x, y = data(50)
    for losses, ev, out, params, local_w0, colls in run_ranks(_demo, 2, 3, timeout=100):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        assert abs(ev - float(F.mse_loss(ref(x), y))) < 1e-5
        np.testing.assert_allclose(out, ref(x).detach().numpy(), rtol=1e-5, atol=1e-6)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6)
        assert local_w0 == (IMAGE // 2, IMAGE)
        assert any("all_reduce" in c or "allreduce" in c for c in colls)


def _two_stages(steps):
    """linear_0 on rank 0's mesh, linear_1 on rank 1's: DistModel runs them stage after stage."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    first, last = dist.ProcessMesh([0], dim_names=["pp"]), dist.ProcessMesh([1], dim_names=["pp"])

    class TwoStages(Net):
        def __init__(self):
            super().__init__()
            for layer, mesh in ((self.linear_0, first), (self.linear_1, last)):
                for name, p in list(layer.named_parameters()):
                    setattr(layer, name, nn.Parameter(dist.shard_tensor(p.detach(), mesh, [dist.Replicate()])))

        def forward(self, x):
            h = dist.reshard(F.relu(self.linear_0(x)), last, [dist.Replicate()])
            return self.linear_1(h)

    net = TwoStages()
    dm = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.1))
    losses = []
    for s in range(steps):
        x, y = data(s)
        x, y = dist.shard_tensor(x, first, [dist.Replicate()]), dist.shard_tensor(y, last, [dist.Replicate()])
        losses.append(dm(x, y))
    mine = {k: v._local_value().detach().clone() for k, v in net.state_dict().items() if v._local_value().numel()}
    return losses, mine


@pytest.mark.timeout(120)
def test_stages_on_two_meshes_run_one_after_the_other():
    """The loss on the last stage's rank (an empty array on the first's, as Paddle's), and each stage's parameters
    as the eager run on one process leaves them."""
    batches = [data(s) for s in range(3)]
    ref, ref_losses = eager(3, batches)
    (first_losses, first), (last_losses, last) = run_ranks(_two_stages, 2, 3, timeout=100)
    assert [loss.size for loss in first_losses] == [0, 0, 0]
    np.testing.assert_allclose([float(loss) for loss in last_losses], ref_losses, rtol=1e-5)
    want = ref.state_dict()
    assert sorted(first) == ["linear_0.bias", "linear_0.weight"]
    assert sorted(last) == ["linear_1.bias", "linear_1.weight"]
    for k, v in {**first, **last}.items():
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6)


class _Branches(nn.Module):
    """Rank 1's batch takes branch c, rank 0's branch b: each rank has gradients for other parameters."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.c(h) if bool(x[0, 0] > 0) else self.b(h)


def _branch_batch(rank):
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    x[0, 0] = 1.0 if rank == 1 else -1.0
    return x, torch.ones(2, 2)


def _branches_data_parallel():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    net = _Branches()
    dm = dist.to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.5))
    loss = float(dm(*_branch_batch(dist.get_rank())))
    return loss, {k: v.clone() for k, v in net.state_dict().items()}


def test_data_parallel_ranks_with_gradients_for_other_parameters_equal_eager():
    net = _Branches()
    loss = sum(F.mse_loss(net(x), y) for x, y in map(_branch_batch, range(2))) / 2
    loss.backward()
    torch.optim.SGD(net.parameters(), lr=0.5).step()
    for got, params in run_ranks(_branches_data_parallel, 2, timeout=60):
        assert got == pytest.approx(loss.item(), abs=1e-6)
        for k, v in net.state_dict().items():  # b's and c's gradients were averaged with each other
            torch.testing.assert_close(params[k], v, atol=1e-6, rtol=1e-6, msg=k)
