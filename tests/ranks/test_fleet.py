"""fleet: topology against Paddle's layout, meta_parallel layers against unsplit torch layers, seed 004 training."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshviz.testing import run_ranks

from ..models import LinearNet

V, D, H = 8, 4, 8


def _batch(step, dp_rank, b=2, t=3):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randint(0, V, (b, t), generator=g), torch.randint(0, V, (b, t), generator=g)


class MPNet(nn.Module):
    def __init__(self):
        from meshviz.distributed.fleet import meta_parallel as mpu

        super().__init__()
        self.emb = mpu.VocabParallelEmbedding(V, D)
        self.up = mpu.ColumnParallelLinear(D, H, has_bias=True, gather_output=False)
        self.down = mpu.RowParallelLinear(H, D, input_is_parallel=True)
        self.head = mpu.ColumnParallelLinear(D, V, has_bias=True, gather_output=False)
        self.ce = mpu.ParallelCrossEntropy()

    def forward(self, ids, labels):
        h = self.down(torch.relu(self.up(self.emb(ids))))
        return self.ce(self.head(h), labels).mean()


class RefNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)
        self.head = nn.Linear(D, V)

    def forward(self, ids, labels):
        h = self.down(torch.relu(self.up(self.emb(ids))))
        return F.cross_entropy(self.head(h).reshape(-1, V), labels.reshape(-1))


def _hybrid():
    import meshviz.distributed as dist
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet import meta_parallel as mpu

    dist.init_parallel_env()
    out = {}
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": 2, "mp_degree": 2, "pp_degree": 1}
    fleet.init(is_collective=True, strategy=s)
    hcg = fleet.get_hybrid_communicate_group()
    out["topo"] = dict(
        dp=(hcg.get_data_parallel_rank(), hcg.get_data_parallel_world_size(), hcg.get_data_parallel_group().ranks),
        mp=(hcg.get_model_parallel_rank(), hcg.get_model_parallel_world_size(),
            hcg.get_model_parallel_group().ranks),
        pp=(hcg.get_stage_id(), hcg.get_pipe_parallel_world_size(), hcg.get_pipe_parallel_group().ranks),
        sharding=(hcg.get_sharding_parallel_rank(), hcg.get_sharding_parallel_world_size()),
        mode=hcg.get_parallel_mode(), glob=hcg.get_global_rank(),
        workers=(fleet.worker_index(), fleet.worker_num(), fleet.is_first_worker()),
    )
    fleet.barrier_worker()

    # each layer alone against its unsplit twin (same seed on every rank -> same full weights)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, generator=g)
    gy = torch.randn(3, 6, generator=g)
    torch.manual_seed(21)
    col = mpu.ColumnParallelLinear(4, 6, has_bias=True)  # gather_output=True
    xc = x.clone().requires_grad_()
    y = col(xc)
    (y * gy).sum().backward()
    out["col"] = (y.detach(), xc.grad, col.weight.detach(), col.bias.detach(), col.weight.grad, col.bias.grad)
    torch.manual_seed(22)
    row = mpu.RowParallelLinear(6, 3)  # input_is_parallel=False
    x6 = torch.randn(3, 6, generator=g).requires_grad_()
    gy3 = torch.randn(3, 3, generator=g)
    y = row(x6)
    (y * gy3).sum().backward()
    out["row"] = (y.detach(), x6.grad, row.weight.detach(), row.bias.detach(), row.weight.grad, row.bias.grad)
    torch.manual_seed(23)
    emb = mpu.VocabParallelEmbedding(V, 3)
    ids = torch.tensor([[0, 7, 3], [4, 4, 1]])
    y = emb(ids)
    gy = torch.randn(2, 3, 3, generator=g)
    (y * gy).sum().backward()
    out["emb"] = (y.detach(), emb.weight.detach(), emb.weight.grad)
    logits = torch.randn(5, V, generator=g)
    labels = torch.tensor([0, 7, -100, 3, 4])
    local = logits.chunk(2, dim=-1)[hcg.get_model_parallel_rank()].clone().requires_grad_()
    loss = mpu.ParallelCrossEntropy()(local, labels.unsqueeze(-1))
    gl = torch.arange(1.0, 6.0).unsqueeze(-1)
    (loss * gl).sum().backward()
    out["ce"] = (loss.detach(), local.grad)
    errs = []
    for fn in (lambda: mpu.ColumnParallelLinear(4, 5), lambda: mpu.RowParallelLinear(3, 4),
               lambda: mpu.VocabParallelEmbedding(7, 2)):
        try:
            fn()
        except ValueError as e:
            errs.append(str(e))
    out["layer_errs"] = errs

    # hybrid training: distributed_model + distributed_optimizer, dp rank d trains on batch d
    torch.manual_seed(0)
    model = fleet.distributed_model(MPNet())
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    losses = []
    for step in range(3):
        ids, lab = _batch(step, hcg.get_data_parallel_rank())
        loss = model(ids, lab)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(loss.item())
    out["losses"] = losses
    out["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def _assemble(shards, dim):
    return torch.cat(shards, dim=dim)


@pytest.mark.timeout(150)
def test_hybrid_dp2_mp2():
    res = run_ranks(_hybrid, 4)
    # Paddle's topology with order [dp, pp, sharding, mp]: rank = dp_index * 2 + mp_index
    for r, out in enumerate(res):
        t = out["topo"]
        dp_i, mp_i = divmod(r, 2)
        assert t["dp"] == (dp_i, 2, [mp_i, mp_i + 2])
        assert t["mp"] == (mp_i, 2, [2 * dp_i, 2 * dp_i + 1])
        assert t["pp"] == (0, 1, [r]) and t["sharding"] == (0, 1)
        assert t["mode"] == 1 and t["glob"] == r  # TENSOR_PARALLEL
        assert t["workers"] == (r, 4, r == 0)
        assert len(out["layer_errs"]) == 3 and all("divisible" in e for e in out["layer_errs"])

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, generator=g)
    gy = torch.randn(3, 6, generator=g)
    torch.manual_seed(21)
    ref = nn.Linear(4, 6)
    xr = x.clone().requires_grad_()
    y = ref(xr)
    (y * gy).sum().backward()
    for pair in ((0, 1), (2, 3)):
        a, b = res[pair[0]]["col"], res[pair[1]]["col"]
        torch.testing.assert_close(_assemble([a[2], b[2]], 0), ref.weight.detach(), rtol=0, atol=0)
        torch.testing.assert_close(_assemble([a[3], b[3]], 0), ref.bias.detach(), rtol=0, atol=0)
        for o in (a, b):
            torch.testing.assert_close(o[0], y.detach())
            torch.testing.assert_close(o[1], xr.grad)
        torch.testing.assert_close(_assemble([a[4], b[4]], 0), ref.weight.grad)
        torch.testing.assert_close(_assemble([a[5], b[5]], 0), ref.bias.grad)

    torch.manual_seed(22)
    ref = nn.Linear(6, 3)
    x6 = torch.randn(3, 6, generator=g).requires_grad_()
    gy3 = torch.randn(3, 3, generator=g)
    y = ref(x6)
    (y * gy3).sum().backward()
    a, b = res[0]["row"], res[1]["row"]
    torch.testing.assert_close(_assemble([a[2], b[2]], 1), ref.weight.detach(), rtol=0, atol=0)
    for o in (a, b):
        torch.testing.assert_close(o[0], y.detach())
        torch.testing.assert_close(o[1], x6.grad)
        torch.testing.assert_close(o[3], ref.bias.detach())
        torch.testing.assert_close(o[5], ref.bias.grad)
    torch.testing.assert_close(_assemble([a[4], b[4]], 1), ref.weight.grad)

    torch.manual_seed(23)
    ref = nn.Embedding(V, 3)
    ids = torch.tensor([[0, 7, 3], [4, 4, 1]])
    y = ref(ids)
    gy = torch.randn(2, 3, 3, generator=g)
    (y * gy).sum().backward()
    a, b = res[2]["emb"], res[3]["emb"]
    torch.testing.assert_close(_assemble([a[1], b[1]], 0), ref.weight.detach(), rtol=0, atol=0)
    for o in (a, b):
        torch.testing.assert_close(o[0], y.detach())
    torch.testing.assert_close(_assemble([a[2], b[2]], 0), ref.weight.grad)

    logits = torch.randn(5, V, generator=g).requires_grad_()
    labels = torch.tensor([0, 7, -100, 3, 4])
    loss = F.cross_entropy(logits, labels, reduction="none")
    (loss * torch.arange(1.0, 6.0)).sum().backward()
    a, b = res[0]["ce"], res[1]["ce"]
    for o in (a, b):
        assert o[0].shape == (5, 1)
        torch.testing.assert_close(o[0].squeeze(-1), loss.detach())
    torch.testing.assert_close(_assemble([a[1], b[1]], 1), logits.grad)

    # hybrid training equals one process on both dp ranks' batches
    torch.manual_seed(0)
    ref = RefNet()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        b0, b1 = _batch(step, 0), _batch(step, 1)
        ids, lab = torch.cat([b0[0], b1[0]]), torch.cat([b0[1], b1[1]])
        loss = ref(ids, lab)
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close((res[0]["losses"][step] + res[2]["losses"][step]) / 2, loss.item())
        assert res[0]["losses"][step] == pytest.approx(res[1]["losses"][step], abs=1e-6)
    splits = {"emb.weight": 0, "up.weight": 0, "up.bias": 0, "down.weight": 1, "head.weight": 0, "head.bias": 0}
    sd = ref.state_dict()
    for k, v in sd.items():
        for pair in ((0, 1), (2, 3)):
            if k in splits:
                got = _assemble([res[pair[0]]["params"][k], res[pair[1]]["params"][k]], splits[k])
            else:
                got = res[pair[0]]["params"][k]
                torch.testing.assert_close(res[pair[1]]["params"][k], got)
            torch.testing.assert_close(got, v, rtol=1e-5, atol=1e-6)


def _seed004(steps=6):
    """Seed 004's fleet program; each rank draws its own batch of 10."""
    from meshviz.distributed import fleet

    fleet.init(is_collective=True)
    torch.manual_seed(2020)
    layer = LinearNet()
    adam = torch.optim.Adam(layer.parameters(), lr=0.001)
    strategy = fleet.DistributedStrategy()
    adam = fleet.distributed_optimizer(adam, strategy=strategy)
    dp_layer = fleet.distributed_model(layer)
    g = torch.Generator().manual_seed(fleet.worker_index())
    losses = []
    for _step in range(steps):
        inputs = torch.randn(10, 10, generator=g)
        labels = torch.randn(10, 1, generator=g)
        loss = F.mse_loss(dp_layer(inputs), labels)
        loss.backward()
        adam.step()
        adam.clear_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in dp_layer.state_dict().items()}, type(dp_layer).__name__


