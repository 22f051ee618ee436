"""to_static with strategy.sharding fed shard_dataloader's dist batches, amp O2 with sharding, amp's custom op lists."""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from meshviz.core.layout import chunk
from meshviz.distributed.auto_parallel import Strategy, to_static
from meshviz.testing import run_ranks

IMAGE, CLASSES, N = 8, 4, 12


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear_0 = nn.Linear(IMAGE, IMAGE)
        self.scale = nn.Parameter(torch.rand(IMAGE) + 0.5)
        self.linear_1 = nn.Linear(IMAGE, CLASSES)

    def forward(self, x):
        return self.linear_1(F.relu(self.linear_0(x)) + self.scale)


def samples():
    g = torch.Generator().manual_seed(5)
    return torch.rand(N, IMAGE, generator=g), torch.rand(N, CLASSES, generator=g)


def per_sample(out, y):
    return ((out - y) ** 2).mean(1)


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


# -- strategy.sharding fed shard_dataloader's dist batches ------------------------------------------------------
def _sharded_loader_run(stage, bs, shape, axis, loss_name, k):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    world = int(np.prod(shape))
    mesh = dist.ProcessMesh(np.arange(world).reshape(shape).tolist(), dim_names=["dp", "mp"][:len(shape)])
    x, y = samples()
    loader = dist.shard_dataloader(torch.utils.data.DataLoader(list(zip(x, y)), batch_size=bs), meshes=[mesh],
                                   shard_dims=axis)
    net = Net()
    s = Strategy({"sharding": {"enable": True, "stage": stage, "degree": world},
                  "gradient_merge": {"enable": k > 1, "k_steps": k}})
    loss = per_sample if loss_name == "per_sample" else nn.MSELoss()
    dm = to_static(net, loader, loss, torch.optim.AdamW(net.parameters(), lr=0.1), s)
    losses, blocks = [], []
    for xb, yb in loader():
        blocks.append(xb._local_value().clone())
        losses.append(dm(xb, yb))
    dm.eval()
    evals = [dm(xb, yb) for xb, yb in loader()]
    dm.predict()
    outs = [dm(xb)["out0"] for xb, _ in loader()]
    return losses, evals, outs, {k: full(v) for k, v in net.state_dict().items()}, blocks


def _one_process(bs, loss_fn, k):
    ref = Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    x, y = samples()
    losses = []
    for j, i in enumerate(range(0, N, bs)):
        loss = loss_fn(ref(x[i:i + bs]), y[i:i + bs])
        ((loss.sum() if loss.dim() else loss) / k).backward()
        if (j + 1) % k == 0:
            opt.step()
            opt.zero_grad()
        losses.append(loss.detach().numpy())
    with torch.no_grad():
        evals = [loss_fn(ref(x[i:i + bs]), y[i:i + bs]).numpy() for i in range(0, N, bs)]
        outs = [ref(x[i:i + bs]).numpy() for i in range(0, N, bs)]
    return ref, losses, evals, outs


@pytest.mark.timeout(150)
@pytest.mark.parametrize("stage, bs, shape, axis, loss_name, k", [
    (1, 4, [2], "dp", "mse", 1),
    (2, 5, [2], "dp", "mse", 1),  # blocks of 3 and 2 rows: the loss is the whole batch's mean, not the blocks'
    (3, 5, [4], "dp", "mse", 1),  # a rank holds no row of the last batches
    (2, 4, [2, 2], "dp", "mse", 1),  # ranks 0, 1 hold the first half, 2, 3 the second
    (3, 4, [2, 2], "mp", "per_sample", 2),
    (1, 4, [2], None, "mse", 1),  # every rank the whole batch
])
def test_sharding_fed_dist_batches_trains_as_one_process_on_the_whole_batch(stage, bs, shape, axis, loss_name, k):
    """It raised on every rank (and before that hung): each rank now trains on its rows, the loss the batch's."""
    ref, ref_losses, ref_evals, ref_outs = _one_process(bs, per_sample if loss_name == "per_sample" else F.mse_loss, k)
    x, _ = samples()
    world = int(np.prod(shape))
    for rank, (losses, evals, outs, params, blocks) in enumerate(
            run_ranks(_sharded_loader_run, world, stage, bs, shape, axis, loss_name, k, timeout=120)):
        for got, want in zip(losses + evals + outs, ref_losses + ref_evals + ref_outs, strict=True):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
        for key, v in ref.state_dict().items():
            torch.testing.assert_close(params[key], v, rtol=2e-5, atol=1e-6, msg=key)
        coord = np.argwhere(np.arange(world).reshape(shape) == rank)[0]
        parts, index = (1, 0) if axis is None else (shape[["dp", "mp"].index(axis)], coord[["dp", "mp"].index(axis)])
        for block, i in zip(blocks, range(0, N, bs), strict=True):  # this rank's rows of the batch
            rows = x[i:i + bs]
            torch.testing.assert_close(block, rows[slice(*chunk(len(rows), parts, int(index)))], rtol=0, atol=0)


