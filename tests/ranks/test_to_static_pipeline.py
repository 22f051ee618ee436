"""to_static with strategy.pipeline: micro-batches through per-stage meshes against one process on the whole batch."""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from meshviz.distributed.auto_parallel import Strategy, to_static
from meshviz.testing import run_ranks

D, OUT, B, LR = 8, 4, 8, 0.1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, OUT)

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


def data(step, b=B):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(b, D, generator=g), torch.randn(b, OUT, generator=g)


def dense(steps, loss_fn=F.mse_loss):
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses = []
    for s in range(steps):
        x, y = data(s)
        loss = loss_fn(net(x), y)
        (loss.sum() if loss.dim() else loss).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return net, losses


def strategy(mode="1F1B", acc=2, pp=2, **more):
    s = Strategy()
    s.pipeline.enable, s.pipeline.schedule_mode, s.pipeline.accumulate_steps = True, mode, acc
    s.pipeline.pp_degree = pp
    for k, v in more.items():
        setattr(s.pipeline, k, v)
    return s


def _staged(mp=False):
    """Net with a on mesh pp=0 and b on pp=1 (each stage 1 rank, or 2 with b's weight split over mp)."""
    import meshviz.distributed as dist

    world = dist.get_world_size()
    mesh = dist.ProcessMesh(np.arange(world).reshape(2, world // 2).tolist(), dim_names=["pp", "mp"])
    first, last = mesh.get_mesh_with_dim("pp", 0), mesh.get_mesh_with_dim("pp", 1)
    net = Net()
    for layer, m in ((net.a, first), (net.b, last)):
        for name, p in list(layer.named_parameters()):
            pl = [dist.Shard(0)] if (mp and layer is net.b) else [dist.Replicate()]
            setattr(layer, name, nn.Parameter(dist.shard_tensor(p.detach(), m, pl)))

    def forward(x):
        h = dist.reshard(F.relu(net.a(x)), last, [dist.Replicate()])
        return dist.reshard(net.b(h), last, [dist.Replicate()])

    net.forward = forward
    return dist, net, first, last


def _train(mode, acc, steps, mp=False, reduction="mean"):
    dist, net, first, last = _staged(mp)
    world = dist.get_world_size()
    dm = to_static(net, None, nn.MSELoss(reduction=reduction), torch.optim.SGD(net.parameters(), lr=LR),
                   strategy(mode, acc))
    losses = []
    for s in range(steps):
        x, y = data(s)
        losses.append(dm(dist.shard_tensor(x, first, [dist.Replicate()]),
                         dist.shard_tensor(y, last, [dist.Replicate()])))
    dm.eval()
    x, y = data(steps)
    ev = dm(dist.shard_tensor(x, first, [dist.Replicate()]), dist.shard_tensor(y, last, [dist.Replicate()]))
    dm.predict()
    pr = dm(dist.shard_tensor(x, first, [dist.Replicate()]))
    full = {k: f.detach().clone() for k, v in net.state_dict().items() if (f := v.full_tensor()).numel()}
    return dist.get_rank() >= world // 2, losses, ev, pr, full


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, acc, world, mp", [
    ("FThenB", 1, 2, False), ("FThenB", 2, 2, False), ("1F1B", 2, 2, False), ("1F1B", 4, 2, False),
    ("FThenB", 4, 4, True), ("1F1B", 2, 4, True),
])
def test_pipeline_trains_as_one_process_on_the_whole_batch(mode, acc, world, mp):
    """The last stage returns each micro-batch's loss (Paddle's fetch merged over micro-batches: a scalar for one,
    an [acc] array for more), the others None; weights after 3 steps, eval and predict as one process's."""
    steps = 3
    ref, _ = dense(steps)
    seen = set()
    for last, losses, ev, pr, full in run_ranks(_train, world, mode, acc, steps, mp, timeout=100):
        assert sorted(full) == (["b.bias", "b.weight"] if last else ["a.bias", "a.weight"])
        seen |= set(full)
        want = ref.state_dict()
        for k, v in full.items():
            torch.testing.assert_close(v, want[k], rtol=1e-6, atol=1e-6)
        if not last:
            assert losses == [None] * steps and ev is None and pr is None
            continue
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        for s in range(steps):  # the reference's losses per micro-batch, from the same weights
            x, y = data(s)
            want = torch.stack([F.mse_loss(net(xi), yi) for xi, yi in zip(x.chunk(acc), y.chunk(acc))])
            got = np.asarray(losses[s])
            assert got.shape == (() if acc == 1 else (acc,))
            np.testing.assert_allclose(got.reshape(-1), want.detach().numpy(), rtol=1e-5, atol=1e-6)
            F.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
        x, y = data(steps)
        want = torch.stack([F.mse_loss(ref(xi), yi) for xi, yi in zip(x.chunk(acc), y.chunk(acc))])
        np.testing.assert_allclose(np.asarray(ev).reshape(-1), want.detach().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(pr["out0"], ref(x).detach().numpy(), rtol=1e-5, atol=1e-6)
    assert len(seen) == 4


def _dp_train(acc, steps):
    """pp2 x dp2: each stage's mesh has 2 ranks along dp; x and y split by rows over dp (Shard(0))."""
    dist, net, first, last = _staged()
    dm = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=LR), strategy("1F1B", acc))
    losses = []
    for s in range(steps):
        x, y = data(s)
        losses.append(dm(dist.shard_tensor(x, first, [dist.Shard(0)]), dist.shard_tensor(y, last, [dist.Shard(0)])))
    full = {k: f.detach().clone() for k, v in net.state_dict().items() if (f := v.full_tensor()).numel()}
    return losses, full