def _seed004_single_on(ranks, steps=6):
    """The same program in one process on the concatenation of ``ranks``' batches."""
    torch.manual_seed(2020)
    layer = LinearNet()
    adam = torch.optim.Adam(layer.parameters(), lr=0.001)
    gens = [torch.Generator().manual_seed(r) for r in ranks]
    losses = []
    for _ in range(steps):
        xs, ys = zip(*[(torch.randn(10, 10, generator=g), torch.randn(10, 1, generator=g)) for g in gens])
        loss = F.mse_loss(layer(torch.cat(xs)), torch.cat(ys))
        loss.backward()
        adam.step()
        adam.zero_grad()
        losses.append(loss.item())
    return losses, layer.state_dict()


@pytest.mark.timeout(120)
def test_seed004_single_and_two_ranks():
    (one,) = run_ranks(_seed004, 1)
    losses, params = _seed004_single_on([0])
    assert one[2] == "LinearNet"  # one worker: the model itself
    assert one[0] == pytest.approx(losses, abs=1e-6)
    two = run_ranks(_seed004, 2)
    losses, params = _seed004_single_on([0, 1])
    for r in range(2):
        assert two[r][2] == "DataParallel"
        for k, v in params.items():
            torch.testing.assert_close(two[r][1][k], v, rtol=1e-5, atol=1e-6)
    # the 2-rank run's loss (mean of the ranks' halves) is the single run's loss on the whole batch
    for step in range(6):
        assert (two[0][0][step] + two[1][0][step]) / 2 == pytest.approx(losses[step], abs=1e-6)


