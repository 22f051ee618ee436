"""to_static with strategy.pipeline as its users write it: a shard_dataloader over pp x dp, against one process."""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from meshviz.distributed.auto_parallel import Strategy, to_static
from meshviz.testing import run_ranks

D, OUT, B, LR = 8, 4, 8, 0.1


class Net(nn.Module):
    def __init__(self, depth=1):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(D, D) for _ in range(depth)])
        self.head = nn.Linear(D, OUT)

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.head(x)


class Data(torch.utils.data.Dataset):
    def __init__(self, n=5 * B):
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(n, D, generator=g), torch.randn(n, OUT, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _strategy(mode, acc):
    s = Strategy()
    s.pipeline.enable, s.pipeline.schedule_mode, s.pipeline.accumulate_steps, s.pipeline.pp_degree = True, mode, acc, 2
    return s


def _mesh():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "dp"])
    return dist, mesh, mesh.get_mesh_with_dim("pp", 0), mesh.get_mesh_with_dim("pp", 1)


def _staged(dist, net, first, last):
    """layers on the first stage, head on the last; the activations keep their rows split over dp."""
    for layer, m in ((net.layers, first), (net.head, last)):
        for sub in layer.modules():
            for name, p in list(sub.named_parameters(recurse=False)):
                setattr(sub, name, nn.Parameter(dist.shard_tensor(p.detach(), m, [dist.Replicate()])))

    def forward(x):
        return net.head(dist.reshard(F.relu(net.layers[0](x)), last, [dist.Shard(0)]))

    net.forward = forward


def _full(net) -> dict:
    return {k: f.detach().clone() for k, v in net.state_dict().items() if (f := v.full_tensor()).numel()}


def _micro_rows(acc, dp=2):
    """Micro-batch i's rows: the i-th part of every dp rank's rows (Paddle's executor splits each rank's feed)."""
    per = B // dp
    k = per // acc
    return [torch.cat([torch.arange(r * per + i * k, r * per + (i + 1) * k) for r in range(dp)]) for i in range(acc)]


def _modes(reduction, acc):
    dist, _mesh_, first, last = _mesh()
    net = Net()
    _staged(dist, net, first, last)
    loader = dist.shard_dataloader(torch.utils.data.DataLoader(Data(), batch_size=B), meshes=[first, last],
                                   shard_dims="dp")
    dm = to_static(net, loader, nn.MSELoss(reduction=reduction), torch.optim.SGD(net.parameters(), lr=LR),
                   _strategy("1F1B", acc))
    out = []
    for step, (x, y) in enumerate(loader()):
        getattr(dm, ("eval", "train", "predict", "train", "eval")[step])()
        out.append(dm(x) if step == 2 else dm(x, y))
    return out, _full(net)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loader_over_pp_and_dp_eval_train_predict_as_one_process(reduction):
    """1F1B, accumulate_steps 4 on pp2 x dp2 fed by shard_dataloader(meshes=[first, last], shard_dims='dp'),
    switching eval / train / predict: the last stage returns each micro-batch's loss (a loss per sample: every
    row's, in the batch's row order), the predicted rows in the batch's order, the weights one process's. The
    rows came back in micro-batch order (rows 0, 1, 4, 5, 2, 3, 6, 7) where the outputs split over dp."""
    acc = 4
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    data = Data()
    want = []
    for step in range(5):
        x, y = data.x[step * B:(step + 1) * B], data.y[step * B:(step + 1) * B]
        if step == 2:
            want.append(net(x).detach().numpy())
            continue
        if reduction == "none":
            want.append(F.mse_loss(net(x), y, reduction="none").detach().numpy())
        else:
            want.append(np.array([float(F.mse_loss(net(x[ix]), y[ix]).detach()) for ix in _micro_rows(acc)]))
        if step in (1, 3):
            loss = F.mse_loss(net(x), y, reduction=reduction)
            (loss.sum() / acc if reduction == "none" else loss).backward()
            opt.step()
            opt.zero_grad()
    for rank, (out, full) in enumerate(run_ranks(_modes, 4, reduction, acc, timeout=100)):
        assert sorted(full) == (["head.bias", "head.weight"] if rank >= 2 else ["layers.0.bias", "layers.0.weight"])
        for k, v in full.items():
            torch.testing.assert_close(v, net.state_dict()[k], rtol=1e-5, atol=1e-6)
        if rank < 2:
            assert out == [None] * 5
            continue
        assert sorted(out[2]) == ["out0"]
        out[2] = out[2]["out0"]
        for got, w in zip(out, want):
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)


def _parallelized(acc):
    dist, mesh, first, last = _mesh()
    dist.auto_parallel.set_mesh(mesh)
    net = Net(depth=4)
    net, opt = dist.parallelize(net, torch.optim.SGD(net.parameters(), lr=LR),
                                config={"pp_config": {"split_spec": "layers"}})
    loader = dist.shard_dataloader(torch.utils.data.DataLoader(Data(), batch_size=B), meshes=[first, last],
                                   shard_dims="dp")
    dm = to_static(net, loader, nn.MSELoss(), opt, _strategy("FThenB", acc))
    losses = [dm(x, y) for x, y in loader()]
    return losses, _full(net)