def _labels_replicated():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    x, y = samples()
    net = Net()
    s = Strategy({"sharding": {"enable": True, "stage": 2, "degree": 2}})
    dm = to_static(net, None, nn.MSELoss(), torch.optim.AdamW(net.parameters(), lr=0.1), s)
    losses = [float(dm(dist.shard_tensor(x[i:i + 4], mesh, [dist.Shard(0)]),
                       dist.shard_tensor(y[i:i + 4], mesh, [dist.Replicate()]))) for i in range(0, N, 4)]
    return losses, {k: full(v) for k, v in net.state_dict().items()}


@pytest.mark.timeout(60)
def test_sharding_fed_split_inputs_and_replicated_labels_trains_as_one_process():
    """The loss takes the labels as they lie: the replicated labels meet each rank's rows of the output."""
    ref, ref_losses, _, _ = _one_process(4, F.mse_loss, 1)
    for losses, params in run_ranks(_labels_replicated, 2, timeout=40):
        np.testing.assert_allclose(losses, np.array(ref_losses), rtol=2e-5)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(params[k], v, rtol=2e-5, atol=1e-6, msg=k)


def _resumed(stage):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    x, y = samples()
    loader = dist.shard_dataloader(torch.utils.data.DataLoader(list(zip(x, y)), batch_size=4), meshes=[mesh],
                                   shard_dims="dp")
    batches = list(loader())

    def make():
        net = Net()
        s = Strategy({"sharding": {"enable": True, "stage": stage, "degree": 2}})
        return net, to_static(net, loader, nn.MSELoss(), torch.optim.AdamW(net.parameters(), lr=0.1), s)

    whole_net, whole = make()
    whole_losses = [float(whole(*b)) for b in batches]
    _, first = make()
    first(*batches[0])
    net, resumed = make()
    resumed.set_state_dict(first.state_dict())
    losses = [float(resumed(*b)) for b in batches[1:]]
    return whole_losses, losses, [torch.equal(full(a), full(b)) for a, b in zip(whole_net.parameters(),
                                                                               net.parameters())]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stage", [1, 3])
def test_sharding_fed_dist_batches_resumes_from_its_state_dict(stage):
    _, ref_losses, _, _ = _one_process(4, F.mse_loss, 1)
    for whole_losses, losses, same in run_ranks(_resumed, 2, stage, timeout=70):
        np.testing.assert_allclose(whole_losses, np.array(ref_losses), rtol=2e-5)
        assert losses == whole_losses[1:] and all(same)


def _bad_dist_batch(case):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    x, y = samples()
    if case == "part of the ranks":
        xb = dist.shard_tensor(x[:4], dist.ProcessMesh([0], dim_names=["dp"]), [dist.Shard(0)])
        yb = dist.shard_tensor(y[:4], dist.ProcessMesh([0], dim_names=["dp"]), [dist.Shard(0)])
    elif case == "columns":
        xb, yb = dist.shard_tensor(x[:4], mesh, [dist.Shard(1)]), dist.shard_tensor(y[:4], mesh, [dist.Shard(1)])
    else:
        xb, yb = x[:4], dist.shard_tensor(y[:4], mesh, [dist.Shard(0)])
    net = Net()
    s = Strategy({"sharding": {"enable": True, "stage": 2, "degree": 2}})
    dm = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.1), s)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(ValueError, match="DistModel: .*(every rank|rows|plain inputs)") as e:
        dm(xb, yb)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    dist.barrier()  # no rank left inside a collective
    return str(e.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["part of the ranks", "columns", "dist labels of plain inputs"])
