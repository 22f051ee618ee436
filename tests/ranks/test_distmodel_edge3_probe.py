"""DistModel's pipeline against one process: a stage's error ends the run; Paddle's learning_rate_0 resumes."""

import time

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from meshviz.distributed.auto_parallel import Strategy, to_static
from meshviz.testing import run_ranks

D, OUT, B, LR = 8, 4, 8, 0.1


class Chain(nn.Module):
    """``p`` stages: Linear(D, D) + ReLU on each but the last, Linear(D, OUT) on the last."""

    def __init__(self, p):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(D, D) for _ in range(p - 1)] + [nn.Linear(D, OUT)])

    def forward(self, x):
        for j, layer in enumerate(self.layers):
            x = layer(x)
            x = F.relu(x) if j < len(self.layers) - 1 else x
        return x


def data(step, b=B):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(b, D, generator=g), torch.randn(b, OUT, generator=g)


def strategy(mode, acc, p, **more):
    s = Strategy()
    s.pipeline.enable, s.pipeline.schedule_mode, s.pipeline.accumulate_steps = True, mode, acc
    s.pipeline.pp_degree = p
    for section, values in more.items():
        for k, v in values.items():
            setattr(getattr(s, section), k, v)
    return s


def _staged(p):
    """Chain(p) with stage j's layer on row j of a [p, world / p] mesh (replicated on it), and the meshes."""
    import meshviz.distributed as dist

    world = dist.get_world_size()
    mesh = dist.ProcessMesh(np.arange(world).reshape(p, world // p).tolist(), dim_names=["pp", "dp"])
    stages = [mesh.get_mesh_with_dim("pp", j) for j in range(p)]
    net = Chain(p)
    for layer, m in zip(net.layers, stages):
        for name, q in list(layer.named_parameters()):
            setattr(layer, name, nn.Parameter(dist.shard_tensor(q.detach(), m, [dist.Replicate()])))

    def forward(x):
        for j, layer in enumerate(net.layers):
            x = layer(dist.reshard(x, stages[j], [dist.Replicate()]))
            x = F.relu(x) if j < p - 1 else x
        return x

    net.forward = forward
    return dist, net, stages


def _feed(dist, stages, x, y=None):
    fx = dist.shard_tensor(x, stages[0], [dist.Replicate()])
    return (fx,) if y is None else (fx, dist.shard_tensor(y, stages[-1], [dist.Replicate()]))


def _full(net):
    return {k: f.detach().clone() for k, v in net.state_dict().items() if (f := v.full_tensor()).numel()}


# -- a stage's own error ends the run at once, naming it ---------------------------------------------------------
def _layer_error():
    """The first stage's layer refuses its input, before it sends the activation the last stage waits for."""
    dist, net, stages = _staged(2)
    real = net.layers[0].forward

    def first(x):
        if x._local_value().numel():
            raise IndexError("stage 0 refuses its input")
        return real(x)

    net.layers[0].forward = first
    dm = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=LR), strategy("1F1B", 2, 2))
    dm(*_feed(dist, stages, *data(0)))


@pytest.mark.timeout(90)
def test_a_layer_error_before_the_stage_transfer_ends_the_run_at_once_on_processes():
    """That rank raises at once (its peer waits in the receive): the run ends naming it well before the collective
    timeout (60 s)."""
    from meshviz.errors import RankError

    t0 = time.monotonic()
    with pytest.raises(RankError) as got:
        run_ranks(_layer_error, 2, timeout=80, collective_timeout=60, ranks="processes")
    assert time.monotonic() - t0 < 40
    assert "rank 0" in str(got.value) and "stage 0 refuses its input" in str(got.value), str(got.value)


# -- Paddle's learning_rate_0 ---------------------------------------------------------------------------------------
class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, OUT)

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


def test_learning_rate_0_is_paddles_float32_scalar_in_opt_or_under_a_scheduler_in_param():
    """Paddle 3.3.1: a float32 0-dim tensor; among the optimizer's states without an LRScheduler, among the
    parameters with one (its value the rate the next step uses here)."""
    net = Plain()
    dm = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.25))
    lr = dm.state_dict("opt")["learning_rate_0"]
    assert lr.dtype == torch.float32 and lr.shape == () and float(lr) == 0.25
    assert "learning_rate_0" not in dm.state_dict("param") and "learning_rate_0" in dm.state_dict()
    opt = torch.optim.SGD(net.parameters(), lr=0.25)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    dm = to_static(net, None, nn.MSELoss(), opt)
    dm(*data(0))
    sched.step()
    assert "learning_rate_0" not in dm.state_dict("opt")
    assert float(dm.state_dict("param")["learning_rate_0"]) == 0.125
    assert float(dm.state_dict()["learning_rate_0"]) == 0.125
    predict = to_static(net)
    assert "learning_rate_0" not in predict.state_dict()
    with pytest.raises(ValueError, match="unknown keys \\['learning_rate_0'\\]"):
        predict.set_state_dict({"learning_rate_0": torch.tensor(0.5)})


@pytest.mark.parametrize("bad, match", [
    (torch.tensor([0.1, 0.2]), "learning_rate_0 takes one learning rate.*shape \\[2\\]"),
    (torch.tensor(-0.1), "learning_rate_0 takes one learning rate.*-0.1"),
    (float("nan"), "learning_rate_0 takes one learning rate.*nan"),
    ("0.1", "learning_rate_0 takes one learning rate.*'0.1'"),
], ids=["two", "negative", "nan", "string"])
def test_a_learning_rate_that_cannot_be_loaded_is_refused_before_writing(bad, match):
    net = Plain()
    opt = torch.optim.SGD(net.parameters(), lr=0.25)
    dm = to_static(net, None, nn.MSELoss(), opt)
    w = net.a.weight.detach().clone()
    with pytest.raises(ValueError, match=match):
        dm.set_state_dict({"a.weight": w + 1, "learning_rate_0": bad})
    assert torch.equal(net.a.weight, w) and opt.param_groups[0]["lr"] == 0.25
    with pytest.raises(ValueError, match="unknown key 'learning_rate_1'"):
        dm.set_state_dict({"learning_rate_1": torch.tensor(0.5)})


