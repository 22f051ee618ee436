"""to_static / DistModel against one dense eager run: shard_dataloader batches, per-sample losses, outputs, specs."""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from meshviz.distributed.auto_parallel import DistModel, Strategy, to_static
from meshviz.testing import run_ranks
from tests.ranks.test_to_static import CLASSES, IMAGE, B, Net, data


def whole(step, world):
    parts = [data(step, r) for r in range(world)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def per_sample(out, y):
    return ((out - y) ** 2).mean(1)


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


class Samples(torch.utils.data.Dataset):
    def __init__(self, as_dict):
        g = torch.Generator().manual_seed(7)
        self.x, self.y, self.as_dict = torch.rand(12, IMAGE, generator=g), torch.rand(12, CLASSES, generator=g), as_dict

    def __getitem__(self, i):
        return {"image": self.x[i], "label": self.y[i]} if self.as_dict else (self.x[i], self.y[i])

    def __len__(self):
        return len(self.x)


# -- a plain model fed by shard_dataloader (seed 003's loop) -------------------------------------------------
def _loader_run(batch_size, as_dict, opt_name):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    loader = torch.utils.data.DataLoader(Samples(as_dict), batch_size=batch_size)
    keys = ["image", "label"] if as_dict else None
    dist_loader = dist.shard_dataloader(loader, meshes=[mesh], shard_dims="dp", input_keys=keys)
    net = Net()
    dm = to_static(net, dist_loader, nn.MSELoss(), getattr(torch.optim, opt_name)(net.parameters(), lr=0.1))

    def batches():
        for b in dist_loader():
            yield (b["image"], b["label"]) if as_dict else b

    losses = [float(dm(x, y)) for x, y in batches()]
    dm.eval()
    evals = [float(dm(x, y)) for x, y in batches()]
    dm.predict()
    outs = [dm(x)["out0"] for x, _ in batches()]
    return losses, evals, outs, {k: full(v) for k, v in net.state_dict().items()}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("batch_size, as_dict, opt_name", [(4, False, "SGD"), (4, True, "SGD"), (5, False, "AdamW")])
def test_a_plain_model_fed_by_shard_dataloader_trains_as_one_process_on_the_whole_batch(batch_size, as_dict, opt_name):
    """The optimizer turns the plain parameters into dist ones at the first step, while that step is recorded."""
    ds = Samples(False)
    ref = Net()
    opt = getattr(torch.optim, opt_name)(ref.parameters(), lr=0.1)
    starts = range(0, len(ds), batch_size)
    ref_losses = []
    for i in starts:
        loss = F.mse_loss(ref(ds.x[i:i + batch_size]), ds.y[i:i + batch_size])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    with torch.no_grad():
        ref_evals = [float(F.mse_loss(ref(ds.x[i:i + batch_size]), ds.y[i:i + batch_size])) for i in starts]
        ref_outs = [ref(ds.x[i:i + batch_size]).numpy() for i in starts]
    for losses, evals, outs, params in run_ranks(_loader_run, 2, batch_size, as_dict, opt_name, timeout=120):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        np.testing.assert_allclose(evals, ref_evals, rtol=1e-5)
        for got, want in zip(outs, ref_outs, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6)


# -- a loss per sample -------------------------------------------------------------------------------------
def test_a_loss_per_sample_trains_on_the_gradient_of_its_sum():
    """Paddle 3.3.1 (CPU, one process): a loss of shape [batch] comes back whole, and the update is that of its sum."""
    batches = [data(s) for s in range(3)]
    ref = Net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for x, y in batches:
        loss = per_sample(ref(x), y)
        loss.sum().backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.detach().numpy())
    net = Net()
    dm = to_static(net, None, per_sample, torch.optim.SGD(net.parameters(), lr=0.1))
    losses = [dm(x, y) for x, y in batches]
    for got, want in zip(losses, ref_losses, strict=True):
        assert got.shape == (B,)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    prog = dm.serial_main_program("train")
    assert prog.graph is not None and "aten.sum.default" in prog.ops()