@pytest.mark.timeout(120)
def test_pipeline_with_rows_split_over_dp_splits_each_ranks_rows():
    """Each dp rank's rows are cut into the micro-batches (Paddle's executor splits each rank's feed): micro-batch i
    is the i-th part of every dp rank's rows; the weights are one process's on the whole batch."""
    acc, steps = 2, 3
    ref, _ = dense(steps)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    want_losses = []
    for s in range(steps):
        x, y = data(s)
        rows = [torch.cat([torch.arange(r * 4 + i * 2, r * 4 + i * 2 + 2) for r in range(2)]) for i in range(acc)]
        want_losses.append([float(F.mse_loss(net(x[ix]), y[ix]).detach()) for ix in rows])
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    results = run_ranks(_dp_train, 4, acc, steps, timeout=100)
    for rank, (losses, full) in enumerate(results):
        if rank < 2:
            assert losses == [None] * steps
        else:
            np.testing.assert_allclose(np.stack(losses), want_losses, rtol=1e-5, atol=1e-6)
        for k, v in full.items():
            torch.testing.assert_close(v, ref.state_dict()[k], rtol=1e-6, atol=1e-6)
    assert sorted(results[0][1]) == ["a.bias", "a.weight"] and sorted(results[3][1]) == ["b.bias", "b.weight"]


@pytest.mark.timeout(120)
def test_pipeline_loss_per_sample_comes_back_for_every_row():
    """A loss per sample: the merged fetch is the whole batch's per-sample losses in row order; the gradient is
    that of their sum averaged over the micro-batches (Paddle's gradient merge with avg)."""
    acc, steps = 4, 2
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    want = []
    for s in range(steps):
        x, y = data(s)
        loss = F.mse_loss(net(x), y, reduction="none")
        want.append(loss.detach().numpy())
        (loss.sum() / acc).backward()
        opt.step()
        opt.zero_grad()
    for last, losses, _, _, full in run_ranks(_train, 2, "FThenB", acc, steps, False, "none", timeout=100):
        if last:
            for got, w in zip(losses, want):
                np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
        for k, v in full.items():
            torch.testing.assert_close(v, net.state_dict()[k], rtol=1e-6, atol=1e-6)


def _bad(case):
    dist, net, first, last = _staged()
    s = strategy()
    x, y = data(0, b=6 if case == "uneven" else B)
    if case == "uneven":
        s.pipeline.accumulate_steps = 4
    elif case == "shard_rows":  # 8 rows in 2 blocks of 4 cannot each split into 8 micro-batches
        s.pipeline.accumulate_steps = 8
    else:
        setattr(*case)
    try:
        dm = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=LR), s)
        pl = [dist.Shard(0)] if case == "shard_rows" else [dist.Replicate()]
        dm(dist.shard_tensor(x, first, pl), dist.shard_tensor(y, last, pl))
    except ValueError as e:
        dist.barrier()  # no rank went on to communicate
        return str(e)
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case, match", [
    ("uneven", r"inputs\[0\] has 6 rows: each block's rows must split evenly into accumulate_steps \(4\)"),
    ("shard_rows", r"8 rows in 2 row blocks"),
])
def test_pipeline_uneven_micro_batches_raise_on_every_rank(case, match):
    import re

    for got in run_ranks(_bad, 4 if case == "shard_rows" else 2, case, timeout=100):
        assert got is not None and re.search(match, got), got