def test_a_dist_batch_that_is_not_each_rank_rows_raises_on_every_rank(case):
    words = run_ranks(_bad_dist_batch, 2, case, timeout=40)
    assert words[0] == words[1]


def _serial_inputs(sharded):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    x, y = samples()
    loader = dist.shard_dataloader(torch.utils.data.DataLoader(list(zip(x, y)), batch_size=4), meshes=[mesh],
                                   shard_dims="dp")
    net = Net()
    s = Strategy({"sharding": {"enable": sharded, "stage": 2, "degree": 2}})
    dm = to_static(net, loader, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.1), s)

    def feeds():
        prog = dm.serial_main_program("train")
        return [prog.graph.find_nodes(op="placeholder")[i].meta["shape"] for i in (-2, -1)]

    before = feeds()  # from the loader's first dist batch
    r = dist.get_rank()
    dm(x[2 * r:2 * r + 2], y[2 * r:2 * r + 2])  # each rank its part as plain tensors
    return before, feeds()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sharded", [False, True])
def test_the_serial_program_holds_the_whole_batch(sharded):
    """A dist batch's shape was multiplied by the ranks (f32[8, 8] for a batch of 4), and sharding's ranks fed their
    own parts showed one rank's part (f32[2, 8])."""
    for before, after in run_ranks(_serial_inputs, 2, sharded, timeout=40):
        assert before == after == ["f32[4, 8]", "f32[4, 4]"]


# -- amp O2 with sharding ----------------------------------------------------------------------------------------
def _o2_by_hand(parts, steps=3, lists=None):
    """Paddle's O2 by hand, data parallel in one process: bfloat16 copies of the float32 master weights run each
    rank's rows; their gradients, as float32, are averaged over the ranks; the optimizer steps the master."""
    master = Net()
    low = copy.deepcopy(master).to(torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=0.1)
    x, y = samples()
    losses = []
    for s in range(steps):
        rows = slice(4 * s, 4 * s + 4)
        grads, rank_losses = [], []
        for r in range(parts):
            part = slice(*chunk(4, parts, r))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(low(x[rows][part]), y[rows][part]).float()
            loss.backward()
            grads.append([q.grad.float() for q in low.parameters()])
            low.zero_grad()
            rank_losses.append(loss.detach())
        for i, p in enumerate(master.parameters()):
            p.grad = sum(g[i] for g in grads) / parts
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, q in zip(master.parameters(), low.parameters()):
                q.copy_(p)
        losses.append(float(sum(rank_losses) / parts))
    return master, losses


def _o2_sharded(stage):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    net = Net()
    s = Strategy({"sharding": {"enable": stage > 0, "stage": max(stage, 1), "degree": 2},
                  "amp": {"enable": True, "dtype": "bfloat16", "level": "O2"}})
    dm = to_static(net, None, nn.MSELoss(), torch.optim.AdamW(net.parameters(), lr=0.1), s)
    x, y = samples()
    losses = [float(dm(x[4 * s:4 * s + 4][2 * r:2 * r + 2], y[4 * s:4 * s + 4][2 * r:2 * r + 2])) for s in range(3)]
    return losses, {k: full(v) for k, v in net.state_dict().items()}, str(net.linear_0.weight.dtype)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stage", [0, 1, 2])  # 0: data parallel
def test_o2_with_sharding_steps_float32_master_weights_as_by_hand(stage):
    """It was refused: the sharded optimizer steps O2's float32 master weights on the averaged float32 gradients."""
    ref, ref_losses = _o2_by_hand(2)
    for losses, params, dtype in run_ranks(_o2_sharded, 2, stage, timeout=70):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
        assert dtype == "torch.float32"
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(params[k], v, rtol=1e-6, atol=1e-7, msg=k)


def test_o2_with_sharding_stage_3_is_refused_clearly():
    net = Net()
    s = Strategy({"sharding": {"enable": True, "stage": 3, "degree": 1},
                  "amp": {"enable": True, "dtype": "bfloat16", "level": "O2"}})
    with pytest.raises(ValueError, match="O2' with sharding stage 3"):
        to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.1), s)