def _per_sample_data_parallel(steps, strategy):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    rank = dist.get_rank()
    net = Net()
    dm = to_static(net, None, per_sample, torch.optim.AdamW(net.parameters(), lr=0.1), Strategy(strategy))
    losses = [dm(*data(s, rank)) for s in range(steps)]
    dm.eval()
    ev = dm(*data(50, rank))
    return losses, ev, {k: full(v) for k, v in net.state_dict().items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy, k", [
    ({}, 1),
    ({"sharding": {"enable": True, "stage": 2, "degree": 2}, "gradient_merge": {"enable": True, "k_steps": 2}}, 2),
])
def test_a_loss_per_sample_on_data_parallel_ranks_is_every_rank_samples_loss(strategy, k):
    steps, world = 4, 2
    ref = Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    ref_losses = []
    for s in range(steps):
        loss = per_sample(ref(whole(s, world)[0]), whole(s, world)[1])
        (loss.sum() / k).backward()
        ref_losses.append(loss.detach().numpy())
        if s % k == k - 1:
            opt.step()
            opt.zero_grad()
    ref_eval = per_sample(ref(whole(50, world)[0]), whole(50, world)[1]).detach().numpy()
    for losses, ev, params in run_ranks(_per_sample_data_parallel, world, steps, strategy, timeout=100):
        for got, want in zip(losses, ref_losses, strict=True):
            assert got.shape == (world * B,)
            np.testing.assert_allclose(got, want, rtol=1e-5)
        np.testing.assert_allclose(ev, ref_eval, rtol=1e-5)
        for name, v in ref.state_dict().items():
            torch.testing.assert_close(params[name], v, rtol=1e-5, atol=1e-6)


# -- predict's outputs, input_spec --------------------------------------------------------------------------
class _DictNet(Net):
    def forward(self, x):
        return {"logits": super().forward(x)}


class _PairNet(Net):
    def forward(self, x):
        return super().forward(x), None


def test_predict_refuses_outputs_that_are_not_tensors():
    x = data(0)[0]
    with pytest.raises(TypeError) as info:
        to_static(_DictNet())(x)
    assert str(info.value) == ("predict: the model must return a tensor or a list/tuple of tensors (each returned "
                               "as out<i>), got dict")
    with pytest.raises(TypeError) as info:
        to_static(_PairNet())(x)
    assert str(info.value).endswith("got tuple holding NoneType")


def test_input_spec_as_paddles_input_and_label_lists():
    spec = [[((B, IMAGE), "float32")], [((B, CLASSES), torch.float32)]]
    net = Net()
    dm = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.1), input_spec=spec)
    prog = str(dm.serial_main_program("train"))  # before any step: the labels' shapes come from the spec
    assert "f32[4, 16]" in prog and "f32[4, 8]" in prog and "mse_loss_backward" in prog
    batches = [data(s) for s in range(2)]
    ref = Net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches:
        want = F.mse_loss(ref(x), y)
        want.backward()
        opt.step()
        opt.zero_grad()
        assert float(dm(x, y)) == pytest.approx(want.item(), rel=1e-6)
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="input_spec must be"):
        to_static(Net(), None, nn.MSELoss(), input_spec=[[((B, IMAGE), "float32")], "labels"])


# -- data parallel starts from rank 0 ----------------------------------------------------------------------
class _Scaled(Net):
    def __init__(self, scale):
        super().__init__()
        self.register_buffer("scale", torch.full((CLASSES,), float(scale)))

    def forward(self, x):
        return super().forward(x) * self.scale


def _buffers_from_rank_0():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    net = _Scaled(dist.get_rank() + 1)
    return to_static(net)(data(9)[0])["out0"], net.scale.clone()


@pytest.mark.timeout(60)
def test_data_parallel_starts_from_rank_0s_buffers_as_well_as_its_parameters():
    with torch.no_grad():
        want = _Scaled(1)(data(9)[0]).numpy()
    for out, scale in run_ranks(_buffers_from_rank_0, 2, timeout=50):
        torch.testing.assert_close(scale, torch.ones(CLASSES))
        np.testing.assert_allclose(out, want, rtol=1e-6)


# -- sharding of dist-tensor parameters --------------------------------------------------------------------
def _replicated_net(mesh):
    import meshviz.distributed as dist

    net = Net()
    for layer in (net.linear_0, net.linear_1):
        for name, p in list(layer.named_parameters()):
            setattr(layer, name, nn.Parameter(dist.shard_tensor(p.detach(), mesh, [dist.Replicate()])))
    return net