def _configs():
    s = Strategy()
    s.pipeline.enable = True
    yield s, r"schedule_mode must be one of \['FThenB', '1F1B'\]", {"schedule_mode": "Eager1F1B"}
    yield s, r"'VPP' \(vpp_degree > 1\) is not supported", {"schedule_mode": "VPP"}
    yield s, r"'VPP' \(vpp_degree > 1\) is not supported", {"vpp_degree": 2}
    yield s, r"accumulate_steps must be a positive int, got 0", {"accumulate_steps": 0}
    yield s, r"accumulate_steps must be a positive int, got 2.0", {"accumulate_steps": 2.0}
    yield s, r"pp_degree \(2\) must divide the number of ranks \(1\)", {"pp_degree": 2}


@pytest.mark.parametrize("i", range(6))
def test_pipeline_bad_configs_raise(i):
    s, match, opts = list(_configs())[i]
    for k, v in opts.items():
        setattr(s.pipeline, k, v)
    net = Net()
    with pytest.raises(ValueError, match=match):
        to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=LR), s)


def test_pipeline_conflicts_raise():
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    s = strategy("1F1B", acc=1, pp=1)
    s.gradient_merge.enable, s.gradient_merge.k_steps = True, 2
    with pytest.raises(ValueError, match=r"replaces gradient_merge with accumulate_steps \(1\)"):
        to_static(net, None, nn.MSELoss(), opt, s)
    s.gradient_merge.k_steps = 1  # the same accumulation: taken
    to_static(net, None, nn.MSELoss(), opt, s)
    s = strategy("FThenB", acc=2, pp=1)
    s.return_numpy = False
    with pytest.raises(ValueError, match="merge_tensor does not support return_numpy False"):
        to_static(net, None, nn.MSELoss(), opt, s)
    s = strategy("FThenB", acc=2, pp=1)
    s.sharding.enable = True
    with pytest.raises(ValueError, match="with strategy.sharding is not supported"):
        to_static(net, None, nn.MSELoss(), opt, s)


def _plain(case):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    net = Net()
    s = strategy("1F1B", acc=2, pp=2) if case == "plain" else strategy("1F1B", acc=1, pp=2)
    try:
        to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=LR), s)
    except ValueError as e:
        dist.barrier()
        return str(e)
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case, match", [
    ("plain", r"pp_degree 2 needs each stage's layers on its own mesh"),
    ("few", r"'1F1B' needs accumulate_steps \(1\) >= pp_degree \(2\)"),
])
def test_pipeline_configs_raise_on_every_rank(case, match):
    import re

    for got in run_ranks(_plain, 2, case, timeout=100):
        assert got is not None and re.search(match, got), got


def test_pipeline_on_one_rank_accumulates_micro_batches():
    """One rank, one stage: accumulate_steps micro-batches, one step per call, as one process on the whole batch."""
    ref, ref_losses = dense(3)
    net = Net()
    dm = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=LR), strategy("FThenB", 4, 1))
    for s in range(3):
        got = dm(*data(s))
        assert got.shape == (4,)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(net.state_dict()[k], v, rtol=1e-6, atol=1e-6)


