"""to_static's amp level O2 (float32 master weights, low-precision casts each step) against one process by hand."""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from meshviz.distributed.auto_parallel import Strategy, to_static
from meshviz.testing import run_ranks

IMAGE, CLASSES, B, STEPS = 16, 8, 4, 3


class Net(nn.Module):
    """A parameter used outside autocast's lists (``scale``) and a layer norm: O2 and O1 differ there."""

    def __init__(self, norm=nn.LayerNorm):
        super().__init__()
        torch.manual_seed(0)
        self.linear_0 = nn.Linear(IMAGE, IMAGE)
        self.norm = norm(IMAGE)
        self.scale = nn.Parameter(torch.rand(IMAGE) + 0.5)
        self.linear_1 = nn.Linear(IMAGE, CLASSES)

    def forward(self, x):
        return self.linear_1(F.relu(self.norm(self.linear_0(x)) * self.scale))


def data(step, b=B):
    g = torch.Generator().manual_seed(100 + step)
    return torch.rand(b, IMAGE, generator=g), torch.rand(b, CLASSES, generator=g)


def strategy(level, dtype="bfloat16"):
    return Strategy({"amp": {"enable": True, "dtype": dtype, "level": level}})


def o2_by_hand(dtype, steps=STEPS, opt_cls=torch.optim.SGD, norm=nn.LayerNorm, keep_norm=False, scaler=None):
    """Paddle's O2 in plain torch: a low-precision model copy (norms kept float32 where asked), a float32 master
    copy the optimizer steps, the copy's gradients cast to float32, the master copied back into the copy."""
    master = Net(norm)
    low = copy.deepcopy(master)
    kept = {n for n, _ in low.named_parameters() if keep_norm and n.startswith("norm.")}
    for n, p in low.named_parameters():
        if n not in kept:
            p.data = p.data.to(dtype)
    opt = opt_cls(master.parameters(), lr=0.1)
    losses = []
    for s in range(steps):
        x, y = data(s)
        with torch.autocast("cpu", dtype=dtype):
            loss = F.mse_loss(low(x), y).float()
        (scaler.scale(loss) if scaler else loss).backward()
        for p, q in zip(master.parameters(), low.parameters()):
            p.grad = q.grad.float()
            q.grad = None
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, q in zip(master.parameters(), low.parameters()):
                q.copy_(p)
        losses.append(float(loss.detach()))
    with torch.no_grad():  # the running statistics the copy kept
        for b, c in zip(master.buffers(), low.buffers()):
            b.copy_(c)
    return master, losses


def one_process(level, dtype="bfloat16", opt_cls=torch.optim.SGD, norm=nn.LayerNorm):
    net = Net(norm)
    dm = to_static(net, None, nn.MSELoss(), opt_cls(net.parameters(), lr=0.1), strategy(level, dtype))
    losses = [float(dm(*data(s))) for s in range(STEPS)]
    return net, dm, losses


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW])
def test_o2_equals_the_recipe_by_hand_and_differs_from_o1(opt_cls):
    ref, ref_losses = o2_by_hand(torch.bfloat16, opt_cls=opt_cls)
    net, dm, losses = one_process("O2", opt_cls=opt_cls)
    assert losses == ref_losses
    for (n, a), b in zip(net.named_parameters(), ref.parameters()):
        assert a.dtype == torch.float32, n  # the parameters are the float32 master weights
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    o1, _, o1_losses = one_process("O1", opt_cls=opt_cls)
    assert o1_losses != losses
    assert not torch.equal(o1.scale, net.scale)
    sd = dm.state_dict()  # float32 values under the parameters' names, as Paddle's program holds them
    assert all(sd[n].dtype == torch.float32 for n, _ in net.named_parameters())
    assert not any("master" in k for k in sd)


def test_o2_eval_and_predict_run_on_the_low_precision_casts():
    ref, _ = o2_by_hand(torch.bfloat16)
    net, dm, _ = one_process("O2")
    low = copy.deepcopy(ref).to(torch.bfloat16)
    x, y = data(50)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = low(x)
        ev = F.mse_loss(out, y)
    dm.eval()
    assert float(dm(x, y)) == float(ev)
    dm.predict()
    np.testing.assert_array_equal(dm(x)["out0"], out.float().numpy())


def test_o2_batch_norm_keeps_float32_parameters():
    ref, ref_losses = o2_by_hand(torch.bfloat16, norm=nn.BatchNorm1d, keep_norm=True)
    net, dm, losses = one_process("O2", norm=nn.BatchNorm1d)
    assert losses == ref_losses
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(net.norm.running_mean, ref.norm.running_mean, rtol=0, atol=0)
    assert set(dm._o2.params) == {"linear_0.weight", "linear_0.bias", "scale", "linear_1.weight", "linear_1.bias"}


def test_o2_float16_keeps_layer_norm_float32_and_scales_the_loss():
    scaler = torch.amp.GradScaler("cpu", init_scale=32768.0)
    ref, ref_losses = o2_by_hand(torch.float16, keep_norm=True, scaler=scaler)
    net, dm, losses = one_process("O2", dtype="float16")
    assert dm._scaler is not None
    assert losses == ref_losses
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_o2_refuses_what_it_cannot_run():
    net = Net()
    s = strategy("O2")
    s.sharding.enable, s.sharding.stage, s.sharding.degree = True, 3, 1
    with pytest.raises(ValueError, match="O2.*stage 3"):
        to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.1), s)


# -- dist-tensor parameters on two ranks ---------------------------------------------------------------------
def _sharded(level):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])

    def shard_fn(name, layer, mesh):
        for pname, p in list(layer.named_parameters(recurse=False)):
            pl = [dist.Replicate()]
            if name == "linear_0":  # column parallel: each rank's block computed as the whole one's, bit for bit
                pl = [dist.Shard(0)]
            setattr(layer, pname, nn.Parameter(dist.shard_tensor(p.detach(), mesh, pl)))

    net = dist.shard_layer(Net(), mesh, shard_fn)
    dm = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.1), strategy(level))
    losses = [float(dm(*data(s))) for s in range(STEPS)]  # every rank feeds the same batch
    params = {k: v.full_tensor().detach().clone() for k, v in dm.state_dict("param").items()}
    return losses, params, tuple(net.linear_0.weight._local_value().shape), str(net.linear_0.weight.dtype)


@pytest.mark.timeout(120)
def test_o2_with_dist_tensor_parameters_on_two_ranks_equals_the_recipe_by_hand():
    ref, ref_losses = o2_by_hand(torch.bfloat16)
    o1 = [r[0] for r in run_ranks(_sharded, 2, "O1", timeout=100)]
    for (losses, params, local, dtype), o1_losses in zip(run_ranks(_sharded, 2, "O2", timeout=100), o1):
        assert losses == ref_losses
        for k, v in ref.named_parameters():
            torch.testing.assert_close(params[k], v.detach(), rtol=0, atol=0, msg=k)
        assert local == (IMAGE // 2, IMAGE) and dtype == "torch.float32"
        assert losses != o1_losses