def _orders_and_errors():
    import meshviz.distributed as dist
    from meshviz.distributed import fleet

    dist.init_parallel_env()
    out = {}
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"mp_degree": 2, "order": ["mp", "pp", "sharding", "dp"]}  # dp_degree -1 -> 2
    fleet.init(is_collective=True, strategy=s)
    hcg = fleet.get_hybrid_communicate_group()
    out["order"] = (hcg.get_data_parallel_group().ranks, hcg.get_model_parallel_group().ranks,
                    hcg.get_data_parallel_world_size())
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"sharding_degree": 2}
    fleet.init(is_collective=True, strategy=s)
    hcg = fleet.get_hybrid_communicate_group()
    out["sharding"] = (hcg.get_parallel_mode(), hcg.get_sharding_parallel_group().ranks,
                       hcg.get_data_parallel_group().ranks)
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"pp_degree": 2}
    s.pipeline_configs = {"micro_batch_size": 2}
    s.pipeline_configs = {"accumulate_steps": 4}
    out["pipeline_configs"] = s.pipeline_configs
    fleet.init(is_collective=True, strategy=s)
    hcg = fleet.get_hybrid_communicate_group()
    out["pp"] = (hcg.get_parallel_mode(), hcg.get_pipe_parallel_group().ranks, hcg.get_stage_id())
    try:
        fleet.distributed_model(nn.Linear(2, 2))
        out["pp_model"] = None
    except (NotImplementedError, TypeError) as e:  # handed to the pipeline runtime, which wants a PipelineLayer
        out["pp_model"] = str(e)
    errs = []
    bad = fleet.DistributedStrategy()
    bad.hybrid_configs = {"dp_degree": 3, "mp_degree": 2}
    for fn in (lambda: fleet.init(is_collective=True, strategy=bad),
               lambda: setattr(fleet.DistributedStrategy(), "hybrid_configs", {"dp_degre": 2}),
               lambda: setattr(fleet.DistributedStrategy(), "hybrid_configs", {"order": ["dp", "mp"]}),
               lambda: setattr(fleet.DistributedStrategy(), "hybrid_configs", {"mp_degree": 0})):
        try:
            fn()
        except ValueError as e:
            errs.append(str(e))
    out["errs"] = errs
    return out