def test_o2_with_fused_passes_equals_o2_by_hand():
    """It was refused: fused_passes compiles O2's forward on the low-precision copies."""
    ref, ref_losses = _o2_by_hand(1)
    net = Net()
    s = Strategy({"fused_passes": {"enable": True}, "amp": {"enable": True, "dtype": "bfloat16", "level": "O2"}})
    dm = to_static(net, None, nn.MSELoss(), torch.optim.AdamW(net.parameters(), lr=0.1), s)
    x, y = samples()
    losses = [float(dm(x[4 * s:4 * s + 4], y[4 * s:4 * s + 4])) for s in range(3)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-2)
    for a, b in zip(net.parameters(), ref.parameters()):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


# -- amp's custom white and black lists -------------------------------------------------------------------------
def _amp_run(level, **lists):
    net = Net()
    s = Strategy({"amp": {"enable": True, "dtype": "bfloat16", "level": level, **lists}})
    dm = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.1), s)
    x, y = samples()
    losses = [float(dm(x[4 * s:4 * s + 4], y[4 * s:4 * s + 4])) for s in range(3)]
    dm.predict()
    return net, losses, dm(x[:4])["out0"]


def _by_hand(forward, steps=3):
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = samples()
    losses = []
    for s in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(forward(net, x[4 * s:4 * s + 4]), y[4 * s:4 * s + 4])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = forward(net, x[:4]).float().numpy()
    return net, losses, out


def _fp32_linear(lin, h):
    with torch.autocast("cpu", enabled=False):
        return F.linear(h.float(), lin.weight.float(), lin.bias.float())


@pytest.mark.parametrize("name", ["matmul", "matmul_v2"])
def test_black_listing_matmul_keeps_the_linears_in_float32(name):
    """custom_black_list was kept and not applied: the linears ran in bfloat16 all the same."""
    ref, ref_losses, ref_out = _by_hand(lambda m, x: _fp32_linear(m.linear_1, F.relu(_fp32_linear(m.linear_0, x))
                                                                  + m.scale))
    net, losses, out = _amp_run("O1", custom_black_list=[name])
    assert losses == ref_losses
    np.testing.assert_array_equal(out, ref_out)
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _, o1_losses, _ = _amp_run("O1")
    assert o1_losses != losses


def test_white_listing_elementwise_add_runs_it_in_bfloat16():
    def forward(m, x):
        h = F.relu(m.linear_0(x))
        with torch.autocast("cpu", enabled=False):
            h = h.bfloat16() + m.scale.bfloat16()
        return m.linear_1(h)

    ref, ref_losses, ref_out = _by_hand(forward)
    net, losses, out = _amp_run("O1", custom_white_list=["elementwise_add"])
    assert losses == ref_losses
    np.testing.assert_array_equal(out, ref_out)
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_o2_black_listing_matmul_runs_the_linears_in_float32_on_the_low_precision_copies():
    """Paddle's O2 black list: the op runs in float32 on its inputs, here the bfloat16 copies of the weights."""
    master = Net()
    low = copy.deepcopy(master).to(torch.bfloat16)
    opt = torch.optim.SGD(master.parameters(), lr=0.1)
    x, y = samples()
    ref_losses = []
    for s in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = F.relu(_fp32_linear(low.linear_0, x[4 * s:4 * s + 4])) + low.scale
            loss = F.mse_loss(_fp32_linear(low.linear_1, h), y[4 * s:4 * s + 4]).float()
        loss.backward()
        for p, q in zip(master.parameters(), low.parameters()):
            p.grad = q.grad.float()
            q.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, q in zip(master.parameters(), low.parameters()):
                q.copy_(p)
        ref_losses.append(float(loss.detach()))
    net, losses, _ = _amp_run("O2", custom_black_list=["matmul"])
    assert losses == ref_losses
    for a, b in zip(net.parameters(), master.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_custom_list_naming_an_op_in_both_raises():
    net = Net()
    s = Strategy({"amp": {"enable": True, "custom_white_list": ["exp"], "custom_black_list": ["exp", "log"]}})
    with pytest.raises(ValueError, match="overlap"):
        to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.1), s)