def _traced(mode, acc):
    from meshviz import trace

    dist, net, first, last = _staged()
    dm = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=LR), strategy(mode, acc))
    x, y = data(0)
    with trace.record() as mem:
        dm(dist.shard_tensor(x, first, [dist.Replicate()]), dist.shard_tensor(y, last, [dist.Replicate()]))
    return [e.to_dict() for e in mem.events]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, acc, want", [
    ("FThenB", 4, ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]),
    ("1F1B", 4, ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]),
])
def test_pipeline_emits_a_block_per_micro_batch(mode, acc, want):
    """Every rank emits the pipeline_step mark and a compute block per micro-batch and phase, with its stage."""
    from meshviz.runtime.pipeline import compute_order
    from meshviz.trace import Compute, Event

    for rank, ev in enumerate(run_ranks(_traced, 2, mode, acc, timeout=100)):
        events = [Event.from_dict(e) for e in ev]
        assert [(b[0] + str(b[2]), b[1]) for b in compute_order(events, rank)] == [(w, rank) for w in want]
        # the step itself is no block: the pipeline view would draw it over the blocks
        assert [e.op for e in events if e.kind == "compute" and e.payload_as(Compute).phase is None] == []
        marks = [e.to_dict()["payload"] for e in events if e.kind == "mark" and e.op == "pipeline_step"]
        assert [(m["schedule"], m["p"], m["m"], m["stage"]) for m in marks] == [(mode, 2, acc, rank)]


def _amp_train(level, dtype, acc, steps):
    dist, net, first, last = _staged()
    s = strategy("1F1B", acc)
    s.amp.enable, s.amp.level, s.amp.dtype = True, level, dtype
    dm = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=LR), s)
    losses = []
    for st in range(steps):
        x, y = data(st)
        losses.append(dm(dist.shard_tensor(x, first, [dist.Replicate()]),
                         dist.shard_tensor(y, last, [dist.Replicate()])))
    full = {k: f.detach().clone() for k, v in net.state_dict().items() if (f := v.full_tensor()).numel()}
    return losses, full


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level, dtype", [("O1", "bfloat16"), ("O1", "float16"), ("O2", "bfloat16")])
def test_pipeline_with_amp_as_one_process_per_micro_batch(level, dtype):
    """amp with the pipeline: each micro-batch's forward under autocast (O2: on low-precision casts of the float32
    weights), float16's loss scaled, one step per call: as one process running the same micro-batches."""
    acc, steps = 2, 2
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    low = getattr(torch, dtype)
    scaler = torch.amp.GradScaler("cpu", init_scale=32768.0) if dtype == "float16" else None
    want = []
    for st in range(steps):
        x, y = data(st)
        got = []
        for xi, yi in zip(x.chunk(acc), y.chunk(acc)):
            with torch.autocast("cpu", dtype=low):
                if level == "O2":
                    params = {k: p.to(low) for k, p in net.named_parameters()}
                    out = torch.func.functional_call(net, params, (xi,))
                else:
                    out = net(xi)
                loss = F.mse_loss(out, yi).float()
            got.append(float(loss.detach()))
            scaled = loss / acc
            (scaler.scale(scaled) if scaler else scaled).backward()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        want.append(got)
    for rank, (losses, full) in enumerate(run_ranks(_amp_train, 2, level, dtype, acc, steps, timeout=100)):
        if rank == 1:
            np.testing.assert_allclose(np.stack(losses), want, rtol=1e-6, atol=1e-6)
        for k, v in full.items():
            torch.testing.assert_close(v, net.state_dict()[k], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("opts, match", [
    ({"custom_black_varnames": ["linear_0.w_0"]}, r"custom_black_varnames \(\['linear_0.w_0'\]\) names variables"),
    ({"level": "O2", "use_promote": False}, r"use_promote False is not supported"),
])
def test_amp_options_meshviz_cannot_apply_raise(opts, match):
    """custom_black_varnames (static program variable names) and use_promote False at O2 were accepted and
    silently not applied; they raise now."""
    net = Net()
    s = Strategy()
    s.amp.enable, s.amp.dtype = True, "bfloat16"
    for k, v in opts.items():
        setattr(s.amp, k, v)
    with pytest.raises(ValueError, match=match):
        to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=LR), s)
    s.amp.level, s.amp.use_promote, s.amp.custom_black_varnames = "O1", False, []  # O1: Paddle reads it only at O2
    dm = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=LR), s)
    x, y = data(0)
    assert np.isfinite(dm(x, y))


def test_pipeline_section_has_paddles_options():
    """Paddle 3.3.1's pipeline section has auto_parallel_sync_shared_params (default False)."""
    s = Strategy({"pipeline": {"auto_parallel_sync_shared_params": True}})
    assert s.pipeline.auto_parallel_sync_shared_params is True
    assert Strategy().pipeline.to_dict()["auto_parallel_sync_shared_params"] is False