@pytest.mark.timeout(120)
def test_orders_modes_and_errors():
    res = run_ranks(_orders_and_errors, 4)
    for r, out in enumerate(res):
        # order [mp, pp, sharding, dp]: rank = mp_index * 2 + dp_index
        mp_i, dp_i = divmod(r, 2)
        assert out["order"] == ([2 * mp_i, 2 * mp_i + 1], [dp_i, dp_i + 2], 2)
        # sharding 2 with dp 2, order [dp, pp, sharding, mp]: rank = dp * 2 + sharding
        dp_i, sh_i = divmod(r, 2)
        assert out["sharding"] == (3, [2 * dp_i, 2 * dp_i + 1], [sh_i, sh_i + 2])
        # pp 2 with dp 2: rank = dp * 2 + stage
        assert out["pp"] == (2, [2 * dp_i, 2 * dp_i + 1], r % 2)
        assert out["pipeline_configs"]["micro_batch_size"] == 2 and out["pipeline_configs"]["accumulate_steps"] == 4
        assert out["pipeline_configs"]["schedule_mode"] == "1F1B"
        assert "pipeline" in out["pp_model"].lower()
        errs = out["errs"]
        assert len(errs) == 4
        assert "world has 4 ranks" in errs[0] and "unknown keys" in errs[1] and "order" in errs[2]
        assert "positive" in errs[3]


def _degrees_per_rank():
    import meshviz.distributed as dist
    from meshviz.distributed import fleet

    dist.init_parallel_env()
    r, errs = dist.get_rank(), []
    order = ["dp", "pp", "sharding", "mp"] if r != 1 else ["mp", "pp", "sharding", "dp"]
    for configs in ({"dp_degree": 2 if r < 2 else 1, "mp_degree": 2 if r < 2 else 4},
                    {"mp_degree": 2, "order": order}):
        s = fleet.DistributedStrategy()
        s.hybrid_configs = configs
        try:
            fleet.init(is_collective=True, strategy=s)
        except ValueError as e:
            errs.append(str(e))
    return errs


