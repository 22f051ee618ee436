"""DistModel and shard_dataloader edges against one dense process: Paddle's loss scaling, set_state_dict checks."""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from meshviz.distributed.auto_parallel import Strategy, to_static
from meshviz.testing import run_ranks
from tests.ranks.test_to_static import Net, data

WORLD = 2


# -- float16 loss scaling as Paddle's update_loss_scaling ------------------------------------------------------
def _amp(init, decr, decr_every):
    return {"enable": True, "dtype": "float16", "level": "O1", "init_loss_scaling": init, "decr_ratio": decr,
            "decr_every_n_nan_or_inf": decr_every, "incr_ratio": 2.0, "incr_every_n_steps": 2}


def _full(v):
    return (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()


def _scaled_run(amp, steps, how):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    rank = dist.get_rank()
    net = Net()
    strategy = {"amp": amp}
    if how == "sharding":
        strategy["sharding"] = {"enable": True, "stage": 2, "degree": WORLD}
    if how == "dist":  # dist parameters: every rank feeds the whole batch
        mesh = dist.ProcessMesh(list(range(WORLD)), dim_names=["x"])
        net.linear_0.weight = dist.shard_tensor(net.linear_0.weight, mesh, [dist.Shard(0)])
    dm = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.1), Strategy(strategy))
    scales = []
    for s in range(steps):
        parts = [data(s, r) for r in (range(WORLD) if how == "dist" else [rank])]
        dm(torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))
        scales.append(dm._scaler.get_scale())
    return scales, {k: _full(v) for k, v in net.state_dict().items()}


def _scaled_dense(amp, steps):
    """One process on the whole batch, stepping and moving the scale as Paddle's static AMP does."""
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scale, good, bad, scales = amp["init_loss_scaling"], 0, 0, []
    for s in range(steps):
        x = torch.cat([data(s, r)[0] for r in range(WORLD)])
        y = torch.cat([data(s, r)[1] for r in range(WORLD)])
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(net(x), y)
        (loss * scale).backward()
        found = not all(torch.isfinite(p.grad).all() for p in net.parameters())
        if not found:
            for p in net.parameters():
                p.grad.mul_(1.0 / scale)
            opt.step()
        opt.zero_grad()
        if found:
            good, bad = 0, bad + 1
            if bad == amp["decr_every_n_nan_or_inf"]:
                scale, bad = max(scale * amp["decr_ratio"], 1.0), 0
        else:
            good, bad = good + 1, 0
            if good == amp["incr_every_n_steps"]:
                scale, good = scale * amp["incr_ratio"], 0
        scales.append(scale)
    return scales, net.state_dict()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["data_parallel", "sharding", "dist"])
@pytest.mark.parametrize("init, decr, decr_every, want", [
    # two overflowing steps per back-off (Paddle's default 2): 2**40 twice, 2**25 twice, then clean steps grow it
    (2.0**40, 2.0**-15, 2, [2.0**40, 2.0**25, 2.0**25, 2.0**10, 2.0**10, 2.0**11]),
    # a back-off never takes the scale below 1
    (2.0**40, 2.0**-45, 1, [1.0, 1.0, 2.0, 2.0, 4.0, 4.0]),
])
def test_float16_loss_scale_backs_off_after_decr_every_n_overflowing_steps_as_paddle(init, decr, decr_every, want,
                                                                                    how):
    amp = _amp(init, decr, decr_every)
    ref_scales, ref = _scaled_dense(amp, len(want))
    assert ref_scales == want  # the overflows really happen where the case says
    for scales, params in run_ranks(_scaled_run, WORLD, amp, len(want), how, timeout=50):
        assert scales == want
        for k, v in ref.items():
            torch.testing.assert_close(params[k], v, rtol=1e-3, atol=1e-4)


# -- set_state_dict: a value it cannot load raises on every rank before anything is written ----------------------
def _load_from_another_mesh(key):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    net = Net()
    net.linear_1.weight = dist.shard_tensor(net.linear_1.weight, mesh, [dist.Shard(1)])
    dm = to_static(net, None, nn.MSELoss(), torch.optim.AdamW(net.parameters(), lr=0.1))
    dm(*data(0))
    before = {k: _full(v) for k, v in dm.state_dict().items()}
    new = {k: dist.shard_tensor(_full(v) + 1, mesh, [dist.Replicate()]) for k, v in before.items()
           if k in ("linear_0.weight", "linear_0.bias")}  # loadable, and listed first
    other = dist.ProcessMesh([1, 0], dim_names=["x"])  # the same ranks in another order
    new[key] = dist.shard_tensor(before[key] + 1, other, [dist.Shard(1)])
    with pytest.raises(ValueError, match=f"{key} lies on .*mesh=\\[0, 1\\].*mesh=\\[1, 0\\].*reshard"):
        dm.set_state_dict(new)
    after = {k: _full(v) for k, v in dm.state_dict().items()}
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0)
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", ["linear_1.weight", "linear_1.weight.exp_avg"])
def test_set_state_dict_of_a_value_on_another_mesh_raises_before_writing_anything(key):
    assert run_ranks(_load_from_another_mesh, WORLD, key, timeout=50) == [True] * WORLD