@pytest.mark.timeout(120)
def test_parallelize_split_spec_then_pipeline_as_one_process():
    """Stages set by dist.parallelize(pp_config={'split_spec': 'layers'}) compose with strategy.pipeline."""
    acc = 2
    net = Net(depth=4)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    data = Data()
    want = []
    for step in range(5):
        x, y = data.x[step * B:(step + 1) * B], data.y[step * B:(step + 1) * B]
        want.append([float(F.mse_loss(net(x[ix]), y[ix]).detach()) for ix in _micro_rows(acc)])
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    results = run_ranks(_parallelized, 4, acc, timeout=100)
    for rank, (losses, full) in enumerate(results):
        for k, v in full.items():
            torch.testing.assert_close(v, net.state_dict()[k], rtol=1e-5, atol=1e-6)
        if rank < 2:
            assert losses == [None] * 5
        else:
            np.testing.assert_allclose(np.stack(losses), want, rtol=1e-5, atol=1e-6)
    assert sorted(set(results[0][1]) | set(results[3][1])) == sorted(net.state_dict())


def _round_trip():
    dist, _mesh_, first, last = _mesh()
    loader = dist.shard_dataloader(torch.utils.data.DataLoader(Data(), batch_size=B), meshes=[first, last],
                                   shard_dims="dp")
    batches = list(loader())
    models = []
    for _ in range(2):
        net = Net()
        _staged(dist, net, first, last)
        models.append((net, to_static(net, loader, nn.MSELoss(), torch.optim.Adam(net.parameters(), lr=LR),
                                      _strategy("1F1B", 2))))
    (net, dm), (net2, dm2) = models
    for x, y in batches[:2]:
        dm(x, y)
    dm2.set_state_dict(dm.state_dict())
    losses = [(dm(x, y), dm2(x, y)) for x, y in batches[2:]]
    return losses, _full(net), _full(net2)


@pytest.mark.timeout(120)
def test_state_dict_round_trip_after_pipeline_training():
    """Adam's states and the weights loaded into a second DistModel: it trains on as the first one does."""
    for rank, (losses, full, full2) in enumerate(run_ranks(_round_trip, 4, timeout=100)):
        for a, b in losses:
            assert (a is None and b is None) if rank < 2 else np.array_equal(a, b)
        assert full.keys() == full2.keys() and len(full) == 2
        for k in full:
            torch.testing.assert_close(full[k], full2[k], rtol=0, atol=0)


def _first_batches(look, rounds):
    dist, _mesh_, first, last = _mesh()
    loader = dist.shard_dataloader(torch.utils.data.DataLoader(Data(), batch_size=B, shuffle=True),
                                   meshes=[first, last], shard_dims="dp")
    net = Net()  # its forward communicates nothing: each rank traces the serial program alone
    dm = to_static(net, loader, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=LR), Strategy())
    seen = [next(loader)[0].full_tensor()]  # a pass under way, continued after the look
    if look:
        dm.serial_main_program("train")
    seen += [next(loader)[0].full_tensor() for _ in range(len(loader) - 1)]
    for _ in range(rounds):
        seen += [x.full_tensor() for x, _ in loader()]
    return torch.cat(seen)


@pytest.mark.timeout(120)
def test_serial_program_reads_the_loader_without_moving_it_on():
    """serial_main_program before a step reads the loader's first batch: the batches training sees (a shuffled
    shard_dataloader's order by epoch, a pass under way) stay those it sees without the look, as Paddle's
    DistModel puts its sampler's epoch back. The look started a pass and drew an epoch: every pass after it ran in
    another order."""
    want = run_ranks(_first_batches, 4, False, 2, timeout=100)
    got = run_ranks(_first_batches, 4, True, 2, timeout=100)
    for rank, (w, g) in enumerate(zip(want, got)):
        assert w.shape == ((3 * len(Data()), D) if rank < 2 else (0,))  # the inputs lie on the first stage
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_serial_program_keeps_torchs_rng_for_a_plain_loader():
    """A plain DataLoader shuffled by torch's RNG: reading its first batch for the program leaves the RNG as it was."""
    def run(look):
        net = Net()
        torch.manual_seed(3)
        loader = torch.utils.data.DataLoader(Data(), batch_size=B, shuffle=True)
        dm = to_static(net, loader, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=LR), Strategy())
        if look:
            assert "serial main program (train)" in str(dm.serial_main_program("train"))
        return torch.cat([x for x, _ in loader]), torch.rand(3)

    (xs, r), (xs2, r2) = run(False), run(True)
    torch.testing.assert_close(xs2, xs, rtol=0, atol=0)
    torch.testing.assert_close(r2, r, rtol=0, atol=0)


def _serial_on_one_rank(who):
    dist, _mesh_, first, last = _mesh()
    net = Net()
    _staged(dist, net, first, last)  # its forward is a function set on the instance, resharding across stages
    dm = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=LR), _strategy("1F1B", 2),
                   input_spec=[[([B, D], "float32")], [([B, OUT], "float32")]])
    note = dm.serial_main_program("train").note if dist.get_rank() == who else None
    dist.barrier()
    return note


@pytest.mark.timeout(120)
def test_serial_program_of_an_instance_forward_communicates_nothing():
    """The serial program is traced on a copy of the layer on the meta device; a forward set on the instance
    (layer.forward = f) ran the original layer instead: a last-stage rank looking at the program alone waited in
    the stages' send/recv for a first stage that never sent. Now the program says why it is not traced."""
    for rank, note in enumerate(run_ranks(_serial_on_one_rank, 4, 2, timeout=60)):
        assert (note is None) if rank != 2 else ("forward is a function set on the instance" in note), note