@pytest.mark.timeout(60)
def test_degrees_that_differ_per_rank_raise_on_every_rank_naming_them():
    head = "fleet.init: hybrid_configs: the ranks were given different settings (every rank needs the same): "
    res = run_ranks(_degrees_per_rank, 4, timeout=50)
    for r, errs in enumerate(res):  # each rank names its own order; it only knows the others' differ
        assert len(errs) == 2 and errs[0] == head + "ranks 0, 1: dp 2, mp 2; ranks 2, 3: dp 1, mp 4", errs
        expect = ("ranks 0, 2, 3: another order; rank 1: order ['mp', 'pp', 'sharding', 'dp']" if r == 1
                  else "ranks 0, 2, 3: order ['dp', 'pp', 'sharding', 'mp']; rank 1: another order")
        assert errs[1] == head + expect, (r, errs[1])


def test_strategy_defaults_and_merge():
    from meshviz.distributed import fleet

    s = fleet.DistributedStrategy()
    h = s.hybrid_configs
    assert h["dp_degree"] == -1 and h["mp_degree"] == 1
    assert h["order"] == s.hybrid_parallel_order == ["dp", "pp", "sharding", "sep", "cp", "mp"]  # Paddle's default
    h["mp_degree"] = 4  # a copy, as in Paddle
    assert s.hybrid_configs["mp_degree"] == 1
    s.hybrid_configs = {"mp_degree": 2}
    s.hybrid_configs = {"pp_degree": 2}
    assert (s.hybrid_configs["mp_degree"], s.hybrid_configs["pp_degree"]) == (2, 2)
    import meshviz.distributed.fleet.meta_parallel as mp  # noqa: F401
    from meshviz.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients

    assert fused_allreduce_gradients is fleet.utils.fused_allreduce_gradients


def test_communicate_topology_is_row_major_over_its_names():
    from meshviz.distributed.fleet import CommunicateTopology

    names, dims = ["data", "pipe", "sharding", "model"], [2, 3, 1, 2]
    topo = CommunicateTopology(names, dims)
    strides = [3 * 1 * 2, 1 * 2, 2, 1]  # row-major: the first name is the outermost axis

    def rank(c):
        return sum(i * s for i, s in zip(c, strides))

    coords = [(a, b, 0, d) for a in range(2) for b in range(3) for d in range(2)]
    assert topo.world_size() == 12 and sorted(rank(c) for c in coords) == list(range(12))
    for c in coords:
        assert tuple(topo.get_coord(rank(c))) == c and topo.get_coord(rank(c)).pipe == c[1]
        assert topo.get_rank(data=c[0], pipe=c[1], sharding=0, model=c[3]) == rank(c)
        assert topo.get_rank_from_stage(rank(c), pipe=2) == rank((c[0], 2, 0, c[3]))
    # lines along an axis: ordered by the other coordinates (row-major), each in axis order
    assert topo.get_comm_list("pipe") == [[rank((a, b, 0, d)) for b in range(3)] for a in range(2) for d in range(2)]
    assert topo.get_comm_list("data") == [[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]]
    assert topo.get_comm_list("model") == [[2 * k, 2 * k + 1] for k in range(6)]
    assert topo.get_comm_list("sharding") == [[r] for r in range(12)]
    assert topo.get_axis_list("pipe", 1) == [2, 3, 8, 9] and topo.get_axis_list("pipe", 3) == []
    assert topo.get_dim("pipe") == 3 and topo.get_dim("sep") == 1
    assert topo.mesh.shape == dims and topo.mesh.dim_names == names
    with pytest.raises(KeyError):
        topo.get_rank(data=2, pipe=0, sharding=0, model=0)
    with pytest.raises(KeyError):
        topo.get_coord(12)


def _sharding_batch(step, rank, b=3):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(b, 6, generator=g), torch.randn(b, 3, generator=g)


def _sharding_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def _fleet_sharding(hybrid, steps=3):
    import meshviz.distributed as dist
    from meshviz.distributed import fleet

    s = fleet.DistributedStrategy()
    s.hybrid_configs = hybrid
    fleet.init(is_collective=True, strategy=s)
    hcg = fleet.get_hybrid_communicate_group()
    model = _sharding_model()
    names = {id(p): n for n, p in model.named_parameters()}
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=0.05))
    model = fleet.distributed_model(model)
    for step in range(steps):
        x, y = _sharding_batch(step, dist.get_rank())
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.clear_grad()
    return {"owners": {names[i]: o for i, o in opt.owner.items()},
            "index": hcg.get_sharding_parallel_rank(),
            "states": sorted(names[id(p)] for p in opt._inner_opt.state),
            "grads": [p.grad for p in model.parameters()],
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hybrid,world", [({"sharding_degree": 2}, 2),
                                          ({"sharding_degree": 2, "dp_degree": 2}, 4)])