def _shard_optimizer_route(stage, k):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    net = _replicated_net(mesh)
    with pytest.raises(ValueError) as info:  # every rank, before any communication
        to_static(net, None, nn.MSELoss(), torch.optim.AdamW(net.parameters(), lr=0.1),
                  Strategy({"sharding": {"enable": True, "stage": stage, "degree": 2}}))
    loader = dist.shard_dataloader(torch.utils.data.DataLoader(Samples(False), batch_size=2), meshes=[mesh],
                                   shard_dims="dp")
    opt = dist.shard_optimizer(torch.optim.AdamW(net.parameters(), lr=0.1), getattr(dist, f"ShardingStage{stage}")(
        "dp", mesh))
    dm = to_static(net, loader, nn.MSELoss(), opt, Strategy({"gradient_merge": {"enable": True, "k_steps": k}}))
    losses = [float(dm(x, y)) for x, y in loader()]
    return str(info.value), losses, {name: full(v) for name, v in net.state_dict().items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_dist_parameters_shard_through_shard_optimizer_with_gradient_merge(stage):
    k, ds = 2, Samples(False)
    ref = Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    ref_losses = []
    for j, i in enumerate(range(0, len(ds), 2)):
        loss = F.mse_loss(ref(ds.x[i:i + 2]), ds.y[i:i + 2])
        (loss / k).backward()
        ref_losses.append(loss.item())
        if j % k == k - 1:
            opt.step()
            opt.zero_grad()
    for words, losses, params in run_ranks(_shard_optimizer_route, 2, stage, k, timeout=100):
        assert words == (f"to_static: strategy.sharding with dist-tensor parameters is not supported; pass dist."
                         f"shard_optimizer(optimizer, dist.ShardingStage{stage}(axis, mesh)) as the optimizer")
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for name, v in ref.state_dict().items():
            torch.testing.assert_close(params[name], v, rtol=1e-5, atol=1e-6)


# -- which tensors are inputs and which labels ---------------------------------------------------------------
class _Masked(Net):
    def forward(self, x, mask=None):
        out = super().forward(x)
        return out if mask is None else out * mask


def _two_labels(out, y, w):
    return (((out - y) ** 2).mean(1) * w).mean()


def test_a_forward_with_an_optional_input_takes_every_tensor_but_the_last_label_as_paddle():
    """Paddle splits a loader's batch so: the last item is the label (a list of them: several labels)."""
    x, y = data(0)
    mask = (torch.arange(CLASSES) % 2).float().expand(B, CLASSES)
    w = torch.arange(B).float()
    ref = _Masked()
    want_masked = F.mse_loss(ref(x, mask), y).item()
    want_two = _two_labels(ref(x), y, w).item()
    dm = to_static(_Masked(), None, nn.MSELoss())
    assert float(dm(x, mask, y)) == pytest.approx(want_masked, rel=1e-6)
    assert float(dm([x, mask, y])) == pytest.approx(want_masked, rel=1e-6)
    assert float(dm(x, y)) == pytest.approx(F.mse_loss(ref(x), y).item(), rel=1e-6)
    assert float(to_static(_Masked(), None, _two_labels)(x, [y, w])) == pytest.approx(want_two, rel=1e-6)
    assert float(to_static(Net(), None, _two_labels)(x, y, w)) == pytest.approx(want_two, rel=1e-6)  # 1 input
    pm = to_static(_Masked())
    np.testing.assert_allclose(pm(x, mask)["out0"], (ref(x) * mask).detach().numpy(), rtol=1e-6)
    with pytest.raises(ValueError) as info:
        dm(x)
    assert str(info.value) == "eval takes the model's input(s) and then the label(s), got 1 tensors"


def test_a_dict_loader_gives_the_serial_program_its_shapes_before_any_step():
    loader = torch.utils.data.DataLoader(Samples(True), batch_size=3)
    net = Net()
    dm = to_static(net, loader, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.1))
    prog = str(dm.serial_main_program("train"))
    assert "f32[3, 16]" in prog and "f32[3, 8]" in prog and "mse_loss_backward" in prog
    pred = dm.serial_main_program("predict")
    assert "mse_loss" not in str(pred) and [op for op in pred.ops() if "addmm" in op]


def test_full_graph_is_read_only_and_false_gives_the_layer_back():
    """Paddle 3.3.1: ``Strategy({"full_graph": False}).full_graph`` is False, it has no setter, and to_static then
    returns the layer object itself (run by paddle.jit.to_static in SOT mode)."""
    assert Strategy().full_graph is True
    s = Strategy({"full_graph": False, "return_numpy": False})
    assert s.full_graph is False and s.to_dict()["full_graph"] is False and "full_graph=False" in repr(s)
    assert Strategy(s.to_dict()).full_graph is False
    with pytest.raises(AttributeError) as info:
        s.full_graph = True
    assert str(info.value) == "property 'full_graph' of 'Strategy' object has no setter"
    net = Net()
    assert to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.1), s) is net
    assert isinstance(to_static(net, None, nn.MSELoss(), None, Strategy()), DistModel)