def _lr_run(how, split, path):
    """Adam under a StepLR (0.1, halved each step) for 4 steps: uninterrupted, and saved after ``split`` steps then
    resumed into a fresh DistModel, optimizer and scheduler (the scheduler's own state loaded, as torch's)."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    rank = dist.get_rank()

    def make():
        if how == "pipeline":
            _, net, stages = _staged(2)
            s = strategy("1F1B", 2, 2)
        else:
            net, stages, s = Plain(), None, None
        opt = torch.optim.Adam(net.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return net, to_static(net, None, nn.MSELoss(), opt, s), opt, sched, stages

    def step(dm, opt, sched, stages, s):
        x, y = data(s)
        got = dm(*(_feed(dist, stages, x, y) if stages else (x[rank::2], y[rank::2])))
        lr = opt.param_groups[0]["lr"]  # the rate this step used (one loaded in place reaches it at the step)
        sched.step()
        return lr, None if got is None else np.asarray(got).tolist()

    _, whole, opt, sched, stages = make()
    want = [step(whole, opt, sched, stages, s) for s in range(4)]
    _, first, opt, sched, stages = make()
    for s in range(split):
        step(first, opt, sched, stages, s)
    sd, sched_state = first.state_dict(), sched.state_dict()
    net, resumed, opt, sched, stages = make()
    if path is None:
        resumed.set_state_dict(sd)
    else:  # Paddle's checkpoint: save, then load into a fresh model's state_dict() in place
        dist.save_state_dict(sd, path)
        dist.load_state_dict(resumed.state_dict(), path)
    sched.load_state_dict(sched_state)
    got = [step(resumed, opt, sched, stages, s) for s in range(split, 4)]
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in
            net.state_dict().items()}
    whole_full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in
                  whole._layer.state_dict().items()}
    return want[split:], got, full, whole_full


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how, split, saved", [
    ("data_parallel", 2, False), ("data_parallel", 1, True), ("pipeline", 2, False), ("pipeline", 3, True),
])
def test_a_run_resumed_under_a_torch_lr_scheduler_continues_as_the_uninterrupted_run(how, split, saved, tmp_path):
    """The learning rates, losses and weights after the resume are the uninterrupted run's (the resumed run stepped
    at the initial 0.1, as before learning_rate_0, from its first step on)."""
    path = str(tmp_path / "ckpt") if saved else None
    for want, got, full, whole in run_ranks(_lr_run, 2, how, split, path, timeout=80):
        assert [lr for lr, _ in got] == [lr for lr, _ in want] == [0.1 * 0.5 ** s for s in range(split, 4)]
        for (_, a), (_, b) in zip(got, want):
            np.testing.assert_allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), rtol=1e-6)
        for k, v in whole.items():
            torch.testing.assert_close(full[k], v, rtol=1e-6, atol=1e-7)


# -- the schedules against one process ------------------------------------------------------------------------------
def _pipe_run(sched, acc, p, merge, steps):
    dist, net, stages = _staged(p)
    more = {"gradient_merge": {"enable": True, "k_steps": acc, "avg": True}} if merge else {}
    dm = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=LR), strategy(sched, acc, p, **more))
    losses = [dm(*_feed(dist, stages, *data(s))) for s in range(steps)]
    dm.eval()
    ev = dm(*_feed(dist, stages, *data(steps)))
    dm.predict()
    pr = dm(*_feed(dist, stages, data(steps)[0]))
    return losses, ev, pr, _full(net)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sched, acc, p, world, merge", [
    ("FThenB", 4, 2, 2, False), ("1F1B", 2, 2, 2, True), ("1F1B", 4, 4, 4, False), ("FThenB", 2, 4, 4, True),
    ("1F1B", 8, 4, 4, False), ("FThenB", 1, 4, 4, False), ("1F1B", 4, 2, 4, True), ("1F1B", 2, 2, 8, False),
])
def test_schedules_train_eval_and_predict_as_one_process(sched, acc, p, world, merge):
    """Weights after 3 steps, each micro-batch's loss, eval's losses and predict's outputs as one process's on the
    whole batch (the last stage holds them; the others None)."""
    steps = 3
    net = Chain(p)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    want_losses = []
    for s in range(steps):
        x, y = data(s)
        want_losses.append(torch.stack([F.mse_loss(net(a), b) for a, b in zip(x.chunk(acc), y.chunk(acc))]).detach())
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    x, y = data(steps)
    with torch.no_grad():
        want_ev = torch.stack([F.mse_loss(net(a), b) for a, b in zip(x.chunk(acc), y.chunk(acc))])
        want_pr = net(x)
    want = net.state_dict()
    seen = set()
    for rank, (losses, ev, pr, full) in enumerate(run_ranks(_pipe_run, world, sched, acc, p, merge, steps,
                                                            timeout=110)):
        seen |= set(full)
        for k, v in full.items():
            torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6)
        if rank < world - world // p:
            assert losses == [None] * steps and ev is None and pr is None
            continue
        for got, w in zip(losses, want_losses):
            np.testing.assert_allclose(np.asarray(got).reshape(-1), w.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(ev).reshape(-1), want_ev.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(pr["out0"], want_pr.numpy(), rtol=1e-5, atol=1e-6)
    assert seen == set(want)