# -- what a step returns keeps its dtype, as Paddle's fetch ------------------------------------------------------
class _Classes(Net):
    def forward(self, x):
        out = super().forward(x)
        return out, out.argmax(-1) + 2**40  # class ids float32 cannot hold


def _classes_loss(out, ids, y):  # the model's outputs come spread, as Paddle's loss(*outputs, *labels)
    return F.mse_loss(out, y)


def _float64_and_ids(return_numpy):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    rank = dist.get_rank()
    net = _Classes().double()
    dm = to_static(net, None, _classes_loss, torch.optim.SGD(net.parameters(), lr=0.1),
                   Strategy({"return_numpy": return_numpy}))
    x, y = data(0, rank)
    loss = dm(x.double(), y.double())
    dm.eval()
    ev = dm(*(t.double() for t in data(1, rank)))
    dm.predict()
    outs = dm(data(2, rank)[0].double())
    return loss, ev, outs["out0"], outs["out1"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("return_numpy", [True, False])
def test_losses_and_outputs_come_back_in_their_own_dtype(return_numpy):
    """A float64 model's losses (the mean over the data-parallel ranks) and outputs stay float64 and int64 class
    ids stay int64, as one process computes them (float32 would round both)."""
    ref = _Classes().double()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = (torch.cat([data(0, r)[i] for r in range(WORLD)]).double() for i in (0, 1))
    loss = _classes_loss(*ref(x), y)
    loss.backward()
    opt.step()
    x1, y1 = (torch.cat([data(1, r)[i] for r in range(WORLD)]).double() for i in (0, 1))
    ev = _classes_loss(*ref(x1), y1).detach()
    for rank, got in enumerate(run_ranks(_float64_and_ids, WORLD, return_numpy, timeout=50)):
        got = [torch.as_tensor(g) for g in got]
        assert [g.dtype for g in got] == [torch.float64, torch.float64, torch.float64, torch.int64]
        torch.testing.assert_close(got[0], loss.detach(), rtol=1e-13, atol=0)
        torch.testing.assert_close(got[1], ev, rtol=1e-13, atol=0)
        out, ids = ref(data(2, rank)[0].double())
        torch.testing.assert_close(got[2], out.detach(), rtol=1e-13, atol=1e-15)
        assert torch.equal(got[3], ids)


# -- set_state_dict before training: the optimizer states not given start as before any step ----------------------
def _whole(step):
    return tuple(torch.cat([data(step, r)[i] for r in range(WORLD)]) for i in (0, 1))


def _resume_one_state(how):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    rank = dist.get_rank()
    mesh = dist.ProcessMesh(list(range(WORLD)), dim_names=["x"])
    net = Net()
    if how == "dist":
        net.linear_1.weight = dist.shard_tensor(net.linear_1.weight, mesh, [dist.Shard(1)])
    strategy = {"sharding": {"enable": True, "stage": 1, "degree": WORLD}} if how == "sharding" else {}
    dm = to_static(net, None, nn.MSELoss(), torch.optim.AdamW(net.parameters(), lr=0.1), Strategy(strategy))
    value = torch.ones(net.linear_1.weight.shape)
    dm.set_state_dict({"linear_1.weight.exp_avg_sq": dist.shard_tensor(value, mesh, [dist.Shard(1)])
                       if how == "dist" else value})
    losses = [float(dm(*(_whole(s) if how == "dist" else data(s, rank)))) for s in range(2)]
    return losses, {k: _full(v) for k, v in net.state_dict().items()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["data_parallel", "dist", "sharding"])
def test_set_state_dict_of_one_optimizer_state_before_training_keeps_the_others_as_before_any_step(how):
    """As Paddle's program holds every state from its start: loading one AdamW moment before the first step leaves
    the other moment zero and the step count 0, as one process given that state (on HEAD the plain optimizer held
    only the state loaded and its first step raised KeyError 'exp_avg')."""
    ref = Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    w = ref.linear_1.weight
    opt.state[w] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(w), "exp_avg_sq": torch.ones_like(w)}
    want = []
    for s in range(2):
        loss = F.mse_loss(ref(_whole(s)[0]), _whole(s)[1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    for losses, params in run_ranks(_resume_one_state, WORLD, how, timeout=50):
        np.testing.assert_allclose(losses, want, rtol=1e-5)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6)