def test_fleet_sharding_is_paddles_stage_1(hybrid, world):
    # Paddle's DygraphShardingOptimizer: largest parameter first, each to the rank holding the fewest elements;
    # only the owner keeps a parameter's optimizer state; training equals one process on every rank's batch
    model = _sharding_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(3):
        xs, ys = zip(*(_sharding_batch(step, r) for r in range(world)))
        F.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
    owners = {"0.weight": 0, "2.weight": 1, "0.bias": 1, "2.bias": 1}  # 60 elements | 30 + 10 + 3
    for res in run_ranks(_fleet_sharding, world, hybrid):
        assert res["owners"] == owners
        assert res["states"] == sorted(n for n, o in owners.items() if o == res["index"])
        assert all(g is not None and not g.any() for g in res["grads"])  # clear_grad zeroes every parameter's
        for k, v in model.state_dict().items():
            torch.testing.assert_close(res["params"][k], v, rtol=1e-5, atol=1e-6)


def _paddle_optimizer_methods():
    """get_lr / set_lr / minimize on the three wrappers Paddle's API returns, every rank on the same batch."""
    import meshviz.distributed as dist
    from meshviz.distributed import fleet

    fleet.init(is_collective=True)
    x, y = torch.randn(4, 10, generator=torch.Generator().manual_seed(7)), torch.ones(4, 1)
    out = {}
    wrappers = {"fleet": lambda m: fleet.distributed_optimizer(torch.optim.SGD(m.parameters(), lr=0.1)),
                "shard_optimizer": lambda m: dist.shard_optimizer(torch.optim.SGD(m.parameters(), lr=0.1)),
                "group_sharded": lambda m: dist.sharding.group_sharded_parallel(
                    m, torch.optim.SGD(m.parameters(), lr=0.1), "os_g")[1]}
    for name, wrap in wrappers.items():
        torch.manual_seed(0)
        model = LinearNet()
        opt = wrap(model)
        lrs = [opt.get_lr()]
        opt.set_lr(0.05)
        lrs.append(opt.get_lr())
        F.mse_loss(model(x), y).backward()
        errors = []
        if name == "group_sharded":  # Paddle's group-sharded optimizers refuse minimize: step instead
            pairs = None  # its level os_g keeps the gradients in its own shards
            for bad in (lambda: opt.minimize(None), lambda: opt.set_lr("0.1")):
                try:
                    bad()
                except (RuntimeError, TypeError) as e:
                    errors.append(type(e).__name__)
            opt.step()
        else:
            _, pairs = opt.minimize(None)
            for bad in (lambda: opt.minimize(None, parameters=[]), lambda: opt.set_lr("0.1")):
                try:
                    bad()
                except (TypeError, ValueError) as e:
                    errors.append(type(e).__name__)
        out[name] = (lrs, pairs and len(pairs), {k: v.detach().clone() for k, v in model.state_dict().items()}, errors)
    return out


@pytest.mark.timeout(120)
def test_paddle_optimizer_methods_on_every_wrapper():
    torch.manual_seed(0)
    ref = LinearNet()
    x, y = torch.randn(4, 10, generator=torch.Generator().manual_seed(7)), torch.ones(4, 1)
    F.mse_loss(ref(x), y).backward()
    torch.optim.SGD(ref.parameters(), lr=0.05).step()
    for out in run_ranks(_paddle_optimizer_methods, 2, timeout=100):
        for name, (lrs, pairs, params, errors) in out.items():
            want = ["RuntimeError" if name == "group_sharded" else "ValueError", "TypeError"]
            assert lrs == [0.1, 0.05] and pairs == (None if name == "group_sharded" else 4), (name, lrs, pairs)
            assert errors == want, (name, errors)
            for k, v in ref.state_dict().items():
                torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6, msg=f"{name} {k}")
    from meshviz.runtime.zero.engine import Zero

    adam = torch.optim.Adam([nn.Parameter(torch.ones(2))], lr=torch.tensor(0.1))
    Zero(adam, None).set_lr(0.25)  # a tensor learning rate stays a tensor
    assert torch.is_tensor(adam.param_groups[0]["lr"]) and adam.param_groups[0]["lr"].item() == 0.25
